"""studies/search_anatomy.py: the behaviour classes of training trajectories and the advantage each received."""

from __future__ import annotations

import json

import pytest

from studies import search_anatomy as sa


def _row(searches: int, shown: list[str], *, reward: float = 0.0, advantage: float = 0.0, step: int = 1,
         question: str = "Who wrote the novel?", golds: tuple[str, ...] = ("Jane Austen",), stop: str = "answer") -> dict:
    segments = []
    for text in shown:
        segments += [{"role": "model", "action": "search", "text": "<search> q </search>"},
                     {"role": "observation", "action": "information", "text": f"<information>{text}</information>"}]
    return {"step": step, "group_id": f"{step}-0", "reward": reward, "advantage": advantage, "stop_reason": stop,
            "searches": searches, "question": question, "golds": list(golds), "segments": segments}


GOLD = "Doc 1(Title: \"Pride\") Pride and Prejudice is a novel by Jane Austen of 1813."
OTHER = "Doc 1(Title: \"Emma\") A film of 1996."


@pytest.mark.parametrize("searches, shown, expected", [
    (0, [], "no_search"),
    (1, [GOLD], "one_search_gold_shown"),
    (1, [OTHER], "one_search_gold_missing"),
    (2, [GOLD, OTHER], "again_after_gold_shown"),
    (2, [OTHER, GOLD], "again_found_gold"),
    (3, [OTHER, OTHER, GOLD], "again_found_gold"),
    (2, [OTHER, OTHER], "again_gold_never_shown"),
])
def test_behaviour_classes(searches, shown, expected):
    assert sa.behaviour(_row(searches, shown)) == expected


def test_a_gold_the_question_names_is_not_shown():
    # "Jane Austen" is in the question itself: finding it in a passage shows nothing (tasks.qa.gold_shown)
    row = _row(1, [GOLD], question="Which novel did Jane Austen write first?")
    assert sa.behaviour(row) == "one_search_gold_missing"
    # the same token-bounded match as the slices: "Austenite" does not hold "Austen"
    assert sa.behaviour(_row(1, ["Austenite is a steel phase."], golds=("Austen",))) == "one_search_gold_missing"


def test_anatomy_sums_the_advantage_by_behaviour_need_and_half():
    need = {"q1": 1, "q2": 2}
    rows = sa.classify([
        _row(1, [GOLD], reward=1.0, advantage=+0.75, step=1, question="q1"),
        _row(2, [GOLD, OTHER], reward=0.0, advantage=-0.25, step=1, question="q1", stop="max_turns"),
        _row(2, [GOLD, OTHER], reward=0.0, advantage=-0.25, step=1, question="q1"),
        _row(2, [GOLD, OTHER], reward=0.0, advantage=-0.25, step=1, question="q1"),
        _row(2, [OTHER, GOLD], reward=1.0, advantage=+0.5, step=2, question="q2"),
        _row(1, [OTHER], reward=0.0, advantage=-0.5, step=2, question="q2"),
        _row(1, [OTHER], reward=0.0, advantage=0.0, step=2, question="not in the pool"),
    ], need)
    a = sa.anatomy(rows, steps=2)
    b = a["by_behaviour"]
    assert a["trajectories"] == 7
    assert b["again_after_gold_shown"] == {"trajectories": 3, "reward_mean": 0.0, "advantage_mean": -0.25,
                                           "advantage_sum": -0.75, "max_turns_share": 0.3333, "share": 0.4286}
    assert b["one_search_gold_shown"]["advantage_sum"] == 0.75
    assert b["one_search_gold_missing"]["trajectories"] == 2 and b["no_search"] == {"trajectories": 0, "share": 0.0}
    assert a["by_pool_need"]["1"]["searched_again"]["advantage_sum"] == -0.75
    assert a["by_pool_need"]["2"]["searched_again"]["advantage_mean"] == 0.5
    assert a["by_pool_need"]["2"]["one_search"]["advantage_mean"] == -0.5
    assert a["by_pool_need"]["2"]["trajectories"] == 2  # the question outside the pool counts in neither need
    # step 2's q2 group holds both behaviours and a reward spread: the one group that contrasts them
    assert a["by_pool_need"]["2"]["groups"] == {"groups": 1, "both_behaviours": 1, "reward_spread": 1, "contrasted": 1}
    # step 1's q1 group holds both behaviours and a spread too
    assert a["by_pool_need"]["1"]["groups"] == {"groups": 1, "both_behaviours": 1, "reward_spread": 1, "contrasted": 1}
    assert a["by_half"]["first_half"]["searched_again_share"] == 0.75
    assert a["by_half"]["second_half"]["searched_again_share"] == pytest.approx(1 / 3, abs=1e-4)


def test_a_group_of_one_behaviour_has_a_zero_mean_advantage_but_is_not_contrasted():
    # every trajectory searched again; one of four was right: advantages +1.5, -0.5 x3 sum to zero
    rows = sa.classify([_row(2, [OTHER, GOLD], reward=1.0, advantage=1.5, step=3, question="q2")]
                       + [_row(2, [OTHER, OTHER], reward=0.0, advantage=-0.5, step=3, question="q2")] * 3
                       + [_row(1, [OTHER], reward=0.0, advantage=0.0, step=4, question="q2")] * 2
                       + [_row(2, [OTHER, OTHER], reward=0.0, advantage=0.0, step=4, question="q2")] * 2,
                       {"q2": 2})
    n2 = sa.anatomy(rows, steps=4)["by_pool_need"]["2"]
    assert n2["searched_again"]["advantage_mean"] == 0.0
    # step 3 has a spread but one behaviour; step 4 has both behaviours but equal rewards
    assert n2["groups"] == {"groups": 2, "both_behaviours": 1, "reward_spread": 1, "contrasted": 0}


def _run(work, arm: str, seed: int, rows: list[dict], finished: bool = True) -> None:
    folder = work / f"{arm}-seed{seed}"
    folder.mkdir(parents=True)
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if finished:
        (folder / "run.json").write_text(json.dumps({"steps": 2, "per_question": {}}))


def test_main_reads_finished_runs_and_keeps_earlier_rows(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sa, "pool_need", lambda path=sa.POOL: {"Who wrote the novel?": 2})
    work = tmp_path / "work"
    _run(work, "grpo", 0, [_row(2, [OTHER, GOLD], reward=1.0, advantage=0.5), _row(1, [OTHER], advantage=-0.5)])
    _run(work, "emapg", 0, [_row(2, [GOLD, OTHER], advantage=-1.0, step=2)])
    _run(work, "grpo", 1, [_row(1, [GOLD])], finished=False)  # unfinished: left out
    with open(work / "emapg-seed0" / "samples.jsonl", "a") as f:  # a row without a reward, then a line torn by a kill
        f.write(json.dumps({"step": 3, "question": "q"}) + "\n" + '{"step": 4, "rew')
    out = tmp_path / "a.json"
    assert sa.main(["--work", str(work), "--out", str(out), "--allow-dirty"]) == 0
    first = json.loads(out.read_text())
    assert first["seeds"] == {"emapg": [0], "grpo": [0]}
    assert first["skipped_lines"] == {"emapg-seed0": 2} and first["arms"]["emapg"]["trajectories"] == 1
    assert first["arms"]["grpo"]["by_pool_need"]["2"]["searched_again"]["advantage_sum"] == 0.5
    assert "| grpo | again_found_gold | 1 |" in capsys.readouterr().out

    # a later work folder holds only a new run: the earlier report's runs are kept, the new one added
    later = tmp_path / "later"
    _run(later, "grpo", 1, [_row(1, [GOLD], reward=1.0, advantage=0.0)])
    out2 = tmp_path / "b.json"
    assert sa.main(["--work", str(later), "--keep-from", str(out), "--out", str(out2), "--allow-dirty"]) == 0
    second = json.loads(out2.read_text())
    assert second["seeds"] == {"emapg": [0], "grpo": [0, 1]}
    assert len(second["rows"]) == 4
    assert set(second["rows"][0]) == set(sa.ROW_KEYS)


def test_main_refuses_a_folder_without_finished_runs(tmp_path):
    (tmp_path / "w").mkdir()
    with pytest.raises(SystemExit):
        sa.main(["--work", str(tmp_path / "w"), "--out", str(tmp_path / "x.json")])

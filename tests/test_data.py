"""Bundled data and the dataset loaders (tasks/datasets.py).

Every bundled file is loaded through the project's own loader with its exact row count;
user files in each supported layout are written to a temp dir and loaded for real.
"""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from emapg.errors import UserError
from emapg.paths import DATA_DIR, REPO_ROOT
from tasks.datasets import (
    BUNDLED_CORPUS,
    MATH_DATASETS,
    QA_DATASETS,
    REGISTRY,
    DatasetError,
    Example,
    load_dataset,
    task_of,
)

BUNDLED_ROWS = {
    ("nq", "test"): 3610,
    ("nq", "train"): 5000,
    ("triviaqa", "test"): 1000,
    ("popqa", "test"): 1000,
    ("hotpotqa", "test"): 7405,
    ("hotpotqa", "train"): 400,
    ("2wikimultihopqa", "test"): 12576,
    ("musique", "test"): 2417,
    ("bamboogle", "test"): 125,
    ("nq_gold", "test"): 2655,
    ("aime2024", "test"): 30,
    ("amc", "test"): 83,
    ("math500", "test"): 500,
    ("minerva", "test"): 272,
    ("olympiadbench", "test"): 675,
    ("math", "train"): 7470,
    # the recorded held-out split (data/qa/heldout.json) and the answerable training pool (data/qa/pool/)
    **{(name, "heldout"): 100 for name in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")},
    ("qa_pool", "train"): 7216,
    ("qa_pool_informative", "train"): 37,
    ("qa_pool_v2", "train"): 798,  # data/qa/pool_v2/ (scripts/build_search_data.py)
}
CORPUS_SOURCES = {"vital": 10033, "hotpot": 11732, "r1traj": 9808, "2wiki": 6117, "nqgold": 2588,
                  "musique": 1881, "wiki18s": 1000}


def test_registry_covers_paper_datasets_and_every_bundled_file():
    assert set(QA_DATASETS) | set(MATH_DATASETS) <= set(REGISTRY)
    registered = {(name, split) for name, info in REGISTRY.items() for split in info.files}
    assert registered == set(BUNDLED_ROWS)
    on_disk = {p.relative_to(DATA_DIR).as_posix() for p in DATA_DIR.rglob("*.jsonl.gz")}
    assert on_disk == {info.files[s] for info in REGISTRY.values() for s in info.files} | {"corpus/wiki_mini.jsonl.gz"}


@pytest.mark.parametrize(("name", "split"), sorted(BUNDLED_ROWS))
def test_bundled_set_loads_with_exact_rows(name, split):
    examples = load_dataset(name, split=split)
    assert len(examples) == BUNDLED_ROWS[name, split]
    assert len({ex.id for ex in examples}) == len(examples)
    for ex in examples:
        assert isinstance(ex, Example)
        # the pool's rows keep the id and data source of the QA set they come from
        origin = ex.id.split("-")[0] if name.startswith("qa_pool") else name
        assert origin in QA_DATASETS or not name.startswith("qa_pool")
        assert ex.id.split("-")[0] in (origin, f"{origin}_train")
        assert isinstance(ex.question, str) and ex.question == ex.question.strip() and ex.question
        assert ex.answers and all(isinstance(a, str) and a and a == a.strip() for a in ex.answers)
        assert ex.data_source == origin
        assert ex.meta["task"] == task_of(name) and ex.meta["split"] == split
        assert ex.meta["upstream_split"] == REGISTRY[name].upstream_split[split]


def test_answer_normalisation_of_math_sets():
    amc = load_dataset("amc")
    assert not any(a.endswith(".0") for ex in amc for a in ex.answers)
    assert next(ex for ex in amc if ex.id == "amc-0").answers == ["142"]
    minerva = load_dataset("minerva")
    assert next(ex for ex in minerva if ex.id == "minerva-0").answers == ["9.6"]
    assert max(len(ex.answers) for ex in minerva) == 3  # multi-answer lists stay lists
    assert all(ex.meta["task"] == "math" for name in MATH_DATASETS for ex in load_dataset(name, limit=3))


def test_nq_questions_are_flashrag_text_and_ids_match_flashrag_numbering():
    nq = {ex.id: ex for ex in load_dataset("nq")}
    assert nq["nq-test-0"].question == "who got the first nobel prize in physics"
    assert nq["nq-test-0"].answers == ["Wilhelm Conrad Röntgen"]
    assert not any(ex.question.endswith("?") for ex in nq.values())


def test_hotpotqa_train_overlap_with_dev_is_flagged():
    dev = load_dataset("hotpotqa")
    train = load_dataset("hotpotqa", split="train")
    flagged = {ex.id for ex in dev if ex.meta.get("in_bundled_train")}
    from_dev = {ex.id for ex in train if ex.meta["origin"] == "rpt_train_from_dev"}
    assert len(flagged) == 300 and flagged == from_dev
    dev_by_id = {ex.id: ex for ex in dev}
    assert all(dev_by_id[ex.id].question == ex.question for ex in train if ex.id in from_dev)
    assert Counter(ex.meta["origin"] for ex in train) == {"hipporag_train": 100, "rpt_train_from_dev": 300}


@pytest.fixture(scope="module")
def corpus_rows() -> list[dict]:
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_corpus_is_search_r1_format(corpus_rows):
    assert len(corpus_rows) == 43159
    assert len({r["id"] for r in corpus_rows}) == len(corpus_rows)
    assert Counter(r["source"] for r in corpus_rows) == CORPUS_SOURCES
    pattern = re.compile(r'"(?P<title>[^\n]*)"\n(?P<text>.+)', re.DOTALL)
    for r in corpus_rows:
        assert set(r) == {"id", "contents", "source"} and isinstance(r["id"], str)
        m = pattern.fullmatch(r["contents"])
        assert m, r["id"]
        assert m["text"].strip() and "\n" not in m["text"]
    assert corpus_rows[0]["contents"].startswith('"0"\n0 is a number')


def test_nq_gold_passages_are_in_the_corpus(corpus_rows):
    by_id = {r["id"]: r["contents"] for r in corpus_rows}
    gold = load_dataset("nq_gold")
    nq = {ex.id: ex for ex in load_dataset("nq")}
    for ex in gold:
        title, _, text = by_id[ex.meta["gold_doc_id"]].partition("\n")
        assert title == f'"{ex.meta["gold_title"]}"'
        assert text == " ".join(ex.meta["gold_text"].split())
        assert nq[ex.meta["nq_id"]].question == ex.question


# --------------------------------------------------------------------------- sampling


def test_limit_is_deterministic_nested_and_keeps_file_order():
    a = [ex.id for ex in load_dataset("hotpotqa", limit=50, seed=3)]
    assert a == [ex.id for ex in load_dataset("hotpotqa", limit=50, seed=3)]
    assert len(a) == 50
    assert a != [ex.id for ex in load_dataset("hotpotqa", limit=50, seed=4)]
    bigger = [ex.id for ex in load_dataset("hotpotqa", limit=51, seed=3)]
    assert set(a) < set(bigger)
    order = {ex.id: i for i, ex in enumerate(load_dataset("hotpotqa"))}
    assert a == sorted(a, key=order.__getitem__)
    assert len(load_dataset("bamboogle", limit=10_000)) == 125
    # pinned: the subset must not change across versions or platforms
    assert [ex.id for ex in load_dataset("bamboogle", limit=3, seed=0)] == PINNED_BAMBOOGLE_SAMPLE


PINNED_BAMBOOGLE_SAMPLE = ["bamboogle-test-63", "bamboogle-test-75", "bamboogle-test-81"]


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "3"])
def test_bad_limit(limit):
    with pytest.raises(DatasetError, match="limit must be a positive integer"):
        load_dataset("bamboogle", limit=limit)


# --------------------------------------------------------------------------- user files


def _write_jsonl(path: Path, rows: list[dict], *, gz: bool = False) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def test_user_flashrag_jsonl_and_gz(tmp_path):
    rows = [{"id": "q1", "question": " Who? ", "golden_answers": ["A", " a2 "]},
            {"id": "q2", "question": "When?", "golden_answers": ["1999"], "extra": {"k": 1}}]
    for path in (_write_jsonl(tmp_path / "d.jsonl", rows), _write_jsonl(tmp_path / "d.jsonl.gz", rows, gz=True)):
        exs = load_dataset("mine", path=path)
        assert [(e.id, e.question, e.answers, e.data_source) for e in exs] == [
            ("q1", "Who?", ["A", "a2"], "mine"), ("q2", "When?", ["1999"], "mine")]
        assert exs[1].meta == {"extra": {"k": 1}, "task": "qa"}


def test_user_plain_json_list_and_mapping(tmp_path):
    (tmp_path / "l.json").write_text(json.dumps([{"question": "q", "answer": "x"}, {"question": "r", "answer": ["y", "z"]}]))
    exs = load_dataset("plain", path=tmp_path / "l.json")
    assert [(e.id, e.answers) for e in exs] == [("plain-1", ["x"]), ("plain-2", ["y", "z"])]
    (tmp_path / "m.json").write_text(json.dumps({"a": {"question": "q", "answer": "x"}}))
    assert [e.id for e in load_dataset("plain", path=tmp_path / "m.json")] == ["a"]
    # a JSON-lines file that is named .json
    _write_jsonl(tmp_path / "lines.json", [{"question": "q", "answer": "x"}, {"question": "r", "answer": "y"}])
    assert len(load_dataset("plain", path=tmp_path / "lines.json")) == 2


def test_user_math_layout_and_aime2025(tmp_path):
    path = _write_jsonl(tmp_path / "aime25.jsonl", [
        {"problem": "Find x.", "answer": 23.0}, {"problem": "Find y.", "answer": "\\frac{1}{2}\n"},
        {"problem": "Find z.", "answer": 0.5}])
    exs = load_dataset("aime2025", path=path)
    assert [e.answers for e in exs] == [["23"], ["\\frac{1}{2}"], ["0.5"]]
    assert all(e.meta["task"] == "math" and e.data_source == "aime2025" for e in exs)
    assert load_dataset("anything", path=path)[0].meta["task"] == "math"  # detected from the layout


def test_user_musique_layout_merges_aliases(tmp_path):
    path = _write_jsonl(tmp_path / "m.jsonl", [{"id": "2hop_1", "question": "q", "answer": "Paris",
                                                 "answer_aliases": ["City of Light", "Paris"]}])
    assert load_dataset("musique", path=path)[0].answers == ["Paris", "City of Light"]


def _search_r1_parquet(path: Path) -> Path:
    """The Search-R1 7-dataset test parquet layout: ids restart per data_source."""
    prompt = "Answer the given question. ... For example, <answer> Beijing </answer>. Question: {}\n"
    rows = [
        {"id": "test_0", "question": "who wrote hamlet?", "golden_answers": ["Shakespeare"], "data_source": "nq"},
        {"id": "test_1", "question": "capital of france?", "golden_answers": ["Paris"], "data_source": "nq"},
        {"id": "test_0", "question": "Which is older, A or B?", "golden_answers": ["A"], "data_source": "hotpotqa"},
    ]
    for r in rows:
        r.update(prompt=[{"role": "user", "content": prompt.format(r["question"])}], ability="fact-reasoning",
                 reward_model={"ground_truth": {"target": r["golden_answers"]}, "style": "rule"},
                 extra_info={"index": 0, "split": "test"})
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_user_search_r1_parquet(tmp_path):
    path = _search_r1_parquet(tmp_path / "test.parquet")
    nq = load_dataset("nq", path=path)  # mixed data sources: only the nq rows
    assert [(e.id, e.question, e.answers, e.data_source) for e in nq] == [
        ("test_0", "who wrote hamlet?", ["Shakespeare"], "nq"), ("test_1", "capital of france?", ["Paris"], "nq")]
    assert nq[0].meta["prompt"][0]["role"] == "user"
    everything = load_dataset("searchr1_test", path=path)
    assert [e.id for e in everything] == ["nq-test_0", "nq-test_1", "hotpotqa-test_0"]
    assert [e.data_source for e in everything] == ["nq", "nq", "hotpotqa"]


def test_user_verl_parquet_without_question_column(tmp_path):
    rows = [{"data_source": "deepscaler", "ability": "math",
             "prompt": [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "What is 6*7? Put the answer in \\boxed{}."}],
             "reward_model": {"ground_truth": "42", "style": "rule"}},
            {"data_source": "nq", "ability": "fact-reasoning",
             "prompt": [{"role": "user", "content": "Answer the given question. Question: who is it?"}],
             "reward_model": {"ground_truth": {"target": ["me"]}, "style": "rule"}}]
    # a ground_truth column is either a string (verl math) or a struct (Search-R1): one file each
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "math.parquet")
    pq.write_table(pa.Table.from_pylist(rows[1:]), tmp_path / "qa.parquet")
    (a,) = load_dataset("deepscaler", path=tmp_path / "math.parquet")
    (b,) = load_dataset("nq", path=tmp_path / "qa.parquet")
    assert (a.question, a.answers, a.meta["task"]) == ("What is 6*7? Put the answer in \\boxed{}.", ["42"], "math")
    assert (b.question, b.answers, b.meta["task"]) == ("who is it?", ["me"], "qa")


# --------------------------------------------------------------------------- errors


def test_errors_are_user_errors_and_value_errors():
    assert issubclass(DatasetError, UserError) and issubclass(DatasetError, ValueError)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"name": "nqq"}, r"unknown dataset 'nqq'; registered: nq, "),
    ({"name": "aime2025"}, r"'aime2025' has no bundled 'test' split \(bundled: none\); pass path="),
    ({"name": "triviaqa", "split": "train"}, r"no bundled 'train' split \(bundled: test, heldout\)"),
    ({"name": "mine", "path": "/nonexistent/x.jsonl"}, r"dataset file not found: /nonexistent/x.jsonl"),
    ({"name": "hf:"}, r"bad Hugging Face dataset name"),
    ({"name": ""}, r"non-empty string"),
])
def test_bad_names_and_paths(kwargs, message):
    with pytest.raises(DatasetError, match=message):
        load_dataset(**kwargs)


@pytest.mark.parametrize(("filename", "content", "message"), [
    ("e.jsonl", "\n\n", r"e.jsonl: the file has no rows"),
    ("e.json", "", r"e.json: the file has no rows"),
    ("e.json", "[]", r"e.json: the file has no rows"),
    ("e.csv", "question,answer\n", r"unsupported file type"),
    ("bad.jsonl", '{"question": "q", "answer": "a"}\n{"question": \n', r"bad.jsonl line 2: invalid JSON"),
    ("bad.json", '{"question": ', r"bad.json: invalid JSON at line 1"),
    ("s.json", '"just a string"', r"expected a JSON list of rows"),
    ("n.jsonl", '{"question": "q", "answer": "a"}\n[1, 2]\n', r"n.jsonl row 2: expected a JSON object, got list"),
    ("q.jsonl", '{"question": "q", "answer": "a"}\n\n{"question": " ", "answer": "a"}\n', r"q.jsonl row 3: no question"),
    ("a.jsonl", '{"question": "q"}\n', r"a.jsonl row 1: no answer"),
    ("ea.jsonl", '{"question": "q", "golden_answers": ["", " "]}\n', r"ea.jsonl row 1: the answer is empty"),
    ("ta.jsonl", '{"question": "q", "answer": {"x": 1}}\n', r"ta.jsonl row 1: an answer must be a string or a number"),
    ("d.jsonl", '{"id": 1, "question": "q", "answer": "a"}\n{"id": "1", "question": "r", "answer": "b"}\n',
     r"d.jsonl: duplicate id '1'"),
])
def test_bad_user_files(tmp_path, filename, content, message):
    (tmp_path / filename).write_text(content)
    with pytest.raises(DatasetError, match=message):
        load_dataset("mine", path=tmp_path / filename)


def test_directory_and_corrupt_parquet(tmp_path):
    with pytest.raises(DatasetError, match="not a file"):
        load_dataset("mine", path=tmp_path)
    (tmp_path / "x.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="cannot read parquet"):
        load_dataset("mine", path=tmp_path / "x.parquet")


def test_hf_name_without_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(DatasetError, match=r"needs the `datasets` package: pip install datasets"):
        load_dataset("hf:RUC-NLPIR/FlashRAG_datasets:nq@test")


def test_hf_name_with_unreachable_hub(monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DatasetError, match=r"cannot load Hugging Face dataset 'no-such-org/no-such-set'"):
        load_dataset("hf:no-such-org/no-such-set@test")


def test_hf_name_loads_through_datasets(tmp_path, monkeypatch):
    """`datasets.load_dataset` also takes a local folder: the hf: path end to end, offline."""
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "myqa"
    folder.mkdir()
    _write_jsonl(folder / "test.jsonl", [{"question": "q1", "golden_answers": ["a"]},
                                         {"question": "q2", "golden_answers": ["b", "c"]}])
    exs = load_dataset(f"hf:{folder}@test")
    assert [(e.id, e.question, e.answers, e.data_source) for e in exs] == [
        ("myqa-1", "q1", ["a"], "myqa"), ("myqa-2", "q2", ["b", "c"], "myqa")]


# --------------------------------------------------------------------------- reproducibility

SHARED = REPO_ROOT.parent / "shared" / "data"


@pytest.mark.skipif(not SHARED.is_dir(), reason="source folder shared/data is not present")
def test_bundle_script_reproduces_bundled_files(tmp_path):
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "bundle_data.py"), "--shared", str(SHARED),
           "--out", str(tmp_path), "--only", "qa", "--only", "train", "--only", "math"]
    subprocess.run(cmd, check=True, capture_output=True, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    built = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.gz"))
    assert len(built) == 15
    for rel in built:
        assert (tmp_path / rel).read_bytes() == (DATA_DIR / rel).read_bytes(), rel

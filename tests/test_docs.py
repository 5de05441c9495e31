"""docs/ALGORITHM.md: every section the code, tests and presets cite exists."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "ALGORITHM.md"
# "ALGORITHM.md §4.2, §4.6", "paper §2.3–§2.4", and the presets' bare "# §3.1" comments
CITATION = re.compile(r"(?:ALGORITHM\.md|paper(?: search)?)\s*((?:§\d+(?:\.\d+)?[\s,–-]*(?:and\s+)?)+)")
SECTION = re.compile(r"§(\d+(?:\.\d+)?)")


def _sections() -> set[str]:
    heads = re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", DOC.read_text(), flags=re.M)
    out = set(heads)
    for h in heads:  # "§8.6" cites item 6 of section 8's numbered list
        if "." not in h:
            body = DOC.read_text().split(f"## {h}. ", 1)[1].split("\n## ", 1)[0]
            out.update(f"{h}.{n}" for n in re.findall(r"^(\d+)\. ", body, flags=re.M))
    return out


def _citations() -> dict[str, set[str]]:
    cited: dict[str, set[str]] = {}
    files = [p for ext in ("py", "yaml", "md") for p in REPO.rglob(f"*.{ext}")
             if ".venv" not in p.parts and "data" not in p.parts[len(REPO.parts):][:1] and p not in (DOC, Path(__file__))]
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        found = {s for m in CITATION.finditer(text) for s in SECTION.findall(m.group(1))}
        if path.suffix == ".yaml" and path.parent.name == "configs":
            found |= set(SECTION.findall(text))
        if found:
            cited[str(path.relative_to(REPO))] = found
    return cited


def test_every_cited_section_exists():
    sections = _sections()
    assert {"1", "2.2", "2.4", "3.1", "3.2", "4.2", "4.5", "4.6", "5", "8.6"} <= sections
    cited = _citations()
    assert len(cited) >= 10, cited  # the scan finds the citations
    missing = {f: sorted(s - sections) for f, s in cited.items() if s - sections}
    assert missing == {}


def test_the_scan_would_see_a_wrong_citation():
    assert CITATION.search("see ALGORITHM.md §9.9") and "9.9" not in _sections()
    assert SECTION.findall(CITATION.search("(paper §2.3–§2.4)").group(1)) == ["2.3", "2.4"]

"""The runs page says what the viewer skipped in each run's files (issue 57's leftover): ``/api/runs`` returns
``problems``, ``skipped_records`` and ``unreadable_files``, and ``view.js`` turns them into a note under the run's row.

Node runs the real ``app/viewer/static/view.js`` (its page-building code needs a browser, so the context gives it only
the globals it touches while loading: ``location``, ``history`` and ``document.addEventListener``, which never fires)
and calls its ``problemsNote`` on the API's own answer over real damaged run folders (tests/fuzz/test_fuzz_viewer.py).
The browser tests (tests/viewer/test_browser.py) cover the page's rendering over healthy runs.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.viewer.runs import open_runs
from app.viewer.server import create_app
from tests.fuzz.test_fuzz_viewer import BAD_LINES, GOOD_ITEM, damaged_train_run

REPO = Path(__file__).resolve().parents[2]
VIEW_JS = REPO / "app" / "viewer" / "static" / "view.js"
NODE = shutil.which("node") or shutil.which("nodejs")

RUN_NOTE = r"""
const vm = require("vm"), fs = require("fs");
const context = {location: {search: "", pathname: "/"}, history: {replaceState() {}},
                 document: {addEventListener() {}}, URLSearchParams, console};
vm.createContext(context);
vm.runInContext(fs.readFileSync(process.argv[1], "utf8") + "\n;this.problemsNote = problemsNote;", context);
const runs = JSON.parse(fs.readFileSync(0, "utf8"));
process.stdout.write(JSON.stringify(runs.map(r => context.problemsNote(r))));
"""


def notes(runs: list[dict]) -> list[str | None]:
    out = subprocess.run([NODE, "-e", RUN_NOTE, str(VIEW_JS)], input=json.dumps(runs), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(NODE is None, reason="needs node to run the page's script")
def test_the_runs_page_notes_what_was_skipped_in_each_run(tmp_path):
    damaged = damaged_train_run(tmp_path)
    healthy = tmp_path / "healthy"
    (healthy / "items").mkdir(parents=True)
    (healthy / "run.json").write_text("{}")
    (healthy / "items" / "nq.jsonl").write_text(json.dumps(GOOD_ITEM) + "\n")
    client = TestClient(create_app(open_runs([damaged, healthy]), allowed_hosts=["testserver"]))
    runs = client.get("/api/runs").json()
    by_label = dict(zip([r["label"] for r in runs], notes(runs)))
    assert by_label["healthy"] is None  # nothing skipped: no note
    skipped = 2 * len(BAD_LINES) + 1  # samples.jsonl and guard.jsonl's bad lines + samples.jsonl's torn last line
    assert by_label["train"] == (f"not shown: {skipped} damaged records skipped, 1 file unreadable "
                                 "(guard.jsonl, metrics.jsonl, samples.jsonl)")
    one = {**runs[0], "skipped_records": 1, "unreadable_files": 0, "problems": {"samples.jsonl": {}}}
    assert notes([one]) == ["not shown: 1 damaged record skipped (samples.jsonl)"]


def test_the_runs_table_shows_the_note():
    """The note is drawn in the runs table's row, under the run's summary (the page builds it with el())."""
    page = VIEW_JS.read_text()
    runs_page = page[page.index("async function pageRuns()"):page.index("// ---", page.index("async function pageRuns()"))]
    assert re.search(r'problemsNote\(r\) \? el\("div", \{class: "problems error"\}, problemsNote\(r\)\)', runs_page)

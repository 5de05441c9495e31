"""``emapg view`` in a real browser: headless Chromium (Debian's ``chromium`` + ``chromium-driver``, driven by Selenium;
nothing is downloaded at run time) loads every page over real tiny runs (tests/fixtures/viewer.py) served by the real
command, and checks what a reader sees: curves drawn (several runs overlaid), trajectories with their turns, passages,
gold answers and masks, the eval filters, the two-evaluation comparison, live updates without a reload, model output
that stays inert, and a console without JavaScript errors. A screenshot of each page goes to the test's tmp dir.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from emapg.servers import free_port
from tests.fixtures.viewer import injected_sample

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
webdriver = pytest.importorskip("selenium.webdriver", reason="needs the selenium package (requirements/cpu.txt)")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("needs a browser: apt-get install chromium chromium-driver (Debian's packages; .ci/run installs them)",
                allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

WAIT_S = 60


@pytest.fixture(scope="module")
def served(viewer_runs, tmp_path_factory):
    """``emapg view`` over a copy of the runs (the live test appends to it), on a free port."""
    root = tmp_path_factory.mktemp("viewed")
    for run in ("train_tags", "train_tools", "eval_b", "eval_injected", "eval_a_sampled", "eval_b_sampled"):
        shutil.copytree(getattr(viewer_runs, run), root / run)
    with (root / "train_tags" / "samples.jsonl").open("a") as f:  # a crafted step whose every text is an injection
        f.write(json.dumps(injected_sample(99)) + "\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "view", str(root), "--port", str(port)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(url + "/api/runs", timeout=5).raise_for_status()
            break
        except httpx.TransportError:
            assert proc.poll() is None and time.monotonic() < deadline, "emapg view did not start"
            time.sleep(0.2)
    runs = {r["label"].split("/")[-1]: r["id"] for r in httpx.get(url + "/api/runs", timeout=5).json()}
    yield url, root, runs
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1000",
                "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(WAIT_S)
    yield driver
    driver.quit()


def open_page(driver, url: str, shots: Path, name: str):
    driver.get_log("browser")  # drop what earlier pages logged
    driver.get(url)
    WebDriverWait(driver, WAIT_S).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1"
                                        or d.find_elements(By.ID, "error"))
    assert not driver.find_elements(By.ID, "error"), driver.find_element(By.ID, "error").text
    return driver


#: When set, the screenshots the documentation shows are also written there: ``EMAPG_VIEWER_SCREENSHOTS=docs/img/viewer
#: pytest tests/viewer/test_browser.py`` regenerates docs/img/viewer/ (docs/evaluation.md).
SCREENSHOTS_ENV = "EMAPG_VIEWER_SCREENSHOTS"
DOC_SCREENSHOTS = ("runs", "curves", "summary", "eval_sampled", "compare")


def finish(driver, shots: Path, name: str) -> None:
    """Screenshot the page, then fail on any console error (a CSP violation included) and any injection that ran."""
    shots.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(shots / f"{name}.png"))
    if os.environ.get(SCREENSHOTS_ENV) and name in DOC_SCREENSHOTS:
        Path(os.environ[SCREENSHOTS_ENV]).mkdir(parents=True, exist_ok=True)
        shutil.copy2(shots / f"{name}.png", Path(os.environ[SCREENSHOTS_ENV]) / f"{name}.png")
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors
    assert driver.execute_script("return window.__pwned === undefined")


def wait_for(driver, condition, message: str):
    # the page re-renders while it updates: an element found a moment ago may be replaced (stale); poll again then
    from selenium.common.exceptions import StaleElementReferenceException

    WebDriverWait(driver, WAIT_S, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda d: condition(d), message)


def act(driver, action, message: str):
    """Do ``action(driver)`` on freshly found elements, again if the page redrew them in between (stale)."""
    wait_for(driver, lambda d: action(d) or True, message)


def choose(driver, select_id: str, value: str) -> None:
    act(driver, lambda d: Select(d.find_element(By.ID, select_id)).select_by_value(value), f"choose {value!r} in #{select_id}")


def test_runs_page(served, browser, tmp_path):
    url, _, runs = served
    open_page(browser, url + "/", tmp_path, "runs")
    rows = browser.find_elements(By.CSS_SELECTOR, "#runs tr[data-run]")
    assert len(rows) == len(runs) == 6
    assert {r.find_elements(By.TAG_NAME, "td")[1].text for r in rows} == {"train", "eval"}
    finish(browser, tmp_path, "runs")


def test_curves_of_two_runs_overlaid_and_live(served, browser, tmp_path):
    url, root, runs = served
    open_page(browser, f"{url}/curves?runs={runs['train_tags']},{runs['train_tools']}", tmp_path, "curves")
    wait_for(browser, lambda d: d.execute_script(
        "return [...document.querySelectorAll('.chart')].filter(c => c.data && c.querySelector('svg .scatterlayer .trace')).length") >= 4,
        "the curves were not drawn")
    traces = browser.execute_script("const c = document.querySelector('.chart[data-key=\"reward/mean\"]');"
                                    "return c.data.map(t => [t.name, t.x.length]);")
    assert sorted(n for _, n in traces) == [2, 3] and len(traces) == 2  # both runs, every step each logged
    assert browser.find_elements(By.CSS_SELECTOR, ".chart[data-key='kl/mean'] .scatterlayer path.js-line")
    # a key turned on draws a new chart
    before = len(browser.find_elements(By.CSS_SELECTOR, ".chart"))
    box = browser.find_element(By.CSS_SELECTOR, "input[data-key='loss/pg']")
    browser.execute_script("arguments[0].closest('details').open = true; arguments[0].click()", box)
    wait_for(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".chart")) == before + 1, "no chart for the new key")
    # live: a step appended to the run shows without a reload
    metrics = root / "train_tags" / "metrics.jsonl"
    last = json.loads(metrics.read_text().splitlines()[-1])
    with metrics.open("a") as f:
        f.write(json.dumps({**last, "step": last["step"] + 1, "reward/mean": 0.75}) + "\n")
    wait_for(browser, lambda d: d.execute_script(
        "const c = document.querySelector('.chart[data-key=\"reward/mean\"]'); return Math.max(...c.data.map(t => t.x.length))") == 4,
        "the new step did not appear")
    finish(browser, tmp_path, "curves")


def test_trajectories_of_a_step(served, browser, tmp_path):
    url, _, runs = served
    open_page(browser, f"{url}/samples?run={runs['train_tags']}&step=2", tmp_path, "samples")
    cards = browser.find_elements(By.CSS_SELECTOR, ".trajectory")
    assert len(cards) == 4
    card = cards[0]
    assert card.find_elements(By.CSS_SELECTOR, ".segment.model") and card.find_elements(By.CSS_SELECTOR, ".segment.observation.masked")
    assert "masked out of the loss" in card.find_element(By.CSS_SELECTOR, ".segment.observation .label").text
    assert "search query:" in card.text and "advantage" in card.text and "tokens: prompt" in card.text
    assert card.find_elements(By.CSS_SELECTOR, ".passage")
    browser.find_element(By.ID, "prev").click()  # step navigation
    wait_for(browser, lambda d: Select(d.find_element(By.ID, "step-select")).first_selected_option.text == "1", "no step 1")
    finish(browser, tmp_path, "samples")


def test_tool_call_trajectories(served, browser, tmp_path):
    url, _, runs = served
    open_page(browser, f"{url}/samples?run={runs['train_tools']}", tmp_path, "samples_tool_calls")
    card = browser.find_elements(By.CSS_SELECTOR, ".trajectory")[0]
    assert "format: tool_calls" in card.text and "<tool_call>" in card.text and "search query: capital of France" in card.text
    assert card.find_elements(By.CSS_SELECTOR, ".segment.observation .passage")
    finish(browser, tmp_path, "samples_tool_calls")


def test_injected_trajectory_stays_inert(served, browser, tmp_path):
    url, _, runs = served
    open_page(browser, f"{url}/samples?run={runs['train_tags']}&step=99", tmp_path, "injected")
    card = browser.find_element(By.CSS_SELECTOR, ".trajectory")
    for evil in ("<script>", "onerror=", "javascript:"):
        assert evil in card.text  # shown as the characters it is
    assert card.find_elements(By.CSS_SELECTOR, "script, img, a, iframe") == []
    assert browser.find_elements(By.ID, "evil-link") == []
    assert {m.text.lower() for m in card.find_elements(By.CSS_SELECTOR, "mark.gold")} == {"gold"}
    finish(browser, tmp_path, "injected")


ROWS = """return [...document.querySelectorAll('#items tr.item')].map(r => ({outcome: r.dataset.outcome,
    dataset: r.dataset.dataset, searches: r.cells[6].textContent, text: r.textContent}))"""


def test_eval_items_filters(served, browser, tmp_path):
    url, _, runs = served
    open_page(browser, f"{url}/eval?run={runs['eval_injected']}", tmp_path, "eval")
    rows = lambda d: d.execute_script(ROWS)  # noqa: E731  (read in one go: the table is redrawn by each filter)
    counts = lambda d: d.find_element(By.ID, "counts").text  # noqa: E731
    assert len(rows(browser)) == 4 and counts(browser).startswith("4 of 4")
    choose(browser, "filter-outcome", "right")
    wait_for(browser, lambda d: [r["outcome"] for r in rows(d)] == ["right"], "the right filter")
    assert "<script>" in rows(browser)[0]["text"] and not browser.find_elements(By.CSS_SELECTOR, "#items script, #items img")
    act(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#items tr.item").click(), "open the item")  # its trajectory, inert too
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#items .trajectory"), "no trajectory")
    browser.save_screenshot(str(tmp_path / "eval_item.png"))
    choose(browser, "filter-outcome", "wrong")
    wait_for(browser, lambda d: len(rows(d)) == 3 and all(r["outcome"] != "right" for r in rows(d)), "the wrong filter")
    choose(browser, "filter-dataset", "nq")
    wait_for(browser, lambda d: [r["dataset"] for r in rows(d)] == ["nq", "nq"], "the dataset filter")
    assert "dataset=nq" in browser.current_url and "outcome=wrong" in browser.current_url
    choose(browser, "filter-dataset", "")
    choose(browser, "filter-outcome", "shown_wrong")
    wait_for(browser, lambda d: "outcome=shown_wrong" in d.current_url and "dataset" not in d.current_url
             and all(r["outcome"] == "shown_wrong" for r in rows(d)), "the shown-but-wrong filter")
    choose(browser, "filter-outcome", "")
    wait_for(browser, lambda d: len(rows(d)) == 4, "every question again")
    n = ""

    def pick_second(d):
        nonlocal n
        searches = Select(d.find_element(By.ID, "filter-searches"))
        n = searches.options[1].text
        searches.select_by_visible_text(n)

    act(browser, pick_second, "choose a number of searches")
    wait_for(browser, lambda d: "searches=" in d.current_url and rows(d) and all(r["searches"] == n for r in rows(d)), "searches filter")
    finish(browser, tmp_path, "eval")


def protocols_of(driver) -> tuple[str, str]:
    """The protocols of the compare page's chosen A and B (each option reads "label (protocol)")."""
    def protocol(select_id):
        text = Select(driver.find_element(By.ID, select_id)).first_selected_option.text
        return text[text.index(" (") + 2: -1]
    return protocol("compare-a"), protocol("compare-b")


def test_default_comparison_is_like_for_like(served, browser, tmp_path):
    """The landing page's pairs and the compare page's default pair greedy with greedy, sampled with sampled; a
    crossed pair is refused with both protocols named."""
    url, _, runs = served
    open_page(browser, url + "/", tmp_path, "runs_pairs")
    pairs = browser.execute_script("return [...document.querySelectorAll('#pairs li')].map(li => [li.dataset.a, li.dataset.b, li.textContent])")
    labels = {v: k for k, v in runs.items()}
    assert sorted((labels[a], labels[b]) for a, b, _ in pairs) == [("eval_a_sampled", "eval_b_sampled"), ("eval_b", "eval_injected")]
    assert all("both greedy" in t or "both sampled mean@2" in t for _, _, t in pairs)
    open_page(browser, url + "/compare", tmp_path, "compare_default")
    a, b = protocols_of(browser)
    assert a == b and browser.find_elements(By.CSS_SELECTOR, "#compare tr.pair")
    assert browser.find_element(By.ID, "compare-counts").text.startswith(a + ":")
    browser.get(f"{url}/compare?a={runs['eval_b']}&b={runs['eval_b_sampled']}")
    wait_for(browser, lambda d: d.find_elements(By.ID, "error"), "a crossed pair was not refused")
    error = browser.find_element(By.ID, "error").text
    assert "greedy" in error and "sampled mean@2 (T=1, top_p=1)" in error and "409" in error
    assert not browser.find_elements(By.CSS_SELECTOR, "#compare tr.pair")


def _report_pooled_row(a: Path, b: Path) -> list[str]:
    """The pooled row of the report's table (eval.learning.learning_table, as the demo's report.md prints it)."""
    from eval.learning import compare_learning, evaluated_datasets, learning_table

    row = learning_table(compare_learning(a, b, evaluated_datasets(a))).splitlines()[-1]
    return [c.strip().strip("*") for c in row.strip("|").split("|")]


@pytest.mark.parametrize("a, b", [("eval_b", "eval_injected"), ("eval_a_sampled", "eval_b_sampled")])
def test_summary_page_shows_the_reports_numbers(served, browser, tmp_path, a, b):
    url, root, runs = served
    open_page(browser, f"{url}/summary?a={runs[a]}&b={runs[b]}", tmp_path, f"summary_{a}")
    cells = browser.execute_script("return [...document.querySelector('#summary-table tr.pooled').cells].map(c => c.textContent)")
    name, n, em_a, em_b, difference = _report_pooled_row(root / a, root / b)[:5]
    assert cells == ["pooled", n, em_a, em_b, difference]
    assert "interval" in browser.find_element(By.ID, "summary-verdict").text
    finish(browser, tmp_path, "summary" if a == "eval_b" else "summary_sampled")


def test_sampled_run_shows_mean_at_k_and_every_sample(served, browser, tmp_path):
    url, _, runs = served
    open_page(browser, f"{url}/eval?run={runs['eval_a_sampled']}", tmp_path, "eval_sampled")
    assert "mean@2" in browser.find_element(By.ID, "eval-caption").text
    badges = browser.execute_script("return [...document.querySelectorAll('#items tr.item')].map(r => r.cells[4].textContent)")
    assert badges and all(t.endswith("/2 right") for t in badges)
    act(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#items tr.item").click(), "open the item")
    wait_for(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#items tr.detail button.sample")) == 2, "no sample buttons")
    act(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#items tr.detail button.sample")[1].click(), "the second sample")
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#items tr.detail[data-sample='1'] .trajectory"), "no second sample")
    finish(browser, tmp_path, "eval_sampled")


def test_two_evaluations_compared(served, browser, tmp_path):
    url, _, runs = served
    open_page(browser, f"{url}/compare?a={runs['eval_b']}&b={runs['eval_injected']}", tmp_path, "compare")
    pairs = lambda d: d.find_elements(By.CSS_SELECTOR, "#compare tr.pair")  # noqa: E731
    assert len(pairs(browser)) == 4
    assert "1 wrong → right, 0 right → wrong" in browser.find_element(By.ID, "compare-counts").text
    choose(browser, "compare-change", "flipped")
    wait_for(browser, lambda d: len(pairs(d)) == 1, "the flipped filter")
    assert pairs(browser)[0].get_attribute("data-change") == "gained" and "wrong → right" in pairs(browser)[0].text
    finish(browser, tmp_path, "compare")


def test_a_step_being_written_appears_without_a_reload(served, browser, tmp_path):
    url, root, runs = served
    open_page(browser, f"{url}/samples?run={runs['train_tools']}", tmp_path, "live")
    assert browser.find_element(By.ID, "follow").is_selected()
    samples = root / "train_tools" / "samples.jsonl"
    row = json.loads(samples.read_text().splitlines()[-1])
    with samples.open("a") as f:
        f.write(json.dumps({**row, "step": 7, "question": "a question logged while the page was open"}) + "\n")
    wait_for(browser, lambda d: "a question logged while the page was open" in d.find_element(By.ID, "trajectories").text,
             "the new step did not show")
    assert Select(browser.find_element(By.ID, "step-select")).first_selected_option.text == "7"
    finish(browser, tmp_path, "live")

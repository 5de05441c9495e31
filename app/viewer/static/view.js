// emapg view: the page. Every string from the API -- model output above all -- enters the DOM as a text node
// (el() below); nothing is ever assigned to innerHTML, and every link is built here from run ids.
"use strict";

const POLL_MS = 2000;
const DEFAULT_KEYS = ["reward/mean", "filter/informative_frac", "reward/zero_variance_groups", "kl/mean", "actor/entropy",
  "actor/grad_norm", "response/length_mean", "response/answered_frac", "search/per_traj", "search/failure_rate",
  "response/repeated_ngram_share", "response/non_text_share", "response/length_drift", "kl/to_start", "probe/flip_rate",
  "time/step", "time/generation", "time/training"];
const OUTCOME_LABELS = {"": "any", right: "right", wrong: "wrong", shown_wrong: "answer shown but wrong",
  not_shown_wrong: "wrong, answer not shown"};

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k === "text") node.textContent = String(v);
    else if (k === "checked" || k === "selected" || k === "value" || k === "open") node[k] = v;
    else node.setAttribute(k, String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    node.appendChild(typeof c === "object" ? c : document.createTextNode(String(c)));
  }
  return node;
}

function link(page, params, text) {
  const query = new URLSearchParams(params).toString();
  return el("a", {href: page + (query ? "?" + query : "")}, text);
}

async function api(path) {
  const response = await fetch(path, {headers: {Accept: "application/json"}});
  if (!response.ok) throw new Error(path + ": HTTP " + response.status);
  return response.json();
}

const params = new URLSearchParams(location.search);
const main = () => document.getElementById("main");

function setParams(values) {
  for (const [k, v] of Object.entries(values)) {
    if (v === "" || v === null || v === undefined) params.delete(k); else params.set(k, v);
  }
  history.replaceState(null, "", location.pathname + (params.toString() ? "?" + params.toString() : ""));
}

function setLive(text) { document.getElementById("live").textContent = text; }

function fmt(x, digits = 3) {
  if (x === null || x === undefined) return "–";
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x)) return String(x);
  return Math.abs(x) >= 1e4 || (Math.abs(x) < 1e-3 && x !== 0) ? x.toExponential(2) : x.toFixed(digits);
}

function ago(seconds) {
  const s = Math.max(0, Date.now() / 1000 - seconds);
  return s < 90 ? Math.round(s) + " s ago" : s < 5400 ? Math.round(s / 60) + " min ago" : Math.round(s / 3600) + " h ago";
}

function textPieces(pieces) {
  return (pieces || []).map(p => p.gold ? el("mark", {class: "gold"}, p.text) : document.createTextNode(p.text));
}

function rightBadge(right) {
  return el("span", {class: "badge " + (right ? "right" : "wrong")}, right ? "right" : "wrong");
}

// ------------------------------------------------------------------------------------------------ runs
async function pageRuns() {
  const root = main();
  async function draw() {
    const runs = await api("/api/runs");
    const rows = runs.map(r => el("tr", {dataset: {run: r.id}},
      el("td", {}, r.label), el("td", {}, r.kind),
      el("td", {}, r.kind === "train" ? `${r.steps} steps (last ${r.last_step}), samples at ${r.sample_steps} steps`
        : `${r.questions} questions, ${r.right} right; ${r.datasets.join(", ")}`),
      el("td", {class: "muted"}, ago(r.updated)),
      el("td", {}, r.kind === "train"
        ? [link("/curves", {runs: r.id}, "curves"), " · ", link("/samples", {run: r.id}, "trajectories")]
        : [link("/eval", {run: r.id}, "items")]),
      el("td", {class: "muted"}, r.path)));
    const evals = runs.filter(r => r.kind === "eval");
    root.replaceChildren(
      el("h2", {}, "Runs"),
      el("table", {id: "runs"}, el("tr", {}, ["run", "kind", "what", "written", "pages", "folder"].map(h => el("th", {}, h))), rows),
      evals.length >= 2 ? el("p", {}, link("/compare", {a: evals[0].id, b: evals[evals.length - 1].id},
        `compare ${evals[0].label} with ${evals[evals.length - 1].label} question by question`)) : null,
      runs.some(r => r.kind === "train") ? el("p", {}, link("/curves", {runs: runs.filter(r => r.kind === "train").map(r => r.id).join(",")},
        "all training runs' curves, overlaid")) : null);
    setLive("updated " + new Date().toLocaleTimeString());
  }
  await draw();
  setInterval(() => draw().catch(showError), POLL_MS * 2);
}

// ------------------------------------------------------------------------------------------------ curves
async function pageCurves() {
  const root = main();
  const runs = (await api("/api/runs")).filter(r => r.kind === "train");
  if (!runs.length) { root.replaceChildren(el("p", {class: "muted"}, "No training run was opened.")); return; }
  let chosen = (params.get("runs") || "").split(",").filter(id => runs.some(r => r.id === id));
  if (!chosen.length) chosen = runs.map(r => r.id);
  const data = {};  // run id -> {records, guard, keys}
  let keys = (params.get("keys") || "").split(",").filter(Boolean);
  const charts = el("div", {class: "charts", id: "charts"});
  const keyBox = el("div", {class: "keys", id: "keys"});
  const runBox = el("div", {class: "controls", id: "run-picker"});

  function allKeys() {
    const set = new Set();
    for (const id of chosen) for (const k of (data[id] || {keys: []}).keys) set.add(k);
    return [...set].sort();
  }

  function drawKeyBox() {
    const every = allKeys();
    if (!keys.length) keys = DEFAULT_KEYS.filter(k => every.includes(k)).concat(every.filter(k => k.startsWith("guard/")));
    const groups = {};
    for (const k of every) (groups[k.split("/")[0]] = groups[k.split("/")[0]] || []).push(k);
    keyBox.replaceChildren(...Object.entries(groups).map(([g, ks]) => el("details", {open: ks.some(k => keys.includes(k))},
      el("summary", {}, `${g} (${ks.length})`),
      ...ks.map(k => el("label", {}, el("input", {type: "checkbox", checked: keys.includes(k), dataset: {key: k}, onchange: e => {
        keys = e.target.checked ? keys.concat([k]) : keys.filter(x => x !== k);
        setParams({keys: keys.join(",")});
        drawCharts(true);
      }}), " ", k)))));
  }

  function drawCharts(rebuild) {
    if (rebuild || charts.children.length !== keys.length) {
      charts.replaceChildren(...keys.map(k => el("div", {class: "chart", dataset: {key: k}})));
    }
    for (const div of charts.children) {
      const key = div.dataset.key;
      const traces = chosen.filter(id => data[id]).map(id => {
        const rows = data[id].records.filter(r => r[key] !== null && r[key] !== undefined);
        return {x: rows.map(r => r.step), y: rows.map(r => r[key]), name: runs.find(r => r.id === id).label,
                mode: rows.length > 30 ? "lines" : "lines+markers", type: "scatter"};
      });
      const shapes = [];
      for (const id of chosen) for (const g of (data[id] || {guard: []}).guard) {
        shapes.push({type: "line", x0: g.step, x1: g.step, yref: "paper", y0: 0, y1: 1, line: {color: "#d93025", dash: "dot", width: 1}});
      }
      Plotly.react(div, traces, {title: {text: key, font: {size: 13}}, margin: {l: 50, r: 10, t: 32, b: 36}, shapes,
        xaxis: {title: {text: "step"}}, yaxis: {exponentformat: "e"}, showlegend: chosen.length > 1, legend: {orientation: "h", y: -0.25}},
        {displaylogo: false, displayModeBar: false, responsive: true});
    }
  }

  async function poll(first) {
    let changed = false;
    for (const id of chosen) {
      const have = data[id] ? data[id].records : [];
      const since = have.length ? have[have.length - 1].step : -1;
      const got = await api(`/api/runs/${encodeURIComponent(id)}/metrics?since=${since}`);
      if (!data[id] || got.records.length || got.guard.length !== data[id].guard.length) {
        data[id] = {records: have.concat(got.records), guard: got.guard, keys: got.keys};
        changed = true;
      }
    }
    if (first) drawKeyBox();
    if (changed || first) drawCharts(first);
    const last = Math.max(...chosen.map(id => data[id].records.length ? data[id].records[data[id].records.length - 1].step : 0));
    setLive(`step ${last} · polled ${new Date().toLocaleTimeString()}`);
  }

  runBox.replaceChildren(el("span", {class: "muted"}, "runs:"), ...runs.map(r => el("label", {},
    el("input", {type: "checkbox", checked: chosen.includes(r.id), dataset: {run: r.id}, onchange: e => {
      chosen = e.target.checked ? chosen.concat([r.id]) : chosen.filter(x => x !== r.id);
      setParams({runs: chosen.join(",")});
      poll(true).catch(showError);
    }}), " ", r.label)));
  const planBox = el("div", {class: "plan", id: "plan"});
  root.replaceChildren(el("h2", {}, "Curves per step"), runBox, planBox,
    el("div", {class: "muted"}, "metrics (each run's metrics.jsonl; dotted red lines: stability-guard events)"), keyBox, charts);
  drawPlans(planBox, chosen).catch(showError);
  await poll(true);
  setInterval(() => poll(false).catch(showError), POLL_MS);
}

// The plan (emapg plan, <run>/plan.json) beside each run's measured peak memory and step time: a drift shows.
async function drawPlans(box, ids) {
  const fmtRow = (v, unit) => v === null || v === undefined ? "–" : unit === "bytes" ? `${(v / 2 ** 30).toFixed(2)} GiB` : `${fmt(v)} s`;
  const tables = [];
  for (const id of ids) {
    const p = await api(`/api/runs/${encodeURIComponent(id)}/plan`);
    if (!p.rows) continue;
    tables.push(el("table", {class: "plan-table"},
      el("caption", {}, `${id}: plan for ${p.devices} x ${p.device} (rates ${p.rates})`),
      el("tr", {}, el("th", {}, ""), el("th", {}, "predicted"), el("th", {}, "measured"), el("th", {}, "drift")),
      ...p.rows.map(r => el("tr", {}, el("td", {}, r.what), el("td", {}, fmtRow(r.predicted, r.unit)),
        el("td", {}, fmtRow(r.measured, r.unit)), el("td", {}, r.drift === null ? "–" : `${(100 * r.drift).toFixed(0)}%`)))));
  }
  box.replaceChildren(...tables);
}

// ------------------------------------------------------------------------------------------------ trajectories
function segmentNode(seg) {
  const what = [seg.role === "model" ? "model turn" : "observation", seg.action || null,
    seg.tokens !== null && seg.tokens !== undefined ? `${seg.tokens} tokens` : null,
    seg.masked ? "masked out of the loss" : "trained on"].filter(Boolean).join(" · ");
  const body = [];
  if (seg.query !== null && seg.query !== undefined) body.push(el("div", {class: "query"}, el("b", {}, "search query: "), seg.query));
  if (seg.passages && seg.passages.length) {
    seg.passages.forEach((p, i) => body.push(el("div", {class: "passage" + (p.has_gold ? " has-gold" : "")},
      el("pre", {class: "text"}, textPieces(p.pieces)))));
  }
  if (seg.pieces && seg.pieces.length) body.push(el("pre", {class: "text"}, textPieces(seg.pieces)));
  return el("div", {class: `segment ${seg.role}` + (seg.masked ? " masked" : ""), dataset: {role: seg.role, masked: String(seg.masked)}},
    el("div", {class: "label"}, what), body);
}

function trajectoryNode(t, extra) {
  const tokens = t.tokens || {};
  const head = el("div", {class: "head"},
    t.reward !== null && t.reward !== undefined ? el("span", {class: "badge " + (t.reward > 0 ? "right" : "wrong")}, "reward " + fmt(t.reward)) : null,
    t.advantage !== null && t.advantage !== undefined ? el("span", {class: "badge"}, "advantage " + fmt(t.advantage)) : null,
    el("span", {class: "badge"}, `${t.searches} search${t.searches === 1 ? "" : "es"}`),
    t.stop_reason ? el("span", {class: "badge"}, "stop: " + t.stop_reason) : null,
    el("span", {class: "badge"}, "format: " + t.format),
    Object.values(tokens).some(v => v !== null && v !== undefined) ? el("span", {class: "badge"},
      `tokens: prompt ${fmt(tokens.prompt_tokens)}, response ${fmt(tokens.response_tokens)}, model ${fmt(tokens.model_tokens)}`) : null,
    t.gold_shown ? el("span", {class: "badge right"}, "gold answer in the passages") : null,
    t.group_id ? el("span", {class: "muted"}, "group " + t.group_id) : null,
    extra || null);
  return el("div", {class: "card trajectory"},
    el("div", {class: "question"}, t.question),
    el("div", {class: "muted"}, "gold: ", t.golds.length ? t.golds.join(" | ") : "–"),
    head,
    t.prompt ? el("details", {}, el("summary", {}, "prompt"), el("pre", {class: "text"}, textPieces(t.prompt))) : null,
    t.segments_inferred ? el("div", {class: "muted"}, "turns inferred from the decoded response (no per-span record)") : null,
    t.segments.map(segmentNode),
    el("div", {class: "answer"}, el("b", {}, "answer: "),
      t.answer_pieces ? el("span", {class: "answer-text"}, textPieces(t.answer_pieces)) : el("span", {class: "muted"}, "none")));
}

async function pageSamples() {
  const root = main();
  const runs = (await api("/api/runs")).filter(r => r.kind === "train");
  if (!runs.length) { root.replaceChildren(el("p", {class: "muted"}, "No training run was opened.")); return; }
  let run = runs.some(r => r.id === params.get("run")) ? params.get("run") : runs[0].id;
  let step = params.has("step") ? Number(params.get("step")) : null;
  let follow = step === null;
  const list = el("div", {id: "trajectories"});
  const controls = el("div", {class: "controls"});
  let steps = [];

  async function load() {
    const got = await api(`/api/runs/${encodeURIComponent(run)}/samples` + (step === null ? "" : `?step=${step}`));
    steps = got.steps;
    step = got.step;
    drawControls();
    list.replaceChildren(...(got.samples.length ? got.samples.map(t => trajectoryNode(t))
      : [el("p", {class: "muted"}, "No samples at this step (logging.log_samples = 0, or the run has not logged a step yet).")]));
  }

  function go(s) { step = s; follow = false; setParams({run, step}); load().catch(showError); }

  function drawControls() {
    const i = steps.indexOf(step);
    controls.replaceChildren(
      el("label", {}, "run ", el("select", {id: "run-select", onchange: e => { run = e.target.value; step = null; follow = true; setParams({run, step: ""}); load().catch(showError); }},
        runs.map(r => el("option", {value: r.id, selected: r.id === run}, r.label)))),
      el("button", {id: "prev", disabled: i <= 0, onclick: () => go(steps[i - 1])}, "◀ previous"),
      el("label", {}, "step ", el("select", {id: "step-select", onchange: e => go(Number(e.target.value))},
        steps.map(s => el("option", {value: s, selected: s === step}, String(s))))),
      el("button", {id: "next", disabled: i < 0 || i >= steps.length - 1, onclick: () => go(steps[i + 1])}, "next ▶"),
      el("label", {}, el("input", {type: "checkbox", id: "follow", checked: follow, onchange: e => { follow = e.target.checked; if (follow) { step = null; load().catch(showError); } }}),
        " follow the newest step"));
  }

  root.replaceChildren(el("h2", {}, "Trajectories of each step"), controls,
    el("p", {class: "muted"}, "Blue: what the model generated (trained on). Grey: what the environment inserted (passages, messages; masked out of the loss). Yellow: a gold answer."),
    list);
  await load();
  setInterval(async () => {
    try {
      const got = await api(`/api/runs/${encodeURIComponent(run)}/samples?step=-1`);
      setLive(`newest step ${got.steps.length ? got.steps[got.steps.length - 1] : "–"} · polled ${new Date().toLocaleTimeString()}`);
      if (follow && got.steps.length && got.steps[got.steps.length - 1] !== step) { step = null; await load(); }
      else if (got.steps.length !== steps.length) { steps = got.steps; drawControls(); }
    } catch (e) { showError(e); }
  }, POLL_MS);
}

// ------------------------------------------------------------------------------------------------ eval items
async function itemDetail(run, item, row) {
  const next = row.nextSibling;
  if (next && next.classList && next.classList.contains("detail")) { next.remove(); return; }
  const t = await api(`/api/runs/${encodeURIComponent(run)}/items/${encodeURIComponent(item.dataset)}/${encodeURIComponent(item.id)}`);
  row.after(el("tr", {class: "detail"}, el("td", {colspan: 7}, trajectoryNode(t))));
}

async function pageEval() {
  const root = main();
  const runs = (await api("/api/runs")).filter(r => r.kind === "eval");
  if (!runs.length) { root.replaceChildren(el("p", {class: "muted"}, "No evaluation run was opened.")); return; }
  let run = runs.some(r => r.id === params.get("run")) ? params.get("run") : runs[0].id;
  const filters = {dataset: params.get("dataset") || "", outcome: params.get("outcome") || "", searches: params.get("searches") || ""};
  const controls = el("div", {class: "controls"});
  const counts = el("div", {class: "counts", id: "counts"});
  const table = el("table", {id: "items"});

  async function load() {
    const q = new URLSearchParams(Object.entries(filters).filter(([, v]) => v !== "")).toString();
    const got = await api(`/api/runs/${encodeURIComponent(run)}/items` + (q ? "?" + q : ""));
    const select = (name, options) => el("select", {id: "filter-" + name, onchange: e => {
      filters[name] = e.target.value; setParams({[name]: e.target.value}); load().catch(showError);
    }}, options.map(([v, label]) => el("option", {value: v, selected: String(filters[name]) === String(v)}, label)));
    controls.replaceChildren(
      el("label", {}, "run ", el("select", {id: "run-select", onchange: e => { run = e.target.value; setParams({run}); load().catch(showError); }},
        runs.map(r => el("option", {value: r.id, selected: r.id === run}, r.label)))),
      el("label", {}, "dataset ", select("dataset", [["", "all"], ...got.datasets.map(d => [d, d])])),
      el("label", {}, "outcome ", select("outcome", Object.entries(OUTCOME_LABELS))),
      el("label", {}, "searches ", select("searches", [["", "any"], ...got.searches.map(s => [s, String(s)])])));
    counts.textContent = `${got.matching} of ${got.total} questions` + (got.items.length < got.matching ? ` (first ${got.items.length} listed)` : "");
    table.replaceChildren(el("tr", {}, ["dataset", "question", "gold", "answer", "", "gold shown", "searches"].map(h => el("th", {}, h))),
      ...got.items.map(item => {
        const row = el("tr", {class: "clickable item", dataset: {outcome: item.outcome, dataset: item.dataset}},
          el("td", {}, item.dataset), el("td", {}, item.question), el("td", {}, item.golds.join(" | ")),
          el("td", {}, item.prediction === null ? el("span", {class: "muted"}, "none") : item.prediction),
          el("td", {}, rightBadge(item.right)), el("td", {}, item.shown ? "yes" : "no"), el("td", {}, String(item.searches)));
        row.addEventListener("click", () => itemDetail(run, item, row).catch(showError));
        return row;
      }));
  }
  root.replaceChildren(el("h2", {}, "Evaluation items"), controls, counts,
    el("p", {class: "muted"}, "Each question's greedy (first) sample; click a row for its trajectory."), table);
  await load();
}

// ------------------------------------------------------------------------------------------------ compare
async function pageCompare() {
  const root = main();
  const runs = (await api("/api/runs")).filter(r => r.kind === "eval");
  if (runs.length < 2) { root.replaceChildren(el("p", {class: "muted"}, "Open two evaluation runs of the same questions to compare them.")); return; }
  let a = runs.some(r => r.id === params.get("a")) ? params.get("a") : runs[0].id;
  let b = runs.some(r => r.id === params.get("b")) ? params.get("b") : runs[runs.length - 1].id;
  let change = params.get("change") || "";
  const controls = el("div", {class: "controls"});
  const summary = el("div", {class: "counts", id: "compare-counts"});
  const table = el("table", {id: "compare"});
  const label = id => runs.find(r => r.id === id).label;

  async function load() {
    const got = await api(`/api/compare?a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}`);
    const pick = (name, value, set) => el("select", {id: "compare-" + name, onchange: e => { set(e.target.value); load().catch(showError); }},
      runs.map(r => el("option", {value: r.id, selected: r.id === value}, r.label)));
    controls.replaceChildren(
      el("label", {}, "A ", pick("a", a, v => { a = v; setParams({a}); })),
      el("label", {}, "B ", pick("b", b, v => { b = v; setParams({b}); })),
      el("label", {}, "show ", el("select", {id: "compare-change", onchange: e => { change = e.target.value; setParams({change}); load().catch(showError); }},
        [["", "every question"], ["flipped", "flipped (right ↔ wrong)"], ["gained", "wrong → right"], ["lost", "right → wrong"],
         ["changed", "answer changed, still wrong or right"]].map(([v, t]) => el("option", {value: v, selected: v === change}, t)))));
    const c = got.counts;
    summary.textContent = `${got.rows.length} questions in both: ${c.gained} wrong → right, ${c.lost} right → wrong, ` +
      `${c.changed} answers changed without flipping, ${c.same} the same` + (got.only_in_one ? `; ${got.only_in_one} in only one run` : "");
    const rows = got.rows.filter(r => change === "" || r.change === change || (change === "flipped" && (r.change === "gained" || r.change === "lost")));
    const answer = s => el("td", {}, s.prediction === null ? el("span", {class: "muted"}, "none") : s.prediction, " ", rightBadge(s.right));
    table.replaceChildren(el("tr", {}, el("th", {}, "dataset"), el("th", {}, "question"), el("th", {}, "gold"),
      el("th", {}, "A: " + label(a)), el("th", {}, "B: " + label(b)), el("th", {}, "change")),
      ...rows.map(r => el("tr", {class: "pair", dataset: {change: r.change}}, el("td", {}, r.dataset), el("td", {}, r.question),
        el("td", {}, r.golds.join(" | ")), answer(r.a), answer(r.b),
        el("td", {class: "change-" + r.change}, {gained: "wrong → right", lost: "right → wrong", changed: "changed", same: "same"}[r.change]))));
  }
  root.replaceChildren(el("h2", {}, "Two evaluations, question by question"), controls, summary, table);
  await load();
}

// ------------------------------------------------------------------------------------------------
function showError(e) {
  const box = document.getElementById("error") || main().appendChild(el("p", {id: "error", class: "error"}));
  box.textContent = "error: " + (e && e.message ? e.message : String(e));
}

const PAGES = {"/": pageRuns, "/curves": pageCurves, "/samples": pageSamples, "/eval": pageEval, "/compare": pageCompare};

document.addEventListener("DOMContentLoaded", () => {
  for (const a of document.querySelectorAll("nav a")) if (a.dataset.page === location.pathname) a.classList.add("active");
  (PAGES[location.pathname] || pageRuns)().then(() => document.body.setAttribute("data-ready", "1")).catch(showError);
});

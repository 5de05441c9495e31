// emapg view: the page. Every string from the API -- model output above all -- enters the DOM as a text node
// (el() below); nothing is ever assigned to innerHTML, and every link is built here from run ids.
"use strict";

const POLL_MS = 2000;
const DEFAULT_KEYS = ["filter/sampled_reward_mean", "reward/mean", "filter/first_round_informative_frac", "filter/informative_frac", "reward/zero_variance_groups", "kl/mean", "actor/entropy",
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
  if (!response.ok) {
    let detail = "";
    try { detail = (await response.json()).detail || ""; } catch (e) { /* not JSON */ }
    throw new Error(detail ? `${detail} (HTTP ${response.status})` : path + ": HTTP " + response.status);
  }
  return response.json();
}

// Two evaluations compare like for like: the same protocol (greedy with greedy, sampled with sampled).
function likePairs(evals) {
  const groups = {};
  for (const r of evals) (groups[r.protocol] = groups[r.protocol] || []).push(r);
  return Object.values(groups).filter(g => g.length >= 2).map(g => [g[0], g[g.length - 1]]);
}

function emText(r) {
  return r.em === null || r.em === undefined ? "–" : `${r.samples > 1 ? "mean@" + r.samples + " " : ""}EM ${r.em.toFixed(1)}%`;
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

// What the viewer skipped in a run's files (the API's problems, skipped_records, unreadable_files): null when nothing.
function problemsNote(r) {
  const skipped = r.skipped_records || 0, unreadable = r.unreadable_files || 0;
  if (!skipped && !unreadable) return null;
  const parts = [];
  if (skipped) parts.push(`${skipped} damaged record${skipped === 1 ? "" : "s"} skipped`);
  if (unreadable) parts.push(`${unreadable} file${unreadable === 1 ? "" : "s"} unreadable`);
  const files = Object.keys(r.problems || {});
  return `not shown: ${parts.join(", ")}` + (files.length ? ` (${files.join(", ")})` : "");
}

// ------------------------------------------------------------------------------------------------ runs
async function pageRuns() {
  const root = main();
  async function draw() {
    const runs = await api("/api/runs");
    const rows = runs.map(r => el("tr", {dataset: {run: r.id}},
      el("td", {}, r.label), el("td", {}, r.kind),
      el("td", {}, r.kind === "train" ? `${r.steps} steps (last ${r.last_step}), samples at ${r.sample_steps} steps`
        : `${r.questions} questions, ${emText(r)} (${r.protocol}); ${r.datasets.join(", ")}`,
        problemsNote(r) ? el("div", {class: "problems error"}, problemsNote(r)) : null),
      el("td", {class: "muted"}, ago(r.updated)),
      el("td", {}, r.kind === "train"
        ? [link("/curves", {runs: r.id}, "curves"), " · ", link("/samples", {run: r.id}, "trajectories")]
        : [link("/eval", {run: r.id}, "items")]),
      el("td", {class: "muted"}, r.path)));
    const evals = runs.filter(r => r.kind === "eval");
    const pairs = likePairs(evals);
    root.replaceChildren(
      el("h2", {}, "Runs"),
      el("table", {id: "runs"}, el("tr", {}, ["run", "kind", "what", "written", "pages", "folder"].map(h => el("th", {}, h))), rows),
      pairs.length ? el("ul", {id: "pairs"}, pairs.map(([a, b]) => el("li", {dataset: {a: a.id, b: b.id}},
        `${a.label} vs ${b.label} (both ${a.protocol}): `, link("/summary", {a: a.id, b: b.id}, "EM, difference and interval"),
        " · ", link("/compare", {a: a.id, b: b.id}, "question by question")))) : null,
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
  const data = {};  // run id -> {records, guard, keys, titles, constant}
  const flatNote = el("div", {class: "muted", id: "flat-note"});
  let keys = (params.get("keys") || "").split(",").filter(Boolean);
  const charts = el("div", {class: "charts", id: "charts"});
  const keyBox = el("div", {class: "keys", id: "keys"});
  const runBox = el("div", {class: "controls", id: "run-picker"});

  function allKeys() {
    const set = new Set();
    for (const id of chosen) for (const k of (data[id] || {keys: []}).keys) set.add(k);
    return [...set].sort();
  }

  // A key flat by construction (filter/informative_frac is 1 when uniform groups are dropped, say) in every chosen
  // run is no default panel; the note says why. A key merely flat so far is drawn.
  function flatKeys() {
    const flat = {};
    for (const k of allKeys()) {
      const runsWith = chosen.filter(id => data[id] && data[id].keys.includes(k));
      const why = runsWith.map(id => (data[id].by_construction || {})[k]);
      if (runsWith.length && why.every(w => w)) flat[k] = `${k} = ${fmt(data[runsWith[0]].constant[k])} (${why[0]})`;
    }
    return flat;
  }

  function title(k) {
    for (const id of chosen) if (data[id] && data[id].titles && data[id].titles[k]) return `${data[id].titles[k]} (${k})`;
    return k;
  }

  function drawKeyBox() {
    const every = allKeys();
    const flat = flatKeys();
    if (!keys.length) keys = DEFAULT_KEYS.filter(k => every.includes(k) && !(k in flat)).concat(every.filter(k => k.startsWith("guard/")));
    const hidden = Object.keys(flat).filter(k => DEFAULT_KEYS.includes(k) && !keys.includes(k));
    flatNote.textContent = hidden.length ? "Flat by construction in this run, so not drawn by default (tick one below to draw it): " +
      hidden.map(k => flat[k]).join("; ") : "";
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
      Plotly.react(div, traces, {title: {text: title(key), font: {size: 13}}, margin: {l: 50, r: 10, t: 32, b: 36}, shapes,
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
        data[id] = {records: have.concat(got.records), guard: got.guard, keys: got.keys, titles: got.titles, constant: got.constant,
                    by_construction: got.by_construction};
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
    el("div", {class: "muted"}, "metrics (each run's metrics.jsonl; dotted red lines: stability-guard events). " +
      "Two rewards where groups are left out of the update: every sampled group's (the policy's, as the report draws it) " +
      "and the kept groups' (reward/mean)."), flatNote, keyBox, charts);
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
// A question's trajectory; a sampled run's every sample is one click away (the sample buttons above it).
async function itemDetail(run, item, row, sample = 0) {
  const next = row.nextSibling;
  const open = next && next.classList && next.classList.contains("detail");
  if (open && next.dataset.sample === String(sample)) { next.remove(); return; }
  const t = await api(`/api/runs/${encodeURIComponent(run)}/items/${encodeURIComponent(item.dataset)}/${encodeURIComponent(item.id)}?sample=${sample}`);
  const tabs = t.sample_scores.length > 1 ? el("div", {class: "controls samples"}, "samples: ", t.sample_scores.map((s, i) =>
    el("button", {class: "sample" + (i === sample ? " active" : ""), dataset: {sample: String(i)},
      onclick: e => { e.stopPropagation(); itemDetail(run, item, row, i).catch(showError); }},
      `${i + 1}: ${s.prediction === null || s.prediction === undefined ? "no answer" : s.prediction} (${s.right ? "right" : "wrong"})`))) : null;
  if (open) next.remove();
  row.after(el("tr", {class: "detail", dataset: {sample: String(sample)}}, el("td", {colspan: 7}, tabs, trajectoryNode(t))));
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

  const caption = el("p", {class: "muted", id: "eval-caption"});
  const describe = () => {
    const r = runs.find(x => x.id === run);
    caption.textContent = r.samples > 1
      ? `${r.protocol}: each question's first sample's answer and how many of its ${r.samples} samples are right (its mean@${r.samples} EM); ` +
        `"right" filters questions whose every sample is right. Click a row for its trajectories, one button per sample.`
      : "Greedy: each question's one answer; click a row for its trajectory.";
  };
  async function load() {
    describe();
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
          el("td", {}, item.samples > 1 ? el("span", {class: "badge " + (item.right_samples ? "right" : "wrong")},
            `${item.right_samples}/${item.samples} right`) : rightBadge(item.right)),
          el("td", {}, item.shown ? "yes" : "no"), el("td", {}, String(item.searches)));
        row.addEventListener("click", () => itemDetail(run, item, row).catch(showError));
        return row;
      }));
  }
  root.replaceChildren(el("h2", {}, "Evaluation items"), controls, counts, caption, table);
  await load();
}

// ------------------------------------------------------------------------------------------------ compare
// The pair a page opens on: the URL's, else the first like-for-like pair (same protocol), else nothing.
function chosenPair(runs) {
  const has = id => runs.some(r => r.id === id);
  const pairs = likePairs(runs);
  let a = has(params.get("a")) ? params.get("a") : (pairs.length ? pairs[0][0].id : runs[0].id);
  const protocol = runs.find(r => r.id === a).protocol;
  const same = runs.filter(r => r.protocol === protocol && r.id !== a);
  let b = has(params.get("b")) ? params.get("b") : (same.length ? same[same.length - 1].id : null);
  return [a, b];
}

function pairPickers(runs, a, b, onPick) {
  const pick = (name, value) => el("select", {id: "compare-" + name, onchange: e => onPick(name, e.target.value)},
    el("option", {value: "", selected: !value}, "–"),
    runs.map(r => el("option", {value: r.id, selected: r.id === value}, `${r.label} (${r.protocol})`)));
  return [el("label", {}, "A ", pick("a", a)), el("label", {}, "B ", pick("b", b))];
}

function scoreCell(s) {
  if (s.samples > 1) return el("td", {}, s.prediction === null ? el("span", {class: "muted"}, "none") : s.prediction, " ",
    el("span", {class: "badge " + (s.right_samples ? "right" : "wrong")}, `${s.right_samples}/${s.samples} right`));
  return el("td", {}, s.prediction === null ? el("span", {class: "muted"}, "none") : s.prediction, " ", rightBadge(s.right));
}

async function pageCompare() {
  const root = main();
  const runs = (await api("/api/runs")).filter(r => r.kind === "eval");
  if (runs.length < 2) { root.replaceChildren(el("p", {class: "muted"}, "Open two evaluation runs of the same questions to compare them.")); return; }
  let [a, b] = chosenPair(runs);
  let change = params.get("change") || "";
  const controls = el("div", {class: "controls"});
  const summary = el("div", {class: "counts", id: "compare-counts"});
  const table = el("table", {id: "compare"});
  const label = id => runs.find(r => r.id === id).label;

  async function load() {
    controls.replaceChildren(...pairPickers(runs, a, b, (name, v) => {
      if (name === "a") a = v; else b = v; setParams({[name]: v}); load().catch(showError);
    }), el("label", {}, "show ", el("select", {id: "compare-change", onchange: e => { change = e.target.value; setParams({change}); load().catch(showError); }},
      [["", "every question"], ["flipped", "score went up or down"], ["gained", "score went up (wrong → right)"],
       ["lost", "score went down (right → wrong)"], ["changed", "answer changed, same score"]].map(([v, t]) => el("option", {value: v, selected: v === change}, t)))));
    if (!a || !b) { summary.textContent = "Choose two evaluations under the same protocol."; table.replaceChildren(); return; }
    const got = await api(`/api/compare?a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}`);
    const c = got.counts;
    const sampled = got.a.samples > 1;
    summary.replaceChildren(`${got.protocol}: ${got.rows.length} questions in both: ` + (sampled
      ? `mean@${got.a.samples} EM up on ${c.gained}, down on ${c.lost}, ` : `${c.gained} wrong → right, ${c.lost} right → wrong, `) +
      `${c.changed} answers changed without it, ${c.same} the same` + (got.only_in_one ? `; ${got.only_in_one} in only one run` : "") + " · ",
      link("/summary", {a, b}, "EM, difference and interval"));
    const rows = got.rows.filter(r => change === "" || r.change === change || (change === "flipped" && (r.change === "gained" || r.change === "lost")));
    const names = sampled ? {gained: "mean@k up", lost: "mean@k down", changed: "changed", same: "same"}
      : {gained: "wrong → right", lost: "right → wrong", changed: "changed", same: "same"};
    table.replaceChildren(el("tr", {}, el("th", {}, "dataset"), el("th", {}, "question"), el("th", {}, "gold"),
      el("th", {}, "A: " + label(a) + (sampled ? " (first sample; right samples)" : "")), el("th", {}, "B: " + label(b)), el("th", {}, "change")),
      ...rows.map(r => el("tr", {class: "pair", dataset: {change: r.change}}, el("td", {}, r.dataset), el("td", {}, r.question),
        el("td", {}, r.golds.join(" | ")), scoreCell(r.a), scoreCell(r.b), el("td", {class: "change-" + r.change}, names[r.change]))));
  }
  root.replaceChildren(el("h2", {}, "Two evaluations, question by question"), controls, summary, table);
  await load();
}

// ------------------------------------------------------------------------------------------------ summary
async function pageSummary() {
  const root = main();
  const runs = (await api("/api/runs")).filter(r => r.kind === "eval");
  if (runs.length < 2) { root.replaceChildren(el("p", {class: "muted"}, "Open two evaluation runs of the same questions to summarise them.")); return; }
  let [a, b] = chosenPair(runs);
  const controls = el("div", {class: "controls"});
  const body = el("div", {id: "summary"});

  async function load() {
    controls.replaceChildren(...pairPickers(runs, a, b, (name, v) => {
      if (name === "a") a = v; else b = v; setParams({[name]: v}); load().catch(showError);
    }));
    if (!a || !b) { body.replaceChildren(el("p", {class: "muted"}, "Choose two evaluations under the same protocol.")); return; }
    const got = await api(`/api/summary?a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}`);
    const level = Math.round(100 * got.confidence);
    const row = (name, x, cls) => el("tr", {class: cls, dataset: {dataset: name}}, el("td", {}, name), el("td", {}, String(x.n)),
      el("td", {}, x.text.em_a), el("td", {}, x.text.em_b), el("td", {}, x.text.difference));  // the report's own text
    const verdict = got.interval[0] > 0 ? "the interval lies above zero: B is better beyond noise"
      : got.interval[1] < 0 ? "the interval lies below zero: B is worse beyond noise"
      : "the interval contains zero: the difference cannot be told from noise at this sample size";
    const metric = got.protocol === "greedy" ? "EM" : "mean@k EM";
    body.replaceChildren(
      el("p", {}, `A: ${got.label_a} · B: ${got.label_b} · protocol: ${got.protocol}`),
      el("table", {id: "summary-table"}, el("tr", {}, ["dataset", "n", `A ${metric} (%)`, `B ${metric} (%)`,
        `B − A (pp, ${level}% CI)`].map(h => el("th", {}, h))),
        Object.entries(got.datasets).map(([ds, x]) => row(ds, x, "dataset")), row("pooled", got, "pooled")),
      el("p", {id: "summary-verdict"}, `Pooled over ${got.n} questions: ${verdict}.`),
      el("p", {class: "muted"}, `${got.method}, ${got.resamples} resamples; computed by eval.learning.compare_learning, ` +
        "the code of the demo's report, so these are the report's numbers. ", link("/compare", {a, b}, "question by question")));
  }
  root.replaceChildren(el("h2", {}, "Did it help? Two evaluations of the same questions"), controls, body);
  await load();
}

// ------------------------------------------------------------------------------------------------
function showError(e) {
  const box = document.getElementById("error") || main().appendChild(el("p", {id: "error", class: "error"}));
  box.textContent = "error: " + (e && e.message ? e.message : String(e));
}

const PAGES = {"/": pageRuns, "/curves": pageCurves, "/samples": pageSamples, "/eval": pageEval, "/compare": pageCompare,
  "/summary": pageSummary};

document.addEventListener("DOMContentLoaded", () => {
  for (const a of document.querySelectorAll("nav a")) if (a.dataset.page === location.pathname) a.classList.add("active");
  (PAGES[location.pathname] || pageRuns)().then(() => document.body.setAttribute("data-ready", "1")).catch(showError);
});

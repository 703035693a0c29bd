// The Layers tab (lightning_hooks): per run, one heatmap per figure, rows = layers in forward
// order, columns = logged steps, with verdict marks, a banner and an anomaly timeline.
// Plain ES module, no build step, nothing from the network; drawn on <canvas> so that a
// 200-module model stays fast. It runs in TensorBoard's plugin iframe and fetches the
// plugin's routes by relative URL.

import {flightView} from "./flight.js";
import {MARK_COLOURS, NONFINITE, at, colourScale, draw, el, fmt, num} from "./heatmap.js";

// The verdicts are LayerHealth's (lightning_hooks/output/_health_verdicts.py), judged by the plugin with its bands.
const TITLES = {std: "activation std", zero_fraction: "zero fraction (dead units)",
                nonfinite_fraction: "non-finite fraction", norm: "gradient norm",
                log10_ratio: "log10 update / parameter ratio"};
const MAX_VISIBLE_ROWS = 48;  // beyond this, rows start collapsed by module prefix

const state = {runs: [], data: {}, views: {}, expanded: {}, thresholds: {}, defaults: {}, problems: {}};
let tip = null;

export async function render() {
  const started = performance.now();
  const css = document.createElement("link");
  css.rel = "stylesheet";
  css.href = "./style.css";
  document.head.appendChild(css);
  document.body.innerHTML = "";
  tip = el("div", {class: "lh-tip"});
  document.body.appendChild(tip);
  const bar = el("div", {class: "lh-toolbar"}, [el("h1", {}, "Layers")]);
  const reload = el("button", {title: "Read the runs again (a run still training shows its new steps)"}, "Reload");
  reload.onclick = () => load();
  const timing = el("span", {class: "lh-timing", id: "lh-timing"});
  bar.append(reload, thresholdToggle(), timing);
  document.body.append(bar, el("div", {id: "lh-thresholds"}), el("div", {id: "lh-runs"}));
  await load(started);
  await openLinkedCell(new URLSearchParams(window.location.search));
  setInterval(() => { if (document.visibilityState === "visible") load(); }, 60000);
}

async function load(started = performance.now()) {
  const root = document.getElementById("lh-runs");
  try {
    const listing = await getJSON("runs");
    state.runs = listing.runs;
    state.defaults = listing.thresholds;
    state.problems = listing.problems;
    if (!Object.keys(state.thresholds).length) state.thresholds = {...listing.thresholds};
    const query = new URLSearchParams(state.thresholds);
    // One run that cannot be read (a bad threshold, a run just deleted) says so in its own card.
    const answers = await Promise.all(state.runs.map((run) => getJSON(`run?run=${encodeURIComponent(run)}&${query}`)
      .catch((error) => ({run, error: error.message}))));
    const runs = answers.filter((data) => !data.error);
    const loaded = performance.now();
    root.innerHTML = "";
    if (!answers.length) root.append(el("div", {class: "lh-card"}, "No run has layer figures yet."));
    for (const data of answers) {
      if (data.error) { root.append(el("div", {class: "lh-card lh-error", "data-run": data.run}, `${data.run}: ${data.error}`)); continue; }
      state.data[data.run] = data;
      root.append(runCard(data));
    }
    const drawn = performance.now();
    const server = runs.reduce((sum, r) => sum + r.server_ms, 0);
    Object.assign(document.body.dataset, {loadMs: (loaded - started).toFixed(0), renderMs: (drawn - loaded).toFixed(0),
                                          serverMs: server.toFixed(0), ready: "true"});
    document.getElementById("lh-timing").textContent =
      `loaded in ${(loaded - started).toFixed(0)} ms (server ${server.toFixed(0)} ms), drawn in ${(drawn - loaded).toFixed(0)} ms`;
  } catch (error) {
    root.innerHTML = "";
    root.append(el("div", {class: "lh-card lh-error"}, `Could not read the runs: ${error.message}`));
    document.body.dataset.ready = "error";
  }
}

async function getJSON(path) {
  const response = await fetch(path);
  if (!response.ok) throw new Error(`${path}: ${response.status} ${await response.text()}`);
  return response.json();
}

function thresholdToggle() {
  const button = el("button", {title: "Where cells are marked: LayerHealth's bands"}, "Thresholds");
  button.onclick = () => {
    const box = document.getElementById("lh-thresholds");
    if (box.firstChild) { box.innerHTML = ""; return; }
    const card = el("div", {class: "lh-card lh-thresholds"});
    for (const [name, value] of Object.entries(state.thresholds)) {
      const input = el("input", {type: "number", step: "any", value: String(value), name});
      input.onchange = () => { state.thresholds[name] = input.value; load(); };
      card.append(el("label", {title: `default ${state.defaults[name]}`}, [`${name} `, input]));
    }
    const reset = el("button", {}, "Defaults");
    reset.onclick = () => { state.thresholds = {...state.defaults}; box.innerHTML = ""; load(); };
    card.append(reset);
    box.append(card);
  };
  return button;
}

function runCard(data) {
  const card = el("div", {class: "lh-card", "data-run": data.run});
  card.append(el("h2", {}, data.run), bannerOf(data));
  if (data.anomalies.length) card.append(timeline(data));
  const flights = data.anomalies.filter((a) => a.flight_record);
  if (flights.length) card.append(el("div", {class: "lh-figures lh-flights"}, flights.map(flightView)));
  if (!data.figures.length) return card;
  const legend = el("div", {class: "lh-legend"}, ["Marked cells:"]);
  legend.append(el("span", {style: `border-color:${MARK_COLOURS.dead}`}), "too high / dead / non-finite",
                el("span", {style: `border-color:${MARK_COLOURS.vanishing}`}), "too low",
                el("span", {style: `border-color:${NONFINITE};background:${NONFINITE}`}), "NaN / Inf",
                ` · rows in ${data.forward_order ? "forward (recorded) order" : "module name order"};`
                + " click a group's label to expand it, a cell to see its histogram");
  card.append(legend);
  const figures = el("div", {class: "lh-figures"});
  for (const figure of data.figures) figures.append(figureView(data, figure));
  card.append(figures);
  return card;
}

function bannerOf(data) {
  if (!data.figures.length) {
    return el("div", {class: "lh-banner", "data-healthy": "unknown"},
              "No layer figures in this run (no ActivationMonitor or GradientMonitor): its anomalies only.");
  }
  if (!data.banner.length) {
    return el("div", {class: "lh-banner healthy", "data-healthy": "true"},
              "Looks healthy: no layer is outside its healthy band at its last logged step.");
  }
  const layers = [...new Set(data.banner.map((b) => b.layer))];
  const box = el("div", {class: "lh-banner unhealthy", "data-healthy": "false", "data-layers": layers.join(",")},
                 `${layers.length} layer${layers.length > 1 ? "s" : ""} unhealthy now:`);
  const list = el("ul");
  const byProblem = new Map();  // one line per layer and problem, however many figures show it
  for (const item of data.banner) {
    const key = `${item.layer}\u0000${item.verdict}`;
    if (!byProblem.has(key)) byProblem.set(key, {...item, seen: []});
    const line = byProblem.get(key);
    line.since = Math.min(line.since, item.since);
    line.seen.push(`${item.figure} = ${fmt(num(item.value))}`);
  }
  for (const item of byProblem.values()) {
    list.append(el("li", {"data-layer": item.layer, "data-verdict": item.verdict, "data-since": String(item.since)},
                   [el("code", {}, item.layer), ` — ${item.problem} since step ${item.since} (${item.seen.join(", ")})`]));
  }
  box.append(list);
  return box;
}

function timeline(data) {
  const wrap = el("div", {class: "lh-anomaly"}, [el("b", {}, `Anomalies (${data.anomalies.length})`)]);
  const steps = data.figures.flatMap((f) => [f.steps[0], f.steps[f.steps.length - 1]]).concat(data.anomalies.map((a) => a.step));
  const lo = Math.min(...steps), hi = Math.max(...steps);
  const line = el("div", {class: "lh-timeline"});
  const report = el("pre", {}, "Click a marker to read its report.");
  line.append(el("span", {class: "lh-axis", style: "left:0"}, `step ${lo}`),
              el("span", {class: "lh-axis", style: "right:0"}, `step ${hi}`));
  for (const anomaly of data.anomalies) {
    const x = hi > lo ? (100 * (anomaly.step - lo)) / (hi - lo) : 0;
    const tick = el("span", {class: "lh-tick", style: `left:${x}%`, "data-step": String(anomaly.step),
                             title: `step ${anomaly.step}: ${anomaly.flags.join(", ")}`});
    tick.onclick = () => { report.textContent = `step ${anomaly.step}${flagsOf(anomaly)}\n\n${anomaly.report || "(no report)"}`; };
    line.append(tick);
  }
  const first = data.anomalies[0];
  report.textContent = `first at step ${first.step}${flagsOf(first)}\n\n${first.report || "(no report)"}`;
  wrap.append(line, report);
  return wrap;
}

// The flag scalars GradientMonitor logs; GradientAnomalyStopping alone logs none (its report names them).
function flagsOf(anomaly) { return anomaly.flags.length ? ` · flags: ${anomaly.flags.join(", ")}` : ""; }

// Rows: each visible row is a layer, or a collapsed group of layers sharing a module prefix.
function visibleRows(run, figure) {
  const names = figure.rows;
  const depth = groupDepth(names);
  const expanded = state.expanded[run] || (state.expanded[run] = new Set());
  const rows = [];
  let i = 0;
  while (i < names.length) {
    const prefix = depth ? names[i].split(".").slice(0, depth).join(".") : null;
    let j = i + 1;
    while (prefix && j < names.length && within(names[j], prefix)) j++;
    if (j - i > 1 && !expanded.has(prefix)) {
      rows.push({label: `▸ ${prefix}.* (${j - i})`, members: range(i, j), group: prefix});
    } else {
      for (let k = i; k < j; k++) {
        rows.push({label: (j - i > 1 ? "  " : "") + names[k], members: [k], group: j - i > 1 ? prefix : null, open: j - i > 1});
      }
    }
    i = j;
  }
  return rows;
}

function within(name, prefix) { return name === prefix || name.startsWith(prefix + "."); }
function range(a, b) { return Array.from({length: b - a}, (_, k) => a + k); }

function groupDepth(names) {  // the finest module-prefix depth that fits MAX_VISIBLE_ROWS rows
  if (names.length <= MAX_VISIBLE_ROWS) return 0;
  const deepest = Math.max(...names.map((n) => n.split(".").length));
  for (let depth = deepest - 1; depth >= 1; depth--) {
    if (new Set(names.map((n) => n.split(".").slice(0, depth).join("."))).size <= MAX_VISIBLE_ROWS) return depth;
  }
  return 1;
}

function figureView(data, figure) {
  const values = figure.values.map((row) => row.map(num));
  const marks = new Map(figure.marks.map(([r, c, v]) => [`${r},${c}`, v]));
  const markedRows = [...new Set(figure.marks.map(([r]) => figure.rows[r]))];
  const box = el("div", {class: "lh-figure", "data-figure": figure.key, "data-marked-rows": markedRows.join(",")});
  const [kind, stat] = [figure.kind, figure.stat];
  box.append(el("h3", {}, `${figure.prefix ? figure.prefix + "-" : ""}${kind} · ${TITLES[stat] || stat}`),
             el("div", {class: "lh-sub"}, `${figure.rows.length} layers × ${figure.steps.length} steps · ${figure.key}`));
  const canvas = el("canvas");
  const hist = el("div", {class: "lh-hist"});
  box.append(canvas, hist);
  const scale = colourScale(values, stat);
  const view = {data, figure, values, marks, scale, canvas, hist, rows: []};
  (state.views[data.run] || (state.views[data.run] = {}))[figure.key] = view;
  view.rows = visibleRows(data.run, figure);
  draw(view);
  canvas.onmousemove = (event) => hover(view, event);
  canvas.onmouseleave = () => { tip.style.display = "none"; };
  canvas.onclick = (event) => click(view, event);
  return box;
}

function hover(view, event) {
  const {row, c, inLabel, valid} = at(view, event);
  if (!valid || (!inLabel && (c < 0 || c >= view.figure.steps.length))) { tip.style.display = "none"; return; }
  const names = row.members.map((m) => view.figure.rows[m]);
  let text = row.members.length > 1 ? `${row.group} (${names.length} layers; click to expand)` : names[0];
  if (!inLabel) {
    const step = view.figure.steps[c];
    text += `\nstep ${step}`;
    for (const m of row.members.slice(0, 8)) {
      const mark = view.marks.get(`${m},${c}`);
      text += `\n${row.members.length > 1 ? view.figure.rows[m] + ": " : "value "}${fmt(view.values[m][c])}`
              + (mark ? `  ⚠ ${(view.data.problems || state.problems)[mark] || mark}` : "");
    }
  }
  tip.textContent = text;
  Object.assign(tip.style, {display: "block", left: `${event.clientX + 14}px`, top: `${event.clientY + 10}px`});
}

async function click(view, event) {
  const {row, c, inLabel, valid} = at(view, event);
  if (!valid) return;
  const expanded = state.expanded[view.data.run];
  if (row.members.length > 1 || (inLabel && row.group)) {  // a group's label or cell: expand or collapse it
    if (expanded.has(row.group)) expanded.delete(row.group); else expanded.add(row.group);
    redrawRun(view.data.run);
    return;
  }
  if (inLabel || c < 0 || c >= view.figure.steps.length) return;
  await openCell(view, row.members[0], c);
}

// A deep link: ?layer=<name>&step=<step>[&run=<run>][&figure=<key>] opens that cell's histogram.
async function openLinkedCell(params) {
  const layer = params.get("layer"), step = Number(params.get("step"));
  if (!layer || !params.has("step")) return;
  const run = params.get("run") || state.runs[0];
  const views = Object.values(state.views[run] || {}).filter((v) => !params.get("figure") || v.figure.key === params.get("figure"));
  const view = views.find((v) => v.figure.rows.includes(layer) && v.figure.histograms[v.figure.rows.indexOf(layer)]);
  if (!view) return;
  const col = view.figure.steps.reduce((best, s, i) => (Math.abs(s - step) < Math.abs(view.figure.steps[best] - step) ? i : best), 0);
  await openCell(view, view.figure.rows.indexOf(layer), col);
}

async function openCell(view, member, c) {
  const tag = view.figure.histograms[member];
  const step = view.figure.steps[c], name = view.figure.rows[member];
  if (!tag) { view.hist.textContent = `${name} at step ${step}: this figure has no histograms.`; return; }
  try {
    const found = await getJSON(`histogram?run=${encodeURIComponent(view.data.run)}&tag=${encodeURIComponent(tag)}&step=${step}`);
    showHistogram(view.hist, found, name);
  } catch (error) {
    view.hist.textContent = `No histogram for ${name} (${tag}) at step ${step}: ${error.message}`;
  }
}

function redrawRun(run) {
  const card = document.querySelector(`.lh-card[data-run="${CSS.escape(run)}"]`);
  card.replaceWith(runCard(state.data[run]));
}

function showHistogram(box, found, name) {
  box.innerHTML = "";
  const close = el("span", {class: "lh-close", title: "close"}, "✕");
  close.onclick = () => { box.innerHTML = ""; };
  const bins = found.bins.filter((b) => b[2] > 0);
  const total = found.bins.reduce((s, b) => s + b[2], 0);
  box.append(close, el("div", {"data-histogram": found.tag, "data-step": String(found.step)},
                       `${name} · histogram ${found.tag} at step ${found.step} · ${total} values`));
  if (!bins.length) return;
  const canvas = el("canvas"), w = 420, h = 140, ratio = window.devicePixelRatio || 1;
  canvas.width = w * ratio; canvas.height = h * ratio; canvas.style.width = `${w}px`; canvas.style.height = `${h}px`;
  const g = canvas.getContext("2d");
  g.scale(ratio, ratio);
  const peak = Math.max(...bins.map((b) => b[2])), bw = (w - 20) / bins.length;
  g.fillStyle = "#f57c00";
  bins.forEach((b, i) => { const bh = ((h - 34) * b[2]) / peak; g.fillRect(10 + i * bw, h - 24 - bh, Math.max(1, bw - 1), bh); });
  g.fillStyle = "#616161"; g.font = "11px Roboto, Arial, sans-serif"; g.textBaseline = "top";
  g.fillText(fmt(bins[0][0]), 10, h - 20);
  g.textAlign = "right"; g.fillText(fmt(bins[bins.length - 1][1]), w - 10, h - 20);
  g.textAlign = "center"; g.fillText("value (one bar per bin; the bins are log-spaced)", w / 2, h - 20);
  g.textAlign = "left"; g.fillText(`max count ${fmt(peak)}`, 10, 2);
  box.append(canvas);
}

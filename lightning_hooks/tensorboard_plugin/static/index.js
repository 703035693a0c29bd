// The Layers tab (lightning_hooks): a summary strip (each run healthy or not, since when, its first culprit;
// the sick runs first), then per run one heatmap per figure, rows = layers in forward order, columns = logged
// steps, with verdict marks, a banner, the loss and learning rate above, an anomaly timeline and flight records.
// Plain ES modules, no build step, nothing from the network; drawn on <canvas> so that a 200-module model stays
// fast. It runs in TensorBoard's plugin iframe, fetches the plugin's routes by relative URL, and follows
// TensorBoard's reload and run selector (host.js).

import {CONTEXT_H, contextOverlay, depthProfile, ratioValues} from "./compare.js";
import {flightView, timeline} from "./flight.js";
import {MARK_COLOURS, NONFINITE, TOP_GAP, at, centredLogScale, colourScale, draw, el, fmt, num, signScale} from "./heatmap.js";
import {histogramView} from "./histogram.js";
import * as host from "./host.js";
import {drawnMember, visibleRows} from "./rows.js";
import {bannerOf, status, strip} from "./summary.js";
import {thresholdToggle} from "./thresholds.js";

const PLUGIN = "lightning_hooks_layers";
const TITLES = {std: "activation std", zero_fraction: "zero fraction (dead units)",
                nonfinite_fraction: "non-finite fraction", norm: "gradient norm",
                log10_ratio: "log10 update / parameter ratio",
                pull: "the loss's pull on the prediction layer, sum(y·dL/dy)"};
const state = {answers: [], data: {}, groups: {}, open: {}, bannerOpen: {}, baseline: {}, filter: "", focus: null,
               thresholds: {}, defaults: {}, problems: {}, hosted: false, loading: null, tbRuns: null};
let tip = null;

export async function render() {
  const started = performance.now();
  document.head.append(el("link", {rel: "stylesheet", href: "./style.css"}));
  document.body.innerHTML = "";
  tip = el("div", {class: "lh-tip"});
  const reload = el("button", {title: "Read the runs again (TensorBoard's own reload does this too)"}, "Reload");
  reload.onclick = () => load();
  const filter = el("input", {type: "search", id: "lh-filter", placeholder: "filter runs and layers (regex)"});
  filter.oninput = () => { state.filter = filter.value; saveURL(); show(); };
  const bar = el("div", {class: "lh-toolbar"}, [el("h1", {}, "Layers"), reload, filter, thresholdToggle(state, load),
                                                  el("span", {class: "lh-timing", id: "lh-timing"})]);
  document.body.append(tip, bar, el("div", {id: "lh-thresholds"}), el("div", {id: "lh-strip"}), el("div", {id: "lh-runs"}));
  state.hosted = host.connect(PLUGIN);
  await readURL(filter);
  host.onDataReloaded(() => load());  // TensorBoard's reload button and auto-reload
  host.onRunsChanged((names) => { state.tbRuns = names; load(); });
  if (state.hosted) state.tbRuns = await host.getRuns().catch(() => null);
  else setInterval(() => { if (document.visibilityState === "visible") load(); }, 60000);  // alone: no host to follow
  await load(started);
  openLinked();
}

async function load(started = performance.now()) {
  if (state.loading) return state.loading;  // one load at a time; a reload asked meanwhile joins it
  state.loading = (async () => {
    try {
      const listing = await getJSON("runs");
      Object.assign(state, {defaults: listing.thresholds, problems: listing.problems});
      if (!Object.keys(state.thresholds).length) state.thresholds = {...listing.thresholds};
      const query = new URLSearchParams(state.thresholds);
      // One run that cannot be read (a bad threshold, a run just deleted) says so in its own card.
      state.answers = await Promise.all(listing.runs.map((run) => getJSON(`run?run=${encodeURIComponent(run)}&${query}`)
        .catch((error) => ({run, error: error.message}))));
      for (const data of state.answers) if (!data.error) state.data[data.run] = data;
      const loaded = performance.now();
      show();
      const drawn = performance.now(), server = state.answers.reduce((sum, r) => sum + (r.server_ms || 0), 0);
      Object.assign(document.body.dataset, {loadMs: (loaded - started).toFixed(0), renderMs: (drawn - loaded).toFixed(0),
                                            serverMs: server.toFixed(0), ready: "true", loads: String(1 + Number(document.body.dataset.loads || 0))});
      document.getElementById("lh-timing").textContent =
        `loaded in ${(loaded - started).toFixed(0)} ms (server ${server.toFixed(0)} ms), drawn in ${(drawn - loaded).toFixed(0)} ms`
        + (state.hosted ? " · follows TensorBoard's reload" : "");
    } catch (error) {
      document.getElementById("lh-runs").replaceChildren(el("div", {class: "lh-card lh-error"}, `Could not read the runs: ${error.message}`));
      document.body.dataset.ready = "error";
    } finally { state.loading = null; }
  })();
  return state.loading;
}

async function getJSON(path) {
  const response = await fetch(path);
  if (!response.ok) throw new Error(`${path}: ${response.status} ${await response.text()}`);
  return response.json();
}

// Which runs show: those TensorBoard lists (its plugin library's run names, where it answers), and the tab's own
// filter, which keeps a run whose name or some layer's name matches.
function shown(data) {
  if (state.tbRuns && state.tbRuns.length && !state.tbRuns.includes(data.run)) return false;
  if (!state.filter) return true;
  const pattern = safeRegex(state.filter);
  return pattern.test(data.run) || (data.figures || []).some((f) => f.rows.some((row) => pattern.test(row)));
}
function safeRegex(text) { try { return new RegExp(text, "i"); } catch (error) { return {test: (s) => s.toLowerCase().includes(text.toLowerCase())}; } }

function show() {
  const order = [...state.answers].sort((a, b) => (status(a).rank - status(b).rank) || a.run.localeCompare(b.run));
  const visible = order.filter(shown);
  const hidden = order.length - visible.length;
  const box = document.getElementById("lh-strip");
  box.replaceChildren(el("div", {class: "lh-card lh-summary"}, [strip(visible, focusRun),
    hidden ? el("div", {class: "lh-sub"}, `${hidden} run${hidden > 1 ? "s" : ""} hidden by the filter`) : ""]));
  const root = document.getElementById("lh-runs");
  root.replaceChildren(...(order.length ? [] : [el("div", {class: "lh-card"}, "No run has layer figures yet.")]));
  for (const data of visible) root.append(safeCard(data));
}

function safeCard(data) {  // a run's card, or the error that stopped it drawing, in its place
  if (data.error) return el("div", {class: "lh-card lh-error", "data-run": data.run}, `${data.run}: ${data.error}`);
  try { return runCard(data); } catch (error) {
    console.error(error);
    return el("div", {class: "lh-card lh-error", "data-run": data.run}, `${data.run}: could not be drawn: ${error.message}`);
  }
}

function focusRun(run) {
  state.focus = run;
  saveURL();
  const card = document.querySelector(`.lh-card[data-run="${CSS.escape(run)}"]`);
  if (card) card.scrollIntoView({block: "start"});
}

function runCard(data) {
  const card = el("div", {class: "lh-card", "data-run": data.run});
  card.append(el("h2", {}, data.run), bannerOf(data, state.bannerOpen[data.run], () => {
    state.bannerOpen[data.run] = !state.bannerOpen[data.run];
    redrawRun(data.run);
  }));
  if (data.anomalies.length) card.append(timeline(data));
  for (const anomaly of data.anomalies.filter((a) => a.flight_error)) {
    card.append(el("div", {class: "lh-error lh-flight-error", "data-flight-step": String(anomaly.step)},
                   `Flight record at step ${anomaly.step}: ${anomaly.flight_error}`));
  }
  const flights = data.anomalies.filter((a) => a.flight_record);
  if (flights.length) card.append(el("div", {class: "lh-figures lh-flights"}, flights.map(safeFlight)));
  if (!data.figures.length) return card;
  card.append(controls(data));
  const figures = el("div", {class: "lh-figures"});
  for (const figure of data.figures) figures.append(figureView(data, figure));
  card.append(figures);
  return card;
}

function safeFlight(anomaly) {
  try { return flightView(anomaly); } catch (error) {
    return el("div", {class: "lh-error lh-flight-error", "data-flight-step": String(anomaly.step)},
              `Flight record at step ${anomaly.step} could not be drawn: ${error.message}`);
  }
}

function controls(data) {
  const base = state.baseline[data.run] || "";
  const pick = el("select", {class: "lh-baseline", title: "Each cell: this run's value ÷ the baseline run's at the same step and layer"});
  pick.append(el("option", {value: ""}, "compare with: none"));
  for (const other of state.answers) if (other.run !== data.run && !other.error && other.figures.length) pick.append(el("option", {value: other.run}, `compare with: ${other.run}`));
  pick.value = base;
  pick.onchange = () => { state.baseline[data.run] = pick.value; state.focus = data.run; saveURL(); redrawRun(data.run); };
  const legend = el("div", {class: "lh-legend"}, [pick, " Marked cells:"]);
  legend.append(el("span", {style: `border-color:${MARK_COLOURS.dead}`}), "too high / dead / non-finite / bad batch",
                el("span", {style: `border-color:${MARK_COLOURS.vanishing}`}), "too low",
                el("span", {style: `border-color:${NONFINITE};background:${NONFINITE}`}), "NaN / Inf",
                ` · rows in ${data.forward_order ? "forward (recorded) order" : "module name order"};`
                + " a collapsed group is drawn by its most abnormal member; click a group's label to open it,"
                + " a cell for its histogram, the step axis for the depth profile");
  return legend;
}

function figureView(data, figure) {
  const values = figure.values.map((row) => row.map(num));
  const marks = new Map(figure.marks.map(([r, c, v]) => [`${r},${c}`, v]));
  const markedRows = [...new Set(figure.marks.map(([r]) => figure.rows[r]))];
  const box = el("div", {class: "lh-figure", "data-figure": figure.key, "data-marked-rows": markedRows.join(",")});
  const baseRun = state.baseline[data.run], baseData = baseRun && state.data[baseRun];
  const base = baseData && baseData.figures.find((f) => f.key === figure.key);
  const title = `${figure.prefix ? figure.prefix + "-" : ""}${figure.kind} · ${TITLES[figure.stat] || figure.stat}`;
  const shownValues = baseRun ? ratioValues(figure, values, base) : values;
  const scale = baseRun ? centredLogScale(shownValues, 10, 1000)
    : figure.judged === "pull" ? signScale(values) : colourScale(values, figure.stat, figure.scale);
  const peers = ["norm", "ratio"].includes(figure.judged) ? " and the other layers'" : "";  // as the judge's headings say
  const how = figure.judged === "pull" ? "read for its sign (the layer's growth is not named while it is below 0)"
    : figure.judged ? `judged against each layer's own history${peers}, no fixed band` : "not judged";
  if (!baseRun && !figure.scale) scale.stated = `${how}: ${scale.stated}`;
  if (baseRun) scale.stated = base ? `÷ ${baseRun} at the same step and layer: the middle colour is equal, yellow higher, purple lower (log)`
    : `${baseRun} has no ${figure.key}`;
  box.append(el("h3", {}, baseRun ? `${title} ÷ ${baseRun}` : title),
             el("div", {class: "lh-sub"}, `${figure.rows.length} layers × ${figure.steps.length} steps · ${figure.key}`),
             el("div", {class: "lh-sub lh-scale"}, scale.stated));
  const canvas = el("canvas"), panel = el("div", {class: "lh-hist"});
  box.append(canvas, panel);
  const context = data.context || [];
  const view = {data, figure, values: shownValues, raw: values, marks, scale, canvas, hist: panel, title: TITLES[figure.stat] || figure.stat,
                base: baseRun ? base : null, top: context.length ? TOP_GAP + CONTEXT_H + 6 : TOP_GAP};
  if (context.length) view.overlay = (g, labelWidth, cell) => contextOverlay(context, TOP_GAP)(g, view, labelWidth, cell);
  view.markedRows = new Set(figure.marks.map(([r]) => r));
  view.drawnMember = (row, c) => drawnMember(view, row, c);
  view.rows = visibleRows(figure.rows, choices(data.run), markedNames(data));
  draw(view);
  canvas.onmousemove = (event) => hover(view, event);
  canvas.onmouseleave = () => { tip.style.display = "none"; };
  canvas.onclick = (event) => click(view, event);
  const opened = (state.open[data.run] || {})[figure.key];
  if (opened) reopen(view, opened);
  return box;
}

function choices(run) { return state.groups[run] || (state.groups[run] = new Map()); }
function markedNames(data) { return new Set(data.figures.flatMap((f) => f.marks.map(([r]) => f.rows[r]))); }

function hover(view, event) {
  const {row, c, inLabel, valid} = at(view, event);
  if (!valid || (!inLabel && (c < 0 || c >= view.figure.steps.length))) { tip.style.display = "none"; return; }
  const names = row.members.map((m) => view.figure.rows[m]);
  let text = row.members.length > 1 ? `${row.group}.* (${names.length} layers; click to open)` : names[0];
  if (!inLabel) {
    const drawn = row.members.length > 1 ? view.drawnMember(row, c) : row.members[0];
    text += `\nstep ${view.figure.steps[c]}`;
    for (const m of row.members) {  // every member, the one drawn marked
      const mark = view.marks.get(`${m},${c}`), problem = mark ? `  ⚠ ${(view.data.problems || state.problems)[mark] || mark}` : "";
      const value = view.base ? `${fmt(view.raw[m][c])} = ×${fmt(view.values[m][c])} the baseline` : fmt(view.raw[m][c]);
      text += `\n${row.members.length > 1 ? `${m === drawn ? "▶ " : "  "}${view.figure.rows[m]}: ` : "value "}${value}${problem}`;
    }
  } else if (row.members.length > 1) text += "\n" + names.join("\n");
  tip.textContent = text;
  Object.assign(tip.style, {display: "block", left: `${event.clientX + 14}px`, top: `${Math.min(event.clientY + 10, window.innerHeight - 20 - 15 * text.split("\n").length)}px`});
}

async function click(view, event) {
  const {row, c, inLabel, valid, below, above} = at(view, event);
  tip.style.display = "none";  // the next hover writes it afresh
  const inColumns = c >= 0 && c < view.figure.steps.length;
  if ((below || above) && inColumns && !inLabel) return open(view, {kind: "profile", step: view.figure.steps[c]});
  if (!valid) return;
  if (row.members.length > 1 || (inLabel && row.group)) {  // a group's label or cell: open or close it
    const groups = choices(view.data.run);
    groups.set(row.group, row.members.length > 1);
    state.focus = view.data.run;
    saveURL();
    redrawRun(view.data.run);
    return;
  }
  if (inLabel || !inColumns) return;
  await open(view, {kind: "histogram", layer: view.figure.rows[row.members[0]], step: view.figure.steps[c]});
}

async function open(view, what) {  // a histogram or a depth profile under the figure, kept across reloads and in the URL
  (state.open[view.data.run] || (state.open[view.data.run] = {}))[view.figure.key] = what;
  state.focus = view.data.run;
  state.selected = {figure: view.figure.key, ...what};
  saveURL();
  await reopen(view, what);
}

async function reopen(view, what) {
  const close = () => { view.hist.innerHTML = ""; delete state.open[view.data.run][view.figure.key]; state.selected = null; saveURL(); };
  const c = nearest(view.figure.steps, what.step);
  if (what.kind === "profile") { view.hist.replaceChildren(depthProfile(view, c, view.data.problems || state.problems, close)); return; }
  const member = view.figure.rows.indexOf(what.layer), tag = view.figure.histograms[member];
  if (!tag) { view.hist.textContent = `${what.layer} at step ${what.step}: this figure has no histograms.`; return; }
  try {
    const found = await getJSON(`histogram?run=${encodeURIComponent(view.data.run)}&tag=${encodeURIComponent(tag)}&step=${view.figure.steps[c]}`);
    view.hist.replaceChildren(histogramView(found, what.layer, close));
  } catch (error) {
    view.hist.textContent = `No histogram for ${what.layer} (${tag}) at step ${what.step}: ${error.message}`;
  }
}

function nearest(steps, step) { return steps.reduce((best, s, i) => (Math.abs(s - step) < Math.abs(steps[best] - step) ? i : best), 0); }

function redrawRun(run) {
  const card = document.querySelector(`.lh-card[data-run="${CSS.escape(run)}"]`);
  if (card) card.replaceWith(safeCard(state.data[run]));
}

// The view in the URL: run (the one last worked on), baseline, open groups, selected cell, filter.
function saveURL() {
  const run = state.focus, groups = run ? [...choices(run)].map(([g, isOpen]) => `${isOpen ? "+" : "-"}${g}`).join(",") : "";
  const sel = state.selected || {};
  host.writeURL(PLUGIN, {run: run || "", baseline: (run && state.baseline[run]) || "", groups, filter: state.filter,
                         figure: sel.figure || "", layer: sel.layer || "", step: sel.step === undefined ? "" : String(sel.step),
                         view: sel.kind || ""});
}

async function readURL(filter) {
  const own = Object.fromEntries(new URLSearchParams(window.location.search));
  const given = {...own, ...((await host.getURLData(PLUGIN).catch(() => null)) || {})};
  state.link = given;
  if (given.filter) { state.filter = filter.value = given.filter; }
  if (!given.run) return;
  state.focus = given.run;
  if (given.baseline) state.baseline[given.run] = given.baseline;
  for (const item of (given.groups || "").split(",").filter(Boolean)) choices(given.run).set(item.slice(1), item[0] === "+");
}

function openLinked() {  // the selected cell (or a deep link ?run=&layer=&step=[&figure=]): its histogram or profile
  const link = state.link || {};
  const run = link.run || (state.answers[0] && state.answers[0].run);
  if (!run || !state.data[run] || !link.step) { if (link.run) focusRun(link.run); return; }
  const figures = state.data[run].figures.filter((f) => !link.figure || f.key === link.figure);
  const figure = link.view === "profile" ? figures[0] : figures.find((f) => f.rows.includes(link.layer) && f.histograms[f.rows.indexOf(link.layer)]);
  if (!figure) return;
  const what = link.view === "profile" ? {kind: "profile", step: Number(link.step)} : {kind: "histogram", layer: link.layer, step: Number(link.step)};
  (state.open[run] || (state.open[run] = {}))[figure.key] = what;
  state.focus = run;
  state.selected = {figure: figure.key, ...what};
  redrawRun(run);
  focusRun(run);
}

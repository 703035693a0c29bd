// The Layers tab's heatmap: rows by steps on a <canvas>, viridis colours, marked cells outlined, a colour
// bar. Used by the run figures (index.js) and the flight records (flight.js): one drawing code for both.
// A view is {figure: {rows, steps, marks}, values, marks (Map "row,col" -> verdict), scale, canvas, rows}
// where rows are the visible rows ({label, members: [figure rows]}), set by the caller; optional: top
// (the space above the grid), labelOf(row) (a row's label), overlay(g, labelWidth, cell) (drawn last).

// Each problem of output/_health_bands.py's PROBLEMS: red when a figure is too high, blue when too low (a test
// checks that every problem has one; an unknown one is drawn red rather than in the canvas's default black).
const HIGH = "#ff1744", LOW = "#00b0ff";
export const MARK_COLOURS = {dead: HIGH, nonfinite: HIGH, nonfinite_grad: HIGH, exploding: HIGH, too_fast: HIGH,
                             attention_logits: HIGH, output_logits: HIGH, massive: HIGH,
                             blowup: HIGH, data: HIGH, vanishing: LOW, too_slow: LOW, entropy_collapse: LOW,
                             collapse: LOW};
export const markColour = (problem) => MARK_COLOURS[problem] || HIGH;
export const NONFINITE = "#212121";  // the fill of a NaN or infinite value
export const ROW_H = 14, TOP_GAP = 6;
const BAR_W = 76, AXIS_H = 30, MAX_LABEL = 36;
const LOG_STATS = new Set(["std", "norm", "abs_max"]);
// Viridis, nine stops: perceptually uniform, readable in grey.
const VIRIDIS = [[68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
                 [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37]];

export function el(tag, attrs = {}, children = []) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  for (const child of [].concat(children)) node.append(child);
  return node;
}

export function num(value) {  // the routes send NaN and +-Infinity as strings
  if (value === null || value === undefined) return null;
  if (typeof value === "number") return value;
  return value === "NaN" ? NaN : value === "Infinity" ? Infinity : value === "-Infinity" ? -Infinity : Number(value);
}

export function fmt(value) {
  if (value === null) return "not logged";
  if (!Number.isFinite(value)) return String(value);
  return Math.abs(value) >= 1e4 || (value !== 0 && Math.abs(value) < 1e-3) ? value.toExponential(3) : String(+value.toPrecision(4));
}

export function colourScale(values, stat) {
  const log = LOG_STATS.has(stat) && values.every((row) => row.every((v) => v === null || !Number.isFinite(v) || v > 0));
  const t = (v) => (log ? Math.log10(v) : v);
  let lo = Infinity, hi = -Infinity;
  for (const row of values) for (const v of row) if (v !== null && Number.isFinite(v)) { lo = Math.min(lo, t(v)); hi = Math.max(hi, t(v)); }
  if (stat.endsWith("_fraction")) { lo = 0; hi = hi > 0 ? hi : 1; }
  if (!(hi > lo)) { hi = lo + 1; }
  return {log, lo, hi, t, at: (v) => Math.min(1, Math.max(0, (t(v) - lo) / (hi - lo)))};
}

// A log scale centred on 1 (the middle colour), reaching at least `least` and at most `most` either way (beyond
// it the colours saturate: the bar says so): for ratios to a usual level.
export function centredLogScale(values, least, most) {
  let m = Math.log10(least), seen = m;
  for (const row of values) for (const v of row) if (v !== null && Number.isFinite(v) && v > 0) seen = Math.max(seen, Math.abs(Math.log10(v)));
  m = Math.min(Math.max(m, seen), Math.log10(most));
  const t = (v) => Math.log10(v);
  return {log: true, lo: -m, hi: m, t, clipped: seen > m, at: (v) => (v > 0 ? Math.min(1, Math.max(0, (t(v) + m) / (2 * m))) : 0)};
}

export function viridis(x) {
  const p = x * (VIRIDIS.length - 1), i = Math.min(VIRIDIS.length - 2, Math.floor(p)), f = p - i;
  const [a, b] = [VIRIDIS[i], VIRIDIS[i + 1]];
  return `rgb(${a.map((c, k) => Math.round(c + f * (b[k] - c))).join(",")})`;
}

export function draw(view) {
  const {figure, values, marks, scale, canvas} = view;
  const TOP = view.top || TOP_GAP;
  const steps = figure.steps.length;
  const cell = Math.max(2, Math.min(18, Math.floor(560 / Math.max(1, steps))));
  view.cell = cell;
  const g = canvas.getContext("2d");
  g.font = "11px Roboto, Arial, sans-serif";
  const markedRows = new Set(figure.marks.map(([r]) => r));
  const labels = view.rows.map((row) => (view.labelOf ? view.labelOf(row) : label(row, markedRows)));
  const LABEL_W = view.labelWidth = 12 + Math.max(40, ...labels.map((text) => g.measureText(text).width));
  const width = LABEL_W + steps * cell + BAR_W, height = TOP + view.rows.length * ROW_H + AXIS_H;
  const ratio = window.devicePixelRatio || 1;
  canvas.width = width * ratio; canvas.height = height * ratio;
  canvas.style.width = `${width}px`; canvas.style.height = `${height}px`;
  // The geometry, for whoever needs to find a cell (the browser tests do).
  Object.assign(canvas.dataset, {labelWidth: LABEL_W, cell, rowHeight: ROW_H, top: TOP,
                                 rows: view.rows.map((row) => row.group && row.members.length > 1 ? row.group + ".*" : view.figure.rows[row.members[0]]).join(",")});
  g.scale(ratio, ratio);
  g.font = "11px Roboto, Arial, sans-serif";
  g.textBaseline = "middle";
  view.rows.forEach((row, r) => {
    const y = TOP + r * ROW_H;
    let worst = null;
    for (let c = 0; c < steps; c++) {
      const cellValues = row.members.map((m) => values[m][c]).filter((v) => v !== null);
      const mark = row.members.map((m) => marks.get(`${m},${c}`)).find((v) => v);
      if (mark) worst = worst || mark;
      if (!cellValues.length) continue;
      const bad = cellValues.find((v) => !Number.isFinite(v));
      const v = bad !== undefined ? bad : cellValues.reduce((a, b) => a + b, 0) / cellValues.length;
      g.fillStyle = Number.isFinite(v) ? viridis(scale.at(v)) : NONFINITE;
      g.fillRect(LABEL_W + c * cell, y, cell, ROW_H - 1);
      if (mark) {
        g.strokeStyle = markColour(mark);
        g.lineWidth = 2;
        g.strokeRect(LABEL_W + c * cell + 1, y + 1, Math.max(1, cell - 2), ROW_H - 3);
      }
    }
    g.fillStyle = worst ? markColour(worst) === HIGH ? "#d32f2f" : "#0277bd" : "#424242";
    g.fillText(labels[r], 4, y + ROW_H / 2);
  });
  axis(g, view, steps, cell, LABEL_W, TOP);
  colourBar(g, view, LABEL_W + steps * cell, TOP);
  if (view.overlay) view.overlay(g, LABEL_W, cell);
}

function label(row, markedRows) {  // a row's label: a dot when some cell of it is marked, long names cut at the front
  const text = (row.members.some((m) => markedRows.has(m)) ? "● " : "") + row.label;
  return text.length > MAX_LABEL ? "…" + text.slice(-(MAX_LABEL - 1)) : text;
}

function axis(g, view, steps, cell, LABEL_W, TOP) {
  const y = TOP + view.rows.length * ROW_H + 4, every = Math.max(1, Math.ceil(steps / 6));
  g.fillStyle = "#616161"; g.textAlign = "center"; g.textBaseline = "top";
  for (let c = 0; c < steps; c += every) g.fillText(String(view.figure.steps[c]), LABEL_W + (c + 0.5) * cell, y);
  g.fillText("step", LABEL_W + (steps * cell) / 2, y + 13);
  g.textAlign = "left";
}

function colourBar(g, view, plotRight, TOP) {
  const {scale} = view;
  const x = plotRight + 10, h = Math.max(40, view.rows.length * ROW_H);
  for (let i = 0; i < h; i++) { g.fillStyle = viridis(1 - i / h); g.fillRect(x, TOP + i, 10, 1); }
  g.fillStyle = "#424242"; g.textBaseline = "middle";
  const label = (t) => fmt(scale.log ? 10 ** t : t);
  g.fillText((scale.clipped ? "≥ " : "") + label(scale.hi), x + 13, TOP + 5);
  g.fillText(label((scale.lo + scale.hi) / 2), x + 13, TOP + h / 2);
  g.fillText((scale.clipped ? "≤ " : "") + label(scale.lo), x + 13, TOP + h - 5);
  if (scale.log) g.fillText("(log)", x + 13, TOP + h + 10);
}

export function at(view, event) {
  const box = view.canvas.getBoundingClientRect();
  const x = event.clientX - box.left, y = event.clientY - box.top;
  const r = Math.floor((y - (view.top || TOP_GAP)) / ROW_H), c = Math.floor((x - view.labelWidth) / view.cell);
  return {row: view.rows[r], c, inLabel: x < view.labelWidth, valid: r >= 0 && r < view.rows.length};
}

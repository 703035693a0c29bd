// The Layers tab's heatmap: rows by steps on a <canvas>, viridis colours (a diverging red-blue for a figure read
// for its sign), marked cells outlined, a colour bar. Used by the run figures (index.js) and the flight records (flight.js): one drawing code for both.
// A view is {figure: {rows, steps, marks}, values, marks (Map "row,col" -> verdict), scale, canvas, rows}
// where rows are the visible rows ({label, members: [figure rows], lead, note}), set by the caller; optional: top
// (the space above the grid), labelOf(row) (a row's label), overlay(g, labelWidth, cell) (drawn last).

// Each problem of output/_health_bands.py's PROBLEMS: red when a figure is too high, blue when too low (a test
// checks that every problem has one; an unknown one is drawn red rather than in the canvas's default black).
const HIGH = "#ff1744", LOW = "#00b0ff";
export const MARK_COLOURS = {dead: HIGH, nonfinite: HIGH, nonfinite_grad: HIGH, exploding: HIGH, too_fast: HIGH,
                             attention_logits: HIGH, output_logits: HIGH, massive: HIGH,
                             blowup: HIGH, data: HIGH, vanishing: LOW, too_slow: LOW, entropy_collapse: LOW,
                             collapse: LOW, output_grad_exploding: HIGH, output_grad_vanishing: LOW};
export const markColour = (problem) => MARK_COLOURS[problem] || HIGH;
export const NONFINITE = "#212121";  // the fill of a NaN or infinite value
export const ROW_H = 14, TOP_GAP = 6;
const BAR_W = 84, AXIS_H = 30, MAX_LABEL_PX = 230;
const LOG_STATS = new Set(["std", "norm", "abs_max"]);
// Viridis, nine stops: perceptually uniform, readable in grey.
const VIRIDIS = [[68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
                 [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37]];
// ColorBrewer's RdBu, eleven stops from blue to red: diverging, its middle a neutral light grey. Blue for below 0
// and red for above, as the marks' blue is too low and red too high.
const RED_BLUE = [[5, 48, 97], [33, 102, 172], [67, 147, 195], [146, 197, 222], [209, 229, 240], [247, 247, 247],
                  [253, 219, 199], [244, 165, 130], [214, 96, 77], [178, 24, 43], [103, 0, 31]];

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

// A fixed scale (the server's stops for a judged figure: its healthy band in the middle colours, out of band at
// the ends) or, for a figure without a fixed band, this figure's own range, at least `LEAST_SPAN` wide so that
// noise is not spread over the whole palette. `at(v)` is the palette position; `stated` says what the colours mean.
const LEAST_SPAN = 0.1;  // of the level (linear), or a tenth of a decade (log)
export function colourScale(values, stat, fixed) {
  if (fixed) return stopScale(fixed);
  const log = LOG_STATS.has(stat) && values.every((row) => row.every((v) => v === null || !Number.isFinite(v) || v > 0));
  const t = (v) => (log ? Math.log10(v) : v);
  let lo = Infinity, hi = -Infinity;
  for (const row of values) for (const v of row) if (v !== null && Number.isFinite(v)) { lo = Math.min(lo, t(v)); hi = Math.max(hi, t(v)); }
  if (!Number.isFinite(lo)) { lo = 0; hi = 1; }
  const least = log ? LEAST_SPAN : LEAST_SPAN * Math.max(Math.abs(lo), Math.abs(hi), 1e-12);
  if (hi - lo < least) { const mid = (lo + hi) / 2; lo = mid - least / 2; hi = mid + least / 2; }
  const shown = (x) => fmt(log ? 10 ** x : x);
  return {log, lo, hi, t, at: (v) => Math.min(1, Math.max(0, (t(v) - lo) / (hi - lo))),
          stated: `colours span this figure's ${shown(lo)} to ${shown(hi)}${log ? " (log)" : ""}`};
}

function stopScale({stops, band, log}) {
  const t = (v) => (log ? (v > 0 ? Math.log10(v) : -Infinity) : v);
  const at = (v) => {
    const x = t(v);
    if (x <= stops[0][0]) return stops[0][1];
    for (let i = 1; i < stops.length; i++) {
      const [x0, p0] = stops[i - 1], [x1, p1] = stops[i];
      if (x <= x1) return p0 + ((p1 - p0) * (x - x0)) / (x1 - x0);
    }
    return stops[stops.length - 1][1];
  };
  const ends = band.map((end) => (end === null ? null : fmt(end)));
  const healthy = ends[0] !== null && ends[1] !== null ? `${ends[0]} to ${ends[1]}` : ends[1] !== null ? `≤ ${ends[1]}` : `≥ ${ends[0]}`;
  return {log, fixed: true, stops, band, t, at, lo: stops[0][0], hi: stops[stops.length - 1][0],
          stated: `fixed scale: healthy ${healthy} in the middle colours, out of band at the ends`};
}

// A figure read for its sign (the loss's pull, sum(y·dL/dy)): a diverging scale symmetric about 0, neutral grey at
// 0, as far either way as the largest value's magnitude; `ends` says what each side means (below 0 the loss asks the
// layer's outputs to grow, above 0 to shrink), on the colour bar and in `stated`.
const SIGN_BAR_W = 124;  // room for the ends' value and meaning beside the bar
export function signScale(values) {
  let m = 0;
  for (const row of values) for (const v of row) if (v !== null && Number.isFinite(v)) m = Math.max(m, Math.abs(v));
  if (!(m > 0)) m = 1;  // nothing but zeros (or nothing): any span shows them neutral
  return {log: false, centred: true, lo: -m, hi: m, t: (v) => v, colour: redBlue, barWidth: SIGN_BAR_W,
          ends: ["grow", "shrink"], at: (v) => Math.min(1, Math.max(0, (v + m) / (2 * m))),
          stated: `a diverging scale centred on 0 (neutral grey at 0, ±${fmt(m)} at the ends): blue below 0, the loss`
            + " asks the layer's outputs to grow; red above 0, to shrink"};
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

// The colour at `x` (0-1) of a palette of evenly spaced stops, linear between them.
function along(stops, x) {
  const p = x * (stops.length - 1), i = Math.min(stops.length - 2, Math.floor(p)), f = p - i;
  const [a, b] = [stops[i], stops[i + 1]];
  return `rgb(${a.map((c, k) => Math.round(c + f * (b[k] - c))).join(",")})`;
}
export const viridis = (x) => along(VIRIDIS, x);
export const redBlue = (x) => along(RED_BLUE, x);

export function draw(view) {
  const {figure, values, marks, scale, canvas} = view;
  const TOP = view.top || TOP_GAP;
  const steps = figure.steps.length;
  const cell = Math.max(2, Math.min(18, Math.floor(560 / Math.max(1, steps))));
  view.cell = cell;
  const g = canvas.getContext("2d");
  g.font = "11px Roboto, Arial, sans-serif";
  const markedRows = new Set(figure.marks.map(([r]) => r));
  const labels = view.rows.map((row) => (view.labelOf ? fit(g, "", view.labelOf(row), "") : label(g, row, markedRows)));
  const LABEL_W = view.labelWidth = 12 + Math.max(40, ...labels.map((text) => g.measureText(text).width));
  const width = LABEL_W + steps * cell + (scale.barWidth || BAR_W), height = TOP + view.rows.length * ROW_H + AXIS_H;
  const ratio = window.devicePixelRatio || 1;
  canvas.width = width * ratio; canvas.height = height * ratio;
  canvas.style.width = `${width}px`; canvas.style.height = `${height}px`;
  // The geometry, for whoever needs to find a cell (the browser tests do).
  Object.assign(canvas.dataset, {labelWidth: LABEL_W, cell, rowHeight: ROW_H, top: TOP, scaleLo: scale.lo, scaleHi: scale.hi,
                                 rows: view.rows.map((row) => row.group && row.members.length > 1 ? row.group + ".*" : view.figure.rows[row.members[0]]).join(",")});
  g.scale(ratio, ratio);
  g.font = "11px Roboto, Arial, sans-serif";
  g.textBaseline = "middle";
  const colour = scale.colour || viridis;
  view.rows.forEach((row, r) => {
    const y = TOP + r * ROW_H;
    let worst = null;
    const marked = row.members.filter((k) => markedRows.has(k));  // most rows have no mark: no lookups
    for (let c = 0; c < steps; c++) {
      const m = row.members.length > 1 && view.drawnMember ? view.drawnMember(row, c) : row.members[0];
      const mark = marked.length ? marked.map((k) => marks.get(`${k},${c}`)).find((v) => v) : undefined;
      if (mark) worst = worst || mark;
      const v = m === null ? null : values[m][c];
      if (v === null) continue;
      g.fillStyle = Number.isFinite(v) ? colour(scale.at(v)) : NONFINITE;
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

// A row's label: a dot when some cell of it is marked, then the row's lead (a group's ▸), its name cut at the
// front when too long, and its note (a group's member count), which is never cut.
function label(g, row, markedRows) {
  return fit(g, (row.members.some((m) => markedRows.has(m)) ? "● " : "") + (row.lead || ""), row.label, row.note || "");
}

// `lead + name + note` in `MAX_LABEL_PX`, the name cut at the front (measured, so every cut label is as wide).
function fit(g, lead, name, note) {
  const room = MAX_LABEL_PX - g.measureText(lead + note).width;
  if (g.measureText(name).width <= room) return lead + name + note;
  let keep = name.length;
  while (keep > 4 && g.measureText("…" + name.slice(-keep)).width > room) keep--;
  return lead + "…" + name.slice(-keep) + note;
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
  const x = plotRight + 10, h = Math.max(40, view.rows.length * ROW_H), colour = scale.colour || viridis;
  Object.assign(view.canvas.dataset, {barX: x, barTop: TOP, barHeight: h});  // for the browser tests, as the cells'
  for (let i = 0; i < h; i++) { g.fillStyle = colour(1 - i / h); g.fillRect(x, TOP + i, 10, 1); }
  g.fillStyle = "#424242"; g.textBaseline = "middle";
  const label = (t) => fmt(scale.log ? 10 ** t : t);
  if (scale.centred) {  // 0 in the middle (no tick: it would read as a minus), each end's value and its meaning
    g.fillText(`+${label(scale.hi)} ${scale.ends[1]}`, x + 15, TOP + 5);
    g.fillText("0", x + 15, TOP + h / 2);
    g.fillText(`${label(scale.lo)} ${scale.ends[0]}`, x + 15, TOP + h - 5);
    return;
  }
  if (scale.fixed) {  // the band's ends where they sit on the palette, and the scale's ends
    const y = (p) => TOP + (1 - p) * h;
    const named = new Map(scale.stops.filter((stop) => stop[2]).map(([value, , name]) => [value, name]));
    const ticks = scale.stops.filter(([, p], i, all) => i === 0 || i === all.length - 1 || (p > 0 && p < 1));
    let last = -Infinity;
    for (const [value, p] of ticks) {
      if (Math.abs(y(p) - last) < 11) continue;
      last = y(p);
      g.fillRect(x + 10, y(p), 3, 1);
      g.fillText(named.get(value) || label(value), x + 15, Math.min(TOP + h - 4, Math.max(TOP + 4, y(p))));
    }
    return;
  }
  g.fillText((scale.clipped ? "≥ " : "") + label(scale.hi), x + 13, TOP + 5);
  g.fillText(label((scale.lo + scale.hi) / 2), x + 13, TOP + h / 2);
  g.fillText((scale.clipped ? "≤ " : "") + label(scale.lo), x + 13, TOP + h - 5);
  if (scale.log) g.fillText("(log)", x + 13, TOP + h + 10);
}

export function at(view, event) {
  const box = view.canvas.getBoundingClientRect();
  const x = event.clientX - box.left, y = event.clientY - box.top;
  const r = Math.floor((y - (view.top || TOP_GAP)) / ROW_H), c = Math.floor((x - view.labelWidth) / view.cell);
  return {row: view.rows[r], c, inLabel: x < view.labelWidth, valid: r >= 0 && r < view.rows.length,
          above: r < 0, below: r >= view.rows.length};
}

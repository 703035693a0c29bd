// A run's anomalies: a timeline of the steps where flags fired (click one for its report), and each flight
// record (GradientAnomalyStopping(flight_recorder=N)) as a heatmap: the recorded layers by the
// steps up to the anomaly, each cell the layer's gradient norm over its usual level (the median over the
// record's first half: the recorder's own usual range, lightning_hooks/callbacks/_flight_recorder.py),
// rows in the order the layers left that range (the leader first, its leave step outlined), the loss drawn
// above (and each step's update norm, when SpikeTrigger(update_norm=...) measured it), the anomaly step dashed.

import {MARK_COLOURS, ROW_H, TOP_GAP, at, centredLogScale, draw, el, fmt, num} from "./heatmap.js";

const LOSS_H = 44;  // the loss line's band above the grid
const TOP = TOP_GAP + LOSS_H + 8;  // the grid's top; one band lower with update norms
const MAX_NAME = 34;
const MAX_ROWS = 48;  // a big model's record: the first rows of the order below are drawn, a line says how many not
const MOST = 1000;  // the colours saturate beyond x1000 or /1000 of the usual level

export function flightView(anomaly) {
  const record = anomaly.flight_record;
  const all = rowOrder(record), order = all.slice(0, MAX_ROWS);
  const usual = record.usual || [];
  const values = order.map((i) => record.norms.map((row) => {
    const norm = num(row[i]), level = usual[i] ? num(usual[i][0]) : null;
    return norm === null || !level ? null : norm / level;
  }));
  const left = new Map(record.onsets.map(([layer, step]) => [layer, step]));
  const figure = {rows: order.map((i) => record.layers[i]), steps: record.steps, marks: []};
  const marks = outOfRange(figure, values, order.map((i) => usual[i]), left);
  figure.marks = [...marks].map(([key, verdict]) => [...key.split(",").map(Number), verdict]);
  const updates = (record.update_norms || []).map(num);
  const box = el("div", {class: "lh-figure lh-flight", "data-flight-step": String(record.step),
                         "data-leader": record.leader || "", "data-rows": figure.rows.join(","),
                         "data-updates": String(updates.filter((v) => v !== null && Number.isFinite(v)).length)});
  box.append(el("h3", {}, `Flight record before the anomaly at step ${record.step}`),
             el("div", {class: "lh-sub lh-leader"}, leaderLine(record)));
  if (all.length > order.length) {
    const rest = record.onsets.length > MAX_ROWS ? "left their usual range later or stayed in it" : "stayed in their usual range";
    box.append(el("div", {class: "lh-sub lh-cut"},
                  `${all.length - order.length} more layers, not drawn, ${rest} (${order.length} of ${all.length} drawn).`));
  }
  const canvas = el("canvas");
  box.append(canvas, legend(record, usual));
  const factor = Math.max(1.5, ...usual.filter(Boolean).map((u) => num(u[1])));
  const top = updates.length ? TOP + LOSS_H + 8 : TOP;
  const view = {figure, values, marks, canvas, top, scale: centredLogScale(values, factor ** 2, MOST),
                rows: figure.rows.map((name, r) => ({label: name, members: [r]})),
                labelOf: (row) => rowLabel(record, figure.rows[row.members[0]], left)};
  view.overlay = (g, labelWidth, cell) => overlay(g, view, record, labelWidth, cell);
  draw(view);
  canvas.onmousemove = (event) => hover(view, record, left, event);
  canvas.onmouseleave = () => { tip().style.display = "none"; };
  return box;
}

function rowOrder(record) {  // the layers that left their range, as the recorder found them (leader first); then the rest
  const index = new Map(record.layers.map((layer, i) => [layer, i]));
  const first = record.onsets.map(([layer]) => index.get(layer)).filter((i) => i !== undefined);
  return first.concat(record.layers.map((_, i) => i).filter((i) => !first.includes(i)));
}

function outOfRange(figure, values, usual, left) {  // the cell where each layer left its usual range: above or below it
  const marks = new Map();
  figure.rows.forEach((layer, r) => {
    const c = left.has(layer) && usual[r] ? figure.steps.indexOf(left.get(layer)) : -1;
    if (c >= 0) marks.set(`${r},${c}`, values[r][c] !== null && values[r][c] < 1 ? "vanishing" : "exploding");
  });
  return marks;
}

function leaderLine(record) {  // what the recorder said (callbacks/_flight_record.py), from outputs or gradients
  if (!record.leader) return "No layer's outputs or gradient norm were out of their usual range at the anomaly.";
  const at = record.step - record.lead, before = `${record.lead} step${record.lead === 1 ? "" : "s"} before the anomaly`;
  if (record.data) return `Every layer at once at step ${at} (${before}): look at the batch.`;
  if (record.judged_by === "outputs") {
    const others = (record.output_onsets || []).length - 1;
    return `Leader: ${record.leader}'s outputs left their usual range first in forward order, at step ${at} (${before})`
      + (others > 0 ? `; the outputs of ${others} module${others > 1 ? "s" : ""} after it left theirs too.` : ".");
  }
  if (record.judged_by === "output gradients") {
    return `Leader: the gradient reaching ${record.leader}'s output left its usual range first in backward order`
      + ` (net of the loss's own), at step ${at} (${before}); the modules before it are its victims.`;
  }
  const tied = record.tied || [];
  if (tied.length) {
    return `A tie: ${[record.leader, ...tied].join(", ")} left their usual gradient-norm range at step ${at} (${before});`
      + " gradient norms alone cannot tell a cause from its effects.";
  }
  const others = record.onsets.length - 1;
  return `Leader: ${record.leader} left its usual gradient-norm range first, at step ${at} (${before})`
    + (others ? `; ${others} other layer${others > 1 ? "s" : ""} left it by the anomaly.` : ".");
}

function rowLabel(record, layer, left) {
  const name = layer.length > MAX_NAME ? "…" + layer.slice(-(MAX_NAME - 1)) : layer;
  if (layer === record.leader) return `▶ leader · ${name} (from ${left.get(layer)})`;
  return left.has(layer) ? `${name} (from ${left.get(layer)})` : name;
}

function legend(record, usual) {
  const factors = usual.filter(Boolean).map((u) => num(u[1]));
  const band = factors.length ? `×/÷ ${fmt(Math.min(...factors))}–${fmt(Math.max(...factors))}` : "—";
  return el("div", {class: "lh-legend"}, [
    "Colour: the layer's gradient norm ÷ its usual level (its median over the record's first half), log scale;"
    + " the middle colour is usual, yellow higher, purple lower. ",
    "Outlined: the step the layer left its usual range (3 robust standard deviations of its log, at least ×1.5;"
    + ` here ${band}) and stayed out of it up to the anomaly, going`,
    el("span", {style: `border-color:${MARK_COLOURS.exploding}`}), "above or",
    el("span", {style: `border-color:${MARK_COLOURS.vanishing}`}),
    `below it. Top: the loss${(record.update_norms || []).length ? ", then each step's update norm" : ""}.`
    + " Dashed: the anomaly step."]);
}

function overlay(g, view, record, labelWidth, cell) {
  band(g, "loss", record.losses.map(num), TOP_GAP, labelWidth, cell, "#f57c00");
  const updates = (record.update_norms || []).map(num);
  if (updates.length) band(g, "update", updates, TOP_GAP + LOSS_H + 8, labelWidth, cell, "#6a1b9a");
  const c = record.steps.indexOf(record.step), x = labelWidth + (Math.max(0, c) + 0.5) * cell;
  g.strokeStyle = "#d32f2f"; g.lineWidth = 1.5; g.setLineDash([4, 3]); g.beginPath();
  g.moveTo(x, TOP_GAP); g.lineTo(x, view.top + view.rows.length * ROW_H); g.stroke(); g.setLineDash([]);
}

function band(g, label, values, y0, labelWidth, cell, colour) {  // one line per step above the grid: loss, update norm
  const steps = values.length, right = labelWidth + steps * cell;
  const finite = values.filter((v) => v !== null && Number.isFinite(v));
  g.fillStyle = "#424242"; g.textBaseline = "middle"; g.textAlign = "left";
  g.fillText(label, 4, y0 + LOSS_H / 2);
  g.strokeStyle = "#e0e0e0"; g.lineWidth = 1;
  g.strokeRect(labelWidth, y0, steps * cell, LOSS_H);
  if (!finite.length) return;
  const lo = Math.min(...finite), hi = Math.max(...finite), span = hi > lo ? hi - lo : 1;
  g.strokeStyle = colour; g.lineWidth = 1.5; g.beginPath();
  let pen = false;
  values.forEach((v, c) => {
    if (v === null || !Number.isFinite(v)) { pen = false; return; }
    const x = labelWidth + (c + 0.5) * cell, y = y0 + LOSS_H - 3 - ((v - lo) / span) * (LOSS_H - 6);
    if (pen) g.lineTo(x, y); else g.moveTo(x, y);
    pen = true;
  });
  g.stroke();
  g.fillStyle = "#616161"; g.fillText(fmt(hi), right + 10, y0 + 5); g.fillText(fmt(lo), right + 10, y0 + LOSS_H - 5);
}

function tip() { return document.querySelector(".lh-tip"); }

function hover(view, record, left, event) {
  const {row, c, inLabel, valid} = at(view, event);
  const box = tip();
  if (!valid || inLabel || c < 0 || c >= record.steps.length) { box.style.display = "none"; return; }
  const layer = view.figure.rows[row.members[0]], i = record.layers.indexOf(layer);
  const usual = record.usual && record.usual[i];
  let text = `${layer}${layer === record.leader ? " (leader)" : ""}\nstep ${record.steps[c]}`
    + `\ngradient norm ${fmt(num(record.norms[c][i]))}`;
  if (usual) text += `\n× ${fmt(view.values[row.members[0]][c])} its usual ${fmt(num(usual[0]))} (range ×/÷ ${fmt(num(usual[1]))})`;
  if (left.has(layer)) text += `\nout of its usual range from step ${left.get(layer)}`;
  text += `\nloss ${fmt(num(record.losses[c]))}`;
  if ((record.update_norms || []).length) text += `\nupdate norm ${fmt(num(record.update_norms[c]))}`;
  box.textContent = text;
  Object.assign(box.style, {display: "block", left: `${event.clientX + 14}px`, top: `${event.clientY + 10}px`});
}

export function timeline(data) {
  const wrap = el("div", {class: "lh-anomaly"}, [el("b", {}, `Anomalies (${data.anomalies.length})`)]);
  const steps = data.figures.flatMap((f) => [f.steps[0], f.steps[f.steps.length - 1]]).concat(data.anomalies.map((a) => a.step));
  const lo = Math.min(...steps), hi = Math.max(...steps);
  const line = el("div", {class: "lh-timeline"});
  const report = el("pre", {}, "Click a marker to read its report.");
  line.append(el("span", {class: "lh-axis", style: "left:0"}, `step ${lo}`), el("span", {class: "lh-axis", style: "right:0"}, `step ${hi}`));
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

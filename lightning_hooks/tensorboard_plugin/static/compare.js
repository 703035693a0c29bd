// A run against a baseline run, the loss and learning rate above the heatmaps, and a step's depth profile.

import {NONFINITE, el, fmt, num, viridis} from "./heatmap.js";

export const CONTEXT_H = 34;  // the loss / lr band above each heatmap

// Each cell this run's value over the baseline's at the same step and layer (a log10 figure: 10^(a - b));
// null where the baseline has no such layer, step or a zero.
export function ratioValues(figure, values, base) {
  if (!base) return values.map((row) => row.map(() => null));
  const rows = new Map(base.rows.map((name, r) => [name, r])), cols = new Map(base.steps.map((step, c) => [step, c]));
  const log10 = figure.stat.startsWith("log10");
  return figure.rows.map((name, r) => figure.steps.map((step, c) => {
    const br = rows.get(name), bc = cols.get(step);
    if (br === undefined || bc === undefined) return null;
    const a = values[r][c], b = num(base.values[br][bc]);
    if (a === null || b === null) return null;
    if (log10) return 10 ** (a - b);
    return b === 0 ? (a === 0 ? 1 : null) : a / b;
  }));
}

// The loss and learning rate as lines over the heatmap's columns (the value at each column's step, or the last
// one before it), each scaled to its own range, its ends labelled on the right.
export function contextOverlay(context, top) {
  return (g, view, labelWidth, cell) => {
    const steps = view.figure.steps, right = labelWidth + steps.length * cell;
    g.strokeStyle = "#e0e0e0"; g.lineWidth = 1; g.strokeRect(labelWidth, top, steps.length * cell, CONTEXT_H);
    context.forEach((series, k) => {
      const ys = steps.map((step) => valueAt(series, step));
      const finite = ys.filter((v) => v !== null && Number.isFinite(v));
      g.fillStyle = k ? "#757575" : "#f57c00"; g.textBaseline = "middle"; g.textAlign = "left"; g.font = "10px Roboto, Arial, sans-serif";
      g.fillText(series.tag, 4, top + 8 + 14 * k);
      if (!finite.length) return;
      const lo = Math.min(...finite), hi = Math.max(...finite), span = hi > lo ? hi - lo : 1;
      g.strokeStyle = k ? "#757575" : "#f57c00"; g.lineWidth = 1.5; g.setLineDash(k ? [3, 2] : []); g.beginPath();
      let pen = false;
      ys.forEach((v, c) => {
        if (v === null || !Number.isFinite(v)) { pen = false; return; }
        const x = labelWidth + (c + 0.5) * cell, y = top + CONTEXT_H - 3 - ((v - lo) / span) * (CONTEXT_H - 6);
        if (pen) g.lineTo(x, y); else g.moveTo(x, y);
        pen = true;
      });
      g.stroke(); g.setLineDash([]);
      g.fillText(`${fmt(lo)}–${fmt(hi)}`, right + 10, top + 8 + 14 * k);
    });
  };
}

function valueAt(series, step) {  // the series' value at `step`, or its last before it
  let found = null;
  for (let i = 0; i < series.steps.length && series.steps[i] <= step; i++) found = num(series.values[i]);
  return found;
}

// One step's depth profile: each layer (forward order) a bar of its value there, marked bars outlined.
export function depthProfile(view, c, problems, onClose) {
  const {figure, values, scale, marks} = view;
  const box = el("div", {"data-profile-step": String(figure.steps[c])});
  const close = el("span", {class: "lh-close", title: "close"}, "✕");
  close.onclick = onClose;
  box.append(close, el("div", {}, `depth profile at step ${figure.steps[c]}: each layer's ${view.title}, forward order`));
  const rowH = 12, labelW = 200, barW = 260, ratio = window.devicePixelRatio || 1;
  const canvas = el("canvas", {class: "lh-profile"});
  canvas.width = (labelW + barW + 70) * ratio; canvas.height = (figure.rows.length * rowH + 6) * ratio;
  canvas.style.width = `${labelW + barW + 70}px`; canvas.style.height = `${figure.rows.length * rowH + 6}px`;
  const g = canvas.getContext("2d");
  g.scale(ratio, ratio); g.font = "10px Roboto, Arial, sans-serif"; g.textBaseline = "middle";
  figure.rows.forEach((name, r) => {
    const v = values[r][c], y = 3 + r * rowH, mark = marks.get(`${r},${c}`);
    g.fillStyle = mark ? "#d32f2f" : "#424242"; g.textAlign = "right";
    g.fillText(name.length > 34 ? "…" + name.slice(-33) : name, labelW - 6, y + rowH / 2);
    if (v === null) return;
    const p = Number.isFinite(v) ? scale.at(v) : 1;
    g.fillStyle = Number.isFinite(v) ? viridis(p) : NONFINITE;
    g.fillRect(labelW, y + 1, Math.max(1, p * barW), rowH - 2);
    g.fillStyle = "#424242"; g.textAlign = "left";
    g.fillText(fmt(v) + (mark ? ` ⚠ ${problems[mark] || mark}` : ""), labelW + Math.max(1, p * barW) + 4, y + rowH / 2);
  });
  box.append(canvas);
  return box;
}

// A clicked cell's histogram on a real value axis: symmetric log (the bins are log-spaced both sides of zero),
// each bar as wide as its bin on that axis, ticks at powers of ten, zero marked.

import {el, fmt} from "./heatmap.js";

const W = 460, H = 150, PAD = 12, AXIS = 30;

export function histogramView(found, name, onClose) {
  const box = el("div");
  const close = el("span", {class: "lh-close", title: "close"}, "✕");
  close.onclick = onClose;
  const total = found.bins.reduce((s, b) => s + b[2], 0);
  box.append(close, el("div", {"data-histogram": found.tag, "data-step": String(found.step)},
                       `${name} · histogram ${found.tag} at step ${found.step} · ${total} values`));
  const bins = found.bins.filter((b) => b[2] > 0);
  if (bins.length) box.append(draw(bins));
  return box;
}

function draw(bins) {
  const lo = Math.min(0, bins[0][0]), hi = Math.max(0, bins[bins.length - 1][1]);
  const finite = bins.flatMap((b) => [b[0], b[1]]).filter((v) => v !== 0 && Number.isFinite(v)).map(Math.abs);
  const c = Math.max(Math.min(...finite), 1e-12);  // below the smallest edge the axis is linear
  const s = (v) => Math.sign(v) * Math.log10(1 + Math.abs(v) / c);
  const x0 = s(lo), x1 = s(hi) > x0 ? s(hi) : x0 + 1;
  const x = (v) => PAD + ((W - 2 * PAD) * (s(v) - x0)) / (x1 - x0);
  const canvas = el("canvas", {class: "lh-hist-canvas", "data-zero-x": ""}), ratio = window.devicePixelRatio || 1;
  canvas.width = W * ratio; canvas.height = H * ratio; canvas.style.width = `${W}px`; canvas.style.height = `${H}px`;
  const g = canvas.getContext("2d");
  g.scale(ratio, ratio);
  const peak = Math.max(...bins.map((b) => b[2])), base = H - AXIS;
  g.fillStyle = "#f57c00";
  for (const [left, right, count] of bins) {
    const bh = ((base - 14) * count) / peak;
    g.fillRect(x(left), base - bh, Math.max(1, x(right) - x(left) - 0.5), bh);
  }
  g.strokeStyle = "#9e9e9e"; g.lineWidth = 1; g.beginPath(); g.moveTo(PAD, base + 0.5); g.lineTo(W - PAD, base + 0.5); g.stroke();
  g.fillStyle = "#616161"; g.font = "10px Roboto, Arial, sans-serif"; g.textBaseline = "top"; g.textAlign = "center";
  let last = -Infinity;
  for (const tick of ticks(lo, hi, c)) {
    const px = x(tick);
    if (px - last < 30) continue;
    last = px;
    g.fillRect(px, base, 1, 4);
    g.fillText(tick === 0 ? "0" : fmt(tick), px, base + 5);
  }
  const zero = x(0);  // zero, dashed across the plot
  canvas.dataset.zeroX = zero.toFixed(1);
  g.strokeStyle = "#212121"; g.setLineDash([3, 3]); g.beginPath(); g.moveTo(zero + 0.5, 4); g.lineTo(zero + 0.5, base); g.stroke();
  g.setLineDash([]);
  g.textAlign = "left"; g.fillText(`max count ${fmt(peak)}`, PAD, 2);
  g.textAlign = "center"; g.fillText("value (symmetric log axis: linear within ±" + fmt(c) + ")", W / 2, base + 17);
  return canvas;
}

function ticks(lo, hi, c) {  // 0 and the powers of ten within the range, both signs
  const out = [0];
  for (let e = Math.floor(Math.log10(c)); e <= Math.ceil(Math.log10(Math.max(Math.abs(lo), Math.abs(hi), c))); e++) {
    const p = 10 ** e;
    if (p <= hi) out.push(p);
    if (-p >= lo) out.unshift(-p);
  }
  return out;
}

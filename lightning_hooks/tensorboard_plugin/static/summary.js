// The summary strip (one line per run: healthy or not, since when, its first culprit; the sick runs first) and
// each run's banner (the layers unhealthy now, the first culprit on the first line, capped at BANNER_LINES).

import {el, fmt, num} from "./heatmap.js";

export const BANNER_LINES = 5;

// The banner's lines, one per layer and problem, the first culprit first, in LayerHealth's order: the earliest
// "since", then the problem (its `order`), then forward order (the first figure's rows, then any other figure's).
// A bad batch is one line, "(every layer)", holding its layers.
export function bannerLines(data) {
  const position = new Map();
  for (const figure of data.figures) for (const row of figure.rows) if (!position.has(row)) position.set(row, position.size);
  const lines = new Map();
  for (const item of data.banner) {
    const key = `${item.layer}\u0000${item.verdict}`;
    if (!lines.has(key)) lines.set(key, {...item, seen: []});
    const line = lines.get(key);
    line.since = Math.min(line.since, item.since);
    line.seen.push(item.layers ? `${item.layers.length} layers out together in ${item.figure}`
                               : `${item.figure} = ${fmt(num(item.value))}`);
  }
  const at = (layer) => (position.has(layer) ? position.get(layer) : position.size);
  return [...lines.values()].sort((a, b) => (a.since - b.since) || ((a.order ?? 99) - (b.order ?? 99))
                                             || (at(a.layer) - at(b.layer)));
}

// A run's status, for the strip and the card order: 0 could not be read, 1 unhealthy, 2 anomalies only, 3 healthy, 4 no figures.
export function status(data) {
  if (data.error) return {rank: 0, text: "could not be read", detail: data.error};
  const lines = bannerLines(data);
  if (lines.length) {
    const first = lines[0];
    return {rank: 1, text: `unhealthy since step ${Math.min(...lines.map((l) => l.since))}`, culprit: first,
            detail: `${lines.length} layer problem${lines.length > 1 ? "s" : ""} now`};
  }
  const anomalies = (data.anomalies || []).length;
  if (!data.figures.length) return {rank: 4, text: "no layer figures", detail: anomalies ? `${anomalies} anomalies` : ""};
  return anomalies ? {rank: 2, text: "healthy now", detail: `${anomalies} anomal${anomalies > 1 ? "ies" : "y"} earlier (step ${data.anomalies[0].step} first)`}
                   : {rank: 3, text: "healthy", detail: "no layer outside its band at its last step"};
}

export function strip(answers, onPick) {
  const table = el("table", {class: "lh-strip"});
  table.append(el("tr", {}, ["", "run", "state", "first culprit", ""].map((h) => el("th", {}, h))));
  for (const data of answers) {
    const s = status(data);
    const culprit = s.culprit ? [el("code", {}, s.culprit.layer), ` — ${s.culprit.problem}`] : "";
    const row = el("tr", {class: `lh-strip-row rank${s.rank}`, "data-run": data.run, "data-rank": String(s.rank),
                          "data-culprit": s.culprit ? s.culprit.layer : "", title: "go to this run's card"},
                   [el("td", {}, el("span", {class: "lh-dot"})), el("td", {class: "lh-run"}, data.run), el("td", {}, s.text),
                    el("td", {}, culprit), el("td", {class: "lh-detail"}, s.detail || "")]);
    row.onclick = () => onPick(data.run);
    table.append(row);
  }
  return table;
}

export function bannerOf(data, open, onToggle) {
  if (!data.figures.length) {
    return el("div", {class: "lh-banner", "data-healthy": "unknown"},
              "No layer figures in this run (no ActivationMonitor or GradientMonitor): its anomalies only.");
  }
  const lines = bannerLines(data);
  if (!lines.length) {
    return el("div", {class: "lh-banner healthy", "data-healthy": "true"},
              "Looks healthy: no layer is outside its healthy band at its last logged step.");
  }
  const layers = [...new Set(lines.flatMap((b) => b.layers || [b.module || b.layer]))];  // a parameter's row is its module's
  const box = el("div", {class: "lh-banner unhealthy", "data-healthy": "false", "data-layers": layers.join(",")},
                 `${layers.length} layer${layers.length > 1 ? "s" : ""} unhealthy now, the first culprit first:`);
  const list = el("ul");
  const shown = open ? lines : lines.slice(0, BANNER_LINES);
  for (const item of shown) {
    list.append(el("li", {"data-layer": item.layer, "data-verdict": item.verdict, "data-since": String(item.since)},
                   [el("code", {}, item.layer), ` — ${item.problem} since step ${item.since} (${item.seen.join(", ")})`]));
  }
  box.append(list);
  if (lines.length > BANNER_LINES) {
    const more = el("button", {class: "lh-more"}, open ? "show the first 5 only" : `and ${lines.length - BANNER_LINES} more`);
    more.onclick = onToggle;
    box.append(more);
  }
  return box;
}

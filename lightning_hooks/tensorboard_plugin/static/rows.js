// Rows: each visible row is a layer, or a collapsed group of layers sharing a module prefix. A big model starts
// with its blocks collapsed, except the groups holding a marked layer (open, so that the culprit shows); what
// the user opens or closes is kept (`choices`: prefix -> open?) across reloads and in the URL.

export const MAX_VISIBLE_ROWS = 48;  // beyond this, rows start collapsed by module prefix

export function visibleRows(names, choices, marked) {
  const depth = groupDepth(names);
  const rows = [];
  let i = 0;
  while (i < names.length) {
    const prefix = depth ? names[i].split(".").slice(0, depth).join(".") : null;
    let j = i + 1;
    while (prefix && j < names.length && within(names[j], prefix)) j++;
    const members = range(i, j);
    const open = choices.has(prefix) ? choices.get(prefix) : members.some((m) => marked.has(names[m]));
    if (j - i > 1 && !open) {
      rows.push({lead: "▸ ", label: `${prefix}.*`, note: ` (${j - i}, most abnormal)`, members, group: prefix});
    } else {
      for (const k of members) rows.push({lead: j - i > 1 ? "  " : "", label: names[k], members: [k], group: j - i > 1 ? prefix : null, open: j - i > 1});
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

// The member a collapsed group's cell is drawn by: its most abnormal one at that step. A non-finite value first,
// then a marked cell, then the value farthest from its own member's usual (its median colour position over the
// figure's steps: a layer 150x its peers, or 150x its own usual, is drawn, where a mean would hide it). Members
// within NEAR of each other's distance are no more abnormal than one another: the first of them is drawn, so that
// a healthy group of members at different scales is drawn by one member, not striped by whichever one's noise is
// the larger at each step. null when no member was logged at that step.
export const NEAR = 0.05;  // of the colour scale's span

export function drawnMember(view, row, c) {
  const usual = view.usual || (view.usual = new Map());
  let best = null, bestScore = -1;
  for (const m of row.members) {
    const v = view.values[m][c];
    if (v === null) continue;
    if (!usual.has(m)) usual.set(m, median(view.values[m].filter((x) => x !== null && Number.isFinite(x)).map((x) => view.scale.at(x))));
    const marked = view.markedRows.has(m) && view.marks.has(`${m},${c}`);
    const score = !Number.isFinite(v) ? 4 : (marked ? 2 : 0) + Math.abs(view.scale.at(v) - usual.get(m));
    if (score > bestScore + NEAR) { best = m; bestScore = score; }
  }
  return best;
}

function median(xs) {
  if (!xs.length) return 0;
  const sorted = [...xs].sort((a, b) => a - b), mid = sorted.length >> 1;
  return sorted.length % 2 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
}

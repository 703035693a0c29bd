// The Thresholds panel: LayerHealth's bands by their names; a change reloads the runs judged by the new bands.

import {el} from "./heatmap.js";

export function thresholdToggle(state, load) {
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

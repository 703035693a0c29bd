"""The Layers tab for a run with only GradientAnomalyStopping: listed, its flight record drawn (real server)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_hooks import GradientAnomalyStopping
from tests.browser import PLUGIN, devtools, get, needs_chromium, tab_url, tensorboard, wait_for
from tests.test_spikes import SPIKE, TRIGGER, RampNet, fit

pytestmark = pytest.mark.slow  # a tensorboard server and headless Chromium
RUN = "guarded/version_0"


def guarded_run(logdir: Path) -> Any:
    """A seeded fit with only GradientAnomalyStopping: ``net.0``'s gradient poisoned (x3 a step) from SPIKE on.

    Returns:
        The flight record the stopper kept (its leader is ``net.0``).
    """
    stopper = GradientAnomalyStopping(action="skip", spikes=TRIGGER, flight_recorder=16, prog_bar=False)
    logger = TensorBoardLogger(str(logdir), name="guarded", version=0)
    fit(logdir, RampNet, stopper, logger=logger)
    logger.experiment.flush()
    return stopper.last_report.flight_record


def wait_for_anomalies(base: str) -> dict[str, Any]:
    def check() -> Any:
        runs = get(base, "runs")["runs"]
        return RUN in runs and (found := get(base, "run", run=RUN))["anomalies"] and found

    return wait_for(check, 120, f"run {RUN!r} with its anomalies")


def test_a_run_with_only_gradient_anomaly_stopping_is_listed_with_its_reports_and_flight_record(tmp_path):
    record = guarded_run(tmp_path)
    with tensorboard(tmp_path, tmp_path / "tensorboard.log") as base:
        answer = wait_for_anomalies(base)
        listing = json.loads(urllib.request.urlopen(f"{base}/data/plugins_listing").read())[PLUGIN]
    assert listing["enabled"]  # the tab shows with no layer figure anywhere
    assert answer["figures"] == [] and answer["banner"] == []
    (anomaly,) = answer["anomalies"]
    assert "grad_norm_spike" in anomaly["report"] and f"step {record.step}" in anomaly["report"]
    drawn = anomaly["flight_record"]
    assert drawn["leader"] == record.leader == "net.0" and drawn["steps"] == list(record.steps)
    assert drawn["onsets"] == [list(onset) for onset in record.onsets]
    assert drawn["usual"][0][0] == pytest.approx(record.usual[0][0], rel=1e-5)


@needs_chromium
def test_the_flight_record_is_drawn_leader_first_with_its_departure_in_colour(tmp_path):
    record = guarded_run(tmp_path)
    with tensorboard(tmp_path, tmp_path / "tensorboard.log", load_fast="true") as base:  # the Rust data server
        wait_for_anomalies(base)
        with devtools(tab_url(base)) as tools:
            page = tools.evaluate(f"""(() => {{ const card = document.querySelector('.lh-card[data-run="{RUN}"]');
                const box = card.querySelector('.lh-flight'), canvas = box.querySelector('canvas');
                return {{banner: card.querySelector('.lh-banner').textContent,
                         ticks: card.querySelectorAll('.lh-tick').length,
                         leader: box.dataset.leader, line: box.querySelector('.lh-leader').textContent,
                         legend: box.querySelector('.lh-legend').textContent, ...canvas.dataset}}; }})()""")
            left = record.steps.index(record.step - record.lead)
            before, after = (cell_colour(tools, page, 0, column) for column in (left - 4, len(record.steps) - 1))
            rows = [cell_colour(tools, page, row, 2) for row in range(len(page["rows"].split(",")))]
    assert "No layer figures in this run" in page["banner"] and page["ticks"] == 1
    order = page["rows"].split(",")
    assert order[: len(record.onsets)] == [layer for layer, _ in record.onsets] and order[0] == "net.0"
    assert sorted(order) == sorted(record.layers)
    assert page["leader"] == "net.0" and page["line"].startswith(f"Leader: net.0 left its usual gradient-norm range"
                                                                 f" first, at step {record.step - record.lead}")
    assert "÷ its usual level" in page["legend"] and "log scale" in page["legend"]
    assert record.step - record.lead >= SPIKE
    # Pixels: the leader's cells are the usual colour before it left its range, another after; no blank canvas.
    assert max(abs(a - b) for a, b in zip(before, after)) > 60, (before, after)
    assert after[0] > before[0] and after[1] > before[1], (before, after)  # above usual: towards viridis' yellow
    assert all(sum(colour) > 0 for colour in rows)


def cell_colour(tools: Any, page: dict[str, Any], row: int, column: int) -> tuple[int, int, int]:
    """The colour of a flight-record cell (a quarter in: clear of the outline and the anomaly's dashed line)."""
    x = float(page["labelWidth"]) + (column + 0.25) * float(page["cell"])
    y = float(page["top"]) + (row + 0.5) * float(page["rowHeight"])
    return tuple(tools.evaluate(f"""(() => {{ const canvas = document.querySelector('.lh-flight canvas');
        const ratio = canvas.width / parseFloat(canvas.style.width);
        return [...canvas.getContext('2d').getImageData(Math.floor({x} * ratio), Math.floor({y} * ratio), 1, 1)
                .data].slice(0, 3); }})()"""))


@needs_chromium
def test_a_big_models_flight_record_draws_the_layers_that_left_first_and_says_how_many_it_left_out(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from lightning_hooks.callbacks._flight_recorder import analyse, record_json
    from lightning_hooks.output._plugin_data import FLIGHT_RECORD_TAG, plugin_data_summary

    steps, layers = list(range(20, 40)), [f"blocks.{i}.mlp" for i in range(60)]
    norms = np.ones((20, 60)) * (1 + 0.05 * np.sin(np.arange(20)))[:, None]
    norms[15:, 59] *= 50.0  # the last layer leads, from step 35; the one before follows at step 38
    norms[18:, 58] *= 20.0
    record = analyse(39, steps, np.linspace(2.0, 1.0, 20), norms, [f"{layer}.weight" for layer in layers])
    with SummaryWriter(str(tmp_path / "big")) as writer:
        writer.add_text("anomalies/report", "Gradient anomaly at step 39: grad_norm_spike", 39)
        entry = plugin_data_summary(FLIGHT_RECORD_TAG, json.dumps(record_json(record)))
        writer._get_file_writer().add_summary(entry, 39)
    with tensorboard(tmp_path, tmp_path / "tensorboard.log") as base:
        wait_for(lambda: get(base, "runs")["runs"] == ["big"] and get(base, "run", run="big")["anomalies"], 120, "big")
        with devtools(tab_url(base)) as tools:
            rows = tools.evaluate("document.querySelector('.lh-flight canvas').dataset.rows").split(",")
            cut = tools.evaluate("document.querySelector('.lh-flight .lh-cut').textContent")
    assert record.leader == "blocks.59.mlp" and rows[:2] == ["blocks.59.mlp", "blocks.58.mlp"]
    assert len(rows) == 48 and rows[2:5] == ["blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"]
    assert cut == "12 more layers, not drawn, stayed in their usual range (48 of 60 drawn)."


@needs_chromium
def test_a_record_judged_from_outputs_says_so_and_draws_each_step_s_update_norm_under_the_loss(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from lightning_hooks.callbacks._flight_leader import OutputLevels
    from lightning_hooks.callbacks._flight_recorder import analyse, record_json
    from lightning_hooks.output._plugin_data import FLIGHT_RECORD_TAG, plugin_data_summary

    steps, modules = list(range(20, 40)), ["a", "b", "c"]
    wobble = 1 + 0.05 * np.sin(np.arange(20))
    levels = np.stack([wobble, 2 * wobble, 3 * wobble], 1)
    levels[15:, 1:] *= 20.0  # b jumps at step 35, c after it with it
    outputs = OutputLevels(20)
    for step, row in zip(steps, levels):
        outputs.add(step, dict(zip(modules, row)))
    updates = 0.01 * wobble
    updates[14] *= 10.0  # the update of step 34
    updates[-1] = np.nan  # the anomalous step's own is not made yet
    record = analyse(39, steps, np.linspace(2.0, 1.0, 20), levels, [f"{m}.weight" for m in modules], outputs, updates)
    assert (record.leader, record.judged_by) == ("b", "outputs")
    with SummaryWriter(str(tmp_path / "outputs")) as writer:
        writer.add_text("anomalies/report", "Gradient anomaly at step 39: update_norm_spike", 39)
        entry = plugin_data_summary(FLIGHT_RECORD_TAG, json.dumps(record_json(record)))  # the tab reads plugin data
        writer._get_file_writer().add_summary(entry, 39)
    with tensorboard(tmp_path, tmp_path / "tensorboard.log") as base:
        wait_for(lambda: get(base, "run", run="outputs")["anomalies"], 120, "the outputs run")
        with devtools(tab_url(base)) as tools:
            box = tools.evaluate("""(() => { const box = document.querySelector('.lh-flight');
                return {updates: box.dataset.updates, line: box.querySelector('.lh-leader').textContent,
                        legend: box.querySelector('.lh-legend').textContent,
                        top: box.querySelector('canvas').dataset.top}; })()""")
    assert box["updates"] == "19" and "then each step's update norm" in box["legend"]
    assert box["line"].startswith("Leader: b's outputs left their usual range first in forward order, at step 35")
    assert float(box["top"]) == 6 + 2 * (44 + 8)  # the grid starts below two bands: the loss, the update norm

"""The Layers tab as a user keeps it open: in TensorBoard's own page, with its reload button, in headless Chromium."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.browser import (
    DEAD,
    devtools,
    get,
    needs_chromium,
    tab_url,
    tensorboard,
    wait_for,
    wait_for_run,
    write_synthetic_run,
)

pytestmark = pytest.mark.slow  # a tensorboard server and headless Chromium


def write_healthy_run(run_dir: Path, steps: int) -> None:
    """A small run with every figure inside its band, and its forward order as the tab's own summary."""
    from torch.utils.tensorboard import SummaryWriter

    from lightning_hooks.output._plugin_data import FORWARD_ORDER_TAG, plugin_data_summary

    with SummaryWriter(str(run_dir)) as writer:
        writer._get_file_writer().add_summary(plugin_data_summary(FORWARD_ORDER_TAG, '["a", "b"]'), 0)
        for step in range(steps):
            for layer in ("a", "b"):
                writer.add_scalar(f"activations/{layer}/zero_fraction", 0.3, step)
                writer.add_scalar(f"activations/{layer}/std", 1.0 + 0.01 * step, step)


def write_malformed_record(run_dir: Path) -> None:
    """A run whose flight record is foreign: ``layers`` is a number, not a list of names."""
    from torch.utils.tensorboard import SummaryWriter

    from lightning_hooks.output._plugin_data import FLIGHT_RECORD_TAG, plugin_data_summary

    record = {"step": 5, "steps": [4, 5], "losses": [1.0, 2.0], "layers": 3, "norms": [[1.0], [2.0]], "onsets": []}
    with SummaryWriter(str(run_dir)) as writer:
        writer.add_text("anomalies/report", "Gradient anomaly at step 5: grad_norm_spike", 5)
        writer._get_file_writer().add_summary(plugin_data_summary(FLIGHT_RECORD_TAG, json.dumps(record)), 5)
        writer.add_scalar("activations/x/zero_fraction", 0.1, 5)


@needs_chromium
def test_the_strip_puts_the_faulty_run_first_and_its_banner_names_the_culprit_first(tmp_path):
    write_healthy_run(tmp_path / "a_healthy", 10)
    write_synthetic_run(tmp_path / "z_faulty", modules=100, steps=20)  # DEAD, in a block that starts collapsed, is dead
    write_malformed_record(tmp_path / "m_malformed")
    with tensorboard(tmp_path, tmp_path / "tensorboard.log", load_fast="true") as base:
        wait_for_run(base, "z_faulty", 20)
        wait_for(lambda: len(get(base, "runs")["runs"]) == 3 and get(base, "run", run="m_malformed")["anomalies"], 60,
                 "three runs")
        with devtools(tab_url(base)) as tools:
            strip = tools.evaluate("""[...document.querySelectorAll('.lh-strip-row')].map((r) =>
                [r.dataset.run, r.dataset.rank, r.dataset.culprit])""")
            cards = tools.evaluate("[...document.querySelectorAll('#lh-runs > .lh-card')].map((c) => c.dataset.run)")
            first_line = tools.evaluate("document.querySelector('[data-run=\"z_faulty\"] .lh-banner li').dataset.layer")
            rows = tools.evaluate("document.querySelector('[data-run=\"z_faulty\"]"
                                  " [data-figure=\"activations/zero_fraction\"] canvas').dataset.rows").split(",")
            flight_error = tools.evaluate("document.querySelector('[data-run=\"m_malformed\"] .lh-flight-error')"
                                          ".textContent")
            drawn = tools.evaluate("document.querySelectorAll('[data-run=\"a_healthy\"] .lh-figure canvas').length")
            tools.evaluate("(f => { f.value = 'a_heal'; f.dispatchEvent(new Event('input')); })"
                           "(document.querySelector('#lh-filter'))")
            filtered = tools.evaluate("[...document.querySelectorAll('#lh-runs > .lh-card')].map((c) => c.dataset.run)")
    # The faulty run leads the strip and the cards, its culprit named; the healthy one comes after.
    assert strip[0] == ["z_faulty", "1", DEAD], strip
    assert ["a_healthy", "3", ""] in strip and cards[0] == "z_faulty"
    assert first_line == DEAD
    # The culprit's group is open although the model's 100 rows start collapsed; the other groups are not.
    assert DEAD in rows and len(rows) < 60 and "encoder.layers.0.mlp.*" in rows
    # A foreign flight record: an error in its own card, saying what is wrong, while the other runs draw.
    assert "`layers` is not a list of names" in flight_error and drawn == 2
    assert filtered == ["a_healthy"]


@needs_chromium
def test_on_a_fault_zoo_run_the_strip_and_the_banners_first_line_name_the_injected_module(tmp_path):
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.fault_zoo import judge_case, run_case

    torch.set_num_threads(1)
    faults = {"a_healthy": None, "b_jump": "jump", "c_dead": "dead"}  # x20 at once, or 0, in the MLP's middle Linear
    cases = {run: run_case("mlp", fault, 200, 100, 2, logger=TensorBoardLogger(tmp_path, name="", version=run))
             for run, fault in faults.items()}
    with tensorboard(tmp_path, tmp_path / "tensorboard.log", load_fast="true") as base:
        for run in cases:
            wait_for_run(base, run, 100)
        with devtools(tab_url(base)) as tools:
            strip = tools.evaluate("""[...document.querySelectorAll('.lh-strip-row')].map((r) =>
                [r.dataset.run, r.dataset.rank, r.dataset.culprit, r.innerText])""")
            first_lines = tools.evaluate("""[...document.querySelectorAll('#lh-runs > .lh-card')].map((c) =>
                (li => li ? [c.dataset.run, `${li.dataset.layer} (${li.dataset.verdict})`, li.innerText]
                          : [c.dataset.run])(c.querySelector('.lh-banner li')))""")
    culprit = cases["b_jump"].culprit
    assert culprit == cases["c_dead"].culprit == "model.4"
    # The faulty runs lead the strip, each naming the injected module; the healthy twin comes last, unmarked.
    assert sorted(row[:3] for row in strip[:2]) == [["b_jump", "1", culprit], ["c_dead", "1", culprit]], strip
    assert strip[2][:3] == ["a_healthy", "3", ""] and first_lines[2] == ["a_healthy"], (strip, first_lines)
    for run, named, text in first_lines[:2]:  # the banner's first line: LayerHealth's first (layer and problem)
        assert named == judge_case(cases[run], None)["first"] and text.startswith(f"{culprit} — "), (run, named)
    assert "outputs blowing up" in dict((row[0], row[3]) for row in strip)["b_jump"]


def test_the_text_tab_lists_no_data_written_for_the_layers_tab(tmp_path):
    import numpy as np
    from torch.utils.tensorboard import SummaryWriter

    from lightning_hooks.callbacks._flight_recorder import analyse, record_json
    from lightning_hooks.output._plugin_data import FLIGHT_RECORD_TAG, FORWARD_ORDER_TAG, plugin_data_summary

    write_healthy_run(tmp_path / "run", 3)
    record = analyse(3, [0, 1, 2, 3], np.array([1.0, 1.0, 1.0, 2.0]), np.array([[1.0], [1.1], [0.9], [9.0]]),
                     ["a.weight"])
    with SummaryWriter(str(tmp_path / "run")) as writer:
        writer.add_text("anomalies/report", "Gradient anomaly at step 3", 3)
        entry = plugin_data_summary(FLIGHT_RECORD_TAG, json.dumps(record_json(record)))
        writer._get_file_writer().add_summary(entry, 3)
    with tensorboard(tmp_path, tmp_path / "tensorboard.log", load_fast="true") as base:
        answer = wait_for(lambda: (found := get(base, "run", run="run"))["anomalies"] and found, 60, "the anomaly")

        def text_tags() -> Any:
            with urllib.request.urlopen(f"{base}/data/plugin/text/tags", timeout=30) as response:
                return json.loads(response.read()).get("run")

        tags = wait_for(text_tags, 60, "text tags")
    assert tags == ["anomalies/report/text_summary"]  # the report is for people; the record and the order are the tab's
    assert answer["anomalies"][0]["flight_record"]["layers"] == ["a"] and answer["forward_order"]
    assert not any(tag.startswith(FORWARD_ORDER_TAG) for tag in tags)


@needs_chromium
def test_tensorboards_reload_button_updates_a_live_runs_tab_and_keeps_what_the_user_opened(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    write_healthy_run(tmp_path / "live", 7)
    with tensorboard(tmp_path, tmp_path / "tensorboard.log", load_fast="true") as base:
        wait_for_run(base, "live", 7)
        with devtools(f"{base}/#lightning_hooks_layers", page_ready=_tab_ready) as tools:
            frame = "document.querySelector('iframe').contentDocument"
            wait_for(lambda: tools.evaluate(f"{frame}.body.dataset.ready") == "true", 60, "the tab")
            loads = int(tools.evaluate(f"{frame}.body.dataset.loads"))
            # The user opens a step's depth profile (a click below the heatmap's columns).
            tools.evaluate(f"""(c => {{ const box = c.getBoundingClientRect(); const d = c.dataset;
                c.dispatchEvent(new MouseEvent('click', {{clientX: box.left + Number(d.labelWidth) + 2,
                clientY: box.top + Number(d.top) + d.rows.split(',').length * Number(d.rowHeight) + 8}})); }})
                ({frame}.querySelector('[data-figure="activations/std"] canvas'))""")
            assert tools.evaluate(f"{frame}.querySelector('[data-profile-step]').dataset.profileStep") == "0"
            with SummaryWriter(str(tmp_path / "live")) as writer:
                for step in range(7, 30):
                    writer.add_scalar("activations/a/std", 1.0, step)
            wait_for_run(base, "live", 30)
            before = tools.evaluate(f"{frame}.body.dataset.loads")
            tools.evaluate("document.querySelector('app-header-reload button').click()")
            wait_for(lambda: int(tools.evaluate(f"{frame}.body.dataset.loads")) > int(before), 30,
                     "the tab reloaded by TensorBoard's button")
            columns = tools.evaluate(f"{frame}.querySelector('[data-figure=\"activations/std\"] .lh-sub').textContent")
            profile = tools.evaluate(f"({frame}.querySelector('[data-profile-step]') || {{dataset: {{}}}})"
                                     ".dataset.profileStep")
            timing = tools.evaluate(f"{frame}.querySelector('#lh-timing').textContent")
    assert loads >= 1 and "× 30 steps" in columns, columns
    assert profile == "0"  # the open depth profile survived the reload
    assert "follows TensorBoard's reload" in timing


def _tab_ready(tools: Any) -> Any:
    return tools.evaluate("(f => f && f.contentDocument && f.contentDocument.body"
                          " && f.contentDocument.body.dataset.ready)(document.querySelector('iframe'))")


@needs_chromium
def test_a_link_to_tensorboard_reproduces_the_view_run_baseline_and_selected_column(tmp_path):
    write_healthy_run(tmp_path / "today", 12)
    write_healthy_run(tmp_path / "yesterday", 12)
    with tensorboard(tmp_path, tmp_path / "tensorboard.log", load_fast="true") as base:
        wait_for_run(base, "today", 12)
        wait_for_run(base, "yesterday", 12)
        keys = {"run": "today", "baseline": "yesterday", "figure": "activations/std", "step": "6", "view": "profile"}
        link = f"{base}/#lightning_hooks_layers&" + "&".join(f"p.lightning_hooks_layers.{k}={v.replace('/', '%2F')}"
                                                                for k, v in keys.items())
        with devtools(link, page_ready=_tab_ready) as tools:
            frame = "document.querySelector('iframe').contentDocument"
            card = f"{frame}.querySelector('.lh-card[data-run=\"today\"]')"
            title = wait_for(lambda: tools.evaluate(f"({card}.querySelector('[data-figure=\"activations/std\"] h3')"
                                                    " || {}).textContent"), 30, "the card")
            picked = tools.evaluate(f"{card}.querySelector('select.lh-baseline').value")
            profile = tools.evaluate(f"({card}.querySelector('[data-profile-step]') || {{dataset: {{}}}})"
                                     ".dataset.profileStep")
            # The user's next choice goes back into TensorBoard's URL.
            tools.evaluate(f"(s => {{ s.value = ''; s.dispatchEvent(new Event('change')); }})"
                           f"({card}.querySelector('select.lh-baseline'))")
            address = tools.evaluate("location.hash")
    assert title.endswith("÷ yesterday") and picked == "yesterday"
    assert profile == "6"  # the depth profile at the linked step is open
    assert "p.lightning_hooks_layers.run=today" in address and "p.lightning_hooks_layers.baseline=&" in address

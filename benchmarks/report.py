"""The report: the issue's targets as PASS/FAIL lines, and the Markdown tables of ``results.md``.

Reads the results dict that ``overhead.py`` assembles (timing from ``harness.analyse``, host
transfers from ``transfers.count_transfers``, memory from the subprocesses); measures nothing.
"""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Any, Optional

import lightning
import torch
from configs import optional
from harness import LOG_EVERY


def _ratio_target(label: str, row: dict[str, Any], key: str, limit: float, noise: str) -> list[Any]:
    """A "ratio <= limit" target on wall time, saying when CPU time would give the other verdict."""
    wall, cpu = row[key], row[key + "_cpu"]
    other = "" if (wall <= limit) == (cpu <= limit) else f"; CPU time says {'PASS' if cpu <= limit else 'FAIL'}"
    return [wall <= limit, f"{label} {wall:.3f}x none <= {limit}x (CPU time {cpu:.3f}x{noise}{other})"]


def check_targets(timing: dict[str, Any], transfers: dict[str, Any], models: list[str]) -> list[list[Any]]:
    """The issue's targets, per model: ``[passed, line]``; ``passed`` None for information only."""
    lines: list[list[Any]] = []
    for kind in models:
        t, noise = timing[kind], timing[kind].get("none (A/A)", {}).get("ratio")
        aa = f"; A/A {noise:.3f}x" if noise else ""
        if (row := t.get(f"monitors/{LOG_EVERY}")) and row["ratio_non_logged"] is not None:
            label = f"{kind}: non-logged steps (monitors/{LOG_EVERY})"
            lines.append(_ratio_target(label, row, "ratio_non_logged", 1.03, aa))
        if (row := t.get(f"monitors/{LOG_EVERY} unchecked")) and row["ratio_non_logged"] is not None:
            lines.append([None, f"{kind}: non-logged steps without the per-step gradient check"
                                f" (monitors/{LOG_EVERY} unchecked) {row['ratio_non_logged']:.3f}x none"])
        if row := t.get("monitors/1"):
            lines.append(_ratio_target(f"{kind}: logging every step (monitors/1)", row, "ratio", 1.5, aa))
        if (row := t.get(f"quick start/{LOG_EVERY}")) and row["ratio_non_logged"] is not None:
            lines.append([None, f"{kind}: the quick start's three callbacks, non-logged steps"
                                f" (quick start/{LOG_EVERY}) {row['ratio_non_logged']:.3f}x none"])
        for name in ("provenance", "stopping+provenance"):
            if row := t.get(name):
                lines.append(_ratio_target(f"{kind}: NaN provenance ({name})", row, "ratio", 1.1, aa))
        if (theirs := t.get("wandb.watch/1", {}).get("ratio")) is not None:
            if (ours := t.get("monitors/1", {}).get("ratio")) is not None:
                third = (theirs - 1) / 3
                lines.append([ours - 1 <= third, f"{kind}: overhead logging every step (monitors/1)"
                              f" {ours - 1:+.3f} <= 1/3 of wandb.watch/1's {theirs - 1:+.3f} (= {third:+.3f})"])
            if (grads := t.get("gradients/1", {}).get("ratio")) is not None:
                lines.append([None, f"{kind}: gradients only, every step: gradients/1 {grads - 1:+.3f} vs"
                                    f" wandb.watch/1 (parameters and gradients) {theirs - 1:+.3f}"])
        w50, m50 = t.get(f"wandb.watch/{LOG_EVERY}", {}), t.get(f"monitors/{LOG_EVERY}", {})
        if "ratio_amortised" in w50 and "ratio_amortised" in m50:
            lines.append([None, f"{kind}: amortised overhead every {LOG_EVERY} steps"
                                f" {m50['ratio_amortised'] - 1:+.3f} vs wandb.watch/{LOG_EVERY}'s"
                                f" {w50['ratio_amortised'] - 1:+.3f} (estimates)"])
        lines += _transfer_targets(kind, transfers)
    return lines


def _transfer_targets(kind: str, transfers: dict[str, Any]) -> list[list[Any]]:
    lines: list[list[Any]] = []
    for name in (f"monitors/{LOG_EVERY}", "monitors/1", "activations/1", "gradients/1", f"quick start/{LOG_EVERY}",
                 "quick start/1", "provenance", "stopping+provenance"):
        for owner, v in transfers.get(kind, {}).get(name, {}).get("per_callback", {}).items():
            if v["logged"] is not None:
                lines.append([v["logged"] <= 1, f"{kind}: {owner} in {name}: {v['logged']:g} host"
                                                " transfer(s) per logged step <= 1"])
            if v["non_logged"]:
                lines.append([None, f"{kind}: {owner} in {name}: {v['non_logged']:g} host transfer(s)"
                                    " per non-logged step"])
    return lines


def machine() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(), "torch": torch.__version__, "lightning": lightning.__version__,
        "wandb": optional("wandb", "__version__"), "platform": platform.platform(),
    }


def _fmt(value: Optional[float], spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _transfers(counts: Optional[dict[str, Any]], key: str) -> str:
    if not counts:
        return "–"
    parts = [f"{_fmt(v[key], 'g')} ({owner})" for owner, v in counts["per_callback"].items() if v[key]]
    return ", ".join(parts) if parts else "0"


def _table(results: dict[str, Any], kind: str) -> list[str]:
    lines = [
        "| config | ms/step | × none | range over fits | × none, CPU time | non-logged × none"
        " | amortised × none | host transfers / logged step | / non-logged step | peak RSS MiB (Δ none)"
        " | Python heap peak MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    base_mem = results["memory"].get("none", {}).get(kind) or {}
    for name, row in results["timing"][kind].items():
        every = results["configs"][name]["every"]
        counts = results["transfers"].get(kind, {}).get(name)
        mem = results["memory"].get(name, {}).get(kind) or {}
        periodic = bool(every and every > 1)
        amortised = _fmt(row.get("ratio_amortised"), ".3f") + ("†" if row.get("amortised_borrowed") else "")
        rss, rss0 = mem.get("rss_peak_mib"), base_mem.get("rss_peak_mib")
        delta = f" ({rss - rss0:+.0f})" if rss is not None and rss0 is not None else ""
        lines.append(
            f"| {name} | {_fmt(row['ms'], '.1f')} | {_fmt(row['ratio'], '.3f')}"
            f" | {row['ratio_min']:.2f}–{row['ratio_max']:.2f} | {_fmt(row['ratio_cpu'], '.3f')}"
            f" | {_fmt(row['ratio_non_logged'] if periodic else None, '.3f')}"
            f" | {amortised if periodic else '–'}"
            f" | {_transfers(counts, 'logged')} | {_transfers(counts, 'non_logged')}"
            f" | {_fmt(rss, '.0f')}{delta} | {_fmt(mem.get('py_peak_mib'), '.1f')} |"
        )
    return lines


def render(results: dict[str, Any]) -> str:
    m, a = results["machine"], results["args"]
    out = [
        "# lightning_hooks overhead benchmark",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), {m['platform']};"
        f" Python {m['python']}, torch {m['torch']}, lightning {m['lightning']},"
        f" wandb {m['wandb'] or 'not installed'}.",
        "",
        f"Run: {a['rounds']} rounds. Per round every configuration and model runs one `Trainer.fit` of"
        f" {a['warmup']} warm-up + {a['steps']} timed steps (cut to {a['min_steps']} once a fit's timed steps"
        f" pass {a['fit_seconds']} s), in a shuffled order, with a baseline fit ('none') first, last and"
        " after every two others. × none: median over fits of (the fit's median step time / the mean of the"
        " medians of the baseline fits just before and after it). Torch threads:"
        f" {a['threads'] or 'default'}. Host transfers: {a['count_steps']} counted steps per config. Memory: "
        + (f"a fresh subprocess per config, {a['memory_steps']} steps per fit." if results["memory"]
           else "not measured.")
        + f" {results['wall_s']:.0f} s in all.",
        "",
    ]
    out += [f"> {note}" for note in results["notes"]] + ([""] if results["notes"] else [])
    for kind in results["models"]:
        out += [f"## {kind}", "", *_table(results, kind), ""]
    out += ["## Configurations", ""]
    out += [f"- **{name}**: {c['description']}" for name, c in results["configs"].items()]
    out += ["", "† amortised with the every-step configuration's ratio for the logged step (no logged step was"
            " timed: step 0, the logged one, is a warm-up step).", "", "## Targets", "", "```"]
    out += [{True: "PASS ", False: "FAIL ", None: "info "}[ok] + line for ok, line in results["targets"]]
    out += ["```", ""]
    return "\n".join(out)


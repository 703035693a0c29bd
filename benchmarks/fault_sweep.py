"""The fault sweep: the fault zoo's goals on cases the zoo does not hold (issue 29, item 2).

The zoo (``benchmarks/fault_zoo.py``) was measured while the judge was built; a judge tuned on it
could hold there only. This sweep runs the zoo's own machinery (its LightningModule, probe and
row) on variations it never held, in groups:

- ``models``: a BERT (post-LayerNorm encoder) and a GPT-NeoX (parallel residual) from
  ``transformers`` configs, a ten-block MLP with LayerNorm, the CNN with GroupNorm, a small ViT,
  a stack of GRUs (tuple outputs) (``benchmarks/_sweep_models.py``), each with every fault.
- ``layers``: the fault in the second module, the second-to-last, a LayerNorm, an embedding.
- ``rates``: ramps of 0.5% and 5% a step, jumps x3 and x100.
- ``onsets``: the fault at 20% and at 90% of the run.
- ``every``: logged every 1, 3 and 10 steps.
- ``optim``: SGD with momentum and AdamW with warm-up and cosine on the MLP, bf16-mixed on CPU.

Added after the judge was built on the groups above (none of it seen while building it):

- ``models2``: a Qwen2 (a Mistral/LLaMA-style decoder: grouped-query attention, RMSNorm) and an OPT
  (head tied to the token embedding) from ``transformers`` configs (with ``attn`` too: one block's
  queries grow 4% a step), three stacked LSTMs (``(output, (h, c))``), a plain CNN (six
  convolutions, no normalisation, no residual).
- ``layers2``: an attention output projection, the final norm (GPT-2's ``ln_f``, Qwen2's ``norm``),
  an MLP's first projection (GPT-2's ``c_fc``, Qwen2's ``up_proj``).
- ``rates2``: ramps of 1% and 2% a step, a jump x1.5. A jump under x2 is graded as a ramp: not
  named while the loss never moved 5% is ``unmoved``; named, it must be first, and at the first
  logged step or before the loss moved (else ``late``).
- ``every2``: logged every 5 steps, the onset at 50%.
- ``long2``: 1,000 steps, logged every 5, the onset at step 500 (the judge's history five times longer).
- ``optim2``: Adam (MLP) and AdamW (GPT-2) with the gradients' norm clipped to 1; SGD with
  Nesterov momentum (MLP, CNN); four micro-batches a step (MLP, CNN, GPT-2).

Added once every group above met its goals but the SGD prediction layer (``benchmarks/_sweep_unseen3.py``):

- ``unseen3``: a GPT-J, a ten-block GPT-2, an MLP classifier, a pre-activation ResNet without norm,
  an MLP-Mixer, a ConvNeXt-style CNN (a depthwise convolution too); LLaMA's value projection, its
  first and last block, GPT-2's ``lm_head``.
- ``unseen3b``: ramps of 0.7% and 3% a step, a shrink x0.3 and a jump x10 (a change past x2 either
  way is graded as abrupt), an onset at 35%, AdamW at a constant LR, the zoo's models at seeds 1-3.
- ``unseen3c``: the Mixer's other faults, a GPT-2 with dropout, other log intervals and lengths,
  onsets at 25%, a ramp of 0.3% a step, jumps x2.5 and x0.5, more layers, AdamW on the CNN.
- ``creep`` (``benchmarks/_sweep_creep.py``): ramps of 0.15-0.4% a step, around the judge's creep
  bound, on the MLP, CNN, GPT-2 and LLaMA, with their healthy twins.
- ``creep-long``: the MLP, CNN and GPT-2 over 400 steps, ramps of 0.2% and 0.4% a step from step 200.
- ``lastblock``: the fault in the last block of the Mixer, the pre-activation ResNet and LLaMA, where a
  healthy gradient over depth is cleared (``benchmarks/_sweep_lastblock.py``).

Added next, on models and settings none of the above held (``benchmarks/_sweep_unseen4.py``,
models in ``benchmarks/_sweep_models4.py``):

- ``unseen4``: a Phi, Falcon, BLOOM, GPT-BigCode, Gemma, DistilBERT and RoBERTa; a WaveNet-like
  dilated convolution stack, torch's post-norm ``nn.TransformerEncoder``, a U-Net-like denoiser, an
  MLP autoencoder, a mixture-of-experts MLP.
- ``unseen4b``: an embedding's norm and output, a router, a post-norm, first convolutions, a skip branch.
- ``unseen4c``: RMSprop, Adagrad, SGD without momentum, Adafactor.
- ``unseen4d`` to ``unseen4f``: harder rates, intervals and onsets on those models, tuple outputs,
  first modules ramping, routers dead, LR x100 under the new optimizers, queries growing.

Added next (``benchmarks/_sweep_unseen5.py``):

- ``unseen5``: the ``unseen4`` models at seeds 2 and 3.
- ``unseen5b``: a Qwen3 and its key RMSNorm, a key projection, GeGLU and SwiGLU gates, an MoE expert's first
  Linear, a top-1 (switch-routed) MoE, LayerNorms of the new models, the U-Net's convolution after its skip
  concatenation, a LLaMA 16 blocks deep.
- ``unseen5c``: ramps of 2% and 6% a step, jumps x0.5, x1.8, x5, a shrink x0.2, onsets at 60% and 80%, logged
  every 4 and 8, batch sizes 4 and 64, weight decay 0.1 under SGD, clipping at 0.5.

Added next (``benchmarks/_sweep_unseen6.py``, models in ``benchmarks/_sweep_models6.py``):

- ``unseen6``: a T5 encoder-decoder (its decoder's cross-attention), a Mistral, a Mixtral (its fused experts),
  a Mamba, a StableLM, a Cohere, a MobileNet-like CNN (depthwise convolutions, squeeze-and-excitation), a
  DenseNet-like CNN (concatenated features) and a message-passing network on graphs.
- ``unseen6b``: the T5's encoder MLP, the MobileNet's excitation Linear, the Mamba's ``in_proj``.
- ``unseen6s``: the T5, the Mixtral, the MobileNet, the Mamba (and its ``in_proj``) and the GNN at seed 1.
- ``unseen6c``: a BART (post-norm encoder-decoder), the GNN's dead, LR x100, NaN and message Linear, the Mamba's
  ``x_proj``, dead and NaN, the DenseNet's transition, Cohere's and StableLM's queries growing.

Added next, settings on the zoo's and earlier sweeps' models (``benchmarks/_sweep_unseen7.py``):

- ``unseen7``: the zoo's four models at seeds 4 and 5.
- ``unseen7b``: positions: LLaMA's head and final norm, a GPT-2 block's whole output (the residual stream),
  a BatchNorm's output, the CNN's head, Qwen2's first and last block.
- ``unseen7c``: ramps of 8%, 12% and 20% a step, jumps x1.3 and x0.75, a ramp that stops after 20 steps,
  onsets at 12%, 15% and 95%.
- ``unseen7d``: AdamW at 3e-3, linear decay to 0, a one-cycle LR, a warm-up over 40% of the run, healthy
  runs of 400-500 steps logged every step.
- ``unseen7e``: jumps x10 and x5, a dead module and a bad batch at 12-15% of the run, ramps from 20%, healthy
  MLPs logged every step under RMSprop and AdamW at 3e-3 without warm-up.
- ``unseen7f``: one-cycle on GPT-2 and the CNN, linear decay on LLaMA, a 40% warm-up on Qwen2 at 3e-3, healthy
  LLaMA and Qwen2 runs of 400-500 steps logged every step.

Added next (``benchmarks/_sweep_unseen8.py``): ``unseen8`` ... ``unseen8f``, the abrupt faults on the later models,
at attention output projections, norms, embeddings and first modules.

Added next (``benchmarks/_sweep_unseen9.py``): ``unseen9`` and ``unseen9b``, wider (192 and 128 wide transformers,
a 256-wide MLP, a 32-channel CNN) and deeper (a 12-block GPT-2, the issue's shape) models; ``unseen10`` and
``unseen10b`` (``benchmarks/_sweep_unseen10.py``): batches of 2 to 16, learning rates 3-10x the recipes', 600-step runs;
``unseen11`` and ``unseen11b`` (``benchmarks/_sweep_unseen11.py``): MLPs with GELU, SiLU, Tanh and dropout, long and
noisy healthy runs; ``unseen12`` and ``unseen12b`` (``benchmarks/_sweep_unseen12.py``): batches of 2 and 4 on more
models and seeds; ``unseen13`` and ``unseen13b`` (``benchmarks/_sweep_unseen13.py``): the wider models in bf16, with
micro-batches, clipping, other positions, intervals and optimizers; ``unseen14`` and ``unseen14b``
(``benchmarks/_sweep_unseen14.py``): faults where the newer excuses apply (the prediction layer, a shared gain, slow
ramps at small batches); ``unseen15`` to ``unseen15c`` (``benchmarks/_sweep_unseen15.py``): cosine with warm restarts,
RAdam, NAdam and Adamax, frozen and thawed layers, an interval of 20; ``unseen16`` and ``unseen16b``
(``benchmarks/_sweep_unseen16.py``): every fault logged every 20, and logged every 50 over 1,500 steps;
``unseen16c`` and ``unseen16d``: modules called several times a step (ALBERT's shared layer, a looped Linear, a
torchvision-style ResNet's one ``ReLU`` per block); ``unseen17`` (``benchmarks/_sweep_unseen17.py``): ramps and
jumps begun at 12% and 16% of the run, in or just after the judge's warm-up; ``unseen18``
(``benchmarks/_sweep_unseen18.py``): 48 faults drawn at random (model, layer, fault, rate, onset, interval), and
``unseen19``, drawn the same way at another seed; ``unseen20``, drawn from 28 other models; ``unseen21``, from all 52;
``unseen22`` to ``unseen24`` (``benchmarks/_sweep_unseen22.py``): from all 52, at wider rates and onsets, on
recipes varied at random (seed, learning rate, run length, log interval).

Per case: the culprit named first, the layers named before it, the delay (steps from the onset
to the first logged step that names it), on healthy runs the verdict lines after the first 10%,
and for a data fault whether it was said as "every layer at once".

    python benchmarks/fault_sweep.py                         # every group, a table
    python benchmarks/fault_sweep.py --groups rates onsets --json before.json
    python benchmarks/fault_sweep.py --groups layers2 --models qwen2 --verbose   # a failing case's findings
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import (
    _sweep_models,  # noqa: E402,F401  (adds the sweep's recipes)
    fault_zoo,  # noqa: E402
)
from benchmarks._sweep_creep import creep  # noqa: E402
from benchmarks._sweep_lastblock import lastblock  # noqa: E402
from benchmarks._sweep_unseen3 import unseen3  # noqa: E402
from benchmarks._sweep_unseen4 import unseen4  # noqa: E402
from benchmarks._sweep_unseen5 import unseen5  # noqa: E402
from benchmarks._sweep_unseen6 import unseen6  # noqa: E402
from benchmarks._sweep_unseen7 import unseen7  # noqa: E402
from benchmarks._sweep_unseen8 import unseen8  # noqa: E402
from benchmarks._sweep_unseen9 import unseen9  # noqa: E402
from benchmarks._sweep_unseen10 import unseen10  # noqa: E402
from benchmarks._sweep_unseen11 import unseen11  # noqa: E402
from benchmarks._sweep_unseen12 import unseen12  # noqa: E402
from benchmarks._sweep_unseen13 import unseen13  # noqa: E402
from benchmarks._sweep_unseen14 import unseen14  # noqa: E402
from benchmarks._sweep_unseen15 import unseen15  # noqa: E402
from benchmarks._sweep_unseen16 import unseen16  # noqa: E402
from benchmarks._sweep_unseen17 import unseen17  # noqa: E402
from benchmarks._sweep_unseen18 import unseen18  # noqa: E402
from benchmarks._sweep_unseen22 import unseen22  # noqa: E402
from benchmarks._sweep_variant import Variant, register  # noqa: E402
from benchmarks.fault_zoo import JUMP, Case, judge_case, run_case  # noqa: E402

__all__ = ["Variant", "grade", "main", "register", "run_variant", "variants", "verdict"]

ALL_FAULTS = ("ramp", "jump", "dead", "vanish", "lr100", "nan", "data")


def _layers() -> list[Variant]:
    abrupt = ("ramp", "jump")
    return [Variant("layers", "mlp", abrupt, target="2"),  # the second Linear (the second module is a ReLU)
            Variant("layers", "mlp", abrupt, target="8"),  # the second-to-last Linear
            Variant("layers", "mlp-deep-ln", (*abrupt, "vanish"), target="16"),  # a LayerNorm
            Variant("layers", "gpt2", (*abrupt, "vanish"), target="net.transformer.h.2.ln_2"),  # a LayerNorm
            Variant("layers", "gpt2", abrupt, target="net.transformer.h.5.mlp.c_proj"),  # the last block
            Variant("layers", "gpt2", abrupt, target="net.transformer.h.0.attn.c_attn"),  # the first block
            Variant("layers", "gpt2", abrupt, target="net.transformer.wpe"),  # an embedding (the second module)
            Variant("layers", "cnn", abrupt, target="blocks.0.conv1"),
            Variant("layers", "cnn", abrupt, target="blocks.3.conv2")]


def variants() -> dict[str, list[Variant]]:
    """The sweep's groups."""
    models = [Variant("models", m, ("healthy", *ALL_FAULTS)) for m in ("bert", "neox", "mlp-deep-ln", "cnn-gn", "vit")]
    models.append(Variant("models", "gru", ("healthy", "ramp", "jump", "dead", "lr100", "nan", "data")))
    rates = [Variant("rates", m, ("ramp",), growth=g) for m in ("mlp", "cnn", "gpt2") for g in (1.005, 1.05)]
    rates += [Variant("rates", m, ("jump",), jump=j) for m in ("mlp", "cnn", "gpt2") for j in (3.0, 100.0)]
    onsets = [Variant("onsets", m, ("healthy", "ramp", "jump"), steps=300, onset=f) for m in ("mlp", "cnn", "gpt2")
              for f in (0.2, 0.9)]
    every = [Variant("every", m, ("healthy", "ramp", "jump", "dead"), every=e, steps=max(200, 60 * e))
             for m in ("mlp", "cnn", "gpt2") for e in (1, 3, 10)]
    optim = [Variant("optim", "mlp", ("healthy", "ramp", "jump", "lr100"), optimizer="sgd", lr=0.02),
             Variant("optim", "mlp", ("healthy", "ramp", "jump", "lr100"), optimizer="adamw", lr=2e-3),
             Variant("optim", "cnn", ("healthy", "ramp", "jump", "lr100"), optimizer="adamw", lr=2e-3),
             Variant("optim", "mlp", ("healthy", "ramp", "jump"), precision="bf16-mixed"),
             Variant("optim", "cnn", ("healthy", "ramp", "jump"), precision="bf16-mixed")]
    return {"models": models, "layers": _layers(), "rates": rates, "onsets": onsets, "every": every, "optim": optim,
            **_unseen(), **unseen3(), **unseen4(), **unseen5(), **unseen6(), **unseen7(), **unseen8(), **unseen9(),
            **unseen10(), **unseen11(), **unseen12(), **unseen13(), **unseen14(), **unseen15(), **unseen16(),
            **unseen17(), **unseen18(), **unseen22(), **creep(), **lastblock()}


def _unseen() -> dict[str, list[Variant]]:
    """The groups added after the judge was built (``models2`` ... ``optim2``, ``long2``)."""
    models = [Variant("models2", m, ("healthy", *ALL_FAULTS, "attn")) for m in ("qwen2", "opt")]  # attn: queries grow
    models.append(Variant("models2", "cnn-plain", ("healthy", *ALL_FAULTS)))
    models.append(Variant("models2", "lstm", ("healthy", "ramp", "jump", "dead", "lr100", "nan", "data")))
    abrupt = ("ramp", "jump")
    layers = [Variant("layers2", "gpt2", abrupt, target=f"net.transformer.{t}") for t in
              ("h.2.attn.c_proj", "ln_f", "h.2.mlp.c_fc")]
    layers += [Variant("layers2", "qwen2", abrupt, target=f"net.model.{t}") for t in
               ("layers.2.self_attn.o_proj", "norm", "layers.2.mlp.up_proj")]
    rates = [Variant("rates2", m, ("ramp",), growth=g) for m in ("mlp", "cnn", "gpt2", "qwen2") for g in (1.01, 1.02)]
    rates += [Variant("rates2", m, ("jump",), jump=1.5) for m in ("mlp", "cnn", "gpt2", "qwen2")]
    every = [Variant("every2", m, ("healthy", "ramp", "jump", "dead"), every=5, steps=300)
             for m in ("mlp", "cnn", "gpt2", "qwen2")]
    long = [Variant("long2", m, ("healthy", "ramp", "jump", "dead"), every=5, steps=1000)
            for m in ("mlp", "cnn", "gpt2")]
    faults = ("healthy", "ramp", "jump", "lr100")
    optim = [Variant("optim2", "mlp", faults, clip=1.0), Variant("optim2", "gpt2", faults, clip=1.0),
             Variant("optim2", "mlp", faults, optimizer="sgd-nesterov", lr=0.02),
             Variant("optim2", "cnn", faults, optimizer="sgd-nesterov"),
             *(Variant("optim2", m, faults, accumulate=4) for m in ("mlp", "cnn", "gpt2"))]
    return {"models2": models, "layers2": layers, "rates2": rates, "every2": every, "long2": long, "optim2": optim}


def run_variant(v: Variant, fault: str, seed: int = 0) -> Case:
    """Train one case of a variant (``healthy``: without a fault), at the variant's own seed if it has one."""
    fault_zoo.JUMP = v.jump  # the zoo's jump factor, read by its module at each step
    try:
        return run_case(register(v), None if fault == "healthy" else fault, v.steps, int(v.onset * v.steps), v.every,
                        seed if v.seed is None else v.seed, growth=v.growth, hold=v.hold)
    finally:
        fault_zoo.JUMP = JUMP


def verdict(v: Variant, row: dict[str, Any], culprit: str) -> dict[str, Any]:
    """The zoo's row of a case, with its variant and whether the culprit was named first, graded."""
    # the case's own onset (a NaN's: the step it was born at); a healthy twin shared by two onsets: the variant's
    onset = int(v.onset * v.steps) if row["fault"] == "healthy" else row["onset"]
    row.update(group=v.group, variant=v.name, every=v.every, growth=v.growth, jump=v.jump, onset=onset)
    if v.hold:
        row["hold"] = v.hold
    if row["fault"] not in ("healthy", "data"):
        row["culprit_first"] = fault_zoo.is_culprit(row["first"] or "", culprit)
    return grade(row)


def grade(row: dict[str, Any]) -> dict[str, Any]:
    """Set ``ok`` if the case meets the goals, and ``goal`` in words.

    A ramp not named while the loss never moved 5% is ``unmoved`` (not counted as a failure: no
    harm yet); one named after the loss moved is ``late`` (ramp timing, reported apart). A fault
    whose hook never ran (the model never calls the module drawn as a module) ``never ran``.
    """
    row["goal"] = "ok"
    if row.get("ran") is False and row["fault"] != "healthy":  # no fault happened: nothing to name, not counted
        row["goal"], row["ok"] = "never ran", True
        return row
    if row["fault"] == "healthy":
        row["ok"] = row["alarms"] == 0
    elif row["fault"] == "data":
        row["ok"] = row["first"] == "(every layer) (data)" and row["delay"] is not None and row["delay"] < row["every"]
    else:
        ramp, delay, loss5 = _gradual(row), row["delay"], row["loss5"]
        is_jump = row["fault"] == "jump"  # a small jump named at the first logged step is never late
        if ramp and delay is None and row["before"] == 0 and loss5 is None:
            row["goal"] = "unmoved"
        elif ramp and delay is not None and loss5 is not None and delay >= max(loss5, row["every"] * is_jump):
            row["goal"] = "late"
        in_time = delay is not None and (ramp or delay < row["every"])
        row["ok"] = row["goal"] == "unmoved" or (row["culprit_first"] and row["before"] == 0 and in_time)
    if not row["ok"]:
        row["goal"] = "**FAIL**"
    return row


def _gradual(row: dict[str, Any]) -> bool:
    """A ramp, or a jump within x2 either way (a step a layer's own drift may hold): judged by whether the loss moved.

    A shrink past x0.5 (x0.3) is abrupt, as a jump past x2 is.
    """
    return row["fault"] in ("ramp", "attn") or (row["fault"] == "jump" and 0.5 < row.get("jump", JUMP) < 2)


def describe(row: dict[str, Any]) -> str:
    """One markdown line."""
    if row["fault"] == "healthy":
        said = f"{row['alarms']} lines after 10%" + (f": {'; '.join(row['lines'][:3])}" if row["alarms"] else "")
    elif row["fault"] == "data":
        said = f"{row['first']} ({row['delay']})"
    else:
        names = f" ({'; '.join(row['before_names'])})" if row["before"] else ""
        said = f"{row['first']} ({row['delay']}), {row['before']} before{names}"
        said += f", loss moved 5% at {row['loss5']}" if _gradual(row) else ""
    hold = f" for {row['hold']} steps" if row.get("hold") else ""
    change = {"ramp": f" x{row['growth']:g}/step{hold}", "jump": f" x{row['jump']:g}"}.get(row["fault"], "")
    return (f"| {row['group']} | {row['variant']} | every {row['every']}, onset {row['onset']} | "
            f"{row['fault']}{change} | {said} | {row['goal']} | {row['s']} |")


HEADER = ("| group | variant | run | fault | named first (delay), named before it | goal | s |\n"
          "|---|---|---|---|---|---|---:|")


def table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Print saved rows, graded again, as the sweep prints them."""
    print(HEADER)
    for row in rows:
        print(describe(grade(row)))
    print(counted(rows))
    return rows


def counted(rows: list[dict[str, Any]]) -> str:
    """How many cases meet the goals, of those whose fault happened."""
    ran = [r for r in rows if r["goal"] != "never ran"]
    left = f" ({len(rows) - len(ran)} whose fault never ran left out)" if len(ran) < len(rows) else ""
    return f"\n{sum(r['ok'] for r in ran)} of {len(ran)} cases meet the goals{left}"


def _table_rows(paths: list[str]) -> dict[tuple[str, ...], list[str]]:
    """The sweep's printed table lines in these files (its output), by case: group, variant, run, fault."""
    found = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if len(cells) == 7 and cells[0] in variants():
                found[tuple(cells[:4])] = cells
    return found


def compare(before: list[str], after: list[str]) -> None:
    """Print each case's line under an earlier judge and under this one (the sweep's printed output), changes first."""
    old, new = _table_rows(before), _table_rows(after)
    print("| group | variant | run | fault | before | after | goal before -> after |\n|---|---|---|---|---|---|---|")
    for key in sorted(new, key=lambda k: old.get(k, [""] * 7)[4] == new[k][4]):
        was = old.get(key, ["-"] * 7)
        print("| " + " | ".join([*key, was[4], new[key][4], f"{was[5]} -> {new[key][5]}"]) + " |")
    ran = [[cells for cells in rows.values() if cells[5] != "never ran"] for rows in (old, new)]
    ok = [sum(cells[5] != "**FAIL**" for cells in rows) for rows in ran]
    print(f"\nbefore: {ok[0]} of {len(ran[0])} cases meet the goals; after: {ok[1]} of {len(ran[1])}"
          " (faults that never ran left out)")


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    """Run the chosen groups, print a markdown table, optionally write the rows as JSON."""
    groups = variants()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", nargs="+", default=list(groups), choices=list(groups))
    parser.add_argument("--models", nargs="+", help="only the variants of these models")
    parser.add_argument("--variants", nargs="+", help="only these variants, by name (as the table prints them)")
    parser.add_argument("--faults", nargs="+", help="only these of each variant's faults (and its healthy twin)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="after a case that fails, LayerHealth's summary")
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--rows", nargs="+", help="print the table of rows written before (--json), graded again")
    parser.add_argument("--before", nargs="+", help="the sweep's output (its printed table) under an earlier judge")
    parser.add_argument("--after", nargs="+", help="with --before: the sweep's output under this one, side by side")
    args = parser.parse_args(argv)
    if args.before:
        compare(args.before, args.after or [])
        return []
    if args.rows:
        return table([row for path in args.rows for row in json.loads(Path(path).read_text())])
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    twins: dict[tuple[Any, ...], Case] = {}
    print(HEADER)
    chosen = (v for g in args.groups for v in groups[g] if not args.models or v.model in args.models)
    for v in (v for v in chosen if not args.variants or v.name in args.variants):
        if v.recipe_key() not in twins:
            twins[v.recipe_key()] = run_variant(v, "healthy", args.seed)
        for fault in (f for f in v.faults if not args.faults or f in args.faults):
            case = twins[v.recipe_key()] if fault == "healthy" else run_variant(v, fault, args.seed)
            rows.append(verdict(v, judge_case(case, twins[v.recipe_key()]), case.culprit))
            print(describe(rows[-1]), flush=True)
            if args.verbose and not rows[-1]["ok"]:
                print(case.summary, flush=True)
            if args.json:  # after every case: a long sweep stopped keeps what it ran
                Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    print(counted(rows))
    return rows


if __name__ == "__main__":
    main()

"""The diagnosis in plain words: per unhealthy layer, which signal, since when, how far from healthy, and what helps.

Built on the record of :class:`~lightning_hooks.output._health_verdicts.Verdicts` (host-side,
torch-free): :func:`diagnose` is LayerHealth's summary and TransformerStability's diagnosis.
Each remedy comes with the evidence it rests on: what the run logged (the value, its band,
where the layer started) and where the remedy was shown to work.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_hooks.output._findings import owner_of
from lightning_hooks.output._health_verdicts import FIGURE_PROBLEMS, Bands, Episode, Verdicts

_LOWER_LR = ("lower the learning rate{group}",
             "every update is proportional to the learning rate (SGD, Adam and AdamW alike), so a lower one makes"
             " every step smaller")
_LOWER_LR_LOGITS = ("lower the learning rate{group}",
                    "these logit instabilities appear above a critical learning rate and go away below it"
                    " (Wortsman et al. 2023, small-scale proxies for large-scale instabilities)")
_WARMUP = ("a longer learning-rate warm-up",
           "warm-up keeps the steps small while Adam's moment estimates rest on few gradients (Liu et al. 2020),"
           " and widens the range of learning rates that train stably (Wortsman et al. 2023)")
_QK_NORM = ("QK-norm: a LayerNorm or RMSNorm on q and k before their product",
            "it bounds the attention logits by construction, and removed this instability in ViT-22B"
            " (Dehghani et al. 2023) and at high learning rates (Wortsman et al. 2023)")
_CLIP = ("gradient clipping, e.g. Trainer(gradient_clip_val=1.0)",
         "it caps the gradients' norm before the optimizer uses them, so one spike can neither take a step far"
         " beyond the usual (SGD) nor swamp the moment estimates (Adam); GPT-3 and PaLM clip at 1.0")
_PROVENANCE = ("find where it began: with provenance=True, GradientMonitor's or GradientAnomalyStopping's AnomalyReport"
               " names the first module, in forward order, whose outputs held a NaN or an Inf, and the parameters"
               " in the order backward made them non-finite",
               "a NaN or an Inf spreads to everything computed from it; provenance checks every step, not only"
               " the logged ones, so it finds the step and the place where it began")

_BACKWARD = ("the gradient reaching this output left its own usual range while the outputs after it, nearer the"
             " loss, kept theirs; the layers before it get their gradient through it: its victims, not named")

#: What usually helps, per problem: (remedy, why it helps or what it rests on).
REMEDIES: dict[str, tuple[tuple[str, str], ...]] = {
    "attention_logits": (_QK_NORM, _LOWER_LR_LOGITS, _WARMUP),
    "entropy_collapse": (_QK_NORM, _LOWER_LR_LOGITS,
                         ("σReparam: spectral normalisation of the attention's linear layers",
                          "Zhai et al. 2023 show it prevents attention entropy collapse"), _WARMUP),
    "output_logits": (("z-loss: add 1e-4 * logsumexp(logits)**2 to the loss",
                       "it keeps log Z near 0; PaLM used it for stability (Chowdhery et al. 2022) and it removes"
                       " output logit divergence (Wortsman et al. 2023)"), _LOWER_LR_LOGITS),
    "massive": (("keep the residual stream in float32, or give attention an explicit sink (a learned bias or"
                 " key)", "massive activations act as attention sinks and are common in trained LLMs"
                 " (Sun et al. 2024); they hurt mostly in low precision"),),
    "data": (("look at the batch of that step: its inputs, labels, padding and loss mask; skip or fix it",
              "every layer moved at once, the first one too (or every gradient at once, as bad labels make"
              " them), so the cause came in with the batch, not from a layer"),),
    "blowup": (("look at this layer first: its weights, its learning rate, what feeds its norm or its residual add",
                "its outputs left their usual range while the layers before it, its inputs, stayed in theirs"),
               _CLIP, _LOWER_LR),
    "collapse": (("look at this layer's weights and its learning rate",
                  "its outputs shrank while the layers before it, its inputs, did not; a layer whose outputs"
                  " collapse cuts the signal of every layer after it and the gradient of every layer before it"),),
    "output_grad_vanishing": (("look at the module right after it in forward order{after}: the gradient reaches"
                               " this output through it, and was cut there (a saturated or dead nonlinearity, a gate"
                               " near 0, a detach, a scale on its backward)", _BACKWARD),),
    "output_grad_exploding": (("look at the module right after it in forward order{after}: the gradient reaches"
                               " this output through it, and grew there (weights grown large, a norm dividing by a"
                               " tiny variance, a scale on its backward)", _BACKWARD), _CLIP),
    "exploding": (_CLIP, _LOWER_LR, _WARMUP),
    "vanishing": (("look at the layers between it and the loss: a dead or saturated layer there cuts its gradient"
                   " off", "its gradient fell against its own history while the other layers' did not"),),
    "dead": (("a lower learning rate{group} or a longer warm-up, or a leaky activation (LeakyReLU, GELU)",
              "the units fired at first and stopped in training (a large step can push a unit's inputs below zero"
              " for every sample); a unit that never fires gets no gradient through its ReLU to bring it back"),),
    "dead_at_init": (("look at the initialisation and the bias of the layer in front: weights or a bias that"
                      " put every pre-activation below zero; re-initialise, or use a leaky activation (LeakyReLU,"
                      " GELU)", "the units gave zeros from the first logged step on, never firing: a lower"
                      " learning rate does not revive a unit dead from the start"),),
    "too_fast": (_LOWER_LR,
                 ("cap this layer's updates against its weights with UpdateTransform's max_ratio",
                  "it bounds each update's norm against the weights' norm after the optimizer made it, for any"
                  " optimizer; clipping the gradient does not under Adam, which divides the gradient's scale away")),
    "too_slow": (("raise the learning rate{group}", "its update ratio fell against its own history while the"
                                                    " other layers' did not"),),
    "nonfinite": (_PROVENANCE, _LOWER_LR),
    "nonfinite_grad": (("drop such steps: GradientAnomalyStopping(action=\"skip\")",
                        "an update from a NaN or an Inf gradient puts NaN into the weights (and Adam's moments) for"
                        " good; clipping cannot mend it, as the norm of a NaN is NaN"), _PROVENANCE, _LOWER_LR),
}

#: What the gradient reaching a module's output did, per problem.
_BACKWARD_WORDS = {"output_grad_vanishing": "vanished", "output_grad_exploding": "exploded"}

#: The figure each problem is judged from.
_FIGURE = {problem: figure for figure, problems in FIGURE_PROBLEMS.items() for problem in problems}


def diagnose(verdicts: Verdicts, top_k: int, groups: Mapping[str, str] = {}) -> str:
    """The verdict (:meth:`Verdicts.summary`), then per layer unhealthy now what is wrong, since when, and what helps.

    Args:
        verdicts: The record of the run's judged figures.
        top_k: The most layers listed per problem, and the most diagnosed.
        groups: Each module's optimizer parameter group (``"param group 0 (lr 0.001)"``), where a
            remedy says to lower (or raise) a learning rate.
    """
    summary = verdicts.summary(top_k)
    now = sorted(((p, layer, e) for (p, layer), e in verdicts.episodes.items() if e.ongoing), key=verdicts.order)
    if not now:
        return summary
    lines = [summary, "Diagnosis:"]
    shown = now[:top_k]
    causes = [(_cause(p, layer, episode, verdicts), p, layer, episode) for p, layer, episode in shown]
    for cause in dict.fromkeys(c for c, _, _, _ in causes):  # causes in order; each one's remedies once
        layers = [(p, layer, episode) for c, p, layer, episode in causes if c == cause]
        lines.extend(f"  {layer}: {_said(p, layer, episode, verdicts)}" for p, layer, episode in layers)
        where = _group([layer for _, layer, _ in layers], groups)
        after = _after(layers[0][1], verdicts)
        lines.extend(f"    - {remedy.format(group=where, after=after)}: {why}" for remedy, why in REMEDIES[cause])
    if len(now) > top_k:
        lines.append(f"  ... and {len(now) - top_k} more (see the verdict above)")
    return "\n".join(lines)


def _cause(problem: str, layer: str, episode: Episode, verdicts: Verdicts) -> str:
    """The key of :data:`REMEDIES`: ``"dead_at_init"`` for units dead since the first logged step, else ``problem``."""
    first = verdicts.first.get((_FIGURE[problem], layer))
    return "dead_at_init" if problem == "dead" and first is not None and episode.first <= first[0] else problem


def _said(problem: str, layer: str, episode: Episode, verdicts: Verdicts) -> str:
    """One problem of one layer: the signal, since when, its worst value, how far from the band, where it started."""
    title = verdicts.bands.titles()[problem].partition(":")[0]
    if problem in _BACKWARD_WORDS:  # the signal's own words: which module's output, and what its gradient did
        title = f"the gradient reaching {layer}'s output {_BACKWARD_WORDS[problem]}"
    if problem == "data":
        return f"{title} at step {episode.first}: {episode.worst:.0f} rows out of their range together"
    first = verdicts.first.get((_FIGURE[problem], layer))
    bound = _bound(problem, verdicts.bands, first[1] if first else None)
    usual = verdicts.judge.usual(_FIGURE[problem], layer)
    if usual is not None and problem not in ("dead", "nonfinite", "nonfinite_grad"):
        return (f"{title} since step {episode.first}, worst {episode.worst:.4g}, x{episode.worst / usual:.3g} its usual"
                f" {usual:.4g}" + (f"; it was {first[1]:.4g} at step {first[0]}" if first else "")
                + _gain_said(problem, layer, verdicts))
    far = ""
    if bound is not None and bound > 0 and math.isfinite(episode.worst):
        if episode.worst >= bound:
            far = f", {episode.worst / bound:.3g}x the bound {bound:.4g}"
        else:
            times = f"{bound / episode.worst:.3g}x " if episode.worst > bound / 1000 else "far "
            far = f", {times}below the bound {bound:.4g}"
    start = f"; it was {first[1]:.4g} at step {first[0]}" if first and first[0] < episode.first else ""
    return f"{title} since step {episode.first}, worst {episode.worst:.4g}{far}{start}"


def _gain_said(problem: str, layer: str, verdicts: Verdicts) -> str:
    """``; judged by its gain ...``: where a module's outputs are judged by their gain, that figure's own numbers."""
    gain = verdicts.judge.gain(layer) if problem in ("blowup", "collapse") else None
    if gain is None:
        return ""
    before, now, usual = gain
    return (f"; judged by its gain (its output std over {before}'s, the quieter figure): {now:.4g} now,"
            f" x{now / usual:.3g} its usual {usual:.4g}")


def _after(layer: str, verdicts: Verdicts) -> str:
    """`` (<module>)``: the next module in forward order whose output gradient is judged (not one inside ``layer``)."""
    depth = verdicts.judge.depth
    later = [row for row in verdicts.judge.tracks.get("output_grad", {})
             if depth.get(row, 0) > depth.get(layer, 0) and not row.startswith(layer + ".")]
    return f" ({min(later, key=lambda row: depth.get(row, 0))})" if later else ""


def _bound(problem: str, bands: Bands, first: float | None) -> float | None:
    """The edge of the healthy band a problem's value crossed, where there is one number."""
    fixed = {"attention_logits": bands.max_attention_logit, "output_logits": bands.max_output_logit,
             "massive": bands.max_massive_ratio, "dead": bands.max_zero_fraction}
    if problem == "entropy_collapse" and first is not None:
        return bands.min_entropy_fraction * first
    return fixed.get(problem)


def _group(layers: Sequence[str], groups: Mapping[str, str]) -> str:
    """`` of param group 0 (lr 0.001), which holds <layers>``, or nothing when no group is known."""
    found = sorted({g for module, g in groups.items() for layer in layers
                    if module == layer or module.startswith(layer + ".") or layer.startswith(module + ".")})
    if not found:
        return ""
    held = " and ".join(layers) if len(layers) < 3 else f"{', '.join(layers[:-1])} and {layers[-1]}"
    return f" of {' and '.join(found)}, which hold{'s' if len(found) == 1 else ''} {held}"


def param_groups(trainer: Any, pl_module: Any) -> dict[str, str]:
    """Each module's optimizer parameter group, as ``"param group 1 (lr 0.003)"``: where a remedy's learning rate is."""
    owner = {id(p): owner_of(name) for name, p in pl_module.named_parameters()}
    found: dict[str, str] = {}
    for optimizer in getattr(trainer, "optimizers", ()):
        for index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                module = owner.get(id(param))
                if module is not None:
                    found.setdefault(module, f"param group {index} (lr {group.get('lr', float('nan')):.3g})")
    return found

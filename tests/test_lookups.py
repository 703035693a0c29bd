"""An embedding's outputs are rows of its own weights: their drift is its weights learning, bounded by its updates.

A healthy BLOOM's or BART's token embedding (initialised at std 0.02, trained by AdamW) grows x2.6-3.7 over a run,
about 1.3% a step at its fastest, and was named ``blowup``. Nothing but its weights moves a lookup's outputs, and a
weight's norm moves at most by its update ratio a step: a drift within twice its update ratio times the steps it
spans is learning; a ramp put on its outputs (4% a step against ratios of 1%) is named as before (docs/verdicts.md).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import ActivationMonitor, GradientMonitor, LayerHealth
from lightning_hooks.callbacks._judged_rows import lookups
from lightning_hooks.output._health_bands import Bands
from lightning_hooks.output._judge import Judge
from lightning_hooks.tensorboard_plugin.verdicts import judge as judge_run
from tests.helpers import events, run_reader, trainer

ORDER = ("emb", "emb_ln", "block.0.fc", "block.1.fc", "block.2.fc", "head")
POINTS = 150  # logged every 2 steps: 300 steps


def embedding_std(point: int) -> float:
    """Flat at 0.02 for 15 points, then 2.6% a point (1.3% a step) for 40, then 0.6% a point: x3.7 in all."""
    fast = min(max(point - 15, 0), 40)
    slow = max(point - 55, 0)
    return 0.02 * math.exp(0.026 * fast + 0.006 * slow)


def embedding_ratio(point: int) -> float:
    """Its weight's update ratio a step (Adam's ``lr / rms(w)``): 1.5% while it grows fastest, falling with it."""
    return 0.015 if 15 <= point < 55 else 0.004


def figures(rng: random.Random, point: int, fault: Optional[Callable[[int], float]] = None,
            ratios: bool = True, weight: str = "emb.weight") -> dict[str, dict[str, float]]:
    """One logged point: the embedding's std (times ``fault(point)``), steady rows after it, every update ratio (the
    embedding's under ``weight``)."""
    level = {"emb": embedding_std(point) * math.exp(rng.gauss(0, 0.01)) * (fault(point) if fault else 1.0)}
    for row in ORDER[1:]:
        level[row] = (1.0 if "ln" in row else 0.5) * math.exp(rng.gauss(0, 0.03))
    out = {"level": level}
    if ratios:
        out["ratio"] = {f"{row}.weight": 0.004 * math.exp(rng.gauss(0, 0.05)) for row in ORDER[1:]}
        out["ratio"][weight] = embedding_ratio(point) * math.exp(rng.gauss(0, 0.05))
    return out


def named(lookup: bool, fault: Optional[Callable[[int], float]] = None, ratios: bool = True, seed: int = 0,
          ratio_every: int = 1, weight: str = "emb.weight") -> list[tuple[int, str]]:
    """The (point, layer) pairs the judge names, told ``emb`` is an embedding or not; the update ratios logged at
    every ``ratio_every``-th point only, the embedding's under ``weight``."""
    rng = random.Random(seed)
    judge = Judge(Bands(), ORDER, {"emb"} if lookup else ())
    found = []
    for point in range(POINTS):
        figs = figures(rng, point, fault, ratios and point % ratio_every == 0, weight)
        found += [(point, f.layer) for f in judge.step(figs, 2 * point).named]
    return found


def test_an_embedding_growing_as_far_as_its_weights_moved_is_learning_not_a_blowup():
    for seed in range(4):
        assert named(lookup=True, seed=seed) == [], seed
        assert named(lookup=True, ratios=False, seed=seed) == [], seed  # no update ratio: a lookup's drift is its own
    # Told nothing about the module, its weight's ratio under another name (a tied weight's), the judge names the
    # healthy embedding's growth (the failure this rule mends); under its own name its ratio's surge against the
    # others' (x3.75) is a weighted module's learning (``_weights_moved``), not named either.
    assert any(layer == "emb" for seed in range(4) for _, layer in named(lookup=False, seed=seed,
                                                                          weight="shared.weight"))
    assert not any(named(lookup=False, seed=seed) for seed in range(4))


def test_a_ramp_on_an_embeddings_outputs_outruns_its_weights_and_is_named_within_a_few_points():
    ramp = lambda point: 1.04 ** (2 * max(0, point - 100))  # noqa: E731  4% a step from step 200
    for seed in range(4):
        found = named(lookup=True, fault=ramp, seed=seed)
        assert found and found[0][1] == "emb" and 100 < found[0][0] <= 110, (seed, found[:3])


def test_a_ramp_is_named_with_its_update_ratios_logged_at_every_other_point_only():
    ramp = lambda point: 1.04 ** (2 * max(0, point - 100))  # noqa: E731
    for seed in range(4):
        found = named(lookup=True, fault=ramp, seed=seed, ratio_every=2)
        assert found and found[0][1] == "emb" and 100 < found[0][0] <= 110, (seed, found[:3])


def test_an_embedding_logged_every_10_steps_is_judged_against_its_ratios_logged_every_step():
    """Activations logged every 10 steps, update ratios every step: the budget spans the steps between its points."""
    for seed in range(4):
        rng, judge, found = random.Random(seed), Judge(Bands(), ORDER, {"emb": "emb.weight"}), []
        for step in range(10 * POINTS):
            figs = figures(rng, step // 10)
            if step % 10:
                figs.pop("level")
            found += [(step, f.layer) for f in judge.step(figs, step).named]
        assert found == [], (seed, found[:3])


def test_an_embeddings_small_step_is_named_at_once_though_its_weights_could_have_moved_as_far():
    """x1.3 at once, with update ratios of 15% a step (a budget far past it): a step is judged as without the rule
    (the first module's step: the batch's, named once it stays, at the next point)."""
    for seed in range(4):
        found: dict[bool, list[tuple[int, str]]] = {}
        for lookup in (True, False):
            rng, judge = random.Random(seed), Judge(Bands(), ORDER, {"emb"} if lookup else ())
            found[lookup] = []
            for point in range(POINTS):
                figs = figures(rng, point, lambda p: (1.3 if p >= 100 else 1.0) * 0.02 / embedding_std(p))  # flat
                figs["ratio"]["emb.weight"] = 0.15
                found[lookup] += [(point, f.layer) for f in judge.step(figs, 2 * point).named]
        assert found[True] and found[True] == found[False] and found[True][0][0] <= 101, (seed, found[True][:3])


def test_the_judges_memory_of_an_embeddings_path_survives_its_state_dict():
    rng, judge = random.Random(0), Judge(Bands(), ORDER, {"emb"})
    for point in range(60):
        judge.step(figures(rng, point), 2 * point)
    again = Judge(Bands(), ORDER, {"emb"})
    again.load_state_dict(json.loads(json.dumps(judge.state_dict())))
    assert list(again.paths["emb"]) == list(judge.paths["emb"]) and len(judge.paths["emb"]) == Bands().window
    assert list(again.ratio_paths["emb"]) == list(judge.ratio_paths["emb"]) and again.points == judge.points == 60


def test_a_tied_embedding_is_judged_by_its_weights_first_name():
    """BART's encoder and decoder embeddings share ``shared``'s weight: its rows are logged under that name."""
    shared = nn.Embedding(8, 4)
    model = nn.ModuleDict({"shared": shared, "enc": nn.Embedding(8, 4), "dec": nn.Embedding(8, 4),
                           "bag": nn.EmbeddingBag(8, 4)})
    model["enc"].weight = model["dec"].weight = shared.weight
    assert lookups(model) == {"shared": "shared.weight", "enc": "shared.weight", "dec": "shared.weight"}


class TinyLM(L.LightningModule):
    """An embedding, a LayerNorm and an MLP predicting the next token; built in ``configure_model`` if ``late``."""

    def __init__(self, late: bool = False) -> None:
        super().__init__()
        self.late = late
        if not late:
            self.configure_model()

    def configure_model(self) -> None:
        if hasattr(self, "emb"):
            return
        self.emb = nn.Embedding(64, 16)
        self.net = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 64))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(self.emb(x)).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("late", [False, True])  # built in ``configure_model``, after the callbacks' ``setup``
def test_activation_monitor_writes_the_embeddings_and_layer_health_and_the_tab_judge_with_them(tmp_path, late):
    torch.manual_seed(0)
    x = torch.randint(0, 64, (64, 8))
    data = DataLoader(TensorDataset(x, (x * 7 + 3) % 64), batch_size=8)
    logger = TensorBoardLogger(tmp_path, name="", version=0)
    health = LayerHealth(max_images=1)
    callbacks = [ActivationMonitor(log_every_n_steps=2), GradientMonitor(log_every_n_steps=2, update_ratio=True),
                 health]
    model = TinyLM(late)
    trainer(tmp_path, callbacks, logger=logger, max_steps=6, log_every_n_steps=2).fit(model, data)
    logger.experiment.flush()
    assert lookups(model) == {"emb": "emb.weight"}
    (written,) = events(logger.log_dir).Tensors("layers/lookups")  # once per fit, with the forward order
    assert json.loads(written.tensor_proto.string_val[0]) == {"emb": "emb.weight"}
    judge = health._verdicts.judge  # logged at steps 0, 1, 3, 5: its std and its weight's update ratio
    assert judge.lookups == {"emb": "emb.weight"} and [at for at, _ in judge.paths["emb"]] == [0, 1, 3, 5]
    assert [at for at, ratio in judge.ratio_paths["emb"] if ratio > 0] == [0, 1, 3, 5]
    reader = run_reader(tmp_path)
    tab = judge_run(reader.figures("version_0"), Bands(), reader.unjudged_ratios("version_0"),
                    reader.forward_order("version_0"), reader.scale_ratios("version_0"), reader.lookups("version_0"))
    tab_path = list(tab.referee.paths["emb"])  # read back from the event file, as float32
    assert tab.referee.lookups == judge.lookups and [at for at, _ in tab_path] == [at for at, _ in judge.paths["emb"]]
    assert all(abs(x - y) < 1e-6 for (_, x), (_, y) in zip(tab_path, judge.paths["emb"]))

"""The blocks of a stack: ActivationMonitor watches what each block hands on (the residual stream)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from lightning_hooks import ActivationMonitor, GradientMonitor, LayerHealth
from lightning_hooks.callbacks._flight_leader import OutputLevels, output_leader
from lightning_hooks.core.selection import select_modules, stack_blocks
from tests.helpers import events, loader, trainer


class Residual(nn.Module):
    """``x + lin(norm(x))``: a pre-norm residual block."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(self.norm(x))


class Stacked(L.LightningModule):
    """Three residual blocks in a ModuleList, a head; the second block's output scaled by ``scale``."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Residual() for _ in range(3))
        self.head = nn.Linear(8, 1)
        self.blocks[1].register_forward_hook(lambda module, args, out: out * scale)  # before any monitor's hook

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_blocks_are_the_repeated_containers_of_a_list_or_sequential() -> None:
    model = Stacked()
    mixed = nn.Sequential(Residual(), nn.Sequential(nn.Linear(8, 8), nn.ReLU()))  # no class repeats: no stack
    lone = nn.ModuleList([Residual()])  # one block: no stack
    leaves = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # repeated, but already taken whole
    empty = nn.Sequential(nn.Sequential(nn.ReLU()), nn.Sequential(nn.ReLU()))  # no parameters: nothing to watch
    experts = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)) for _ in range(4))
    root = nn.ModuleDict({"model": model, "mixed": mixed, "lone": lone, "leaves": leaves, "empty": empty,
                          "experts": experts})  # side by side, each on its tokens: not a stack
    assert stack_blocks(root) == set(map(id, model.blocks))


def test_blocks_behind_a_wrapper_count_by_the_class_they_wrap() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = Stacked()
    model.blocks = nn.ModuleList(checkpoint_wrapper(b) for b in model.blocks)
    names = [n for n, _ in select_modules(model, None, blocks=True)]
    assert [n for n in names if n.startswith("blocks.") and n.count(".") == 1] == ["blocks.0", "blocks.1", "blocks.2"]


def test_only_the_default_selection_of_an_output_monitor_takes_blocks() -> None:
    model = Stacked()
    plain = [n for n, _ in select_modules(model, None)]
    with_blocks = [n for n, _ in select_modules(model, None, blocks=True)]
    assert [n for n in with_blocks if n not in plain] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [n for n, _ in select_modules(model, "blocks.*.lin", blocks=True)] == [f"blocks.{i}.lin" for i in range(3)]
    assert ActivationMonitor()._watches_blocks and not GradientMonitor()._watches_blocks


def test_a_scaled_residual_stream_shows_in_its_blocks_row_only(tmp_path: Any) -> None:
    """The second block's output x50 moves its row x50 and no row inside it; its children's rows come first."""
    stds = {}
    for scale in (1.0, 50.0):
        torch.manual_seed(0)
        health = LayerHealth()
        logger = TensorBoardLogger(str(tmp_path), name=f"s{scale:g}")
        trainer(tmp_path, [ActivationMonitor(log_every_n_steps=1, histogram=False), health], logger=logger,
                max_steps=1).fit(Stacked(scale), loader())
        acc = events(logger.log_dir)
        stds[scale] = {t.split("/")[1]: acc.Scalars(t)[0].value for t in acc.Tags()["scalars"]
                       if t.startswith("activations/") and t.endswith("/std")}
        depth = health._verdicts.judge.depth  # forward order, as the judge ranks culprits: a block after its layers
        assert depth["blocks.1.norm"] < depth["blocks.1.lin"] < depth["blocks.1"] < depth["blocks.2.norm"]
    ratio = {name: stds[50.0][name] / stds[1.0][name] for name in stds[1.0]}
    assert abs(ratio["blocks.1"] - 50) < 1e-3 * 50
    assert all(abs(ratio[n] - 1) < 1e-4 for n in ("blocks.0", "blocks.1.norm", "blocks.1.lin", "blocks.0.lin"))
    assert abs(ratio["blocks.2.norm"] - 1) < 1e-3  # the next block's norm takes the scale out


def test_the_flight_record_crowns_the_layer_inside_a_block_not_the_block() -> None:
    """Rows come as registered (a block before its layers); the record leads with the first out in forward order."""
    outputs = OutputLevels(40)
    for step in range(40):
        grow = 1.1 ** max(0, step - 30)  # the block's last layer ramps from step 31: the block's output with it
        outputs.add(step, {"h.0": 1.0, "h.0.lin": 1.0, "h.1": 1.0 * grow, "h.1.norm": 1.0, "h.1.lin": 0.5 * grow,
                           "head": 1.0 + 0.01 * (step % 2)})
    assert outputs.modules == ("h.0.lin", "h.0", "h.1.norm", "h.1.lin", "h.1", "head")
    leader = output_leader(outputs.modules, outputs.array())
    assert leader is not None and leader.names == ("h.1.lin",)


class TupleResidual(Residual):
    """Returns ``(stream, cache)`` as transformers 4's decoder layers do; the cache 100x the stream's scale."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        out = super().forward(x)
        return out, 100.0 * torch.randn(3, 5)


class TupleStacked(Stacked):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TupleResidual() for _ in range(3))
        self.seen: list[float] = []
        self.blocks[1].register_forward_hook(lambda module, args, out: self.seen.append(float(out[0].std())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)[0]
        return self.head(h)


def test_a_block_returning_a_tuple_is_measured_on_its_stream(tmp_path: Any) -> None:
    """The block's row is its first item's std (the stream), not the cache's beside it."""
    torch.manual_seed(0)
    model, logger = TupleStacked(), TensorBoardLogger(str(tmp_path), name="tuple")
    trainer(tmp_path, [ActivationMonitor(log_every_n_steps=1, histogram=False)], logger=logger,
            max_steps=1).fit(model, loader())
    logged = events(logger.log_dir).Scalars("activations/blocks.1/std")[0].value
    assert abs(logged - model.seen[0]) < 0.02 * model.seen[0]

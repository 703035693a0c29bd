"""A loss spike caught by the gradient norm first, rolled back, and the layer that led named.

A small decoder (2 transformer blocks) learns a synthetic language (a Markov chain over 16
tokens). At step 80 a broken shard arrives: 15 batches of padding (token 0, over and over).
Padding is easy to predict, so the loss goes *down* on it and a loss watcher sees nothing; but
the whole batch pushes the model the same way, so the gradient norm jumps at once. When real
data comes back the damage shows: the loss spikes.

The script trains three times on the same data and prints what happened:

- ``clean``: the broken shard replaced by good data, for reference;
- ``watch``: the broken shard, with ``GradientAnomalyStopping(action="warn", spikes=...)`` and
  Lightning's own ``SpikeDetection`` (which watches the loss only, and raises: this run ends
  there): when each trigger fired, which batches SpikeDetection would skip, and the flight
  record of the loss spike (also written as ``flight-record-step95.csv`` next to the logs);
- ``rollback``: the broken shard, with ``action="rollback"``: the gradient-norm trigger fires at
  the first padding batch, the model goes back to its last snapshot, the rest of the shard is
  passed over, and the run ends with a held-out loss close to the clean run's.

    python examples/spike_flight_recorder.py [log_dir]     # default: runs/spike_flight_recorder
    tensorboard --logdir runs/spike_flight_recorder
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import lightning as L
import torch
from _quiet import quiet_lightning  # Lightning's own noise, silenced by message (see _quiet.py)
from lightning.fabric.utilities.spike import TrainingSpikeException
from lightning.pytorch.callbacks.spike import SpikeDetection
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import GradientAnomalyStopping, SpikeTrigger

VOCAB, LENGTH, WIDTH, BATCH, STEPS = 16, 12, 24, 32, 130
SHARD, SHARD_BATCHES = 80, 15  # the broken shard: batches 80-94
TRIGGER = SpikeTrigger(window=64, warmup=48)  # a short run: half the defaults (128, 64)


def transitions() -> torch.Tensor:
    """A Markov chain: each token has three likely successors; token 0 (padding) mostly repeats."""
    gen = torch.Generator().manual_seed(0)
    chain = torch.full((VOCAB, VOCAB), 1e-3)
    for token in range(1, VOCAB):
        chain[token, torch.randperm(VOCAB - 1, generator=gen)[:3] + 1] = torch.tensor([0.6, 0.3, 0.1])
    chain[0, 0], chain[0, 1:] = 0.5, 0.5 / (VOCAB - 1)
    return chain / chain.sum(1, keepdim=True)


def sequences(n: int, seed: int) -> torch.Tensor:
    gen, chain = torch.Generator().manual_seed(seed), transitions()
    tokens = torch.empty(n, LENGTH + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(1, VOCAB, (n,), generator=gen)
    for t in range(LENGTH):
        tokens[:, t + 1] = torch.multinomial(chain[tokens[:, t]], 1, generator=gen).squeeze(1)
    return tokens


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Decoder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Parameter(torch.randn(LENGTH, WIDTH) * 0.02)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)
        self.register_buffer("mask", torch.triu(torch.ones(LENGTH, LENGTH, dtype=torch.bool), 1))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens[:, :-1]) + self.pos
        for block in self.blocks:
            h = block(h, self.mask)
        logits = self.head(self.ln(h))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch[0])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


def data(broken: bool) -> DataLoader:
    tokens = sequences(STEPS * BATCH, seed=1)
    if broken:
        tokens[SHARD * BATCH : (SHARD + SHARD_BATCHES) * BATCH] = 0
    return DataLoader(TensorDataset(tokens), batch_size=BATCH)


def train(log_dir: str, name: str, broken: bool, callbacks: list) -> tuple[Decoder, Optional[int]]:
    """Train; return the model and the batch at which Lightning's SpikeDetection raised (if it did)."""
    L.seed_everything(0, verbose=False)
    model = Decoder()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=STEPS, logger=TensorBoardLogger(log_dir, name=name), log_every_n_steps=10,
        callbacks=callbacks, enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
    )
    try:
        trainer.fit(model, data(broken))
    except TrainingSpikeException:
        return model, trainer.global_step - 1
    return model, None


def held_out(model: Decoder) -> float:
    with torch.no_grad():
        return model.loss(sequences(1024, seed=2)).item()


def main(log_dir: str = "runs/spike_flight_recorder") -> None:
    quiet_lightning()
    clean, _ = train(log_dir, "clean", broken=False, callbacks=[])
    # act_late=False: each step's flags read before its update, so `last_flags` at a batch's end are its own
    # (and the step at which SpikeDetection raises is read too).
    watcher = GradientAnomalyStopping(action="warn", spikes=TRIGGER, flight_recorder=64, prog_bar=False,
                                      act_late=False)
    seen: dict[str, list[int]] = {}
    watcher_flags = _StepFlags(watcher, seen)
    _, lightning_step = train(log_dir, "watch", broken=True, callbacks=[
        watcher, watcher_flags, SpikeDetection(exclude_batches_path=os.path.join(log_dir, "watch"))])
    stopper = GradientAnomalyStopping(action="rollback", spikes=TRIGGER, rollback_every_n_steps=10,
                                      skip_batches=SHARD_BATCHES, flight_recorder=64, prog_bar=False)
    guarded, _ = train(log_dir, "rollback", broken=True, callbacks=[stopper])
    print(f"\nA broken shard (padding) at steps {SHARD}-{SHARD + SHARD_BATCHES - 1} of {STEPS}:")
    grad_norm, loss = seen.get("grad_norm_spike", [None]), seen.get("loss_spike", [None])
    print(f"  gradient-norm trigger fired at step {grad_norm[0]}, loss trigger at step {loss[0]}"
          f" (steps flagged: gradient norm {grad_norm}, loss {loss})")
    with open(os.path.join(log_dir, "watch", "skip_batches.json")) as f:
        excluded = json.load(f)
    print(f"  Lightning's SpikeDetection (loss only) raised at step {lightning_step}; the batches it says to"
          f" skip: {excluded} (the shard was {SHARD}-{SHARD + SHARD_BATCHES - 1})")
    record = watcher.last_report.flight_record if watcher.last_report else None
    if record is not None:
        print(f"  at the loss spike, the {record.summary()}")
    step, to = stopper.last_rollback or (None, None)
    print(f"  rollback: step {step} went back to the state before step {to}; updates dropped:"
          f" {stopper.dropped_steps}")
    print(f"Held-out loss: clean {held_out(clean):.3f}, rolled back {held_out(guarded):.3f}\n")
    print(f"Where to look:  tensorboard --logdir {log_dir}  (Text tab: anomalies/report, anomalies/flight_record)")


class _StepFlags(L.Callback):
    """Notes the steps at which each of the watcher's flags fired, from its flags of every step.

    ``last_flags``, not ``last_report``: a report is made once per run of anomalous steps, so a
    loss spike inside a run that the gradient norm began would not be in one.
    """

    def __init__(self, watcher: GradientAnomalyStopping, seen: dict[str, list[int]]) -> None:
        self.watcher, self.seen = watcher, seen

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        for flag in self.watcher.last_flags:
            self.seen.setdefault(flag, []).append(trainer.global_step - 1)


if __name__ == "__main__":
    main(*sys.argv[1:])

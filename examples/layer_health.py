"""Layer health at a glance: pictures of every layer over training, and a verdict at the end.

A seven-module MLP with two faults: three quarters of the third Linear's biases are far below
its outputs (the ReLUs after it, net.3, die) and the last Linear learns 1000x too fast (its own
parameter group). ActivationMonitor and GradientMonitor(update_ratio=True) log as usual;
LayerHealth draws, from what they log, each module's outputs over the steps and depth profiles
(std, zero fraction, gradient norm and update ratio per layer) to TensorBoard, and at the end
prints its verdict (once): the layers outside the healthy bands, since which step. The script
then lists the pictures written.

LayerHealth draws with matplotlib, an optional extra (the Quick start's ``pip install -e .``
leaves it out): ``pip install -e '.[health]'`` first; without it the script says so and stops.

    python examples/layer_health.py [log_dir]          # default: runs/layer_health
    tensorboard --logdir runs/layer_health
"""

from __future__ import annotations

import importlib.util
import sys

import lightning as L
import torch
from _quiet import quiet_lightning  # Lightning's own noise, silenced by message (see _quiet.py)
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import ActivationMonitor, GradientMonitor, LayerHealth


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
            nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1),
        )
        with torch.no_grad():
            self.net[2].bias[:48] = -10.0  # fault 1: 48 of net.3's 64 ReLUs never fire

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        last = list(self.net[6].parameters())
        rest = [p for p in self.parameters() if all(p is not q for q in last)]
        return torch.optim.SGD([{"params": rest}, {"params": last, "lr": 1.0}], lr=1e-3)  # fault 2: lr 1000x


def data(n: int = 1024) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=gen)
    return DataLoader(TensorDataset(x, x[:, :4].sum(1, keepdim=True)), batch_size=32, shuffle=True, generator=gen)


def main(log_dir: str = "runs/layer_health") -> None:
    if importlib.util.find_spec("matplotlib") is None:
        sys.exit("examples/layer_health.py: LayerHealth draws its pictures with matplotlib, an optional extra the"
                 " Quick start leaves out. Install it with:  pip install -e '.[health]'  (from the repository root),"
                 " then run this again.")
    quiet_lightning()
    L.seed_everything(0, verbose=False)
    logger = TensorBoardLogger(log_dir, name="")
    health = LayerHealth(image_every_n_steps=20, max_images=4)
    callbacks = [ActivationMonitor(log_every_n_steps=5, modules=[nn.Linear, nn.ReLU]),
                 GradientMonitor(log_every_n_steps=5, granularity="module", update_ratio=True), health]
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=2, logger=logger, callbacks=callbacks, log_every_n_steps=5,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
    )
    trainer.fit(MLP(), data())
    logger.experiment.flush()

    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    events.Reload()
    print(f"\n(The verdict above is LayerHealth's, printed once at the end of fit.) Pictures in {logger.log_dir}:")
    for tag in events.Tags()["images"]:
        images = events.Images(tag)
        print(f"  {tag:36} {len(images)} images of {images[0].width}x{images[0].height} px,"
              f" at steps {[e.step for e in images]}")
    print(f"\nWhere to look:  tensorboard --logdir {log_dir}  (Images, or Time Series, under 'health')")
    print("  health/activation_histograms/net.3: about 90% of its outputs exactly 0 from step 0, the strip")
    print("  red (dead units); net.1, a healthy ReLU, has half. net.5 dies later, after net.6's oversized")
    print("  updates; net.6's output jumps between about -20 and +10 (its learning rate is far too high).")
    print("  health/depth_profile/*: zero fraction above the dashed line at net.3 and net.5; update ratio")
    print("  ~1 at net.6, far above the green healthy band. Text tab, health/summary: the verdict.")


if __name__ == "__main__":
    main(*sys.argv[1:])

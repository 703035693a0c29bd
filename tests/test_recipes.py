"""The recipes users run, against figures computed independently: packed RNNs, library activations."""

import copy
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from lightning_hooks import STAT_NAMES, ActivationMonitor
from tests.helpers import csv_metrics, trainer

LENGTHS = torch.tensor([7, 5, 5, 4, 3, 3, 2, 1])  # 8 sequences of at most 7 steps, padded


class PackedRNN(L.LightningModule):
    """An LSTM or GRU fed ``pack_padded_sequence``; the loss reads the last hidden state."""

    def __init__(self, cell: type[nn.RNNBase]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = cell(6, 12, batch_first=True)
        self.head = nn.Linear(12, 1)

    def forward(self, x: torch.Tensor) -> Any:
        return self.rnn(pack_padded_sequence(x, LENGTHS, batch_first=True, enforce_sorted=False))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        _, hidden = self(x)
        last = hidden[0] if isinstance(hidden, tuple) else hidden
        return nn.functional.mse_loss(self.head(last[-1]), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def sequences() -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 7, 6, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum((1, 2))[:, None]), batch_size=8)


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_a_packed_rnn_is_summarised_over_its_data_and_hidden_states_only(tmp_path, cell):
    model = PackedRNN(cell)
    initial = copy.deepcopy(model)
    monitor = ActivationMonitor(modules="rnn", stats=STAT_NAMES, log_every_n_steps=1)
    trainer(tmp_path, [monitor], logger=CSVLogger(tmp_path), max_steps=1).fit(model, sequences())
    row = csv_metrics(str(tmp_path))[0]

    x, _ = next(iter(sequences()))
    with torch.no_grad():
        packed, hidden = initial(x)
    states = hidden if isinstance(hidden, tuple) else (hidden,)
    values = torch.cat([packed.data.flatten(), *(h.flatten() for h in states)]).double()
    assert packed.data.shape == (int(LENGTHS.sum()), 12)  # no padding in the data
    expected = {"count": values.numel(), "calls": 1, "abs_max": values.abs().max(), "mean": values.mean(),
                "std": values.std(), "min": values.min(), "max": values.max()}
    for stat, value in expected.items():
        assert float(row[f"activations/rnn/{stat}"]) == pytest.approx(float(value), rel=1e-5, abs=1e-6), stat
    assert float(row["activations/rnn/abs_max"]) < 2  # never a batch size (8) or a sort index

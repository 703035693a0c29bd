"""TransformerStability through a fit: every way out drops its rows; it logs the steps watch_after asks for."""

from typing import Any

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from lightning_hooks import GradientAnomalyError, GradientAnomalyStopping, LayerHealth, TransformerStability
from tests.helpers import TinyNet, events, forward_hook_count, loader, trainer
from tests.test_diagnosis import NanAt2
from tests.test_stability import Decoder, SdpaAttention, token_loader


class RaisesAt1(Decoder):
    """Raises in step 1's training_step, after its forward: the step's rows are read, not yet logged."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 1:
            raise RuntimeError("boom at step 1")
        return loss


def test_a_fit_that_raises_leaves_no_rows_held_and_no_hooks(tmp_path):
    stability = TransformerStability(log_every_n_steps=1)
    model = RaisesAt1(SdpaAttention)
    with pytest.raises(RuntimeError, match="boom at step 1"):
        trainer(tmp_path, [stability], logger=False, max_steps=4).fit(model, token_loader())
    assert stability._rows == [] and stability._pending_step is None and not stability._collecting
    assert forward_hook_count(model) == 0
    assert stability.verdicts.last_step == 0  # step 0 was logged and judged; step 1's rows were dropped


def test_after_an_anomaly_it_logs_every_step_for_watch_after_steps(tmp_path):
    stopper = GradientAnomalyStopping(action="skip", watch_after=3, prog_bar=False)
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    trainer(tmp_path, [stopper, TransformerStability(log_every_n_steps=50)], logger=logger, max_steps=8).fit(
        NanAt2(SdpaAttention), token_loader(32))
    logger.experiment.flush()
    steps = {e.step for e in events(str(tmp_path / "tb")).Scalars("activations/h.0.attn/attention_entropy")}
    assert stopper.last_report.step == 2
    assert steps == {0, 3, 4, 5}  # step 0, then the 3 after the one acted on


@pytest.mark.filterwarnings("ignore:LayerHealth. no TensorBoardLogger")
def test_the_report_mid_fit_names_the_param_group_and_comes_from_the_first_callback_that_diagnoses(tmp_path):
    health = LayerHealth()
    stability = TransformerStability(log_every_n_steps=1, max_attention_logit=0.01)
    stopper = GradientAnomalyStopping(action="raise")
    with pytest.raises(GradientAnomalyError) as info:
        trainer(tmp_path, [health, stability, stopper], logger=False, max_steps=5).fit(NanAt2(SdpaAttention),
                                                                                        token_loader())
    diagnosis = info.value.report.diagnosis
    assert diagnosis == health.diagnosis() == health.summary()  # LayerHealth comes first in `callbacks`
    assert "lower the learning rate of param group 0 (lr 0.001), which holds h.0.attn and h.1.attn: " in diagnosis


class _CallsItsNet(TinyNet):
    """An MLP whose training_step calls its submodule, never the model itself: its own output is never made."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)


def test_on_a_model_without_attention_it_says_so_before_training_and_what_it_still_reads(tmp_path):
    with pytest.warns(UserWarning, match=r"no attention module in the model .* reads only the output logits of"
                                         r" \['output'\]") as caught:
        trainer(tmp_path, [TransformerStability(log_every_n_steps=1)], max_steps=2).fit(TinyNet(), loader())
    assert not [w for w in caught if "read nothing" in str(w.message)]  # self(x): the output is read
    assert "activations/output/logit_abs_max" in events(str(tmp_path)).Tags()["scalars"]


def test_targets_that_are_never_called_are_named_at_the_first_logged_step(tmp_path):
    with pytest.warns(UserWarning, match=r"read nothing at the first logged step \(0\): none of \['output'\] was"
                                         r" called in the training step"):
        trainer(tmp_path, [TransformerStability(log_every_n_steps=1)], max_steps=2).fit(_CallsItsNet(), loader())

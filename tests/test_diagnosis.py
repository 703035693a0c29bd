"""The diagnosis in plain words: which layer, which signal, since when, how far, what helps; "healthy" otherwise."""

import logging
import random
from typing import Any

import pytest
import torch

from lightning_hooks import GradientAnomalyError, GradientAnomalyStopping, LayerHealth, TransformerStability
from lightning_hooks.output._diagnosis import REMEDIES, diagnose
from lightning_hooks.output._health_verdicts import PROBLEMS, Bands, Verdicts
from lightning_hooks.output._judge import Judge
from lightning_hooks.tensorboard_plugin.run_data import Figure
from lightning_hooks.tensorboard_plugin.verdicts import bands_from_query, judge
from tests.helpers import events, trainer
from tests.test_stability import Decoder, SdpaAttention, token_loader


def growing_logits() -> Verdicts:
    """h.1.attn's max attention logit 2, 4, ... then 40, 80 from step 20; h.0.attn stays at 2; entropy collapses."""
    verdicts = Verdicts(Bands())
    for step, (logit, entropy) in enumerate([(2.0, 2.5), (4.0, 2.0), (40.0, 0.5), (80.0, 0.2)]):
        verdicts.add("attention_max_logit", step * 10, {"h.0.attn": 2.0, "h.1.attn": logit})
        verdicts.add("attention_entropy", step * 10, {"h.0.attn": 2.5, "h.1.attn": entropy})
    return verdicts


def test_every_problem_has_remedies_and_a_healthy_run_is_called_healthy():
    assert set(REMEDIES) == {*PROBLEMS, "dead_at_init"}
    verdicts = Verdicts(Bands())
    verdicts.add("attention_max_logit", 0, {"h.0.attn": 3.0})
    assert diagnose(verdicts, top_k=5) == ("Layer health at step 0: healthy (no layer out of its usual range;"
                                           " see docs/verdicts.md).")


def test_the_diagnosis_names_layer_signal_since_when_how_far_and_what_helps_with_the_evidence():
    text = diagnose(growing_logits(), top_k=5, groups={"h.1.attn.qkv": "param group 1 (lr 0.1)"})
    lines = text.splitlines()
    assert lines[:6] == ["Layer health at step 30: 1 layer unhealthy now",
                         "  attention logit growth: max attention logit above 30",
                         "    h.1.attn                 worst 80         since step 20",
                         "  attention entropy collapse: entropy below 0.1x its first logged value",
                         "    h.1.attn                 worst 0.2        since step 30",
                         "Diagnosis:"]
    assert lines[6] == ("  h.1.attn: attention logit growth since step 20, worst 80, 2.67x the bound 30;"
                        " it was 2 at step 0")
    assert lines[7].startswith("    - QK-norm: a LayerNorm or RMSNorm on q and k") and "Dehghani" in lines[7]
    assert lines[8].startswith("    - lower the learning rate of param group 1 (lr 0.1), which holds h.1.attn: ")
    collapse = next(line for line in lines if line.startswith("  h.1.attn: attention entropy collapse"))
    assert collapse == ("  h.1.attn: attention entropy collapse since step 30, worst 0.2, 1.25x below the bound 0.25;"
                        " it was 2.5 at step 0")
    assert "h.0.attn:" not in text


def test_units_dead_from_the_start_point_at_the_init_and_units_that_died_later_at_the_learning_rate():
    born, died = Verdicts(Bands()), Verdicts(Bands())  # one run each: a layer behind a dead one is its victim
    for step, later in enumerate([0.1, 0.2, 0.995, 1.0]):
        born.add("zero_fraction", step * 10, {"net.1": 1.0, "net.3": 0.1})
        died.add("zero_fraction", step * 10, {"net.1": 0.1, "net.3": later})
    lines = diagnose(born, top_k=5).splitlines()
    at = lines.index("  net.1: dead units since step 0, worst 1, 1.25x the bound 0.8")
    assert lines[at + 1].startswith("    - look at the initialisation and the bias")
    assert "a lower learning rate does not revive" in lines[at + 1]
    lines = diagnose(died, top_k=5, groups={"net.3": "param group 0 (lr 0.5)"}).splitlines()
    at = lines.index("  net.3: dead units since step 20, worst 1, 1.25x the bound 0.8; it was 0.1 at step 0")
    assert lines[at + 1].startswith("    - a lower learning rate of param group 0 (lr 0.5), which holds net.3")


def test_most_outputs_zero_is_dead_units_where_it_stays_so_and_nearly_all_at_once():
    """A small batch's ReLU sparsity crosses the bound for one logged point now and then (the sweep's 256-wide MLP at
    batch 2: 0.65-0.81): not dead. Above the bound for 3 logged points in a row it is, named at the third (and the
    episode goes on while it stays); 99% zeros are dead at once."""
    record = Verdicts(Bands())
    values = [0.7, 0.82, 0.7, 0.81, 0.75, 0.85, 0.9, 0.95, 0.93, 0.5, 0.7]
    for step, value in enumerate(values):
        record.add("zero_fraction", step * 10, {"net.1": value, "net.3": 0.995 if step >= 4 else 0.5})
    assert record.episodes[("dead", "net.1")].first == 70
    assert record.episodes[("dead", "net.3")].first == 40


def test_a_relus_sparsity_creeping_past_the_bound_as_it_learns_is_not_dead_units_and_units_dying_then_are():
    """A healthy 1024-wide MLP's ReLU (``unseen27``): 0.5 of its outputs zero at the start, 0.8 by step 250, then
    0.77-0.83 batch to batch, over the bound for several points in a row. Its live outputs fell from 0.5 to 0.2 over
    250 points, never to half of the most they were over the last 24: not dead. The same ReLU whose live share then
    falls from 0.2 to 0.08 over 4 points (units dying at a learning rate too high) is dead at the third point above
    the bound after that, and stays named to the end while it stays there (the fall long out of the 24 points)."""
    rng = random.Random(0)
    learning = [0.5 + 0.3 * min(1.0, step / 250) + rng.uniform(-0.03, 0.03) for step in range(400)]
    assert dead_episode(range(400), learning) is None
    dying = [0.8 + 0.12 * min(1.0, (step - 300) / 4) if step >= 300 else z for step, z in enumerate(learning)]
    episode = dead_episode(range(400), dying)
    assert episode is not None and 302 <= episode.first <= 304 and episode.ongoing and episode.last == 399


def dead_episode(steps: range, zeros: list[float]) -> Any:
    """The ``dead`` episode (or None) of one module whose zero fraction at each of ``steps`` is ``zeros``'s."""
    record = Verdicts(Bands())
    for step, value in zip(steps, zeros):
        record.add("zero_fraction", step, {"net.1": value})
    record.flush()
    return record.episodes.get(("dead", "net.1"))


@pytest.mark.parametrize("every", [2, 5])
def test_units_dying_are_judged_over_steps_not_logged_points(every: int):
    """A plain CNN's last ReLU at twice its LR (``unseen28``): 0.5 of its outputs zero until step 40, 0.81 by step 100,
    then flat; its live share halved within 48 steps (24 points logged every 2), never within 24: a learning phase,
    not named, logged every 2 or every 5. Units dying within 10 steps after that are dead, logged either way."""
    rng, steps = random.Random(every), range(0, 400, every)
    learning = [0.5 + 0.31 * min(1.0, max(0.0, step - 40) / 60) + rng.uniform(-0.005, 0.005) for step in steps]
    assert dead_episode(steps, learning) is None
    dying = [0.81 + 0.13 * min(1.0, (step - 300) / 10) if step >= 300 else z for step, z in zip(steps, learning)]
    episode = dead_episode(steps, dying)
    assert episode is not None and 300 < episode.first <= 300 + 4 * every and episode.ongoing, episode


def test_a_module_not_called_at_a_step_keeps_its_run_and_a_resumed_fits_first_point_is_not_its_first():
    """An expert logged at every other step only (not called between) keeps its count of points above the bound:
    dead at its third. A fit resumed at step 5000 (LayerHealth starts afresh) does not take its first point above
    the bound for units dead from the initialisation."""
    judge, named = Judge(Bands()), []
    for step in range(12):
        rows = {"moe.1": 0.5} if step % 2 else {"moe.1": 0.5, "moe.3": 0.5 if step == 0 else 0.9}
        named += [(step * 10, f.row) for f in judge.step({"zero_fraction": rows}, step * 10).named]
    assert named[0] == (60, "moe.3"), named
    resumed = Verdicts(Bands())
    for step, value in zip((5000, 5010, 5020), (0.81, 0.7, 0.72)):
        resumed.add("zero_fraction", step, {"net.1": value})
    assert ("dead", "net.1") not in resumed.episodes


def test_the_record_survives_a_checkpoint_and_the_episode_goes_on():
    before = growing_logits()
    after = Verdicts(Bands())
    after.load_state_dict(before.state_dict())
    for record in (before, after):
        record.add("attention_entropy", 40, {"h.0.attn": 2.5, "h.1.attn": 0.2})
    assert diagnose(after, top_k=5) == diagnose(before, top_k=5)
    assert after.episodes[("entropy_collapse", "h.1.attn")].first == 30


def test_the_layers_tab_marks_the_cells_layer_health_judges():
    figure = Figure("activations/attention_max_logit", "", "activations", "attention_max_logit",
                    ["h.0.attn", "h.1.attn"], [0, 10, 20], [[2.0, 2.0, 2.0], [2.0, 31.0, 80.0]])
    assert judge([figure], Bands()).figures == [(figure, [(1, 1, "attention_logits"), (1, 2, "attention_logits")])]
    assert judge([figure], bands_from_query({"max_attention_logit": "50"})).figures == [
        (figure, [(1, 2, "attention_logits")])]


def test_layer_health_takes_the_bands_of_transformer_stability_and_prints_the_diagnosis_once(tmp_path, caplog):
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    health = LayerHealth()
    callbacks = [TransformerStability(log_every_n_steps=1, max_attention_logit=0.01), health]
    with caplog.at_level(logging.INFO):
        trainer(tmp_path, callbacks, logger=logger, max_steps=3).fit(Decoder(SdpaAttention), token_loader())
    logger.experiment.flush()
    summary = health.summary()
    assert "attention logit growth: max attention logit above 0.01\n    h.0.attn " in summary
    assert "  h.0.attn: attention logit growth since step 0" in summary and "QK-norm" in summary
    assert caplog.text.count("Layer health at step") == 1
    acc = events(str(tmp_path / "tb"))
    for tag in ("health/summary/text_summary", "stability/diagnosis/text_summary"):
        (text,) = acc.Tensors(tag)
        assert "h.0.attn: attention logit growth since step 0" in text.tensor_proto.string_val[0].decode()


class NanAt2(Decoder):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step == 2 else loss


def test_the_anomaly_report_carries_the_diagnosis_so_far(tmp_path):
    stopper = GradientAnomalyStopping(action="raise", act_late=False)  # raised at step 2, before its figures
    stability = TransformerStability(log_every_n_steps=1, max_attention_logit=0.01)
    with pytest.raises(GradientAnomalyError) as info:
        trainer(tmp_path, [stability, stopper], logger=False, max_steps=5).fit(NanAt2(SdpaAttention),
                                                                                token_loader())
    report = info.value.report
    assert report.diagnosis is not None and report.diagnosis.startswith("Layer health at step 1: ")
    assert "  h.0.attn: attention logit growth since step 0" in report.diagnosis
    assert "    - lower the learning rate of param group 0 (lr 0.001), which holds h.0.attn and h.1.attn: " in (
        report.diagnosis)
    assert "\n  diagnosis so far:\n    Layer health at step 1: " in str(report)


def test_transformer_stability_keeps_its_verdicts_in_its_state_dict(tmp_path):
    stability = TransformerStability(log_every_n_steps=1, max_attention_logit=0.01)
    trainer(tmp_path, [stability], logger=False, max_steps=2).fit(Decoder(SdpaAttention), token_loader())
    resumed = TransformerStability(log_every_n_steps=1, max_attention_logit=0.01)
    resumed.load_state_dict(stability.state_dict())
    assert resumed.diagnosis() == stability.diagnosis() and "h.0.attn: attention logit growth" in resumed.diagnosis()

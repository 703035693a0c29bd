"""TransformerStability: figures checked against softmax(q·kᵀ/√d) materialised here, read back from TensorBoard."""

import copy
import math
from collections import Counter
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import TransformerStability
from lightning_hooks.measure._attention import Sample, attention_row, logit_row, massive_row
from lightning_hooks.tensorboard_plugin.run_data import TAG
from tests.helpers import events, forward_hook_count, host_transfers, trainer

VOCAB, CONTEXT, WIDTH, HEADS = 32, 12, 16, 4
ALL = dict(sample_sequences=64, sample_heads=64, sample_queries=64)  # read every row: exact comparisons


def entropy_and_max(probs: torch.Tensor, logits: torch.Tensor, allowed: torch.Tensor) -> tuple[float, float]:
    """Mean entropy of the rows that may see two keys or more, and the max allowed logit, computed plainly."""
    ent = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
    rows = allowed.sum(-1) >= 2
    return ent[rows.expand_as(ent)].mean().item(), logits.masked_fill(~allowed, -math.inf).max().item()


def test_attention_row_matches_the_materialised_softmax_with_masks_and_grouped_queries():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 6, 8, generator=gen) * 3, torch.randn(2, 2, 7, 8, generator=gen) * 3
    allowed = torch.rand(2, 1, 6, 7, generator=gen) > 0.3
    kk = k.repeat_interleave(2, dim=1)  # grouped queries: heads 0, 1 read kv head 0
    logits = q @ kk.transpose(-1, -2) / math.sqrt(8)
    causal = torch.ones(6, 7, dtype=torch.bool).tril()
    ok = allowed & causal
    probs = logits.masked_fill(~ok, -math.inf).softmax(-1).nan_to_num(0.0)
    entropy, peak = entropy_and_max(probs, logits, ok)
    row = attention_row(q, k, causal=True, allowed=allowed, sample=Sample(9, 9, 9))
    assert row[0].item() == pytest.approx(peak, rel=1e-5)
    assert (row[1] / row[2]).item() == pytest.approx(entropy, rel=1e-5)


def test_a_sample_reads_evenly_spread_rows_and_the_max_logit_ignores_an_additive_mask():
    q, k = torch.randn(1, 8, 16, 4), torch.randn(1, 8, 16, 4)
    bias = torch.zeros(16, 16).masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), -math.inf)
    assert attention_row(q, k, bias=bias, sample=Sample(1, 2, 3))[2].item() == 2 * 2  # 2 heads x 2 queries of 3
    # (the first query sees one key only: no entropy to speak of, left out)
    exact = attention_row(q, k, causal=True, sample=Sample(1, 8, 16))
    assert attention_row(q, k, bias=bias, sample=Sample(1, 8, 16)).tolist() == pytest.approx(exact.tolist())


def test_logit_and_massive_rows_match_a_plain_computation():
    x = torch.randn(3, 5, 11)
    x[1, 2, 3] = 500.0
    peak, lse, rows = logit_row(x).tolist()
    assert (peak, lse / rows) == pytest.approx((500.0, torch.logsumexp(x, -1).mean().item()), rel=1e-5)
    ratio, kurtosis, _ = massive_row(x).tolist()
    centred = x - x.mean()
    assert ratio == pytest.approx(500.0 / x.abs().median().item(), rel=1e-5)
    assert kurtosis == pytest.approx((centred**4).mean().item() / (centred**2).mean().item() ** 2, rel=1e-4)


class SdpaAttention(nn.Module):
    """Hand-written causal self-attention through F.scaled_dot_product_attention."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def qk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(z.unflatten(-1, (HEADS, WIDTH // HEADS)).transpose(1, 2) for z in self.qkv(x).split(WIDTH, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qk(x)
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


class MhaAttention(nn.Module):  # the nn.MultiheadAttention inside is selected, not this wrapper
    """nn.MultiheadAttention (sequence first) with a boolean causal mask: True where not allowed."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(WIDTH, HEADS)
        self.register_buffer("mask", torch.ones(CONTEXT, CONTEXT, dtype=torch.bool).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq_first = x.transpose(0, 1)
        return self.mha(seq_first, seq_first, seq_first, attn_mask=self.mask, need_weights=False)[0].transpose(0, 1)


class Block(nn.Module):
    def __init__(self, attention: type[nn.Module]) -> None:
        super().__init__()
        self.ln, self.attn = nn.LayerNorm(WIDTH), attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.ln(x))


class Decoder(L.LightningModule):
    def __init__(self, attention: type[nn.Module], lr: float = 1e-3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.h = nn.ModuleList(Block(attention) for _ in range(2))
        self.lm_head = nn.Linear(WIDTH, VOCAB)
        self.lr = lr

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        for block in self.h:
            x = block(x)
        return self.lm_head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        return F.cross_entropy(self(ids).flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def token_loader(n: int = 16) -> DataLoader:
    ids = torch.randint(0, VOCAB, (n, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=4)


def fit(tmp_path: Any, model: L.LightningModule, stability: TransformerStability, steps: int = 3) -> Any:
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    trainer(tmp_path, [stability], logger=logger, max_steps=steps, log_every_n_steps=2).fit(model, token_loader())
    logger.experiment.flush()
    return events(str(tmp_path / "tb"))


def first_step(acc: Any, tag: str) -> float:
    return next(e.value for e in acc.Scalars(tag) if e.step == 0)


def expected_attention(attn: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """Entropy and max logit of an attention module on input ``x``, from probabilities materialised here."""
    causal = torch.ones(CONTEXT, CONTEXT, dtype=torch.bool).tril()
    if isinstance(attn, MhaAttention):  # its own probabilities, per head
        seq_first = x.transpose(0, 1)
        _, probs = attn.mha(seq_first, seq_first, seq_first, attn_mask=attn.mask, average_attn_weights=False)
        w_q, w_k, _ = attn.mha.in_proj_weight.chunk(3)
        b_q, b_k, _ = attn.mha.in_proj_bias.chunk(3)
        q = (x @ w_q.T + b_q).unflatten(-1, (HEADS, -1)).transpose(1, 2)
        k = (x @ w_k.T + b_k).unflatten(-1, (HEADS, -1)).transpose(1, 2)
        logits = q @ k.transpose(-1, -2) / math.sqrt(WIDTH // HEADS)
    else:
        q, k, _ = attn.qk(x)
        logits = q @ k.transpose(-1, -2) / math.sqrt(WIDTH // HEADS)
        probs = logits.masked_fill(~causal, -math.inf).softmax(-1)
    return entropy_and_max(probs, logits, causal)


@pytest.mark.parametrize("attention", [SdpaAttention, MhaAttention])
def test_logged_attention_logits_and_entropy_match_the_softmax_materialised_here(tmp_path, attention):
    model = Decoder(attention)
    before = copy.deepcopy(model)
    acc = fit(tmp_path, model, TransformerStability(**ALL))
    ids = next(iter(token_loader()))[0]
    x = before.wte(ids)
    attn = "attn.mha" if attention is MhaAttention else "attn"
    with torch.no_grad():
        for i, block in enumerate(before.h):
            entropy, peak = expected_attention(block.attn, block.ln(x))
            assert first_step(acc, f"activations/h.{i}.{attn}/attention_entropy") == pytest.approx(entropy, rel=1e-4)
            assert first_step(acc, f"activations/h.{i}.{attn}/attention_max_logit") == pytest.approx(peak, rel=1e-4)
            x = block(x)
            ratio = x.abs().max() / x.abs().median()
            assert first_step(acc, f"activations/h.{i}/massive_ratio") == pytest.approx(ratio.item(), rel=1e-5)
        logits = before.lm_head(x)
    assert first_step(acc, "activations/lm_head/logit_abs_max") == pytest.approx(logits.abs().max().item(), rel=1e-5)
    assert first_step(acc, "activations/lm_head/logit_lse") == pytest.approx(
        torch.logsumexp(logits, -1).mean().item(), rel=1e-5)
    # The steps logged are Lightning's: 0, then 1 for log_every_n_steps=2.
    assert sorted({e.step for e in acc.Scalars(f"activations/h.0.{attn}/attention_entropy")}) == [0, 1]
    assert all(TAG.match(tag) for tag in acc.Tags()["scalars"] if tag.startswith("activations/"))


class Gpt2(L.LightningModule):
    """A tiny GPT-2 built from its config (no download)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        config = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=WIDTH, n_layer=2, n_head=HEADS,
                            attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.gpt = GPT2LMHeadModel(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        return F.cross_entropy(self.gpt(ids).logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_a_hugging_face_gpt2_is_found_and_read_as_its_own_attention_probabilities_say(tmp_path):
    pytest.importorskip("transformers")
    model = Gpt2()
    before = copy.deepcopy(model)
    stability = TransformerStability(**ALL)
    acc = fit(tmp_path, model, stability)
    assert stability.module_names == ["gpt.transformer.h.0.attn", "gpt.transformer.h.1.attn", "gpt.lm_head",
                                      "gpt.transformer.h.0", "gpt.transformer.h.1"]
    ids = next(iter(token_loader()))[0]
    with torch.no_grad():
        out = before.gpt(ids, output_attentions=True, output_hidden_states=True)
    causal = torch.ones(CONTEXT, CONTEXT, dtype=torch.bool).tril()
    for i, probs in enumerate(out.attentions):
        entropy, _ = entropy_and_max(probs, probs, causal)
        assert first_step(acc, f"activations/gpt.transformer.h.{i}.attn/attention_entropy") == pytest.approx(
            entropy, rel=1e-4)
    hidden = out.hidden_states[1]  # the output of block 0
    ratio = hidden.abs().max() / hidden.abs().median()
    assert first_step(acc, "activations/gpt.transformer.h.0/massive_ratio") == pytest.approx(ratio.item(), rel=1e-5)
    assert first_step(acc, "activations/gpt.lm_head/logit_abs_max") == pytest.approx(
        out.logits.abs().max().item(), rel=1e-5)


def test_one_host_transfer_per_logged_step_and_no_work_on_other_steps(tmp_path, monkeypatch):
    rows: list[int] = []

    def counted(callbacks: list[Any]) -> Counter:
        model = Decoder(SdpaAttention)
        with host_transfers() as calls:
            trainer(tmp_path, callbacks, logger=False, max_steps=6).fit(model, token_loader(24))
        assert forward_hook_count(model) == 0
        return calls

    stability = TransformerStability(log_every_n_steps=3)
    add = stability._add
    monkeypatch.setattr(stability, "_add", lambda index, row: (rows.append(index), add(index, row))[1])
    with_it = counted([stability])
    # Logged steps 0, 2 and 5: one .cpu() each; 5 rows each (2 attention modules, the head, 2 blocks).
    assert with_it - counted([]) == Counter({"cpu": 3}) and len(rows) == 3 * 5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"attention": True}, r"`attention` must be None \(the default\), False \(off\) or a module selection"),
     ({"logits": ""}, r"empty"), ({"sample_heads": 0}, r"`sample_heads` must be a positive int, got 0"),
     ({"max_attention_logit": -1.0}, r"`max_attention_logit` must be a finite number > 0, got -1.0"),
     ({"min_entropy_fraction": 1.5}, r"`min_entropy_fraction` must be a number in \(0, 1\], got 1.5"),
     ({"log_every_n_steps": 0}, r"`log_every_n_steps` must be a positive int or None, got 0")],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TransformerStability(**kwargs)


def test_every_argument_is_keyword_only_and_a_pattern_that_matches_nothing_fails_before_training(
        tmp_path):
    with pytest.raises(TypeError):
        TransformerStability(5)  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"`blocks` pattern 'blocks\.\*' matched no module"):
        trainer(tmp_path, [TransformerStability(blocks="blocks.*")], max_steps=1).fit(Decoder(SdpaAttention),
                                                                                       token_loader())


class FusedAttention(SdpaAttention):
    """Attention computed by hand (no SDPA call): nothing to read it from."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qk(x)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        probs = (q @ k.transpose(-1, -2) / 2).masked_fill(~causal, -math.inf).softmax(-1)
        return self.proj((probs @ v).transpose(1, 2).flatten(2))


def test_an_attention_module_that_calls_no_sdpa_is_named_in_a_warning_once(tmp_path):
    with pytest.warns(UserWarning, match=r"no attention figures from \['h\.0\.attn', 'h\.1\.attn'\]") as found:
        trainer(tmp_path, [TransformerStability(log_every_n_steps=1)], logger=False, max_steps=3).fit(
            Decoder(FusedAttention), token_loader())
    assert sum("no attention figures" in str(w.message) for w in found) == 1


def test_gpt2_read_from_its_sdpa_call_gives_the_figures_of_its_c_attn_output(monkeypatch):
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    from lightning_hooks.callbacks import _stability_hooks

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=WIDTH, n_layer=1, n_head=HEADS,
                        attn_implementation="sdpa")
    model = GPT2LMHeadModel(config).eval()  # no dropout: the two reads see the same forward
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(10)  # logits far from 0, so that a wrong scale or mask shows
    rows = {}
    for kind in ("gpt2", "sdpa"):
        monkeypatch.setattr(_stability_hooks, "kind_of", lambda module, k=kind: k)
        got: list[torch.Tensor] = []
        handles = _stability_hooks.register(0, "attention", "attn", model.transformer.h[0].attn,
                                            lambda i, row, _got=got: _got.append(row), lambda name, hook: hook,
                                            Sample(9, 9, 99))
        with torch.no_grad():
            model(next(iter(token_loader()))[0])
        for handle in handles:
            handle.remove()
        rows[kind] = got[0].tolist()
    assert rows["sdpa"] == pytest.approx(rows["gpt2"], rel=1e-5) and rows["gpt2"][0] > 10

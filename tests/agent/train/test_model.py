"""The GPT and its FP8 conversion."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lossguard.agent.config import ModelConfig, PrecisionConfig
from lossguard.agent.precision import (
    PrecisionError,
    check_fp8_supported,
    convert_to_fp8,
    is_fp8_eligible,
)
from lossguard.agent.train.model import GPT, MLP

CFG = ModelConfig(n_layer=3, n_head=2, n_embd=32, block_size=16)


def test_embeddings_are_tied_and_loss_starts_near_uniform() -> None:
    torch.manual_seed(0)
    model = GPT(CFG, vocab_size=256)
    assert model.lm_head.weight is model.wte.weight
    idx = torch.randint(0, 256, (4, 16))
    logits, loss = model(idx, torch.randint(0, 256, (4, 16)))
    assert logits.shape == (4, 16, 256)
    assert loss is not None and abs(loss.item() - math.log(256)) < 0.1


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(CFG, vocab_size=64).eval()
    idx = torch.randint(0, 64, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 64
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[0, :10], b[0, :10])
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_residual_projections_get_scaled_init() -> None:
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=8, n_head=4, n_embd=256, block_size=16), vocab_size=256)
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    proj = torch.cat([m.c_proj.weight.flatten() for m in mlps])
    fc = torch.cat([m.c_fc.weight.flatten() for m in mlps])
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert fc.std().item() == pytest.approx(0.02, rel=0.05)


def test_parameter_count_convention() -> None:
    model = GPT(CFG, vocab_size=256)
    total = sum(p.numel() for p in model.parameters())
    assert model.num_params(non_embedding=False) == total
    assert model.num_params() == total - CFG.block_size * CFG.n_embd


def test_too_long_sequence_is_refused() -> None:
    with pytest.raises(ValueError, match=r"exceeds model\.block_size 16"):
        GPT(CFG, vocab_size=64)(torch.zeros(1, 17, dtype=torch.long))


def test_fp8_leaves_out_the_head_and_odd_shapes() -> None:
    assert is_fp8_eligible(nn.Linear(32, 64), "blocks.0.mlp.c_fc")
    assert not is_fp8_eligible(nn.Linear(32, 64), "lm_head")
    assert not is_fp8_eligible(nn.Linear(24, 64), "x")
    assert not is_fp8_eligible(nn.Linear(32, 40), "x")
    assert not is_fp8_eligible(nn.LayerNorm(32), "x")


def test_fp8_conversion_uses_torchao_float8linear() -> None:
    from torchao.float8.float8_linear import Float8Linear

    for recipe in ("tensorwise", "rowwise"):
        model = GPT(CFG, vocab_size=256)
        swapped = convert_to_fp8(
            model, PrecisionConfig(dtype="fp8", fp8_recipe=recipe), torch.device("cpu")
        )
        linears = [
            m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"
        ]
        assert swapped == len(linears) == 4 * CFG.n_layer
        assert all(isinstance(m, Float8Linear) for m in linears)
        assert not isinstance(model.lm_head, Float8Linear)
        assert model.lm_head.weight is model.wte.weight


def test_fp8_stops_on_gpus_older_than_ada(monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU here: stand in for an A100's answers to the two device queries.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(PrecisionError, match=r"^precision.dtype: fp8 needs .* 8.9 .*A100.* is 8.0"):
        check_fp8_supported(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_supported(torch.device("cuda"))

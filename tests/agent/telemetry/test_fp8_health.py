"""FP8 health sampling of torchao Float8Linear layers on a tiny GPT (FP8 emulated on CPU)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import pytest
import torch
from torch import nn

from lossguard.agent.config import ModelConfig, PrecisionConfig
from lossguard.agent.precision import convert_to_fp8
from lossguard.agent.telemetry.fp8_health import STATS, TENSORS, Fp8Health
from lossguard.agent.train.model import GPT, Block
from tests.support.host_reads import count_host_reads

CFG = ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=32)
VOCAB = 256
Recipe = Literal["tensorwise", "rowwise"]
BATCH, SEQ = 2, 16  # small: FP8 matmuls are emulated on CPU
LAYER = "blocks.0.attn.c_attn"  # takes blocks.0.ln_1's output as its input


def fp8_gpt(recipe: Recipe) -> GPT:
    torch.manual_seed(0)
    model = GPT(CFG, vocab_size=VOCAB)
    convert_to_fp8(model, PrecisionConfig(dtype="fp8", fp8_recipe=recipe), torch.device("cpu"))
    return model


def step(model: GPT, seed: int) -> None:
    """One forward and backward under CPU bf16 autocast, as an fp8 run does."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx, targets)
    assert loss is not None
    loss.backward()


def sample(health: Fp8Health, model: GPT, seed: int) -> dict:
    health.arm()
    step(model, seed)
    result = health.collect()
    assert result is not None
    return result


def no_hooks(model: nn.Module) -> bool:
    return all(
        not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)
        for m in model.modules()
    )


def edit_ln_1(model: GPT, edit: Callable[[torch.Tensor], torch.Tensor]):
    """Rewrite block 0's ln_1 output, i.e. the input of blocks.0.attn.c_attn."""
    block = model.blocks[0]
    assert isinstance(block, Block)
    return block.ln_1.register_forward_hook(lambda m, a, out: edit(out))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_sampled_step_covers_every_float8_linear(recipe: Recipe) -> None:
    from torchao.float8.float8_linear import Float8Linear

    model = fp8_gpt(recipe)
    health = Fp8Health(model, recipe)
    fp8 = [fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert health.layers == fp8 and len(fp8) == 8
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    grad_dtype = e5m2 if recipe == "tensorwise" else e4m3
    assert {t: f.dtype for t, f in health._formats[LAYER].items()} == {
        "input": e4m3,
        "weight": e4m3,
        "grad_output": grad_dtype,
    }

    result = sample(health, model, seed=1)
    assert no_hooks(model)
    assert set(result["layers"]) == set(fp8)
    for tensors in result["layers"].values():
        assert set(tensors) == set(TENSORS)
        for stats in tensors.values():
            assert set(stats) == set(STATS)
            assert math.isfinite(stats["amax"]) and stats["amax"] > 0
            assert 0.0 <= stats["overflow"] <= 1.0 and 0.0 <= stats["underflow"] <= 1.0
    for tensor in TENSORS:
        worst = result["worst"][tensor]
        for stat in STATS:
            values = [t[tensor][stat] for t in result["layers"].values()]
            assert worst[stat] == max(values)
            assert result["layers"][worst[f"layer_{stat}"]][tensor][stat] == worst[stat]


def test_unarmed_step_has_no_hooks_and_collects_nothing() -> None:
    model = fp8_gpt("tensorwise")
    health = Fp8Health(model, "tensorwise")
    step(model, seed=1)
    assert no_hooks(model)
    assert health.collect() is None
    health.arm()
    assert not no_hooks(model)
    health.disarm()
    assert no_hooks(model) and health.collect() is None


def test_collect_reads_the_host_once(monkeypatch: pytest.MonkeyPatch) -> None:
    model = fp8_gpt("tensorwise")
    health = Fp8Health(model, "tensorwise")
    health.arm()
    step(model, seed=1)
    reads = count_host_reads(monkeypatch)
    assert health.collect() is not None
    assert reads == ["tolist"]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_overflow_flags_a_range_jump_since_the_last_sample(recipe: Recipe) -> None:
    model = fp8_gpt(recipe)
    health = Fp8Health(model, recipe)
    first = sample(health, model, seed=1)
    assert first["worst"]["input"]["overflow"] == 0.0  # no previous scale: only non-finite counts
    normal = sample(health, model, seed=2)
    handle = edit_ln_1(model, lambda out: out * 1000.0)
    jumped = sample(health, model, seed=3)
    handle.remove()

    assert normal["layers"][LAYER]["input"]["overflow"] < 0.01
    assert jumped["layers"][LAYER]["input"]["overflow"] > 0.5
    worst = jumped["worst"]["input"]
    assert worst["overflow"] > 0.5 and worst["layer_overflow"].startswith("blocks.0.attn.")
    assert worst["layer_amax"].startswith("blocks.0.attn.")
    assert jumped["layers"][LAYER]["input"]["amax"] > 100 * normal["layers"][LAYER]["input"]["amax"]
    # the jumped step is now the previous scale: back to normal inputs, nothing saturates
    assert sample(health, model, seed=4)["layers"][LAYER]["input"]["overflow"] == 0.0


def test_non_finite_values_count_as_overflow() -> None:
    model = fp8_gpt("tensorwise")
    health = Fp8Health(model, "tensorwise")

    def poison(out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[0, 0, 0] = math.inf
        return out

    handle = edit_ln_1(model, poison)
    health.arm()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.zeros(1, 8, dtype=torch.long))
    handle.remove()
    result = health.collect()
    assert result is not None
    stats = result["layers"][LAYER]["input"]
    assert stats["amax"] == math.inf and stats["overflow"] == pytest.approx(1 / (8 * 64))


def outlier(out: torch.Tensor) -> torch.Tensor:
    out = out.clone()
    out[0, 0, 0] = 1e6
    return out


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_one_outlier_shrinks_the_dynamic_scale_and_underflow_rises(recipe: Recipe) -> None:
    model = fp8_gpt(recipe)
    health = Fp8Health(model, recipe)
    normal = sample(health, model, seed=1)["layers"][LAYER]["input"]["underflow"]
    handle = edit_ln_1(model, outlier)
    spiked = sample(health, model, seed=2)["layers"][LAYER]["input"]["underflow"]
    handle.remove()

    assert normal < 0.01
    if recipe == "tensorwise":
        assert spiked > 0.5  # one scale for the whole tensor: nearly everything flushes to zero
    else:
        rows = BATCH * SEQ  # per-row scales: only the outlier's row flushes
        assert spiked > normal and spiked == pytest.approx(1 / rows, abs=0.5 / rows)


def test_micro_batches_of_a_sampled_step_accumulate() -> None:
    model = fp8_gpt("tensorwise")
    health = Fp8Health(model, "tensorwise")
    health.arm()
    step(model, seed=1)
    handle = edit_ln_1(model, lambda out: out * 10.0)
    step(model, seed=2)
    handle.remove()
    result = health.collect()
    assert result is not None and no_hooks(model)
    # an unscaled LayerNorm output of width 64 (unit gain) stays below sqrt(63) < 8
    assert result["layers"][LAYER]["input"]["amax"] > 8.0

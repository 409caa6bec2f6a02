"""Optimiser parameter groups, LR schedules and early stopping."""

from __future__ import annotations

import itertools

import pytest
import torch

from lossguard.agent.config import ModelConfig, OptimConfig, TrainConfig
from lossguard.agent.train.model import GPT
from lossguard.agent.train.optim import WarmupSchedule, build_optimizer, build_scheduler
from lossguard.agent.train.trainer import EarlyStopping


def test_no_weight_decay_on_norms_biases_and_embeddings() -> None:
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=8), vocab_size=64)
    opt = build_optimizer(model, TrainConfig(weight_decay=0.1), OptimConfig())
    assert opt.defaults["fused"] is True
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    linear_weights = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
    assert decayed == {n for n, _ in model.named_parameters() if n.endswith(linear_weights)}
    assert {"wte.weight", "wpe.weight", "ln_f.weight", "blocks.0.ln_1.bias"} <= kept
    assert all(n.endswith(".bias") or "ln" in n or n.startswith("w") for n in kept)
    assert len(decayed) + len(kept) == len(list(model.parameters()))


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_schedules_warm_up_linearly_then_decay_to_the_floor(kind: str) -> None:
    s = WarmupSchedule(kind, warmup_steps=10, max_steps=110, min_ratio=0.1)
    assert [s(i) for i in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert s(9) == pytest.approx(1.0) and s(10) == pytest.approx(1.0)
    end = {"cosine": 0.1, "linear": 0.1, "constant": 1.0}[kind]
    middle = {"cosine": 0.55, "linear": 0.55, "constant": 1.0}[kind]
    assert s(60) == pytest.approx(middle)
    assert s(110) == pytest.approx(end) and s(500) == pytest.approx(end)
    values = [s(i) for i in range(10, 111)]
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(values))


def test_scheduler_drives_the_optimizer_lr() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([param], lr=1.0)
    sched = build_scheduler(
        opt, TrainConfig(lr=1.0, warmup_steps=4, max_steps=8, schedule="linear")
    )
    lrs = []
    for _ in range(8):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[-1] == pytest.approx(0.1 + 0.9 * (1 - 3 / 4))


def test_early_stopping_counts_patience_only_after_warmup() -> None:
    stop = EarlyStopping(patience=2, min_delta=0.0, warmup_steps=100)
    assert not stop.should_stop(0, 5.0)
    assert not any(stop.should_stop(s, 6.0) for s in (20, 40, 60, 80, 100))  # warmup: free
    assert not stop.should_stop(120, 6.0)
    assert not stop.should_stop(140, 4.0)  # improvement resets
    assert not stop.should_stop(160, 4.5)
    assert stop.should_stop(180, 4.0)  # equal is not better than the best


def test_weight_ema_averages_without_host_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    from lossguard.agent.train.optim import WeightEma
    from tests.support.host_reads import count_host_reads

    model = torch.nn.Linear(3, 2)
    ema = WeightEma(model, decay=0.5)
    averaged = ema.module
    assert isinstance(averaged, torch.nn.Linear)
    reads = count_host_reads(monkeypatch)
    history = []
    for value in (1.0, 3.0, 5.0):
        with torch.no_grad():
            model.weight.fill_(value)
        ema.update_parameters(model)
        history.append(averaged.weight[0, 0].clone())
    monkeypatch.undo()
    assert reads == []
    assert [float(h) for h in history] == [1.0, 2.0, 3.5]  # copy, then 0.5*ema + 0.5*w
    clone = WeightEma(torch.nn.Linear(3, 2), decay=0.5)
    clone.load_state_dict(ema.state_dict())
    assert clone.updates == 3
    assert torch.equal(next(clone.module.parameters()), averaged.weight)

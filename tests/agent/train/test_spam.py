"""SPAM (agent/train/spam.py) against two references: pytorch-optimizer's port of the authors'
code, and Algorithm 1 written out plainly; its skipped steps change nothing and read nothing
to the host."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from pytorch_optimizer.optimizer import spam as oracle_module

from lossguard.agent.train.spam import SPAM
from tests.support.host_reads import count_host_reads

STEPS = 40
KNOBS: dict[str, Any] = {"reset_every": 12, "warmup": 5, "threshold": 5000.0, "clip_after": 3}
HYPER: dict[str, Any] = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-6}
SPIKES = {7: 1000.0, 20: 3000.0, 33: 500.0}  # step -> gradient scale, on a few entries


def make_params() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(8, 6, generator=generator), torch.randn(6, generator=generator)]


def gradients() -> Iterator[list[torch.Tensor]]:
    """Seeded gradients; at the steps in SPIKES a few entries of each are scaled up."""
    generator = torch.Generator().manual_seed(1)
    for step in range(1, STEPS + 1):
        grads = [torch.randn(8, 6, generator=generator), torch.randn(6, generator=generator)]
        if step in SPIKES:
            grads[0][0, :3] *= SPIKES[step]
            grads[1][:2] *= SPIKES[step]
        yield grads


def groups(params: list[torch.Tensor]) -> list[dict[str, object]]:
    """Decay on the matrix, none on the vector (as the trainer's parameter groups)."""
    return [
        {"params": [params[0]], "weight_decay": 0.1},
        {"params": [params[1]], "weight_decay": 0.0},
    ]


def run(optimizer_for, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each step's update of each parameter."""
    optimizer = optimizer_for(groups(params))
    updates = []
    for grads in gradients():
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
        updates.append([p.detach() - b for p, b in zip(params, before, strict=True)])
    return updates


def ours(params: list[torch.Tensor]) -> tuple[SPAM, list[list[torch.Tensor]]]:
    made: list[SPAM] = []

    def build(param_groups):
        made.append(SPAM(param_groups, **HYPER, **KNOBS))
        return made[0]

    updates = run(build, params)
    return made[0], updates


def leaf_params() -> list[torch.Tensor]:
    return [torch.nn.Parameter(p) for p in make_params()]


class AuthorsCosineDecay(oracle_module.CosineDecay):
    """The warm-up as the authors' code takes it: ``CosineAnnealingLR.step(c)``, the closed
    form at ``c``. pytorch-optimizer 4.1.0 sets ``last_epoch = c`` and then steps, which gives
    the value at ``c + 1``: one step later in the warm-up than the authors."""

    def step(self, current_step: int) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # step(epoch) is deprecated, not gone
            self.cosine_stepper.step(current_step)


def test_updates_match_pytorch_optimizer_across_resets_warmups_and_clipping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(oracle_module, "CosineDecay", AuthorsCosineDecay)

    def oracle(param_groups):
        return oracle_module.SPAM(
            param_groups,
            **HYPER,
            density=1.0,
            warmup_epoch=KNOBS["warmup"],
            threshold=KNOBS["threshold"],
            grad_accu_steps=KNOBS["clip_after"],
            update_proj_gap=KNOBS["reset_every"],
        )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the oracle's SGD-driven scheduler warns
        expected = run(oracle, leaf_params())
    spam, got = ours(leaf_params())
    for step, (mine, theirs) in enumerate(zip(got, expected, strict=True), start=1):
        for a, b in zip(mine, theirs, strict=True):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-9), f"step {step}"
    resets, clipped = spam.metric_totals.tolist()
    assert resets == STEPS // KNOBS["reset_every"] == 3
    assert clipped > 0  # the spikes were clipped; the test compared clipping too


def algorithm_1(params: list[torch.Tensor]) -> tuple[list[list[torch.Tensor]], int]:
    """Algorithm 1 of the paper, one tensor at a time in float64, with the authors' schedule
    (module doc of agent/train/spam.py); returns the updates and the entries clipped."""
    beta1, beta2 = HYPER["betas"]
    lr, eps = HYPER["lr"], HYPER["eps"]
    gap, warmup = int(KNOBS["reset_every"]), int(KNOBS["warmup"])
    theta, after = KNOBS["threshold"], KNOBS["clip_after"]
    decays = [0.1, 0.0]
    m = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    v = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    weights = [p.detach().double() for p in params]
    updates, clipped = [], 0
    for t, grads in enumerate(gradients(), start=1):
        if t % gap == 0:  # momentum reset
            m = [torch.zeros_like(x) for x in m]
            v = [torch.zeros_like(x) for x in v]
        c = t % gap if t >= gap else warmup
        scale = 1 - 0.99 * (1 + math.cos(math.pi * c / (warmup + 1))) / 2 if c < warmup else 1.0
        step_size = lr * scale * math.sqrt(1 - beta2**t) / (1 - beta1**t)
        step_updates = []
        for i, g in enumerate(grads):
            g = g.double()
            if t >= after and t % gap >= after:  # spike-aware clipping
                spike = g**2 > theta * v[i]
                clipped += int(spike.sum())
                g = torch.where(spike, g.sign() * (theta * v[i]).sqrt(), g)
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g**2
            new = weights[i] - step_size * m[i] / (v[i].sqrt() + eps)
            new = new - lr * decays[i] * new
            step_updates.append((new - weights[i]).float())
            weights[i] = new
        updates.append(step_updates)
    return updates, clipped


def test_updates_follow_algorithm_1_written_out() -> None:
    expected, clipped = algorithm_1(make_params())
    spam, got = ours(leaf_params())
    for step, (mine, theirs) in enumerate(zip(got, expected, strict=True), start=1):
        for a, b in zip(mine, theirs, strict=True):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), f"step {step}"
    assert clipped > 0 and spam.metric_totals.tolist() == [3, clipped]


def snapshot(spam: SPAM, params: list[torch.Tensor]) -> list[torch.Tensor]:
    state = [t.clone() for p in params for t in spam.state[p].values()]
    return [p.detach().clone() for p in params] + state + [spam.metric_totals.clone()]


@pytest.mark.parametrize("bad", [math.nan, 1e6])  # a non-finite step, a spike (rung 1)
def test_a_skipped_step_changes_nothing(bad: float) -> None:
    params = leaf_params()
    skipping = SPAM(groups(params), **HYPER, **KNOBS)
    reference_params = leaf_params()
    reference = SPAM(groups(reference_params), **HYPER, **KNOBS)
    for step, grads in enumerate(gradients(), start=1):
        if step == 12:  # a reset step: skipped, it must not reset either
            for p in params:
                p.grad = torch.full_like(p, bad)
            skipping.found_inf = torch.ones(())
            before = snapshot(skipping, params)
            skipping.step()
            after = snapshot(skipping, params)
            assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        skipping.found_inf = torch.zeros(())
        for opt, ps in ((skipping, params), (reference, reference_params)):
            for p, g in zip(ps, grads, strict=True):
                p.grad = g.clone()
            opt.step()
    # the same weights, moments and counters as a run that never saw the skipped step
    mine, theirs = snapshot(skipping, params), snapshot(reference, reference_params)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def test_a_step_reads_nothing_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    params = leaf_params()
    spam = SPAM(groups(params), **HYPER, **KNOBS)
    reads = count_host_reads(monkeypatch)
    for step, grads in enumerate(gradients(), start=1):
        spam.found_inf = torch.tensor(float(step % 5 == 0))
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        spam.step()
    assert reads == []


def test_state_dict_round_trip_continues_bit_for_bit(tmp_path) -> None:
    """Saved mid-interval and loaded into a new optimizer (its step on the CPU, as
    ``torch.load(map_location="cpu")`` gives it), training goes on as if uninterrupted."""
    whole_params, resumed_params = leaf_params(), leaf_params()
    whole = SPAM(groups(whole_params), **HYPER, **KNOBS)
    resumed: SPAM | None = None
    first = SPAM(groups(resumed_params), **HYPER, **KNOBS)
    for step, grads in enumerate(gradients(), start=1):
        opts = [(whole, whole_params), (resumed or first, resumed_params)]
        for opt, ps in opts:
            for p, g in zip(ps, grads, strict=True):
                p.grad = g.clone()
            opt.step()
        if step == 10:  # two steps before a reset
            torch.save(first.state_dict(), tmp_path / "opt.pt")
            resumed = SPAM(groups(resumed_params), **HYPER, **KNOBS)
            resumed.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    assert resumed is not None
    assert all(torch.equal(a, b) for a, b in zip(whole_params, resumed_params, strict=True))
    for a, b in zip(whole_params, resumed_params, strict=True):
        assert all(torch.equal(whole.state[a][k], resumed.state[b][k]) for k in whole.state[a])

"""Level shifts: a loss that stepped up and stays flat, with a calm gradient norm and only finite
values, is taken as the detectors' new level; one that keeps rising, comes with gradient-norm
trouble or with a non-finite value is not."""

from __future__ import annotations

import io
import random
from typing import Any

import pytest
import torch

from lossguard.agent.config import SpikeConfig
from lossguard.agent.telemetry.level_shift import LevelShift, accept_level_shift
from lossguard.agent.telemetry.spikes import SpikeBank
from lossguard.common.catalogue import SIGNALS

CPU = torch.device("cpu")
NAN, INF = float("nan"), float("inf")
JUMP_AT = 201  # the first step of the new level in every scenario below


def gauss(n: int, mean: float, sigma: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.gauss(mean, sigma) for _ in range(n)]


def stepped_loss(after: list[float] | None = None) -> list[float]:
    """200 steps around 3.0, then 150 around 3.6 (12 standard deviations up), or ``after``."""
    return gauss(JUMP_AT - 1, 3.0, 0.05, seed=1) + (after or gauss(150, 3.6, 0.05, seed=2))


def calm_grad_norm(n: int = 350) -> list[float]:
    return gauss(n, 1.0, 0.05, seed=3)


class Detectors:
    """A loss and a grad-norm detector in one bank, as the Guard has them, judged at every log
    interval (every 10 steps) as ``IntervalLog.end`` judges them."""

    def __init__(self, cfg: SpikeConfig | None = None, *, lenient_grad: bool = False) -> None:
        self.bank = SpikeBank(cfg or SpikeConfig(), CPU, [True, not lenient_grad])
        self.detectors = dict(zip(SIGNALS, self.bank.detectors, strict=True))
        self.step = 0
        self.shifts: list[tuple[int, LevelShift]] = []  # (declared at, shift)
        self.stats: dict[str, dict[str, float]] = {}  # as judged at the last interval

    def feed(self, losses: list[float], grad_norms: list[float]) -> None:
        for values in zip(losses, grad_norms, strict=True):
            self.bank.update(torch.tensor(values, dtype=torch.float64))
            self.step += 1
            if self.step % 10 == 0:
                self.stats = {s: d.stats_dict() for s, d in self.detectors.items()}
                shift = accept_level_shift(self.detectors, self.stats, self.step)
                if shift is not None:
                    self.shifts.append((self.step, shift))

    def loss(self) -> dict[str, float]:
        return self.detectors["loss"].stats_dict()


def test_a_flat_step_up_is_taken_as_the_new_level_after_level_shift_after_steps() -> None:
    run = Detectors()  # the defaults: level_shift_after 100
    losses, grad_norms = stepped_loss(), calm_grad_norm()
    run.feed(losses[:300], grad_norms[:300])
    assert len(run.shifts) == 1
    declared, shift = run.shifts[0]
    assert declared == 300 == JUMP_AT + 99  # the first interval with 100 steps of episode
    assert (shift.signal, shift.began) == ("loss", JUMP_AT)
    assert shift.mean_before == pytest.approx(3.0, abs=0.02)
    assert shift.level == pytest.approx(3.6, abs=0.03)
    assert abs(shift.trend) < 0.1
    after = run.loss()  # on the device: the episode ended, the window emptied
    assert after["active"] == 0 and after["duration"] == 0 and after["spikes_total"] == 1
    assert (after["level_shifts_total"], after["level_shift_step"]) == (1, JUMP_AT)
    assert run.detectors["loss"].state_dict()["count"] == 0
    published = run.stats["loss"]  # what the interval published: the same, though read before
    for field in ("active", "duration", "level_shifts_total", "level_shift_step"):
        assert published[field] == after[field]

    # the new level is the baseline: it opens no episode, a spike above it does
    run.feed(losses[300:], grad_norms[300:])
    assert run.loss()["active"] == 0 and run.loss()["spikes_total"] == 1
    run.feed([4.6], [1.0])
    assert run.loss()["spike"] == 1 and run.loss()["spikes_total"] == 2
    assert len(run.shifts) == 1


def test_a_step_up_that_keeps_rising_stays_an_episode() -> None:
    rising = [v + 0.004 * t for t, v in enumerate(gauss(150, 3.6, 0.05, seed=2))]
    run = Detectors()
    run.feed(stepped_loss(rising), calm_grad_norm())
    assert run.shifts == []
    loss = run.loss()
    assert loss["active"] == 1 and loss["duration"] == 150
    assert loss["shift_trend"] > 0.5  # its fitted rise is over half its jump


def test_a_step_up_that_falls_back_slowly_is_a_level_shift() -> None:
    falling = [v - 0.002 * t for t, v in enumerate(gauss(150, 3.8, 0.05, seed=2))]
    run = Detectors()
    run.feed(stepped_loss(falling), calm_grad_norm())
    assert [(at, shift.began) for at, shift in run.shifts] == [(JUMP_AT + 99, JUMP_AT)]
    assert run.shifts[0][1].trend < -0.1


@pytest.mark.parametrize(
    ("at", "value", "lenient", "shifted"),
    [
        (150, 10.0, False, True),  # a grad-norm episode that ended before the jump
        (JUMP_AT - 1, 10.0, False, False),  # the step before the jump: its update moved the loss
        (JUMP_AT + 30, 10.0, False, False),  # during the loss episode
        (JUMP_AT + 30, INF, False, False),  # a non-finite grad norm opens an episode
        (JUMP_AT + 30, INF, True, True),  # not under fp16's GradScaler (its overflows)
    ],
)
def test_a_step_up_with_gradient_norm_trouble_is_no_level_shift(
    at: int, value: float, lenient: bool, shifted: bool
) -> None:
    grad_norms = calm_grad_norm()
    grad_norms[at - 1] = value
    run = Detectors(lenient_grad=lenient)
    run.feed(stepped_loss(), grad_norms)
    assert [shift.began for _, shift in run.shifts] == ([JUMP_AT] if shifted else [])
    if not shifted:
        assert run.loss()["active"] == 1 and run.loss()["duration"] == 150


@pytest.mark.parametrize("nan_at", [JUMP_AT, JUMP_AT + 50])
def test_an_episode_with_a_nonfinite_loss_is_no_level_shift(nan_at: int) -> None:
    """Opened by the NaN, or a NaN inside an episode a spike opened."""
    losses = stepped_loss()
    losses[nan_at - 1] = NAN
    run = Detectors()
    run.feed(losses, calm_grad_norm())
    assert run.shifts == []
    loss = run.loss()
    assert loss["active"] == 1 and loss["duration"] == 150 and loss["shift_trend"] == INF


def state(run: Detectors) -> dict[str, dict[str, Any]]:
    """Both detectors' state, through torch.save and load as a checkpoint holds it."""
    buffer = io.BytesIO()
    torch.save({s: d.state_dict() for s, d in run.detectors.items()}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def restored(saved: dict[str, dict[str, Any]], step: int) -> Detectors:
    run = Detectors()
    for signal, detector in run.detectors.items():
        detector.load_state_dict(saved[signal])
        detector.set_step(step)
    run.step = step
    return run


def test_the_fit_and_the_shifts_are_checkpointed_state() -> None:
    losses, grad_norms = stepped_loss(), calm_grad_norm()
    whole = Detectors()
    whole.feed(losses[:260], grad_norms[:260])
    mid_episode = state(whole)
    whole.feed(losses[260:], grad_norms[260:])

    resumed = restored(mid_episode, 260)
    resumed.feed(losses[260:], grad_norms[260:])
    assert resumed.shifts == whole.shifts  # the same shift, at the same step
    assert resumed.loss() == whole.loss()

    again = restored(state(whole), 350)
    assert (again.loss()["level_shifts_total"], again.loss()["level_shift_step"]) == (1, JUMP_AT)


def test_a_state_from_before_the_level_keys_loads_and_judges_no_episode_it_cannot_fit() -> None:
    losses, grad_norms = stepped_loss(), calm_grad_norm()
    run = Detectors()
    run.feed(losses[:260], grad_norms[:260])
    newer = ("level_sums", "level_shift")
    old = {s: {k: v for k, v in d.items() if k not in newer} for s, d in state(run).items()}
    resumed = restored(old, 260)
    loss = resumed.loss()
    assert loss["active"] == 1 and loss["duration"] == 60  # the old keys did load
    assert (loss["level_shifts_total"], loss["level_shift_step"]) == (0, -1)
    assert loss["shift_trend"] == INF  # its sums are unknown: not judged
    resumed.feed(losses[260:], grad_norms[260:])
    assert resumed.shifts == [] and resumed.loss()["active"] == 1

    # back down: the episode ends; the next one, opened by a spike, is fitted again
    resumed.feed(gauss(30, 3.0, 0.05, seed=5), calm_grad_norm(30))
    assert resumed.loss()["active"] == 0
    resumed.feed(gauss(100, 3.6, 0.05, seed=6), calm_grad_norm(100))
    assert [(at, shift.began) for at, shift in resumed.shifts] == [(480, 381)]


@pytest.mark.gpu
def test_on_cuda_the_fit_never_syncs_and_judges_as_on_cpu() -> None:
    losses, grad_norms = stepped_loss(), calm_grad_norm()
    on_cpu = Detectors()
    on_cpu.feed(losses, grad_norms)
    bank = SpikeBank(SpikeConfig(), torch.device("cuda"), [True, True])
    detectors = dict(zip(SIGNALS, bank.detectors, strict=True))
    pairs = zip(losses, grad_norms, strict=True)
    values = [torch.tensor(pair, dtype=torch.float64, device="cuda") for pair in pairs]
    shifts: list[tuple[int, LevelShift]] = []
    for step, value in enumerate(values, start=1):
        torch.cuda.set_sync_debug_mode("error")
        try:
            bank.update(value)  # every step: device operations only
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if step % 10 == 0:  # the log interval's one read, then the rebase (no sync either)
            stats = {s: d.stats_dict() for s, d in detectors.items()}
            torch.cuda.set_sync_debug_mode("error")
            try:
                shift = accept_level_shift(detectors, stats, step)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            if shift is not None:
                shifts.append((step, shift))
    assert [(at, s.began) for at, s in shifts] == [(at, s.began) for at, s in on_cpu.shifts]
    (_, got), (_, want) = shifts[0], on_cpu.shifts[0]
    assert got.level == pytest.approx(want.level, rel=1e-9)
    assert got.trend == pytest.approx(want.trend, rel=1e-6, abs=1e-9)
    assert detectors["loss"].stats_dict() == pytest.approx(on_cpu.loss(), rel=1e-9, abs=1e-12)

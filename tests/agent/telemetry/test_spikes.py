"""SpikeDetector: agreement with a plain-Python reference, detection, episodes, no host sync."""

from __future__ import annotations

import io
import math
import random
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from lossguard.agent.config import SpikeConfig
from lossguard.agent.telemetry.spikes import STAT_FIELDS, SpikeBank, SpikeDetector
from tests.support.host_reads import count_host_reads

SMALL = {"window": 16, "min_history": 4, "recover_steps": 3}
CPU = torch.device("cpu")
NAN, INF = float("nan"), float("inf")
# Compared exactly; the window statistics approximately.
COUNTERS = [
    "spike",
    "active",
    "duration",
    "spikes_total",
    "nonfinite_total",
    "nonfinite",
    "nonfinite_step",
    "spike_step",
    "spike_value",
    "level_shifts_total",
    "level_shift_step",
]
APPROX = ["zscore", "mean", "std", "spike_mean", "spike_std", "shift_trend", "shift_level"]
assert {*COUNTERS, *APPROX, "value"} == set(STAT_FIELDS)


def small(**changes: Any) -> SpikeConfig:
    """The small test settings: window 16, min_history 4, recover_steps 3."""
    return SpikeConfig.model_validate({**SMALL, **changes})


def default(**changes: Any) -> SpikeConfig:
    return SpikeConfig.model_validate(changes)


def key(stats: dict[str, float]) -> tuple[Any, ...]:
    """Stats that compare equal when equal, NaN included."""
    return tuple("nan" if math.isnan(v) else v for v in stats.values())


class Reference:
    """The documented semantics with lists and loops; same arithmetic order as the detector."""

    def __init__(self, cfg: SpikeConfig) -> None:
        self.cfg = cfg
        self.window: list[float] = []
        self.active = False
        self.in_band_run = 0
        self.duration = 0
        self.spikes_total = 0
        self.nonfinite_total = 0
        self.step = 0
        self.nonfinite_step = -1
        self.spike_at = (-1.0, -INF, -INF, -INF)  # step, value, mean, std
        self.episode: list[float] = []  # the current episode's values
        self.opened_by_spike = False
        self.last = dict.fromkeys(STAT_FIELDS, 0.0)
        self.last.update(nonfinite_step=-1.0, mean=-INF, std=-INF)
        self.last.update(shift_trend=-INF, shift_level=-INF, level_shift_step=-1.0)
        spike_fields = ("spike_step", "spike_value", "spike_mean", "spike_std")
        self.last.update(zip(spike_fields, self.spike_at, strict=True))

    def update(self, x: float) -> bool:
        cfg = self.cfg
        self.step += 1
        finite = math.isfinite(x)
        n = len(self.window)
        spike, zscore = False, 0.0
        mean = std = -INF  # unknown before min_history
        if n >= cfg.min_history:
            shift = self.window[-cfg.min_history]  # the detector's shift, for equal rounding
            devs = [w - shift for w in self.window]
            mean_d = sum(devs) / n
            var = max(sum(d * d for d in devs) / n - mean_d * mean_d, 0.0)
            mean, std = mean_d + shift, math.sqrt(var)
            if finite:
                if cfg.mode == "zscore":
                    spike = x > mean + cfg.zscore * std
                else:
                    spike = mean > 0 and x >= cfg.ratio * mean
                if std > 0:
                    zscore = (x - mean) / std
        if finite and not spike:
            self.window = [*self.window, x][-cfg.window :]
            self.in_band_run += 1
        else:
            if not self.active:
                self.active, self.duration = True, 0
                self.episode, self.opened_by_spike = [], spike
                self.spikes_total += spike  # a non-finite value opens an episode, uncounted
                if spike:
                    self.spike_at = (float(self.step), x, mean, std)
            self.in_band_run = 0
        if self.active:
            self.duration += 1
            self.episode.append(x)
            if self.in_band_run >= cfg.recover_steps:
                self.active, self.duration = False, 0
        self.nonfinite_total += not finite
        if not finite:
            self.nonfinite_step = self.step
        self.last = {
            "value": x,
            "zscore": zscore,
            "spike": float(spike),
            "active": float(self.active),
            "duration": float(self.duration),
            "spikes_total": float(self.spikes_total),
            "nonfinite_total": float(self.nonfinite_total),
            "nonfinite": float(not finite),
            "nonfinite_step": float(self.nonfinite_step),
            "mean": mean,
            "std": std,
            "spike_step": self.spike_at[0],
            "spike_value": self.spike_at[1],
            "spike_mean": self.spike_at[2],
            "spike_std": self.spike_at[3],
            **self.shift_fit(),
            "level_shifts_total": 0.0,
            "level_shift_step": -1.0,
        }
        return not finite

    def shift_fit(self) -> dict[str, float]:
        """The least-squares line through the episode's values, against the jump."""
        if not self.active:
            return {"shift_trend": -INF, "shift_level": -INF}
        values, n = self.episode, float(len(self.episode))
        if not (self.opened_by_spike and all(map(math.isfinite, values)) and n >= 2):
            return {"shift_trend": INF, "shift_level": -INF}
        total = sum(values)
        weighted = sum(t * v for t, v in enumerate(values, start=1))
        mean = total / n
        slope = (weighted - (n + 1) / 2 * total) / (n * (n * n - 1) / 12)
        jump = mean - self.spike_at[2]
        if not jump > 0:
            return {"shift_trend": INF, "shift_level": -INF}
        return {"shift_trend": slope * (n - 1) / jump, "shift_level": mean + slope * (n - 1) / 2}


def feed(detector: SpikeDetector, values: Sequence[float]) -> list[dict[str, float]]:
    """Update with each value; the stats after every step."""
    out = []
    for x in values:
        detector.update(torch.tensor(x, dtype=torch.float64))
        out.append(detector.stats_dict())
    return out


def assert_matches(got: dict[str, float], want: dict[str, float], where: str) -> None:
    for field in COUNTERS:
        assert got[field] == want[field], (where, field, got, want)
    assert got["value"] == want["value"] or (math.isnan(got["value"]) and math.isnan(want["value"]))
    for field in APPROX:
        assert got[field] == pytest.approx(want[field], rel=1e-9, abs=1e-9), (where, field, got)


def compare(cfg: SpikeConfig, values: Sequence[float]) -> None:
    detector, reference = SpikeDetector(cfg, torch.device("cpu")), Reference(cfg)
    for i, x in enumerate(values):
        flag = detector.update(torch.tensor(x, dtype=torch.float64))
        assert flag.dtype == torch.bool and flag.shape == ()
        assert bool(flag) == reference.update(x)
        assert_matches(
            detector.stats_dict(), reference.last, f"step {i}: {values[max(0, i - 20) : i + 1]}"
        )


def decode(base: int, code: int) -> float:
    """One signal value from a random code: mostly noise around base, some jumps, some NaN/Inf.

    Values lie on a 1/64 grid, so window sums are exact in any order and the detector and the
    reference round alike.
    """
    kind, size = code % 100, code // 100
    if kind < 86:
        return (base + size % 33 - 16) / 64
    if kind < 94:
        return (base + 64 * (1 + size % 64)) / 64  # up by 1 to 64
    if kind < 97:
        return (base - size % 512) / 64  # down, possibly below zero
    if kind < 99:
        return (NAN, INF, -INF)[size % 3]
    return base / 64 + 1000.0


@settings(max_examples=50, deadline=None)
@given(
    mode=st.sampled_from(["zscore", "ratio"]),
    zscore=st.sampled_from([1.0, 3.0, 6.0]),
    base=st.integers(-64, 512),
    codes=st.integers(0, 400).flatmap(
        lambda n: st.lists(st.integers(0, 99_999), min_size=n, max_size=n)
    ),
)
def test_matches_reference_after_every_step(
    mode: str, zscore: float, base: int, codes: list[int]
) -> None:
    compare(small(mode=mode, zscore=zscore), [decode(base, c) for c in codes])


def continuous(seed: str) -> list[float]:
    """Noise with spikes, non-finite values and a long episode."""
    rng = random.Random(seed)
    values = []
    for _ in range(600):
        u = rng.random()
        values.append(rng.gauss(2.0, 0.1) * (rng.uniform(3, 30) if u < 0.05 else 1.0))
    values[100:110] = [NAN] * 3 + [INF] * 3 + [-INF] * 4
    values[200:260] = [50.0] * 60  # a long episode
    return values


@pytest.mark.parametrize("mode", ["zscore", "ratio"])
def test_matches_reference_on_continuous_values(mode: str) -> None:
    compare(small(mode=mode, zscore=3.0), continuous(mode))


def gauss(n: int, mean: float, sigma: float, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [rng.gauss(mean, sigma) for _ in range(n)]


@pytest.mark.parametrize("mode", ["zscore", "ratio"])
def test_stationary_noise_never_spikes(mode: str) -> None:
    detector = SpikeDetector(default(mode=mode), CPU)
    history = feed(detector, gauss(1000, 3.0, 0.05))
    assert max(s["spikes_total"] for s in history) == 0
    assert not any(s["active"] or s["spike"] for s in history)
    assert max(abs(s["zscore"]) for s in history) < 6
    assert history[-1]["zscore"] != 0  # scored once history is there


def test_step_up_is_an_episode_that_recovers_and_counts_once() -> None:
    cfg = default()  # window 128, k 6, min_history 32, M 20
    detector = SpikeDetector(cfg, CPU)
    before = feed(detector, gauss(200, 3.0, 0.05))
    window = detector.state_dict()["window"].clone()
    assert before[-1]["spikes_total"] == 0

    spiking = feed(detector, [8.0, 9.0, 8.5, 12.0, 8.0])
    assert [s["spike"] for s in spiking] == [1.0] * 5
    assert [s["active"] for s in spiking] == [1.0] * 5
    assert [s["duration"] for s in spiking] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [s["spikes_total"] for s in spiking] == [1.0] * 5  # one episode, not five
    assert spiking[0]["zscore"] > cfg.zscore
    assert torch.equal(detector.state_dict()["window"], window)  # spikes stay out

    back = feed(detector, gauss(30, 3.0, 0.05, seed=1))
    assert not any(s["spike"] for s in back)
    steps = cfg.recover_steps
    assert [s["active"] for s in back[: steps - 1]] == [1.0] * (steps - 1)
    assert [s["duration"] for s in back[: steps - 1]] == [6.0 + i for i in range(steps - 1)]
    assert back[steps - 1]["active"] == 0 and back[steps - 1]["duration"] == 0
    assert all(s["active"] == 0 and s["spikes_total"] == 1 for s in back[steps - 1 :])

    again = feed(detector, [9.0, 3.0])
    assert again[0]["spike"] == 1 and again[0]["spikes_total"] == 2
    assert again[1]["active"] == 1 and again[1]["duration"] == 2


def test_spike_inside_recovery_extends_the_episode() -> None:
    detector = SpikeDetector(small(), CPU)
    feed(detector, gauss(50, 3.0, 0.05))
    history = feed(detector, [9.0, 3.0, 3.0, 9.0, 3.0, 3.0, 3.0, 3.0])
    assert [s["active"] for s in history] == [1, 1, 1, 1, 1, 1, 0, 0]
    assert [s["duration"] for s in history] == [1, 2, 3, 4, 5, 6, 0, 0]
    assert history[-1]["spikes_total"] == 1


def test_falling_signal_is_not_a_spike() -> None:
    for mode in ("zscore", "ratio"):
        detector = SpikeDetector(default(mode=mode), CPU)
        history = feed(detector, [*gauss(100, 3.0, 0.05), 0.1, 0.01])
        assert history[-2]["zscore"] < -6
        assert history[-1]["spikes_total"] == 0 and history[-1]["active"] == 0


@pytest.mark.parametrize(("value", "spike"), [(3.99, 0.0), (4.0, 1.0), (40.0, 1.0)])
def test_ratio_mode_threshold(value: float, spike: float) -> None:
    detector = SpikeDetector(small(mode="ratio"), CPU)
    assert feed(detector, [2.0] * 8 + [value])[-1]["spike"] == spike


def test_ratio_mode_needs_a_positive_mean() -> None:
    detector = SpikeDetector(small(mode="ratio"), CPU)
    history = feed(detector, [-1.0, 1.0] * 4 + [5.0, -2.0, 0.5])
    assert all(s["spike"] == 0 for s in history)


def test_flat_signal_has_zero_zscore_and_any_rise_spikes() -> None:
    detector = SpikeDetector(small(), CPU)
    history = feed(detector, [0.1] * 20 + [0.1000001])
    assert all(s["zscore"] == 0 for s in history)
    assert history[-2]["spike"] == 0 and history[-1]["spike"] == 1


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_nonfinite_is_counted_flagged_and_kept_out_of_the_window(bad: float) -> None:
    clean, dirty = SpikeDetector(small(), CPU), SpikeDetector(small(), CPU)
    start = gauss(40, 3.0, 0.05)
    feed(clean, start)
    feed(dirty, start)

    flag = dirty.update(torch.tensor(bad))
    assert flag.dtype == torch.bool and bool(flag)
    stats = dirty.stats_dict()
    assert stats["nonfinite"] == 1 and stats["nonfinite_total"] == 1
    assert stats["spike"] == 0 and stats["zscore"] == 0
    assert stats["active"] == 1 and stats["spikes_total"] == 0  # an episode, but no spike
    for key in ("window", "count"):
        assert torch.equal(dirty.state_dict()[key], clean.state_dict()[key])

    later = gauss(5, 3.0, 0.05, seed=2)
    for got, want in zip(feed(dirty, later), feed(clean, later), strict=True):
        assert got["zscore"] == want["zscore"]  # same mean and std: the value never got in
        assert got["nonfinite"] == 0 and got["nonfinite_total"] == 1
    assert not bool(dirty.update(torch.tensor(3.0)))


class OpLog(TorchDispatchMode):
    """Records every aten op dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


SYNCING_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "item"}


def noisy_signal(n: int) -> Iterator[torch.Tensor]:
    rng = random.Random(5)
    for i in range(n):
        x = NAN if i % 37 == 36 else rng.gauss(3.0, 0.05) * (8 if i % 50 == 49 else 1)
        yield torch.tensor(x, dtype=torch.float32)


@pytest.mark.parametrize("mode", ["zscore", "ratio"])
def test_update_never_syncs_with_the_host(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    detector = SpikeDetector(small(mode=mode), CPU)
    values = list(noisy_signal(200))
    calls = count_host_reads(monkeypatch)
    with OpLog() as log:
        for value in values:
            detector.update(value)
    monkeypatch.undo()
    assert calls == []
    assert not {op.__name__.split(".")[0] for op in log.ops} & SYNCING_OPS  # C++ .item() too
    kernels = [op for op in log.ops if not op.is_view]
    # small: this runs every training step (about 33, 4 for the step bookkeeping and 1 for
    # the level-shift sums)
    assert len(kernels) / len(values) <= 41
    assert (
        detector.stats_dict()["spikes_total"] > 0 and detector.stats_dict()["nonfinite_total"] > 0
    )


@pytest.mark.parametrize("mode", ["zscore", "ratio"])
def test_state_dict_round_trip_continues_identically(mode: str) -> None:
    cfg = small(mode=mode)
    values = [float(v) for v in noisy_signal(300)]
    original = SpikeDetector(cfg, CPU)
    feed(original, values[:140])
    state = original.state_dict()

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    restored = SpikeDetector(cfg, CPU)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(restored.stats(), original.stats())
    ahead = [key(s) for s in feed(original, values[140:])]
    assert [key(s) for s in feed(restored, values[140:])] == ahead  # exactly
    assert ahead[-1][STAT_FIELDS.index("spikes_total")] > 1

    original.load_state_dict(state)  # a rollback: the saved copy did not move on with it
    assert [key(s) for s in feed(original, values[140:])] == ahead


def test_load_rejects_other_window_and_missing_keys() -> None:
    state = SpikeDetector(small(), CPU).state_dict()
    other = SpikeDetector(small(window=32), CPU)
    with pytest.raises(ValueError, match="window"):
        other.load_state_dict(state)
    del state["run"]
    with pytest.raises(ValueError, match="run"):
        SpikeDetector(small(), CPU).load_state_dict(state)


def test_stats_before_any_update_and_input_kinds() -> None:
    detector = SpikeDetector(small(), CPU)
    stats = detector.stats()
    assert stats.dtype == torch.float64 and stats.shape == (len(STAT_FIELDS),)
    unknown = {"nonfinite_step": -1.0, "spike_step": -1.0, "level_shift_step": -1.0}
    unknown.update(dict.fromkeys(("mean", "std", "spike_value", "spike_mean", "spike_std"), -INF))
    unknown.update(shift_trend=-INF, shift_level=-INF)
    assert detector.stats_dict() == {f: unknown.get(f, 0.0) for f in STAT_FIELDS}
    loss = (torch.ones(3, requires_grad=True) * 2).mean()
    detector.update(loss)  # float32, requires grad
    detector.update(torch.tensor([2.0], dtype=torch.bfloat16))  # one element, any shape
    assert detector.stats_dict()["value"] == 2.0


def test_the_flags_an_update_returns_keep_their_values() -> None:
    """Held across later updates (the bank writes its state in place): the CUDA test below
    reads them all at the end."""
    detector = SpikeDetector(small(), CPU)
    values = [*gauss(20, 3.0, 0.05), NAN, *gauss(5, 3.0, 0.05, seed=1)]
    flags = [detector.update(torch.tensor([v])) for v in values]
    assert [bool(f) for f in flags] == [math.isnan(v) for v in values]


@pytest.mark.gpu
def test_update_never_syncs_on_cuda() -> None:
    detector = SpikeDetector(default(), torch.device("cuda"))
    values = [v.cuda() for v in noisy_signal(300)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flags = [detector.update(v) for v in values]
        stats = detector.stats()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    reference = Reference(default())
    expected = [reference.update(float(v)) for v in values]
    assert [bool(f) for f in flags] == expected
    assert_matches(dict(zip(STAT_FIELDS, stats.tolist(), strict=True)), reference.last, "cuda")


def test_routine_nonfinite_values_can_stay_out_of_episodes() -> None:
    """fp16: the GradScaler's overflow steps give inf grad norms that are no divergence."""
    detector = SpikeDetector(small(), CPU, nonfinite_opens_episode=False)
    feed(detector, gauss(50, 3.0, 0.05))
    stats = feed(detector, [math.inf])[-1]
    assert stats["nonfinite_total"] == 1 and stats["active"] == 0 and stats["spikes_total"] == 0
    assert feed(detector, [9.0])[-1]["active"] == 1  # a real spike still opens one


def test_steps_of_the_last_nonfinite_value_and_of_the_spike_that_opened_an_episode() -> None:
    detector = SpikeDetector(small(), CPU)
    history = feed(detector, [*gauss(20, 3.0, 0.05), NAN, *gauss(10, 3.0, 0.05, seed=1)])
    assert [s["nonfinite_step"] for s in history[:20]] == [-1.0] * 20
    assert {s["nonfinite_step"] for s in history[20:]} == {21.0}  # steps count from 1
    assert history[-1]["spike_step"] == -1 and history[-1]["spike_value"] == -INF

    window = detector.state_dict()["window"]  # the values the spike is judged against
    spiking = feed(detector, [9.0, 12.0, INF])  # steps 32, 33 (inside the episode), 34
    assert [s["spike_step"] for s in spiking] == [32.0] * 3  # the spike that opened it
    assert spiking[-1]["spike_value"] == 9.0
    known = window[~window.isnan()]
    assert spiking[-1]["spike_mean"] == pytest.approx(float(known.mean()), rel=1e-12)
    assert spiking[-1]["spike_std"] == pytest.approx(float(known.std(correction=0)), rel=1e-9)
    assert spiking[-1]["nonfinite_step"] == 34

    detector.set_step(1000)  # a restore: the training loop's count wins
    assert feed(detector, [-INF])[-1]["nonfinite_step"] == 1001


def test_nonfinite_step_is_checkpointed_state() -> None:
    detector = SpikeDetector(small(), CPU)
    feed(detector, gauss(30, 3.0, 0.05))
    clean = detector.state_dict()  # a checkpoint before the NaN
    feed(detector, [3.0, NAN, 3.0])
    assert detector.stats_dict()["nonfinite_step"] == 32
    dirty = detector.state_dict()

    detector.load_state_dict(clean)  # a rollback to before the NaN
    assert detector.stats_dict()["nonfinite_step"] == -1
    assert feed(detector, [3.0, 3.0, NAN])[-1]["nonfinite_step"] == 33  # it comes back anew

    buffer = io.BytesIO()
    torch.save(dirty, buffer)
    buffer.seek(0)
    detector.load_state_dict(torch.load(buffer, weights_only=True))
    assert detector.stats_dict()["nonfinite_step"] == 32
    assert feed(detector, [3.0])[-1]["nonfinite_step"] == 32  # the step count came back too


def test_a_state_from_before_the_step_keys_still_loads() -> None:
    detector = SpikeDetector(small(), CPU)
    feed(detector, [*gauss(30, 3.0, 0.05), NAN, 9.0])
    old = {
        k: v
        for k, v in detector.state_dict().items()
        if k not in ("step", "nonfinite_step", "spike_at")
    }
    restored = SpikeDetector(small(), CPU)
    restored.load_state_dict(old)
    stats = restored.stats_dict()
    assert stats["nonfinite_total"] == 1 and stats["active"] == 1  # the old keys did load
    assert stats["nonfinite_step"] == -1 and stats["spike_step"] == -1
    restored.set_step(32)
    assert feed(restored, [NAN])[-1]["nonfinite_step"] == 33


def test_a_bank_updates_each_signal_as_a_detector_of_its_own() -> None:
    """One batched update of two signals (the second lenient with non-finite values, as fp16
    grad norms are) gives each the statistics and state of a detector that saw it alone, and
    a row restores from a detector's state."""
    cfg = small(zscore=3.0)
    bank = SpikeBank(cfg, CPU, [True, False])
    alone = [SpikeDetector(cfg, CPU), SpikeDetector(cfg, CPU, nonfinite_opens_episode=False)]
    signals = [continuous("loss"), continuous("grad_norm")[::-1]]
    for step, values in enumerate(zip(*signals, strict=True)):
        flags = bank.update(torch.tensor(values, dtype=torch.float64))
        for row, detector in enumerate(alone):
            assert bool(flags[row]) == bool(
                detector.update(torch.tensor(values[row], dtype=torch.float64))
            )
            assert key(bank.detectors[row].stats_dict()) == key(detector.stats_dict()), step
    restored = SpikeBank(cfg, CPU, [True, False])
    for row, detector in enumerate(alone):
        restored.detectors[row].load_state_dict(detector.state_dict())
        assert key(restored.detectors[row].stats_dict()) == key(detector.stats_dict())
    with pytest.raises(TypeError, match=r"SpikeBank\.update"):
        bank.detectors[0].update(torch.tensor(1.0))

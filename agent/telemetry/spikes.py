"""Spike and non-finite detection for one training signal (loss or grad norm), on device.

``SpikeDetector.update`` runs every step with only tensor ops on the signal's device (no host
sync); ``stats`` packs the results into one float64 tensor that is read once per log interval.
Signals with the same settings share a ``SpikeBank``: their state batched, one row a signal,
updated for all of them by one set of operations (each detector reads and restores its row).

Semantics (the choices the metric catalogue's spike series rest on):

* Window: the last ``window`` values that were finite and not spikes, so an episode cannot
  normalise itself. Mean and *population* std (divide by n) over the values in it.
* Detection starts once the window holds ``min_history`` values. zscore mode: spike when
  ``value > mean + k * std`` (one-sided; with std == 0 any rise above the mean is a spike).
  ratio mode: spike when ``value >= ratio * mean`` and ``mean > 0`` (a ratio means nothing for a
  signal whose mean is not positive).
* zscore: ``(value - mean) / std`` against the window before the value; 0 before
  ``min_history``, when std == 0 and when the value is non-finite.
* A non-finite value is not a spike: it counts in ``nonfinite_total`` and stays out of the
  window, but it is out of band, so it starts (or extends) an episode like a spike does.
* Episode: starts at an out-of-band step (spike or non-finite); ``duration`` counts its steps
  from 1; it ends (active and duration back to 0) on the ``recover_steps``-th consecutive
  in-band step. In-band values inside an episode join the window. ``spikes_total`` counts
  episodes started by a spike (a non-finite value counts in ``nonfinite_total`` instead).
  A lasting level shift upward never rejoins the window, so its episode stays active until
  the signal comes back down.
* Steps: the detector counts its updates (``step``: the number of the step just taken, from 1;
  ``set_step`` aligns it with the training loop's count after a restore). ``nonfinite_step`` is
  the step of the last non-finite value, -1 when there was none. The spike that opened the
  latest episode opened by a spike is kept as ``spike_step`` (-1 when none), ``spike_value``,
  ``spike_mean`` and ``spike_std`` (the window's statistics before it).
* ``mean`` and ``std`` are the window's statistics before the last value. Statistics that do not
  exist yet (before ``min_history`` values, before the first spike) read ``-inf``, so that a
  maximum over ranks picks a rank that has them.
* Level shifts (the caller judges them, ``level_shift.py``): from the spike that opens an
  episode on, each step adds its value and its position in the episode times its value to two
  sums, so that ``stats`` can fit a least-squares line through the episode's values.
  ``shift_trend`` is the line's rise over the episode (slope x (duration - 1)) divided by the
  jump (the episode's mean less the window mean before the spike): about 0 for a loss that
  stepped up and stays flat, negative for one that falls back, positive for one that keeps
  climbing (0.67 for one that climbs as far again as it jumped). It is judged only for an episode
  opened by a spike at its first step and with every value since finite, at least 2 steps long
  and with a positive jump; ``+inf`` for any other active episode and ``-inf`` outside one (so
  that a maximum over ranks is the least flat rank). ``shift_level`` is the line's value at
  the last step (``-inf`` when not judged; a state saved before the sums existed has none: its
  episode is not judged). ``rebase`` empties the window and ends the episode: detection
  starts again once ``min_history`` values of the new level are in; ``level_shifts_total``
  and ``level_shift_step`` (the first step of the last shifted episode, -1 when none) count
  the rebases that accepted a level shift.
"""

from __future__ import annotations

from typing import Any

import torch

from lossguard.agent.config import SpikeConfig

STAT_FIELDS = (
    "value",
    "zscore",
    "spike",
    "active",
    "duration",
    "spikes_total",
    "nonfinite_total",
    "nonfinite",
    "nonfinite_step",
    "mean",
    "std",
    "spike_step",
    "spike_value",
    "spike_mean",
    "spike_std",
    "shift_trend",
    "shift_level",
    "level_shifts_total",
    "level_shift_step",
)

_F64 = torch.float64
_STATE_KEYS = (
    "window",
    "count",
    "run",
    "duration",
    "spikes_total",
    "nonfinite_total",
    "value",
    "mean",
    "std",
    "spike",
    "nonfinite",
    "step",
    "nonfinite_step",
    "spike_at",
    "level_sums",
    "level_shift",
)
# Added after the first release: a state without them still loads (with their initial values).
_NEWER_KEYS = ("step", "nonfinite_step", "spike_at", "level_sums", "level_shift")
_UNKNOWN = float("-inf")


class SpikeBank:
    """The detectors of several signals with the same settings, their state batched (one row
    a signal): one ``update`` runs the same ~40 small device operations for all of them,
    instead of ~40 per signal. ``detectors``: one SpikeDetector a signal, each reading and
    restoring its own row."""

    def __init__(
        self, cfg: SpikeConfig, device: torch.device | str, nonfinite_opens_episode: list[bool]
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self._zscore_mode = cfg.mode == "zscore"
        rows = len(nonfinite_opens_episode)
        # False where non-finite values are routine (fp16 grad norms: the GradScaler's overflow
        # steps): they are counted and kept out of the window, but do not open an episode.
        self._lenient = (
            torch.tensor([not opens for opens in nonfinite_opens_episode], device=self.device)
            if not all(nonfinite_opens_episode)
            else None
        )

        def filled(value: float, dtype: torch.dtype = _F64) -> torch.Tensor:
            return torch.full((rows,), value, dtype=dtype, device=self.device)

        # Shift register, oldest first; unfilled slots hold NaN and drop out of the sums.
        self.window = torch.full((rows, cfg.window), float("nan"), dtype=_F64, device=self.device)
        self.count = filled(0.0)  # values in the window
        # Consecutive in-band steps since the last out-of-band one; an episode is active while
        # it is below recover_steps, so it starts there (no episode yet).
        self.run = filled(float(cfg.recover_steps))
        # (1, the step's position in the episode) a row: one multiply-add adds the value and
        # position x value to the level sums
        self.positions = torch.zeros((rows, 2), dtype=_F64, device=self.device)
        self.positions[:, 0] = 1.0
        self.duration = self.positions[:, 1]  # 0 outside an episode
        self.spikes_total = filled(0.0)
        self.nonfinite_total = filled(0.0)
        # The last step, written in place each update, for stats().
        self.value = filled(0.0)
        self.mean = filled(float("nan"))  # no window yet
        self.std = filled(0.0)
        self.spike = filled(False, torch.bool)
        self.nonfinite = filled(False, torch.bool)
        self.step = filled(0.0)  # the step of the last update, from 1
        self.nonfinite_step = filled(-1.0)
        # The spike that opened the latest episode: step, value, window mean and std before it;
        # then the level sums since it (NaN before one): of the values, and position x value.
        nan = float("nan")
        self._opened = torch.tensor(
            [[-1.0, _UNKNOWN, _UNKNOWN, _UNKNOWN, nan, nan]] * rows, dtype=_F64, device=self.device
        )
        self.spike_at = self._opened[:, :4]
        self.level_sums = self._opened[:, 4:]
        self._zero = filled(0.0)
        # Level shifts accepted (rebase): how many, and the first step of the last one.
        self.level_shift = torch.tensor([[0.0, -1.0]] * rows, dtype=_F64, device=self.device)
        self.detectors = [
            SpikeDetector(cfg, self.device, nonfinite_opens_episode=opens, bank=(self, row))
            for row, opens in enumerate(nonfinite_opens_episode)
        ]

    def update(self, values: torch.Tensor) -> torch.Tensor:
        """Take this step's value of every signal (one element a row, in row order); return
        which are non-finite (a new bool tensor, one a row). Device operations only, no host
        sync."""
        cfg, window, count = self.cfg, self.window, self.count
        v = self.value.copy_(values.detach().reshape(self.value.shape))
        finite = (v - v) == 0  # isfinite() in 2 kernels instead of 4
        # Statistics relative to a window value, which keeps the variance exact for a flat
        # signal. That value is the min_history-th newest: NaN (unfilled) until detection may
        # start, which makes the mean NaN, so no comparison below is true and no test is needed.
        shift = window[:, -cfg.min_history]
        dev = window - shift.unsqueeze(1)  # NaN on the unfilled slots, which nansum leaves out
        mean_d = dev.nansum(dim=1) / count
        var = (dev * dev).nansum(dim=1).div_(count).sub_(mean_d * mean_d).clamp_min_(0.0)
        std = torch.sqrt(var, out=self.std)  # 0 until detection starts (NaN while empty)
        mean = torch.add(mean_d, shift, out=self.mean)
        if self._zscore_mode:
            spike = torch.gt(v, torch.add(mean, std, alpha=cfg.zscore), out=self.spike)
        else:
            spike = torch.ge(v, mean * cfg.ratio, out=self.spike).logical_and_(mean > 0)
        spike.logical_and_(finite)  # +inf is non-finite, not a spike
        in_band = finite ^ spike  # finite and not a spike (a spike is finite)
        shifted = torch.cat((window[:, 1:], v.unsqueeze(1)), dim=1)
        torch.where(in_band.unsqueeze(1), shifted, window, out=window)
        count.add_(in_band).clamp_max_(cfg.window)
        nonfinite = torch.bitwise_not(finite, out=self.nonfinite)
        calm = in_band if self._lenient is None else in_band | (nonfinite & self._lenient)
        starts = (self.run >= cfg.recover_steps) > calm  # no episode yet, and out of band
        opens = starts & spike  # a NaN opens an episode but is no spike
        self.spikes_total.add_(opens)
        self.run.add_(1.0).mul_(calm)
        self.duration.add_(1.0).mul_(self.run < cfg.recover_steps)
        self.nonfinite_total.add_(nonfinite)
        step = self.step.add_(1.0)
        torch.where(nonfinite, step, self.nonfinite_step, out=self.nonfinite_step)
        zero = self._zero
        opened = torch.stack((step, v, mean, std, zero, zero), dim=1)
        torch.where(opens.unsqueeze(1), opened, self._opened, out=self._opened)
        # the level sums run on past the episode's end; only an episode's own are judged
        self.level_sums.addcmul_(v.unsqueeze(1), self.positions)
        return nonfinite.clone()  # the bank's own is overwritten by the next update


class SpikeDetector:
    """Rolling-window spike and non-finite detection for one signal, on device: a bank of one,
    or one row of a SpikeBank."""

    def __init__(
        self,
        cfg: SpikeConfig,
        device: torch.device | str,
        *,
        nonfinite_opens_episode: bool = True,
        bank: tuple[SpikeBank, int] | None = None,
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.nonfinite_opens_episode = nonfinite_opens_episode
        owner, row = bank or (SpikeBank(cfg, device, [nonfinite_opens_episode]), 0)
        self._bank = owner
        # this signal's row of every state tensor: views, which the bank's updates write
        self._window = owner.window[row]
        self._count = owner.count[row]
        self._run = owner.run[row]
        self._duration = owner.duration[row]
        self._spikes_total = owner.spikes_total[row]
        self._nonfinite_total = owner.nonfinite_total[row]
        self._value = owner.value[row]
        self._mean = owner.mean[row]
        self._std = owner.std[row]
        self._spike = owner.spike[row]
        self._nonfinite = owner.nonfinite[row]
        self._step = owner.step[row]
        self._nonfinite_step = owner.nonfinite_step[row]
        self._spike_at = owner.spike_at[row]
        self._level_sums = owner.level_sums[row]
        self._level_shift = owner.level_shift[row]
        self._initial = {key: getattr(self, f"_{key}").clone() for key in _NEWER_KEYS}

    def set_step(self, step: int) -> None:
        """Align the step count with the training loop's: ``step`` steps are done (no sync)."""
        self._step.fill_(float(step))

    def rebase(self, shift_began: int | None = None) -> None:
        """Take the current level as the new baseline: empty the window and end any episode
        (on the device, no sync). ``shift_began``: the rebase accepts a level shift whose
        episode began at that step (counted in ``level_shifts_total``)."""
        self._window.fill_(float("nan"))
        self._count.zero_()
        self._run.fill_(float(self.cfg.recover_steps))
        self._duration.zero_()
        if shift_began is not None:
            self._level_shift[0].add_(1.0)
            self._level_shift[1].fill_(float(shift_began))

    def update(self, value: torch.Tensor) -> torch.Tensor:
        """Take this step's value (a 1-element tensor); return whether it is non-finite (bool).
        Only for a detector of its own (a bank's rows are updated together by the bank)."""
        if len(self._bank.detectors) != 1:
            raise TypeError("update a SpikeBank's detectors through SpikeBank.update")
        return self._bank.update(value).reshape(())

    def exceeds(self, zscore: float, min_history: int) -> torch.Tensor:
        """Whether the last value was finite and above the window's mean plus ``zscore`` std,
        with at least ``min_history`` values in the window (a bool device tensor, no sync)."""
        above = self._value > torch.add(self._mean, self._std, alpha=zscore)
        return above & ~self._nonfinite & (self._count >= min_history)

    def stats(self) -> torch.Tensor:
        """The last step's statistics as a 1-D float64 device tensor, in STAT_FIELDS order."""
        scored = (self._std > 0) & ~self._nonfinite
        zscore = torch.where(scored, (self._value - self._mean) / self._std, 0.0)
        active = self._run < self.cfg.recover_steps
        window_stats = torch.stack((self._mean, self._std))  # known once the mean is
        window_stats = torch.where(self._mean.isfinite(), window_stats, _UNKNOWN)
        fields = (
            self._value,
            zscore,
            self._spike,
            active,
            self._duration,
            self._spikes_total,
            self._nonfinite_total,
            self._nonfinite,
            self._nonfinite_step,
        )
        scalars = torch.stack([f.to(_F64) for f in fields])
        shift = self._shift_fit(active)
        return torch.cat((scalars, window_stats, self._spike_at, shift, self._level_shift))

    def _shift_fit(self, active: torch.Tensor) -> torch.Tensor:
        """``shift_trend`` and ``shift_level``: the least-squares line through the episode's
        values (positions 1..n), against the jump from the window mean before its spike."""
        n = self._duration
        began = self._step - n + 1
        total, weighted = self._level_sums
        mean = total / n
        # slope = sum((t - mean t) v) / sum((t - mean t)^2), mean t = (n + 1) / 2
        slope = (weighted - (n + 1) / 2 * total) / (n * (n * n - 1) / 12)
        rise = slope * (n - 1)
        jump = mean - self._spike_at[2]
        clean = (self._spike_at[0] == began) & (self._nonfinite_step < began) & (n >= 2)
        judged = active & clean & (jump > 0)
        trend = torch.where(judged, rise / jump, torch.where(active, float("inf"), _UNKNOWN))
        level = torch.where(judged, mean + slope * (n - 1) / 2, _UNKNOWN)
        return torch.stack((trend, level))

    def stats_dict(self) -> dict[str, float]:
        """``stats()`` read to the host (one sync), keyed by STAT_FIELDS."""
        return dict(zip(STAT_FIELDS, self.stats().tolist(), strict=True))

    def state_dict(self) -> dict[str, Any]:
        """Copies of all device state: window, counts, episode and the last step."""
        return {key: getattr(self, f"_{key}").clone() for key in _STATE_KEYS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output (from any device); the window size must match. A state
        saved before the step keys existed loads with their initial values (no non-finite step,
        no spike, step 0: the caller aligns it with ``set_step``)."""
        state = {**self._initial, **state}
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"spike detector state lacks {', '.join(missing)}")
        shape = tuple(state["window"].shape)
        if shape != (self.cfg.window,):
            raise ValueError(f"spike window holds {shape} values, config says {self.cfg.window}")
        for key in _STATE_KEYS:  # in place: the state is this signal's row of the bank
            current: torch.Tensor = getattr(self, f"_{key}")
            current.copy_(state[key].detach().reshape(current.shape))

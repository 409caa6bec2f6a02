"""Guard: the one instrumentation API, used alike by the built-in trainer and by user loops.

    guard = Guard(run_dir, model=model, optimizer=opt, scheduler=sched, data=sampler, config=cfg)
    for batch in ...:
        loss = ...; loss.backward()
        guard.after_backward(loss, tokens=n)   # grad norm (and clipping), on device
        opt.step(); sched.step()
        guard.end_step()                       # counters; every log interval: one host sync
        guard.poll()                           # control commands, applied at this boundary
        if guard.stop_requested: break
    guard.finish()                             # final checkpoint; then guard.close()

Per-step values stay on the device; they are read once per log interval. Checkpoints cover
every registered state (``register``), the data position and all RNG states.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Protocol

import torch
from torch import nn

from .checkpoint import CheckpointMeta, CheckpointStore, snapshot
from .commands import CommandRunner
from .config import Config, ConfigError
from .control import ControlServer, ListenError
from .distributed import (
    all_gather_objects,
    all_reduce_max,
    all_reduce_max_tensor,
    all_reduce_sum,
    broadcast_objects,
    control_group,
    rank_and_world,
)
from .metrics import SIGNALS
from .progress import ProgressDisplay, make_progress
from .protocol import SOCKET_NAME, Target
from .rng import capture_rng, restore_rng
from .rundir import RunDirectory, package_versions
from .telemetry import Telemetry

log = logging.getLogger("lossguard.agent")

CHECKPOINT_FORMAT = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any], /) -> Any: ...


class RestoreError(RuntimeError):
    """A checkpoint could not be restored; the message names it and why. ``not_found``: no
    usable checkpoint matched the target."""

    def __init__(self, message: str, *, not_found: bool = False) -> None:
        super().__init__(message)
        self.not_found = not_found


def device_description(device: torch.device) -> dict[str, Any]:
    """What env.json records about the training device."""
    info: dict[str, Any] = {"type": device.type, "name": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_bytes=props.total_memory,
            cuda=torch.version.cuda,
        )
    else:
        info["threads"] = torch.get_num_threads()
    return info


def weights_digest(model: nn.Module) -> str:
    """sha256 of the model's tensors: equal on every rank that holds the same weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(
            tensor.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        )
    return digest.hexdigest()


DETECTOR_STATE = "spikes/"


def _optional(state_name: str) -> bool:
    """Detector state: a checkpoint without it (or from other settings) still restores."""
    return state_name.startswith(DETECTOR_STATE)


def _skips_on_device(
    optimizer: torch.optim.Optimizer | None, scaler: torch.amp.GradScaler | None
) -> bool:
    """A fused optimizer skips a step on a device flag (``found_inf``) without a host sync;
    with a GradScaler, the scaler already skips non-finite steps itself."""
    if optimizer is None or scaler is not None:
        return False
    if optimizer.defaults.get("fused"):
        return True
    log.warning(
        "the optimizer is not fused: non-finite steps are counted but their updates cannot be "
        "skipped without a host sync (use e.g. torch.optim.AdamW(..., fused=True))"
    )
    return False


class Guard:
    """Accounting, gradient norm, metrics, checkpoints and control for a training loop."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Stateful | None = None,
        data: Stateful | None = None,
        scaler: torch.amp.GradScaler | None = None,
        ema: Stateful | None = None,
        config: Config | None = None,
        progress: bool = True,
        flops_per_token: float | None = None,
    ) -> None:
        self.config = config if config is not None else Config()
        train = self.config.train
        self.max_steps = train.max_steps
        self.log_every = train.log_every
        self.grad_clip = train.grad_clip
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.state: dict[str, Stateful] = {"model": model}
        extra = {"optimizer": optimizer, "scheduler": scheduler, "data": data}
        extra.update(scaler=scaler, ema=ema)
        self.state.update({k: v for k, v in extra.items() if v is not None})
        self.rank, self.world_size = rank_and_world()
        self.device = next(model.parameters()).device
        self._params = [p for p in model.parameters() if p.requires_grad]

        self.step = 0
        self.tokens_total = 0
        self.lr_scale = 1.0
        self.paused = False
        self.stop_requested = False
        self.started_at = time.time()
        self.last_record: dict[str, Any] | None = None
        self.last_train_loss: float | None = None
        self.last_val: tuple[int, float] | None = None  # (step, val_loss) of the last evaluation
        self._last_saved_step: int | None = None
        self._save_due = False
        self._state_mixed = False
        self._seen_totals: dict[str, int] = {}
        self._nonfinite_checkpoint_taken = False
        self._signal: int | None = None
        self._previous_handlers: dict[int, Any] = {}
        self._reset_interval()

        self.path = Path(run_dir)
        self.run_id = self.config.run.id or self.path.name
        self.run_dir: RunDirectory | None = None
        self.checkpoints: CheckpointStore | None = None
        self.control: ControlServer | None = None
        self._display: ProgressDisplay | None = None
        self._group = control_group()
        self.commands = CommandRunner(self)
        self.telemetry: Telemetry | None = None
        self._skipped = torch.zeros((), device=self.device)
        self._can_skip = _skips_on_device(optimizer, scaler)
        if self.config.telemetry.enabled:
            self.telemetry = Telemetry(
                self.config,
                model=model,
                device=self.device,
                rank=self.rank,
                world_size=self.world_size,
                run_id=self.run_id,
                flops_per_token=flops_per_token or 6.0 * sum(p.numel() for p in self._params),
                group=self._group,
                loss_scaling=scaler is not None,
            )
            for signal_name, detector in self.telemetry.detectors.items():
                self.state[f"{DETECTOR_STATE}{signal_name}"] = detector
        self.wandb: Any = None
        if self.rank == 0:
            continuing = (self.path / "config.yaml").exists()
            self.run_dir = RunDirectory(self.path)
            self.control = self._start_control()  # these fail before any file is written
            if self.config.wandb.enabled:
                from .wandb_logger import WandbLogger

                self.wandb = WandbLogger(
                    self.config.wandb,
                    run_id=self.run_id,
                    run_dir=self.path,
                    config=self.config.resolved(),
                    resume=continuing,
                )
            self.run_dir.write_config(self.config.resolved())
            self.run_dir.write_env(device_description(self.device), self.world_size)
            self.checkpoints = CheckpointStore(
                self.path / "checkpoints",
                keep_last=self.config.checkpoint.keep_last,
                config_hash=self.config.digest(),
                versions=package_versions(),
            )
            self.run_dir.write_discovery(
                run_id=self.run_id,
                socket_path=self.control.socket_path if self.control else None,
                metrics_urls=self.telemetry.urls if self.telemetry else [],
                world_size=self.world_size,
            )
            if progress:
                self._display = make_progress(self.max_steps, self.step)
            self.event(
                "start",
                pid=os.getpid(),
                world_size=self.world_size,
                control_socket=str(self.control.socket_path) if self.control else None,
                control_tcp=self.control.tcp_address if self.control else None,
            )
        self._install_signal_handlers()

    # ----------------------------------------------------------------- the per-step API

    @contextlib.contextmanager
    def idle(self) -> Iterator[None]:
        """Time spent inside is not training (evaluation, a pause): it stays out of step
        times, tokens/s and MFU."""
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self._interval_start += spent
            if self.telemetry is not None:
                self.telemetry.exclude(spent)

    def register(self, name: str, obj: Stateful) -> None:
        """Add state that checkpoints save and rollbacks restore (anything with state_dict)."""
        if name in self.state:
            raise ValueError(f"state {name!r} is already registered")
        self.state[name] = obj

    def _reset_interval(self) -> None:
        zero = torch.zeros((), device=self.device)
        self._loss_sum = zero.clone()
        self._grad_norm_last = zero.clone()
        self._grad_norm_max = zero.clone()
        self._interval_steps = 0
        self._interval_tokens = 0
        self._interval_start = time.perf_counter()
        self._pending_tokens = 0

    def after_backward(self, loss: torch.Tensor, *, tokens: int) -> torch.Tensor:
        """Record the step's loss and tokens; compute (and clip to ``train.grad_clip``) the
        gradient norm. Returns the pre-clip norm as a device tensor; nothing is synced."""
        if self.scaler is not None and self.optimizer is not None:
            self.scaler.unscale_(self.optimizer)
        if self.telemetry is not None:  # sampled steps only: FP8 health, gradient diagnostics
            for record in self.telemetry.collect_samples(self.step + 1):
                self._emit(record, display=False)
        if self.grad_clip is not None:
            norm = nn.utils.clip_grad_norm_(self._params, self.grad_clip, foreach=True)
        else:
            grads = [p.grad for p in self._params if p.grad is not None]
            norm = nn.utils.get_total_norm(grads, foreach=True)
        norm = norm.detach().float()
        if self.telemetry is not None:
            # Skip on the grad norm only: it is the same on every rank after DDP's all-reduce,
            # so every replica skips the same steps (a rank's own loss is counted, not acted on).
            norm_bad = self.telemetry.on_step(loss, norm)
            if self.scaler is not None:
                self._skipped += norm_bad  # the GradScaler skips these steps itself
            elif self._can_skip and self.config.telemetry.skip_nonfinite:
                self.optimizer.found_inf = norm_bad.float()  # type: ignore[union-attr]
                self._skipped += norm_bad
        self._loss_sum += loss.detach().float()
        self._grad_norm_last = norm
        self._grad_norm_max = torch.maximum(self._grad_norm_max, norm)
        self._pending_tokens = int(tokens)
        return norm

    def end_step(self) -> None:
        """Close the optimizer step; at each log interval, sync once and write the metrics."""
        self.step += 1
        self._interval_steps += 1
        self._interval_tokens += self._pending_tokens
        self._pending_tokens = 0
        if self.telemetry is not None:
            self.telemetry.step_done(self.step)
            self.telemetry.sampling(self.step + 1)
        if self.step % self.log_every == 0 or self.step == self.max_steps:
            self._log_interval()
        every = self.config.checkpoint.every
        self._save_due = every is not None and self.step % every == 0

    def poll(self) -> None:
        """At this step boundary: take the periodic checkpoint (after any evaluation of this
        step, so it carries the val loss), then apply control commands and stop signals. While
        the run is paused this blocks, still serving commands, until resumed or stopped."""
        if self._save_due:
            self._save_due = False
            self.save("periodic")
        while True:
            with self.idle() if self.paused else contextlib.nullcontext():
                commands, signalled = self.commands.gather(wait=self.paused)
            if signalled and not self.stop_requested:
                self.event("signal", signal=self._signal_name())
                self.commands.stop(reason="signal")
            for request, pending in commands:
                self.commands.apply(request, pending)
            if not self.paused or self.stop_requested:
                return

    def record_eval(self, val_loss: float, **extra: float) -> None:
        """Log a validation result (already reduced over ranks) at the current step."""
        self.last_val = (self.step, val_loss)
        if self.telemetry is not None:
            self.telemetry.publish_eval(val_loss)
        record: dict[str, Any] = {
            "kind": "eval",
            "step": self.step,
            "time": time.time(),
            "val_loss": val_loss,
            "val_perplexity": math.exp(min(val_loss, 700.0)),
        }
        record.update(extra)
        self._emit(record)

    # ----------------------------------------------------------------- metrics

    def _log_interval(self) -> None:
        if self._interval_steps == 0:
            return
        summed = torch.stack(
            [
                self._loss_sum,
                self._grad_norm_last,
                self._grad_norm_max,
                torch.tensor(float(self._interval_tokens), device=self.device),
                self._skipped,
            ]
        ).double()
        parts = [all_reduce_sum(summed)]
        if self.telemetry is not None:  # flags: the worst rank wins, so every rank agrees
            parts.append(all_reduce_max_tensor(self.telemetry.stats()))
        values = torch.cat(parts).tolist()  # the one sync
        loss_sum, norm_last, norm_max, tokens, skipped = values[:5]
        elapsed = time.perf_counter() - self._interval_start
        steps = self._interval_steps
        self.tokens_total += int(tokens)
        self.last_train_loss = loss_sum / (steps * self.world_size)
        record: dict[str, Any] = {
            "kind": "train",
            "step": self.step,
            "time": time.time(),
            "train_loss": self.last_train_loss,
            "grad_norm": norm_last / self.world_size,
            "grad_norm_max": norm_max / self.world_size,
            "lr": self.learning_rate(),
            "tokens": self.tokens_total,
            "tokens_per_second": tokens / elapsed if elapsed > 0 else 0.0,
            "step_time_seconds": elapsed / steps,
        }
        data = self.state.get("data")
        if data is not None and hasattr(data, "position"):
            record["data_position"] = int(data.position)
        if self.scaler is not None:
            record["loss_scale"] = float(self.scaler.get_scale())
        record["skipped_steps"] = int(skipped / self.world_size)
        if self.telemetry is not None:
            self.telemetry.publish(record, values[5:], float(self._interval_tokens), elapsed)
            self._record_detections(record)
        self._emit(record)
        self._reset_interval()
        if not math.isfinite(loss_sum) and not self._nonfinite_checkpoint_taken:
            self._nonfinite_checkpoint_taken = True  # kept for post-mortem, marked unhealthy
            self.save("nonfinite", healthy=False)

    def _record_detections(self, record: dict[str, Any]) -> None:
        """Audit trail: a spike episode or a non-finite value seen in this interval."""
        for signal_name in SIGNALS:
            for event, counter in (("spike", "spikes_total"), ("nonfinite", "nonfinite_total")):
                key = f"{signal_name}_{counter}"
                total, seen = record[key], self._seen_totals.get(key, 0)
                if total > seen:
                    zscore = record[f"{signal_name}_zscore"]
                    self.event(event, signal=signal_name, total=total, zscore=zscore)
                self._seen_totals[key] = total

    def learning_rate(self) -> float | None:
        if self.optimizer is None:
            return None
        return float(self.optimizer.param_groups[0]["lr"])

    def _emit(self, record: dict[str, Any], *, display: bool = True) -> None:
        if display:
            self.last_record = record
        if self.run_dir is not None:
            self.run_dir.metrics.append(record)
        if self.wandb is not None:
            self.wandb.log(record)
        if display and self._display is not None:
            self._display.update(record)

    def event(self, kind: str, /, **fields: Any) -> None:
        """Append to the audit trail, events.jsonl (rank 0)."""
        if self.run_dir is not None:
            record = {"time": time.time(), "step": self.step, "event": kind, **fields}
            self.run_dir.events.append(record)

    # ----------------------------------------------------------------- checkpoints

    def _healthy_now(self) -> bool:
        """This rank: false inside a spike episode, or when the current interval or the last
        logged one saw a non-finite loss (DESIGN.md ``last_good``)."""
        interval_finite = bool(torch.isfinite(self._loss_sum).item())
        last = self.last_train_loss
        in_episode = self.telemetry is not None and self.telemetry.episode_active()
        return interval_finite and (last is None or math.isfinite(last)) and not in_episode

    def _checkpoint_payload(self) -> tuple[dict[str, Any], bool]:
        """Everything a bit-exact resume needs, and whether every rank is healthy now.
        Collective under torchrun: the RNG states and health of all ranks are gathered."""
        gathered = all_gather_objects((capture_rng(), self._healthy_now()), self._group)
        payload = {
            "format": CHECKPOINT_FORMAT,
            "step": self.step,
            "tokens": self.tokens_total,
            "lr_scale": self.lr_scale,
            "world_size": self.world_size,
            "rng": [rng for rng, _ in gathered],
            "state": {name: obj.state_dict() for name, obj in self.state.items()},
        }
        return payload, all(healthy for _, healthy in gathered)

    def save(
        self,
        reason: str = "manual",
        *,
        healthy: bool | None = None,
        wait: bool = False,
        on_done: Callable[[CheckpointMeta | BaseException], None] | None = None,
    ) -> None:
        """Checkpoint now (rank 0 writes). Async unless ``checkpoint.async`` is off or ``wait``;
        ``on_done`` gets the meta or the error once the checkpoint is on disk."""
        if self._state_mixed:
            log.error("not saving: a failed restore left the state mixed")
            return
        payload, all_healthy = self._checkpoint_payload()
        self._last_saved_step = self.step  # on every rank: finish() must agree on the collective
        if self.checkpoints is None:
            return
        store = self.checkpoints
        healthy = all_healthy if healthy is None else healthy
        val = self.last_val[1] if self.last_val and self.last_val[0] == self.step else None
        meta_fields: dict[str, Any] = {
            "tokens": self.tokens_total,
            "healthy": healthy,
            "reason": reason,
            "train_loss": self.last_train_loss,
            "val_loss": val,
        }
        store.wait()  # at most one save in flight; its end must not clear this one's gauge
        started = time.perf_counter()
        if self.telemetry is not None:
            self.telemetry.checkpoint_started()

        def finished(result: CheckpointMeta | BaseException) -> None:
            failed = isinstance(result, BaseException)
            seconds = time.perf_counter() - started
            if self.telemetry is not None:
                self.telemetry.checkpoint_finished(None if failed else seconds, store.named())
            if isinstance(result, BaseException):
                log.error("checkpoint at step %d failed: %s", payload["step"], result)
                self.event("checkpoint_failed", reason=reason, error=str(result))
            else:
                self.event(
                    "checkpoint",
                    name=result.name,
                    reason=reason,
                    seconds=seconds,
                    healthy=result.healthy,
                    checkpoint_step=result.step,
                )
            if on_done is not None:
                on_done(result)

        if self.config.checkpoint.async_save and not wait:
            store.save_async(self.step, snapshot(payload), on_done=finished, **meta_fields)
            return
        try:
            meta = store.save(self.step, payload, **meta_fields)
        except Exception as exc:  # a failed save must not stop training
            finished(exc)
            return
        finished(meta)

    def restore(self, target: Target, *, skip_batches: int = 0) -> dict[str, Any]:
        """Load a checkpoint into every registered state on every rank; then skip batches.
        Returns what was restored: checkpoint name and step. A checkpoint that cannot be
        loaded raises RestoreError and changes nothing; one that fails halfway through being
        applied stops training (its state would be a mix)."""
        data = self.state.get("data")
        if skip_batches and (data is None or not hasattr(data, "skip")):
            raise RestoreError("skip_batches needs registered data with a skip() method")
        loaded: list[Any] = [None]
        if self.checkpoints is not None:
            self.checkpoints.wait()
            try:
                meta, payload = self.checkpoints.load(target)
                loaded = [{"meta": meta, "payload": payload}]
            except Exception as exc:
                loaded = [f"{exc}"]
        loaded = broadcast_objects(loaded, self._group)
        if isinstance(loaded[0], str):
            raise RestoreError(loaded[0], not_found=True)
        meta, payload = loaded[0]["meta"], loaded[0]["payload"]
        missing = sorted(n for n in set(self.state) - set(payload["state"]) if not _optional(n))
        if missing:
            raise RestoreError(f"{meta.name} has no state for {', '.join(missing)}")
        failure: Exception | None = None
        try:
            self._apply_payload(payload)
        except Exception as exc:
            failure = exc
        if all_reduce_max([int(failure is not None)], self._group)[0]:  # every rank agrees
            self.stop_requested = True
            self._state_mixed = True  # never save this state
            why = failure or "on another rank"
            raise RestoreError(
                f"{meta.name} failed halfway ({why}); training stops to protect the run"
            ) from failure
        if skip_batches:
            data.skip(skip_batches)  # type: ignore[union-attr]
        self.last_train_loss = meta.train_loss
        self.last_val = (meta.step, meta.val_loss) if meta.val_loss is not None else None
        self._nonfinite_checkpoint_taken = False  # a new divergence gets its own post-mortem
        if self.checkpoints is not None:  # later checkpoints belong to the timeline we left
            left = self.checkpoints.supersede_after(meta)
            if left:
                self.event("superseded", checkpoints=left, restored=meta.name)
            if self.telemetry is not None:
                self.telemetry.checkpoint_finished(None, self.checkpoints.named())
        return {"checkpoint": meta.name, "step": int(payload["step"])}

    def _apply_payload(self, payload: dict[str, Any]) -> None:
        """Optional state (detectors) first and forgivingly, then the training state."""
        for name, obj in sorted(self.state.items(), key=lambda item: not _optional(item[0])):
            saved = payload["state"].get(name)
            if not _optional(name):
                obj.load_state_dict(saved)
                continue
            try:
                obj.load_state_dict(saved)
            except (ValueError, KeyError, TypeError, RuntimeError) as exc:
                log.warning("%s not restored (%s): it starts afresh", name, exc or "absent")
        rng = payload["rng"]
        restore_rng(rng[self.rank] if len(rng) == self.world_size else rng[0])
        self.step = int(payload["step"])
        self.tokens_total = int(payload["tokens"])
        self.lr_scale = float(payload["lr_scale"])
        self._last_saved_step = self.step
        self._save_due = False
        self._reset_interval()
        if self.telemetry is not None:  # counters count on from the restored totals
            self.telemetry.resync_totals()

    def set_paused(self, paused: bool) -> None:
        """Pause or resume at this boundary (every rank, so every rank's gauge says so)."""
        self.paused = paused
        if self.telemetry is not None:
            self.telemetry.paused(paused)

    def set_lr_scale(self, scale: float) -> None:
        """Multiply the learning rate by ``scale`` relative to the schedule, from now on."""
        ratio = scale / self.lr_scale
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] *= ratio
        base_lrs = getattr(self.scheduler, "base_lrs", None)
        if base_lrs is not None:
            self.scheduler.base_lrs = [b * ratio for b in base_lrs]  # type: ignore[union-attr]
        self.lr_scale = scale

    def finish(self) -> None:
        """Training ended normally: save the final state (``checkpoint.save_on_exit``)."""
        if self.config.checkpoint.save_on_exit and self._last_saved_step != self.step:
            self.save("final", wait=True)

    # ----------------------------------------------------------------- control and signals

    def _start_control(self) -> ControlServer | None:
        cfg = self.config.control
        if not cfg.socket and cfg.tcp is None:
            return None
        tcp = None
        if cfg.tcp is not None:
            host, _, port = cfg.tcp.rpartition(":")
            tcp = (host, int(port))
        try:
            server = ControlServer(
                socket_path=self.path / SOCKET_NAME if cfg.socket else None,
                tcp=tcp,
                token=os.environ.get(cfg.token_env) if tcp else None,
                on_reject=self._record_rejected,
            )
        except ListenError as exc:
            raise ConfigError(f"control.{exc.endpoint}: {exc}") from None
        server.start()
        return server

    def _record_rejected(self, request_id: str | None, code: Any, message: str) -> None:
        if request_id is not None:  # a command we could identify; garbage lines are not events
            self.event(
                "command", id=request_id, ok=False, error={"code": code.value, "message": message}
            )

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in STOP_SIGNALS:
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """First SIGTERM/SIGINT: save and stop at the next boundary; a second one: default."""
        self._signal = signum
        for sig, previous in self._previous_handlers.items():
            signal.signal(sig, previous)

    def _signal_name(self) -> str | None:
        return signal.Signals(self._signal).name if self._signal is not None else None

    @property
    def signal_pending(self) -> bool:
        return self._signal is not None

    def close(self, *, failed: bool = False) -> None:
        """Log the last partial interval, wait for saves, and release everything. After a
        failure nothing collective runs (the other ranks may be elsewhere)."""
        if not failed:
            self._log_interval()
        for signum, previous in self._previous_handlers.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, previous)
        if self.checkpoints is not None:
            self.checkpoints.wait()
        if self.control is not None:
            self.control.close()
        if self.telemetry is not None:
            self.telemetry.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self._display is not None:
            self._display.close()
            self._display = None
        if self.run_dir is not None:
            self.event("close", stop_requested=self.stop_requested)
            self.run_dir.mark_finished(
                "failed" if failed else "stopped" if self.stop_requested else "completed"
            )
            self.run_dir.close()

    def __enter__(self) -> Guard:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.finish()
        self.close(failed=exc_type is not None)

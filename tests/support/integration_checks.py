"""What the framework-callback tests share: an operator that drives a run over its control
socket while the framework trains in the test's own thread, a live scrape, and the checks on
the run directory afterwards."""

from __future__ import annotations

import json
import math
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

from lossguard.agent.recovery import weights_digest
from lossguard.common.control.client import ControlClient, ControlError
from lossguard.common.rundir.names import SOCKET_NAME
from lossguard.monitor.sources.discovery import discover_agents
from tests.support.host_reads import count_host_reads
from tests.support.processes import wait_for
from tests.support.runs import events, step_records

RUN_ID = "run"
NAN_STEP = 3  # the optimizer step whose loss the test models make NaN


def settings(**sections: dict[str, Any]) -> dict[str, Any]:
    """A lossguard config for the callbacks: exporter on a free port, a log line every 5."""
    return {"telemetry": {"host": "127.0.0.1", "port": 0}, "train": {"log_every": 5}, **sections}


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float:
    """One series of this run's rank 0, which must be there."""
    key = (name, frozenset({"run_id": RUN_ID, "rank": "0", **labels}.items()))
    assert key in samples, f"{name}{labels} not scraped"
    return samples[key]


class Operator(threading.Thread):
    """Runs ``operate`` against the run beside the training; ``join`` re-raises its failure."""

    def __init__(self, runs_root: Path, model: nn.Module) -> None:
        super().__init__(daemon=True)
        self.runs_root = runs_root
        self.model = model
        self.seen: dict[str, Any] = {}
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            operate(self.runs_root / RUN_ID, self.runs_root, self.model, self.seen)
        except BaseException as exc:
            self.failure = exc
            stop_quietly(self.runs_root / RUN_ID)  # do not leave the training paused

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        assert not self.is_alive(), "the operator did not finish"
        if self.failure is not None:
            raise self.failure


def stop_quietly(run_dir: Path) -> None:
    try:
        with ControlClient(socket_path=run_dir / SOCKET_NAME, timeout=60) as ctl:
            ctl.request("stop")
    except Exception:
        pass  # the run is gone already


def operate(run_dir: Path, runs_root: Path, model: nn.Module, seen: dict[str, Any]) -> None:
    """Find the run as the monitor does; pause it and scrape it; save; refuse a rollback the
    framework cannot do; roll back to the save (weights as saved); stop it."""
    socket_path = run_dir / SOCKET_NAME
    wait_for((run_dir / "agent.json").exists, 60, "agent.json (written after the socket)")
    info = json.loads((run_dir / "agent.json").read_text())
    found = [(t.run_id, t.url) for t in discover_agents(runs_root)]
    assert found == [(RUN_ID, info["metrics_url"])]
    with ControlClient(socket_path=socket_path, timeout=60) as ctl:

        def step() -> int:
            return int(ctl.request("status")["step"])

        wait_for(lambda: step() > 10, 60, "a clean log interval after the NaN one")
        paused = ctl.request("pause")["step"]
        status = ctl.request("status")
        assert status["paused"] and status["step"] == paused
        seen["scrape"] = scrape(info["metrics_url"])
        saved = ctl.request("save")
        assert saved["step"] == paused
        digest = weights_digest(model)
        with pytest.raises(ControlError, match=r"bad_request: skip_batches: .* cannot rewind"):
            ctl.request("rollback", {"target": paused, "skip_batches": 0})
        ctl.request("resume")
        wait_for(lambda: step() >= paused + 4, 60, "four more steps")
        ctl.request("pause")
        seen["rollback"] = ctl.request("rollback", {"target": paused, "skip_batches": "abandoned"})
        assert weights_digest(model) == digest
        assert step() == paused
        ctl.request("resume")
        wait_for(lambda: step() >= paused + 2, 60, "steps after the rollback")
        seen["stop"] = ctl.request("stop")
    seen["paused_at"], seen["saved"] = paused, saved


def check_live_metrics(seen: dict[str, Any]) -> None:
    """The scrape taken while paused: Guard's catalogue under the run's labels, the NaN
    counted and its update skipped."""
    samples = seen["scrape"]
    assert sample(samples, "lossguard_step") == seen["paused_at"]
    assert sample(samples, "lossguard_paused") == 1
    names = ("train_loss", "val_loss", "grad_norm", "learning_rate")
    for name in (f"lossguard_{n}" for n in names):
        assert math.isfinite(sample(samples, name)), name
    assert sample(samples, "lossguard_grad_norm") > 0
    assert sample(samples, "lossguard_tokens_per_second") > 0
    assert sample(samples, "lossguard_mfu_ratio") > 0
    assert sample(samples, "lossguard_device_memory_bytes", kind="allocated") > 0
    assert sample(samples, "lossguard_nonfinite_total", signal="loss") == 1
    assert sample(samples, "lossguard_nonfinite_step", signal="loss") == NAN_STEP
    assert sample(samples, "lossguard_skipped_steps_total", reason="nonfinite") == 1


def check_run_directory(run_dir: Path, seen: dict[str, Any]) -> list[Path]:
    """After training: the rollback went back to the save, the stop ended the run, and each
    of save and stop had the framework write its own checkpoint (returned, oldest first)."""
    rollback, paused = seen["rollback"], seen["paused_at"]
    assert rollback["to_step"] == paused and rollback["checkpoint"] == seen["saved"]["name"]
    assert rollback["skipped_batches"] == rollback["from_step"] - paused  # one batch a step
    assert json.loads((run_dir / "agent.json").read_text())["exit"] == "stopped"
    trail = events(run_dir)
    assert [e["args"]["skip_batches"] for e in trail if e.get("cmd") == "rollback"] == [
        0,
        "abandoned",
    ]
    saves = [Path(e["path"]) for e in trail if e["event"] == "framework_checkpoint"]
    assert len(saves) == 2 and all(path.exists() for path in saves)
    nonfinite = [(e["signal"], e["step"]) for e in trail if e["event"] == "nonfinite"]
    assert nonfinite == [("loss", 5), ("grad_norm", 5)]  # audited at the interval's end
    return saves


def check_resumed(run_dir: Path, resumed_at: int, last: int) -> None:
    """After a framework resume: the run directory went on at the framework's step, the
    previous attempt's files moved aside, and the run completed."""
    assert json.loads((run_dir / "agent.json").read_text())["exit"] == "completed"
    (aside,) = run_dir.glob("overwritten-*")
    assert (aside / "checkpoints").is_dir() and (aside / "events.jsonl").is_file()
    assert [e["step"] for e in events(run_dir) if e["event"] == "continued"] == [resumed_at]
    logged = list(step_records(run_dir))
    assert min(logged) > resumed_at and max(logged) == last


def per_call(
    callback: object,
    hooks: tuple[str, ...],
    gauge: Callable[[], float],
    patch: Callable[[object, str, Any], None] = setattr,
) -> list[float]:
    """Wrap the callback's ``hooks`` (on the instance, so the framework calls the wrapped
    ones) to record, for each call, how much ``gauge`` grew during it."""
    grown: list[float] = []
    for hook in hooks:
        method: Callable[..., Any] = getattr(callback, hook)

        def measured(*args: Any, _method: Callable[..., Any] = method, **kw: Any) -> Any:
            before = gauge()
            result = _method(*args, **kw)
            grown.append(gauge() - before)
            return result

        patch(callback, hook, measured)
    return grown


def count_hot_reads(
    monkeypatch: pytest.MonkeyPatch, callback: object, hooks: tuple[str, ...]
) -> list[float]:
    """Host reads (device syncs) made inside the callback's per-micro-batch and pre-optimizer
    hooks, one count per call."""
    reads = count_host_reads(monkeypatch)
    return per_call(callback, hooks, lambda: len(reads), monkeypatch.setattr)


def all_finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())

"""Shared fixtures: tiny configs on a small slice of the stdlib corpus, and CLI helpers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from lossguard.agent.config import Config, parse_config
from tests.live_marker import (  # noqa: F401 (the live marker's hooks)
    pytest_configure,
    pytest_runtest_protocol,
    pytest_runtest_teardown,
)

# One intra-op thread per test process: pytest-xdist runs one worker per core, and torch's
# default (a thread per core in every worker) oversubscribes the cores several times over.
torch.set_num_threads(1)

# Every Python process a test starts prints its threads' stacks on a fatal signal: one that
# will not stop gets SIGABRT from stop_process and leaves where it hung in its log.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

REPO = Path(__file__).resolve().parent.parent


def tiny_settings(runs: Path, cache: Path, **sections: Any) -> dict[str, Any]:
    """A config dict for a model small enough to train in seconds on 2 CPU cores."""
    data: dict[str, Any] = {
        "run": {"dir": str(runs), "id": "tiny", "seed": 7, "device": "cpu"},
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
        "data": {"kind": "text", "max_bytes": 400_000, "cache_dir": str(cache)},
        # a configured peak: measuring this CPU's (0.3 s of matmuls) at every agent start cost
        # the suite more than a minute; tests of the measured peak set it back to None
        "telemetry": {"host": "127.0.0.1", "port": 0, "peak_flops": 1e11},
        "train": {
            "max_steps": 20,
            "batch_size": 8,
            "lr": 3e-3,
            "warmup_steps": 5,
            "eval_every": 10,
            "eval_batches": 4,
            "log_every": 5,
        },
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values} if isinstance(values, dict) else values
    return data


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tokenised-corpus cache for the whole session."""
    return tmp_path_factory.mktemp("corpus-cache")


@pytest.fixture
def tiny_config(tmp_path: Path, corpus_cache: Path):
    """Build a tiny Config: ``tiny_config(train={"max_steps": 30}, precision={...})``."""

    def build(**sections: dict[str, Any]) -> Config:
        return parse_config(tiny_settings(tmp_path / "runs", corpus_cache, **sections))

    return build


def supervisor_argv(run_dir: Path, *options: str, command: list[str]) -> list[str]:
    """``lossguard-supervise run --run-dir RUN_DIR OPTIONS -- COMMAND``."""
    cli = [sys.executable, "-m", "lossguard.supervisor.cli", "run"]
    return [*cli, "--run-dir", str(run_dir), *options, "--", *command]


def run_cli(
    *args: str, timeout: float = 240, module: str = "lossguard.agent.cli", **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m lossguard.agent.cli ARGS`` (or another ``module``) with its output
    captured (not a TTY)."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        check=False,
    )


HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")


def count_host_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on, record every call that reads a tensor to the host (a device sync)."""
    reads: list[str] = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *args: Any, _original=original, _name=name, **kw: Any) -> Any:
            reads.append(_name)
            return _original(self, *args, **kw)

        monkeypatch.setattr(torch.Tensor, name, read)
    return reads


def wait_for(predicate, timeout: float, what: str, interval: float = 0.005):
    """Poll ``predicate`` until it returns something truthy; at the deadline, fail naming it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def start_agent(
    config: Path,
    *args: str,
    env: dict[str, str] | None = None,
    module: str = "lossguard.agent.cli",
) -> subprocess.Popen:
    """Start ``lossguard-agent run CONFIG ARGS`` in the background (output captured); ``module``
    may be a stand-in that runs it (tests/fake_gpu_agent.py)."""
    return subprocess.Popen(
        [sys.executable, "-m", module, "run", str(config), "--no-progress", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def write_config(path: Path, settings: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(settings))
    return path


def step_records(run_dir: Path) -> dict[int, float]:
    """Train loss per step from metrics.jsonl, the last line for a step winning (as after a
    resume or rollback replays steps)."""
    losses: dict[int, float] = {}
    for record in json_lines(run_dir / "metrics.jsonl"):
        if record["kind"] == "train":
            losses[record["step"]] = record["train_loss"]
    return losses


def last_step(run_dir: Path) -> int:
    """The step of the newest whole record in metrics.jsonl."""
    return int(json_lines(run_dir / "metrics.jsonl")[-1]["step"])


def events(run_dir: Path) -> list[dict[str, Any]]:
    return json_lines(run_dir / "events.jsonl")


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file a live process appends to; the text after the last
    newline is a line still being written and is left out."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line]


def monitor_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``lossguard-monitor ARGS`` with its output captured."""
    return run_cli(*args, timeout=120, module="lossguard.monitor.cli")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def stalled_rules(tmp_path: Path) -> Path:
    """The shipped rules with TrainingStalled after 3 s without a step, for 2 s (300 s and 5m
    shipped: tests/bench_supervisor.py runs those), written into ``tmp_path``."""
    rules = yaml.safe_load((REPO / "alerts" / "lossguard.rules.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "TrainingStalled":
                rule["expr"] = rule["expr"].replace("> 300", "> 3")
                rule["for"] = "2s"
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return path


def write_monitor_config(path: Path, rules: list[Path], **sections: Any) -> tuple[Path, str]:
    """A monitor.yml evaluating ``rules`` every second, its state beside it, listening on a
    free port; returns the file and the monitor's base URL."""
    port = free_port()
    settings: dict[str, Any] = {
        "rules": {"files": [str(r) for r in rules], "evaluation_interval": "1s"},
        "state": {"path": str(path.parent / "state.db")},
        "listen": {"host": "127.0.0.1", "port": port},
        **sections,
    }
    path.write_text(yaml.safe_dump(settings))
    return path, f"http://127.0.0.1:{port}"


def start_monitor(config: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``lossguard-monitor run --config CONFIG ARGS`` with ``env`` added to the
    environment (stderr captured to a file beside the config, so a long run never blocks on a
    full pipe)."""
    log = open(config.with_suffix(".log"), "a")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(
        [sys.executable, "-m", "lossguard.monitor.cli", "run", "--config", str(config), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def alert_events(db: Path) -> list[dict[str, Any]]:
    """The monitor's recorded alert transitions, read-only, oldest first."""
    if not db.exists():
        return []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        try:
            rows = conn.execute(
                "SELECT kind, fingerprint, labels, at FROM alert_events ORDER BY id"
            ).fetchall()
        except sqlite3.OperationalError:  # the monitor has not created its tables yet
            return []
    return [
        {"kind": kind, "fingerprint": fp, "labels": json.loads(labels), "at": at}
        for kind, fp, labels, at in rows
    ]


def stop_process(process: subprocess.Popen, timeout: float = 30) -> int:
    """SIGTERM, then wait; if it does not end in ``timeout``: a Python process gets SIGABRT
    first (its threads' stacks go to its stderr, see PYTHONFAULTHANDLER above: where it hung),
    then SIGKILL."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            if _runs_python(process):
                process.send_signal(signal.SIGABRT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(10)
            process.kill()
            process.wait()
    return int(process.returncode)


def _runs_python(process: subprocess.Popen) -> bool:
    try:
        return os.path.realpath(f"/proc/{process.pid}/exe") == os.path.realpath(sys.executable)
    except OSError:
        return False


def stop_processes(*processes: subprocess.Popen, timeout: float = 30) -> list[int]:
    """:func:`stop_process` for each, all SIGTERMed first so that their shutdowns (an agent's
    final save) overlap; their exit codes, in order."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    return [stop_process(process, timeout) for process in processes]


def corpus_slice(cache: Path) -> Path:
    """``tiny_settings``' corpus slice as one file in ``cache`` (made once), byte for byte (less
    a character its cut split): with ``data.path`` set to it a run trains on the same tokens,
    without walking the standard library at its start."""
    from lossguard.agent.train.corpus import TOKEN_DTYPE, prepare_text_corpus

    path = cache / "tiny-slice.txt"
    if not path.exists():
        data = parse_config(tiny_settings(cache, cache)).data
        tokens = prepare_text_corpus(data, cache)
        splits = [np.fromfile(tokens / f"{s}.bin", dtype=TOKEN_DTYPE) for s in ("train", "val")]
        text = np.concatenate(splits).astype(np.uint8).tobytes().decode("utf-8", errors="ignore")
        partial = path.with_suffix(f".{os.getpid()}")
        partial.write_bytes(text.encode())
        partial.rename(path)
    return path


def sliced_settings(runs: Path, cache: Path, **sections: Any) -> dict[str, Any]:
    """``tiny_settings`` on ``corpus_slice``: the same run, started faster."""
    settings = tiny_settings(runs, cache, **sections)
    settings["data"]["path"] = str(corpus_slice(cache))
    return settings


@pytest.fixture
def sliced_config(tmp_path: Path, corpus_cache: Path):
    """``tiny_config`` on ``corpus_slice``: the same Config, its Trainer built faster."""

    def build(**sections: dict[str, Any]) -> Config:
        return parse_config(sliced_settings(tmp_path / "runs", corpus_cache, **sections))

    return build

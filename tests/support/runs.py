"""Tiny run configs (a model that trains in seconds on 2 CPU cores, on a slice of the stdlib
corpus), monitor configs, and reading what a run or a monitor wrote."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from lossguard.agent.config import parse_config
from tests.support.processes import REPO, free_port


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


def throttle(seconds: float, from_step: int = 1) -> dict[str, Any]:
    """A ``slow_step`` fault: every step from ``from_step`` on takes at least ``seconds``, so a
    run that waits on other processes does not take a core meanwhile (the last ``slow_step``
    in a run's faults wins)."""
    return {"kind": "slow_step", "step": from_step, "duration": 10**8, "seconds": seconds}


def write_config(path: Path, settings: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(settings))
    return path


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file a live process appends to; the text after the last
    newline is a line still being written and is left out."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line]


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


def stalled_rules(tmp_path: Path) -> Path:
    """The shipped rules with TrainingStalled after 3 s without a step, for 2 s (300 s and 5m
    shipped: benchmarks/bench_supervisor.py runs those), written into ``tmp_path``."""
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

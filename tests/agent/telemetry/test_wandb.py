"""W&B mirroring, offline: records land in the run's transaction log, read back from disk."""

from __future__ import annotations

import json
import logging
import math
import struct
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lossguard.agent.config import WandbConfig
from lossguard.agent.telemetry.wandb_logger import WandbLogger, numeric_fields, resolve_mode
from lossguard.common.config import ConfigError
from tests.support.processes import wait_for

pytestmark = pytest.mark.live

FAKE_KEY = "lossguard-test-fake-api-key-0123456789abcdef"


@pytest.fixture
def wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Offline, silent W&B with every folder it writes in tmp_path; yields the runs' root.
    wandb reads the environment once per process: tear its singleton down around each test."""
    wandb = pytest.importorskip("wandb")
    wandb.teardown()
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var, folder in [
        ("WANDB_DIR", "wandb-dir"),
        ("WANDB_CONFIG_DIR", "wandb-config"),
        ("WANDB_CACHE_DIR", "wandb-cache"),
        ("WANDB_DATA_DIR", "wandb-data"),
    ]:
        monkeypatch.setenv(var, str(tmp_path / folder))
    yield tmp_path / "runs"
    wandb.teardown()


# ------------------------------------------------------------- reading an offline run back

_BLOCK = 32 * 1024  # the transaction log is a LevelDB-style log: 32 KiB blocks of chunks
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path) -> Iterator[Any]:
    """The protobuf Records of a run-<id>.wandb file (header ':W&B', magic 0xBEE1, version 0;
    then chunks of crc32(type + data) u32, length u16, type u8, data)."""
    pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")
    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or kind == 0:  # block trailer / padding
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        if len(chunk) < length:  # still being written
            return
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"bad chunk at {pos} in {path}"
        pos += 7 + length
        pending += chunk
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


class OfflineRun:
    """One offline-run-* folder: its run record, history rows and last summary."""

    def __init__(self, path: Path) -> None:
        self.run: Any = None
        self.rows: list[dict[str, Any]] = []
        self.summary: dict[str, Any] = {}
        self.complete = False  # the exit record is there
        for record in _records(path):
            kind = record.WhichOneof("record_type")
            self.complete = self.complete or kind == "exit"
            if kind == "run":
                self.run = record.run
            elif kind == "history":
                self.rows.append(
                    {_key(item): json.loads(item.value_json) for item in record.history.item}
                )
            elif kind == "summary":
                for item in record.summary.update:
                    self.summary[_key(item)] = json.loads(item.value_json)


def offline_runs(root: Path, run_id: str) -> list[OfflineRun]:
    """The offline runs of ``run_id`` under ``root``, oldest first. wandb-core may still be
    writing a log when ``finish()`` returns: wait for each one's exit record."""
    paths = list(root.glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb"))
    assert paths, f"no offline run {run_id} under {root}"

    def complete() -> list[OfflineRun] | None:
        runs = [OfflineRun(path) for path in paths]
        return runs if all(r.complete for r in runs) else None

    runs = wait_for(
        complete, timeout=30, what=f"wandb to close the logs of {run_id}", interval=0.05
    )
    return sorted(runs, key=lambda r: r.run.start_time.ToNanoseconds())


def train(step: int, loss: float) -> dict[str, Any]:
    return {
        "kind": "train",
        "step": step,
        "time": 1.7e9 + step,
        "train_loss": loss,
        "grad_norm": 1.0 / step,
        "lr": 1e-3,
        "tokens": 1024 * step,
        "tokens_per_second": 5000.0 + step,
        "fp8": {"amax": {"w": 2.0 * step}, "note": "text"},
        "healthy": True,
        "reason": None,
    }


def evaluation(step: int, loss: float) -> dict[str, Any]:
    return {"kind": "eval", "step": step, "time": 1.7e9 + step, "val_loss": loss}


def make(root: Path, run_id: str, *, resume: bool = False, **cfg: Any) -> WandbLogger:
    return WandbLogger(
        WandbConfig(enabled=True, **cfg),
        run_id=run_id,
        run_dir=root / run_id,
        config={"train": {"lr": 1e-3}, "run": {"id": run_id}},
        resume=resume,
    )


# ------------------------------------------------------------------------------ tests


def test_records_and_summaries_land_in_the_offline_run(wandb_env: Path) -> None:
    logger = make(wandb_env, "r1", tags=["ci"])
    assert logger.mode == "offline" and logger.run.offline
    assert logger.run.id == "r1"
    for step in range(1, 31):
        logger.log(train(step, loss=10.0 / step))
        if step % 10 == 0:
            logger.log(evaluation(step, loss=20.0 / step))
    logger.finish()
    logger.finish()  # idempotent

    (run,) = offline_runs(wandb_env / "r1", "r1")  # default dir: the run directory
    assert (run.run.run_id, run.run.display_name, run.run.project) == ("r1", "r1", "lossguard")
    assert list(run.run.tags) == ["ci"]
    rows = {row["step"]: row for row in run.rows}
    assert sorted(rows) == list(range(1, 31))
    assert all(row["_step"] == row["step"] for row in run.rows)
    for step, row in rows.items():
        assert math.isclose(row["train_loss"], 10.0 / step)
        assert row["tokens"] == 1024 * step and row["fp8/amax/w"] == 2.0 * step
        assert not {"kind", "healthy", "reason", "fp8/note"} & row.keys()
        assert ("val_loss" in row) == (step % 10 == 0)  # eval shares the train row of its step
    assert math.isclose(rows[30]["val_loss"], 20.0 / 30)
    assert math.isclose(run.summary["train_loss"]["min"], 10.0 / 30)
    assert math.isclose(run.summary["val_loss"]["min"], 20.0 / 30)
    assert run.summary["grad_norm"]["max"] == 1.0
    assert math.isclose(run.summary["tokens_per_second"]["mean"], 5015.5)


def test_a_resumed_logger_continues_the_same_run(wandb_env: Path) -> None:
    first = make(wandb_env, "r2")
    for step in range(1, 11):
        first.log(train(step, loss=1.0))
    first.finish()
    second = make(wandb_env, "r2", resume=True)  # resumed from a checkpoint at step 7
    assert second.run.id == "r2"
    for step in range(8, 16):
        second.log(train(step, loss=2.0))
    second.finish()

    runs = offline_runs(wandb_env / "r2", "r2")
    assert [r.run.run_id for r in runs] == ["r2", "r2"]
    assert [row["step"] for row in runs[0].rows] == list(range(1, 11))
    assert [row["step"] for row in runs[1].rows] == list(range(8, 16))
    assert all(row["train_loss"] == 2.0 for row in runs[1].rows)


def test_a_step_behind_the_last_one_gets_its_own_row(
    wandb_env: Path, caplog: pytest.LogCaptureFixture
) -> None:
    logger = make(wandb_env, "r3")
    for step in range(1, 11):
        logger.log(train(step, loss=1.0))
    logger.log(evaluation(10, loss=1.5))
    with caplog.at_level(logging.WARNING, logger="lossguard.agent.telemetry.wandb_logger"):
        for step in range(6, 13):  # rolled back to step 5
            logger.log(train(step, loss=2.0))
            if step == 8:
                logger.log(evaluation(8, loss=2.5))
    logger.finish()
    warnings = [r for r in caplog.records if r.name == "lossguard.agent.telemetry.wandb_logger"]
    assert len(warnings) == 1 and "step 6 is behind" in warnings[0].getMessage()

    (run,) = offline_runs(wandb_env / "r3", "r3")
    assert [row["step"] for row in run.rows] == [*range(1, 11), *range(6, 13)]
    assert [row["_step"] for row in run.rows] == list(range(1, 18))  # W&B's own step only grows
    assert run.rows[9]["train_loss"] == 1.0 and run.rows[9]["val_loss"] == 1.5  # not overwritten
    assert [row["train_loss"] for row in run.rows[10:]] == [2.0] * 7
    assert [row.get("val_loss") for row in run.rows[10:]] == [None, None, 2.5, *[None] * 4]


def test_the_api_key_never_reaches_the_run_files(
    wandb_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    elsewhere = wandb_env.parent / "wandb-out"
    logger = make(wandb_env, "r4", mode="offline", dir=elsewhere)
    assert logger.mode == "offline" and logger.run.offline
    assert logger.run.settings.api_key == FAKE_KEY  # wandb did pick it up
    for step in range(1, 6):
        logger.log(train(step, loss=1.0))
    logger.finish()

    assert offline_runs(elsewhere, "r4")[0].rows
    files = [p for root in (wandb_env, elsewhere) for p in root.rglob("*") if p.is_file()]
    assert files
    for path in files:
        assert FAKE_KEY.encode() not in path.read_bytes(), path
    out, err = capsys.readouterr()
    assert FAKE_KEY not in out + err


def test_auto_mode_is_offline_without_an_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert resolve_mode("auto") == "offline"
    assert resolve_mode("online") == "online"
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    assert resolve_mode("auto") == "online"
    assert resolve_mode("offline") == "offline"


def test_numeric_fields_flatten_nested_numbers() -> None:
    record = {"kind": "x", "a": 1, "b": 2.5, "ok": False, "n": {"c": 3, "d": {"e": 4.0}, "s": "t"}}
    assert dict(numeric_fields(record)) == {"a": 1, "b": 2.5, "n/c": 3, "n/d/e": 4.0}


def test_a_missing_wandb_package_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    with pytest.raises(ConfigError) as info:
        make(tmp_path, "r5")
    assert str(info.value) == (
        "wandb.enabled: the wandb package is not installed (pip install 'lossguard[wandb]')"
    )


def test_a_training_run_mirrors_its_metrics_to_wandb(wandb_env: Path, corpus_cache: Path) -> None:
    from lossguard.agent.config import parse_config
    from lossguard.agent.train.trainer import Trainer
    from tests.support.runs import tiny_settings

    settings = tiny_settings(
        wandb_env, corpus_cache, train={"max_steps": 20, "log_every": 5}, wandb={"enabled": True}
    )
    trainer = Trainer(parse_config(settings), progress=False)
    try:
        trainer.fit()
    finally:
        trainer.close()
    (run,) = offline_runs(wandb_env / "tiny", "tiny")
    rows = {row["step"]: row for row in run.rows}
    assert sorted(rows) == [0, 5, 10, 15, 20]
    logged = [
        json.loads(line)
        for line in (wandb_env / "tiny/metrics.jsonl").read_text().split("\n")
        if line
    ]
    for record in logged:
        if record["kind"] == "train":
            assert math.isclose(rows[record["step"]]["train_loss"], record["train_loss"])
            assert math.isclose(rows[record["step"]]["mfu"], record["mfu"])
    assert math.isclose(rows[20]["val_loss"], logged[-1]["val_loss"])

"""Real training of tiny GPTs on CPU: precisions, run directory, CLI, torchrun, bench."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from torch import nn

from lossguard.agent.config import Config, load_config
from lossguard.agent.train.trainer import FitResult, Trainer
from tests.support.processes import REPO, run_cli
from tests.support.runs import sliced_settings

pytestmark = pytest.mark.live


def fit(cfg: Config) -> tuple[FitResult, Trainer]:
    trainer = Trainer(cfg, progress=False)
    try:
        return trainer.fit(), trainer
    finally:
        trainer.close()


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_loss_falls_on_the_demo_corpus(tmp_path: Path, corpus_cache: Path) -> None:
    overrides = [
        f"run.dir={tmp_path}",
        "run.id=demo",
        f"data.cache_dir={corpus_cache}",
        "train.max_steps=100",
        "train.eval_every=50",
        "train.eval_batches=5",  # the demo's 20 measure the same fall, 4x slower
        "telemetry.host=127.0.0.1",
        "telemetry.port=0",
    ]
    result, _ = fit(load_config(REPO / "configs/demo.yaml", overrides))
    evals = records(result.run_dir, "eval")
    assert [e["step"] for e in evals] == [0, 50, 100]
    start, end = evals[0]["val_loss"], evals[-1]["val_loss"]
    assert start == pytest.approx(math.log(256), abs=0.3)  # untrained: uniform over bytes
    assert end < start - 2.0, (start, end)


@pytest.mark.parametrize(
    ("dtype", "recipe"),
    [("fp32", None), ("bf16", None), ("fp16", None), ("fp8", "tensorwise"), ("fp8", "rowwise")],
)
def test_each_precision_trains(sliced_config, dtype: str, recipe: str | None) -> None:
    precision = {"dtype": dtype} | ({"fp8_recipe": recipe} if recipe else {})
    result, trainer = fit(sliced_config(precision=precision, train={"max_steps": 40}))
    train = records(result.run_dir, "train")
    evals = records(result.run_dir, "eval")
    assert all(math.isfinite(r["train_loss"]) for r in train)
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 1.0
    assert (trainer.scaler is not None) == (dtype == "fp16")
    if dtype == "fp8":
        from torchao.float8.float8_linear import Float8Linear

        linears = [
            m
            for name, m in trainer.raw_model.named_modules()
            if isinstance(m, nn.Linear) and name != "lm_head"
        ]
        assert trainer.fp8_layers == len(linears) == 8
        assert all(isinstance(m, Float8Linear) for m in linears)
        assert not isinstance(trainer.raw_model.lm_head, Float8Linear)


def test_fp8_loss_stays_within_ten_percent_of_bf16(sliced_config) -> None:
    final = {}
    for dtype in ("bf16", "fp8"):
        cfg = sliced_config(run={"id": dtype}, precision={"dtype": dtype}, train={"max_steps": 80})
        result, _ = fit(cfg)
        final[dtype] = records(result.run_dir, "eval")[-1]["val_loss"]
    assert abs(final["fp8"] - final["bf16"]) / final["bf16"] < 0.10, final


def test_compiled_model_trains_like_eager(sliced_config) -> None:
    losses = {}
    for compiled in (False, True):
        cfg = sliced_config(
            run={"id": f"compile-{compiled}"},
            model={"n_layer": 1, "compile": compiled},
            train={"max_steps": 6, "log_every": 2, "eval_every": 6},
        )
        result, trainer = fit(cfg)
        assert (trainer.model is not trainer.raw_model) == compiled
        losses[compiled] = [r["train_loss"] for r in records(result.run_dir, "train")]
    assert losses[True] == pytest.approx(losses[False], rel=1e-3)


def test_run_directory_holds_config_env_and_metrics(sliced_config) -> None:
    cfg = sliced_config(train={"max_steps": 12, "log_every": 4, "eval_every": 6, "grad_accum": 2})
    result, trainer = fit(cfg)
    run_dir = result.run_dir
    assert run_dir == Path(cfg.run.dir) / "tiny"
    saved = Config.model_validate(yaml.safe_load((run_dir / "config.yaml").read_text()))
    assert saved == trainer.cfg and saved.run.id == "tiny"
    env = json.loads((run_dir / "env.json").read_text())
    assert {"python", "packages", "device", "git_commit", "world_size"} <= env.keys()
    train = records(run_dir, "train")
    assert [r["step"] for r in train] == [4, 8, 12]
    assert [r["tokens"] for r in train] == [4 * 2 * 8 * 64 * k for k in (1, 2, 3)]
    assert [r["data_position"] for r in train] == [4, 8, 12]
    assert [r["step"] for r in records(run_dir, "eval")] == [0, 6, 12]


def test_ema_weights_are_evaluated_too(sliced_config) -> None:
    result, trainer = fit(sliced_config(train={"ema_decay": 0.9}))
    last = records(result.run_dir, "eval")[-1]
    assert trainer.ema is not None and math.isfinite(last["val_loss_ema"])
    assert last["val_loss_ema"] != last["val_loss"]


def test_early_stopping_waits_for_warmup(sliced_config) -> None:
    early = {"patience": 1, "min_delta": 100.0}  # no evaluation can improve by 100
    cfg = sliced_config(
        train={"max_steps": 100, "warmup_steps": 20, "eval_every": 10, "early_stopping": early}
    )
    result, _ = fit(cfg)
    assert result.stop_reason == "early_stopping"
    assert result.steps == 30  # evals at 10 and 20 fall inside warmup and do not count


def test_cli_run_prints_structured_lines_and_honours_set(
    tmp_path: Path, corpus_cache: Path
) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(sliced_settings(tmp_path / "runs", corpus_cache)))
    result = run_cli("run", str(cfg), "--set", "train.max_steps=10", "--set", "run.id=cli")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("kind=eval step=0/10 val_loss=")
    assert any(
        line.startswith("kind=train step=10/10 loss=") and "tok/s=" in line for line in lines
    )
    assert any("eta=" in line for line in lines)
    saved = yaml.safe_load((tmp_path / "runs/cli/config.yaml").read_text())
    assert saved["train"]["max_steps"] == 10 and saved["run"]["id"] == "cli"
    again = run_cli("run", str(cfg), "--set", "run.id=cli")
    assert again.returncode == 2 and "run.id: run directory" in again.stderr


def test_bench_prints_a_table_per_precision(tmp_path: Path, corpus_cache: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(sliced_settings(tmp_path / "runs", corpus_cache)))
    result = run_cli("bench", str(cfg), "--steps", "3", "--warmup", "1", "--precision", "fp32,bf16")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if "cpu" in line]
    assert [row.split()[1] for row in rows] == ["fp32", "bf16"]
    assert "tokens/s" in result.stdout and "1.00x" in rows[0]
    assert not (tmp_path / "runs" / "bench-fp32").exists()  # scratch run dirs are removed


def test_torchrun_two_ranks_match_one_process(tmp_path: Path, corpus_cache: Path) -> None:
    """2 ranks x batch 4 see the same global batch as 1 process x batch 8."""
    settings = sliced_settings(tmp_path / "runs", corpus_cache, train={"max_steps": 20})
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(settings))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    ddp_args = ["--set", "run.id=ddp", "--set", "train.batch_size=4", "--no-progress"]
    ddp = subprocess.run(
        [*torchrun, "--nproc_per_node=2", "-m", "lossguard.agent.cli", "run", str(cfg), *ddp_args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    single = run_cli("run", str(cfg), "--set", "run.id=one", "--set", "train.batch_size=8")
    assert single.returncode == 0, single.stderr
    runs = tmp_path / "runs"
    env_json = json.loads((runs / "ddp/env.json").read_text())
    assert env_json["world_size"] == 2
    for kind, key in (("train", "train_loss"), ("eval", "val_loss")):
        a = [r[key] for r in records(runs / "ddp", kind)]
        b = [r[key] for r in records(runs / "one", kind)]
        assert len(a) == len(b) > 1
        assert a == pytest.approx(b, rel=1e-5), (kind, a, b)
    tokens = [r["tokens"] for r in records(runs / "ddp", "train")]
    assert tokens == [r["tokens"] for r in records(runs / "one", "train")]


def test_bench_overhead_prints_the_ratio(tmp_path: Path, corpus_cache: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(sliced_settings(tmp_path / "runs", corpus_cache)))
    args = ("--overhead", "--rounds", "2", "--steps", "2", "--warmup", "1")
    result = run_cli("bench", str(cfg), *args)
    assert result.returncode == 0, result.stderr
    assert "on + scraped 1/s" in result.stdout
    ratio = float(result.stdout.split("on / off = ")[1].split()[0])
    assert 0.2 < ratio < 5.0

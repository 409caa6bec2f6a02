"""The sampled FP8 fidelity check (telemetry.fp8_fidelity): a high-precision shadow replays the
step, on tiny torchao Float8Linear models (FP8 emulated on CPU)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch import nn

from lossguard.agent.config import Config, PrecisionConfig, parse_config
from lossguard.agent.guard import Guard
from lossguard.agent.precision import convert_to_fp8
from lossguard.agent.telemetry.fp8_fidelity import build_shadow
from lossguard.agent.train.bench import run_overhead_benchmark
from lossguard.agent.train.faults import OUTLIER, plant_outlier
from lossguard.agent.train.trainer import Trainer
from lossguard.common.config import ConfigError
from tests.support.host_reads import count_host_reads
from tests.support.processes import run_cli
from tests.support.runs import sliced_settings

pytestmark = pytest.mark.live

THRESHOLD = 0.9  # FP8FidelityLow in alerts/lossguard.rules.yml
GAUGE = "lossguard_fp8_fidelity_min_grad_cosine"
CPU = torch.device("cpu")


def fp8_mlp() -> nn.Sequential:
    """Two Float8Linear layers around a BatchNorm (buffers) and dropout (RNG)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.BatchNorm1d(64), nn.GELU(), nn.Dropout(0.2), nn.Linear(64, 16)
    )
    convert_to_fp8(model, PrecisionConfig(dtype="fp8"), CPU)
    return model


def records(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def sample(guard: Guard, name: str) -> list[tuple[dict[str, str], float]]:
    """The exporter's current samples of ``name``: (labels, value)."""
    assert guard.telemetry is not None
    return [
        (s.labels, s.value)
        for family in guard.telemetry.metrics.registry.collect()
        for s in family.samples
        if s.name == name
    ]


def user_loop(
    run_dir: Path,
    steps: int,
    *,
    fidelity: bool,
    replay: bool = True,
    reads: list[str] | None = None,
    per_step: list[int] | None = None,
) -> Guard:
    """A user's loop through Guard (checks every 3 steps); ``per_step`` gets the number of
    ``reads`` (``count_host_reads``) each step made."""
    cfg = parse_config(
        {
            "precision": {"dtype": "fp8"},
            "train": {"log_every": 100},
            "snapshot": {"every": None},  # its boundaries read the health: counted elsewhere
            "telemetry": {
                "host": "127.0.0.1",
                "port": 0,
                "fp8_fidelity": {"enabled": fidelity, "every": 3},
            },
        }
    )
    model = fp8_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    guard = Guard(run_dir, model=model, optimizer=opt, config=cfg, max_steps=steps, progress=False)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        before = len(reads or [])
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 16, generator=gen)

        def forward_backward(module: nn.Module, x: torch.Tensor = x, y: torch.Tensor = y):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(module(x).float(), y)
            loss.backward()
            return loss.detach()

        loss = forward_backward(model)
        guard.after_backward(loss, tokens=16, replay=forward_backward if replay else None)
        opt.step()
        opt.zero_grad()
        guard.end_step()
        guard.poll()
        if per_step is not None:
            per_step.append(len(reads or []) - before)
    return guard


def test_off_by_default_and_only_for_fp8(tmp_path: Path) -> None:
    assert not Config().telemetry.fp8_fidelity.enabled
    with pytest.raises(ConfigError, match=r"^telemetry\.fp8_fidelity\.enabled: needs precision"):
        parse_config({"telemetry": {"fp8_fidelity": {"enabled": True}}})
    cfg = parse_config({"precision": {"dtype": "fp8"}, "telemetry": {"port": 0}})
    guard = Guard(tmp_path, model=fp8_mlp(), config=cfg, progress=False)
    try:
        assert guard.telemetry is not None
        assert guard.telemetry.samplers.fidelity is None  # no shadow
    finally:
        guard.close()


def test_shadow_shares_the_weights_in_plain_linear_layers_without_hooks() -> None:
    from torchao.float8.float8_linear import Float8Linear

    model = fp8_mlp()
    model[0].register_forward_hook(lambda *_: pytest.fail("a live hook ran on the shadow"))
    shadow = build_shadow(model)
    assert [type(m) for m in shadow.modules() if isinstance(m, nn.Linear)] == [nn.Linear] * 2
    assert isinstance(model[0], Float8Linear)  # the live model is untouched
    for live, copy in zip(model.parameters(), shadow.parameters(), strict=True):
        assert copy is not live and copy.data_ptr() == live.data_ptr()
    shadow(torch.randn(4, 32)).sum().backward()
    assert all(p.grad is None for p in model.parameters())


def test_healthy_checks_leave_training_exactly_as_without_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads, per_step = count_host_reads(monkeypatch), list[int]()
    checked = user_loop(tmp_path / "on", 6, fidelity=True, reads=reads, per_step=per_step)
    monkeypatch.undo()
    plain = user_loop(tmp_path / "off", 6, fidelity=False)
    checked.close()
    plain.close()
    # same weights, BatchNorm statistics and RNG stream: the check changed nothing
    states = checked.model.state_dict(), plain.model.state_dict()
    for a, b in zip(*(state.values() for state in states), strict=True):
        assert torch.equal(a, b)
    found = records(tmp_path / "on", "fp8_fidelity")
    assert [r["step"] for r in found] == [3, 6]
    for record in found:
        # the same dropout masks as the live step, or the cosine would be far lower
        assert record["min_grad_cosine"] > 0.99
        assert record["min_grad_cosine"] == min(record["layers"].values())
        assert set(record["layers"]) == {"0", "1", "4"}  # modules with parameters
        assert record["loss_rel_error"] < 1e-2 and record["dtype"] == "fp32"
    # normal steps read nothing from the device; a check reads once (step 6: and max_steps'
    # log interval)
    assert per_step == [0, 0, 1, 0, 0, 2]
    ((labels, value),) = sample(checked, GAUGE)
    assert (labels["layer"], value) == (found[-1]["layer"], found[-1]["min_grad_cosine"])
    assert sample(checked, "lossguard_fp8_fidelity_checks_total")[0][1] == 2
    assert sample(plain, GAUGE) == []


def test_a_loop_without_replay_is_warned_once_and_not_checked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="lossguard.agent")
    guard = user_loop(tmp_path, 6, fidelity=True, replay=False)
    guard.close()
    assert records(tmp_path, "fp8_fidelity") == []
    warned = [r for r in caplog.records if "no replay function" in r.getMessage()]
    assert len(warned) == 1


def test_outlier_flushes_every_other_value_in_fp8() -> None:
    out = torch.randn(2, 3, 8)
    planted = plant_outlier(out)
    assert torch.equal(planted.view(-1)[:-1], out.view(-1)[:-1])
    assert planted.view(-1)[-1] == out.abs().amax() * OUTLIER
    fp8 = torch.float8_e4m3fn
    scaled = (planted * (torch.finfo(fp8).max / planted.abs().amax())).to(fp8).float()
    assert torch.count_nonzero(scaled) == 1  # torchao's tensorwise scale: the rest is 0


def trainer_settings(tmp_path: Path, corpus_cache: Path, **telemetry: Any) -> dict[str, Any]:
    """A tiny fp8 GPT (width 32, 16 tokens, 2 micro-batches of 2) with an activation_outlier
    at step 4."""
    return sliced_settings(
        tmp_path / "runs",
        corpus_cache,
        model={"n_embd": 32, "block_size": 16, "dropout": 0.1},
        train={"max_steps": 4, "batch_size": 2, "grad_accum": 2, "log_every": 2}
        | {"eval_every": 100, "eval_batches": 1},
        precision={"dtype": "fp8"},
        telemetry={"fp8": {"every": 2}, **telemetry},
        faults=[{"kind": "activation_outlier", "step": 4}],
    )


def test_trainer_check_is_near_one_then_drops_under_an_activation_outlier(
    tmp_path: Path, corpus_cache: Path
) -> None:
    fidelity = {"enabled": True, "every": 2}
    cfg = parse_config(trainer_settings(tmp_path, corpus_cache, fp8_fidelity=fidelity))
    trainer = Trainer(cfg, progress=False)
    try:
        trainer.fit()
        found = {r["step"]: r for r in records(trainer.run_path, "fp8_fidelity")}
        ((labels, value),) = sample(trainer.guard, GAUGE)
        ((_, rel_error),) = sample(trainer.guard, "lossguard_fp8_fidelity_loss_rel_error")
    finally:
        trainer.close()
    assert sorted(found) == [2, 4]
    assert found[2]["min_grad_cosine"] > 0.99 and found[2]["loss_rel_error"] < 1e-2
    # the outlier crushes the rest of each FP8 input to zero; the shadow computes it in fp32
    assert found[4]["min_grad_cosine"] < THRESHOLD
    health = {r["step"]: r for r in records(trainer.run_path, "fp8")}
    assert health[4]["worst"]["input"]["underflow"] > 0.9
    # one series, the worst layer of the last check (the step-2 layer's series is gone)
    assert labels["layer"] == found[4]["layer"] and value == found[4]["min_grad_cosine"]
    assert rel_error == found[4]["loss_rel_error"] and math.isfinite(rel_error)


def test_under_torchrun_the_shadow_gradients_are_averaged_as_ddp_averages(
    tmp_path: Path, corpus_cache: Path
) -> None:
    """Each rank trains on its own batches; compared with DDP's averaged gradients, a rank's
    own shadow gradients would be far off."""
    settings = trainer_settings(tmp_path, corpus_cache, fp8_fidelity={"enabled": True, "every": 1})
    settings["train"]["max_steps"] = 2
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(settings))
    ran = run_cli(
        *("--standalone", "--nproc_per_node=2", "-m", "lossguard.agent.cli", "run"),
        *(str(config), "--no-progress"),
        module="torch.distributed.run",
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    found = records(tmp_path / "runs" / "tiny", "fp8_fidelity")
    assert [r["step"] for r in found] == [1, 2]
    assert all(r["min_grad_cosine"] > 0.99 for r in found), found


def test_bench_compares_telemetry_on_with_and_without_the_check(
    tmp_path: Path, corpus_cache: Path
) -> None:
    cfg = parse_config(trainer_settings(tmp_path, corpus_cache, fp8_fidelity={"every": 2}))
    result = run_overhead_benchmark(cfg, rounds=1, steps=2, warmup=0, fidelity=True)
    assert result.labels == ("telemetry on", "+ FP8 fidelity every 2 (fp32)")
    assert result.ratio_name == "check / no check" and 0.2 < result.ratio < 5.0
    with pytest.raises(ConfigError, match=r"^--steps: must be a multiple of .*every \(2\)"):
        run_overhead_benchmark(cfg, rounds=1, steps=3, warmup=0, fidelity=True)

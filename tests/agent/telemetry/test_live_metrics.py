"""Telemetry of real training runs: the live exporter, MFU, spike and NaN detection, FP8 health,
faults and W&B."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from lossguard.agent.config import Config, parse_config
from lossguard.agent.train.flops import flops_per_token
from lossguard.agent.train.model import GPT
from lossguard.agent.train.trainer import Trainer
from lossguard.common.catalogue import CATALOGUE, NVML_METRICS, OPTIMIZER_COUNTERS, exposed_name
from tests.support.processes import run_cli, start_agent, wait_for
from tests.support.runs import sliced_settings, write_config

pytestmark = pytest.mark.live


def config(tmp_path: Path, cache: Path, **sections: Any) -> Config:
    return parse_config(sliced_settings(tmp_path / "runs", cache, **sections))


def scrape(run_dir: Path) -> str:
    url = json.loads((run_dir / "agent.json").read_text())["metrics_url"]
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode()


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Series name -> [(labels, value)] (prometheus-client's own parser)."""
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def train_and_scrape(cfg: Config) -> tuple[Trainer, str]:
    """Train to the end, then scrape the still-running exporter."""
    trainer = Trainer(cfg, progress=False)
    try:
        trainer.fit()
        return trainer, scrape(trainer.run_path)
    finally:
        trainer.close()


def records(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def promtool_findings(text: str) -> str:
    checked = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    return checked.stdout + checked.stderr if checked.returncode else ""


def test_live_scrape_has_every_catalogue_metric_and_promtool_is_clean(
    tmp_path: Path, corpus_cache: Path
) -> None:
    cfg = config(
        tmp_path,
        corpus_cache,
        precision={"dtype": "fp8"},
        train={"max_steps": 12, "log_every": 4, "eval_every": 6},
        checkpoint={"every": 4},
        telemetry={
            "fp8": {"every": 2},
            "fp8_fidelity": {"enabled": True, "every": 6},
            "grad_diagnostics": {"enabled": True, "every": 2},
        },
    )
    trainer = Trainer(cfg, progress=False)
    try:
        trainer.fit()
        trainer.guard.checkpoints.wait()  # type: ignore[union-attr]
        trainer.guard.commands.apply(*_status_request())  # a control command was counted
        text = scrape(trainer.run_path)
    finally:
        trainer.close()
    assert promtool_findings(text) == ""
    found = samples(text)
    # SPAM's counters: tests/agent/train/test_spam_training.py
    optimizer = {exposed_name(n) for n in OPTIMIZER_COUNTERS}
    expected = (
        {exposed_name(n) for n in CATALOGUE if n not in NVML_METRICS}
        - optimizer
        - {
            "lossguard_amp_loss_scale"  # fp16 only: checked below
        }
    )
    missing = {n for n in expected if not any(s.startswith(n) for s in found)}
    assert missing == set()
    absent = ("lossguard_gpu_utilization_ratio", *optimizer)  # no GPU, AdamW: absent
    assert not any(n in found for n in absent)
    for series in found.values():
        for labels, _ in series:
            if "run_id" in labels:
                assert labels["run_id"] == "tiny" and labels["rank"] == "0"
    assert "process_cpu_seconds_total" in found
    info = json.loads((trainer.run_path / "agent.json").read_text())
    assert info["run_id"] == "tiny" and info["socket"].endswith("control.sock")

    fp16 = config(tmp_path / "fp16", corpus_cache, precision={"dtype": "fp16"})
    trainer, text = train_and_scrape(fp16)
    assert promtool_findings(text) == ""
    assert samples(text)["lossguard_amp_loss_scale"][0][1] > 0


def _status_request() -> tuple[Any, None]:
    from lossguard.common.control.protocol import Request

    return Request("t1", "status", {}), None


def test_mfu_and_throughput_match_an_independent_computation(
    tmp_path: Path, corpus_cache: Path
) -> None:
    cfg = config(
        tmp_path,
        corpus_cache,
        train={"max_steps": 20, "log_every": 5, "grad_accum": 2},
        telemetry={"peak_flops": None},
    )
    trainer, text = train_and_scrape(cfg)
    m = cfg.model
    n_params = GPT(m, 256).num_params(non_embedding=False) - m.block_size * m.n_embd
    per_token = 6 * n_params + 12 * m.n_layer * m.n_head * (m.n_embd // m.n_head) * m.block_size
    assert flops_per_token(n_params, m.n_layer, m.n_head, m.n_embd // m.n_head, m.block_size) == (
        per_token
    )
    peak = samples(text)["lossguard_peak_flops"]
    assert peak[0][0]["source"] == "measured"
    tokens_per_step = cfg.train.batch_size * cfg.train.grad_accum * m.block_size
    for record in records(trainer.run_path, "train"):
        expected_tps = tokens_per_step / record["step_time_seconds"]
        assert record["tokens_per_second"] == pytest.approx(expected_tps, rel=1e-6)
        assert record["mfu"] == pytest.approx(expected_tps * per_token / peak[0][1], rel=1e-6)
    gauge = samples(text)["lossguard_mfu_ratio"][0][1]
    assert gauge == pytest.approx(records(trainer.run_path, "train")[-1]["mfu"], rel=1e-6)


SPIKE_RUN = {"batch_size": 32, "log_every": 10, "eval_every": 100_000, "schedule": "constant"}


def test_a_clean_run_has_no_spike_over_500_steps_then_an_lr_fault_makes_one_that_recovers(
    tmp_path: Path, corpus_cache: Path
) -> None:
    """One run: its 499 steps before the fault are the clean run (the detectors judge ~470 of
    them, past a full window; the 1000-step soak is the same run with train.max_steps=1000),
    scraped there; then the fault's spike is detected and recovers from."""
    fault = {"kind": "lr_scale", "step": 500, "duration": 5, "factor": 15.0}
    cfg = config(tmp_path, corpus_cache, train={"max_steps": 600, **SPIKE_RUN}, faults=[fault])
    trainer = Trainer(cfg, progress=False)
    try:
        while trainer.guard.step < 499:
            trainer.train_step()
        clean = scrape(trainer.run_path)
        trainer.fit()
        text = scrape(trainer.run_path)
    finally:
        trainer.close()
    assert all(v == 0 for _, v in samples(clean)["lossguard_spikes_total"])
    train = {r["step"]: r for r in records(trainer.run_path, "train")}
    assert all(not r["loss_spike_active"] for s, r in train.items() if s < 500)
    assert all(train[s]["loss_spikes_total"] == 0 for s in train if s < 500)
    assert train[510]["loss_spike_active"] is True and train[510]["loss_spikes_total"] == 1
    assert train[600]["loss_spike_active"] is False  # recovered
    assert train[600]["loss_spikes_total"] == 1
    spikes = {labels["signal"]: v for labels, v in samples(text)["lossguard_spikes_total"]}
    assert spikes["loss"] == 1
    faults = [e for e in _events(trainer.run_path) if e["event"] == "fault"]
    assert len(faults) == 1 and {k: faults[0][k] for k in fault} == fault
    spike = next(e for e in _events(trainer.run_path) if e["event"] == "spike")
    diagnosis = spike["diagnosis"]  # of the step that opened the episode, not the interval's end
    assert diagnosis["signal"] == "loss" and 500 <= diagnosis["step"] < 505
    assert diagnosis["nonfinite"] is False and diagnosis["zscore"] > 6
    assert diagnosis["value"] > diagnosis["window_mean"] + 6 * diagnosis["window_std"]
    assert diagnosis["causes"]


def test_nan_fault_is_counted_and_its_update_skipped(tmp_path: Path, corpus_cache: Path) -> None:
    fault = {"kind": "nonfinite_loss", "step": 5, "duration": 1}
    cfg = config(tmp_path, corpus_cache, train={"max_steps": 10}, faults=[fault])
    trainer = Trainer(cfg, progress=False)
    try:
        weights = []
        for _ in range(6):
            trainer.train_step()
            weights.append([p.detach().clone() for p in trainer.raw_model.parameters()])
        before, during, after = weights[3], weights[4], weights[5]
        assert all(torch.equal(a, b) for a, b in zip(before, during, strict=True))  # skipped
        assert not all(torch.equal(a, b) for a, b in zip(during, after, strict=True))
        assert all(torch.isfinite(p).all() for p in trainer.raw_model.parameters())
        trainer.fit()
        text = scrape(trainer.run_path)
    finally:
        trainer.close()
    found = samples(text)
    nonfinite = {labels["signal"]: v for labels, v in found["lossguard_nonfinite_total"]}
    assert nonfinite["loss"] == 1
    skips = {labels["reason"]: v for labels, v in found["lossguard_skipped_steps_total"]}
    assert skips == {"nonfinite": 1, "spike": 0}
    seen = [e for e in _events(trainer.run_path) if e["event"] == "nonfinite"]
    assert [(e["signal"], e["total"]) for e in seen] == [("loss", 1), ("grad_norm", 1)]


def test_fp8_activation_fault_raises_the_overflow_ratio(tmp_path: Path, corpus_cache: Path) -> None:
    fault = {"kind": "scale_activations", "step": 8, "duration": 1, "factor": 1000.0}
    cfg = config(
        tmp_path,
        corpus_cache,
        precision={"dtype": "fp8"},
        train={"max_steps": 8, "eval_every": 100},
        telemetry={"fp8": {"every": 1}},
        faults=[fault],
    )
    trainer, text = train_and_scrape(cfg)
    fp8 = {r["step"]: r["worst"]["input"] for r in records(trainer.run_path, "fp8")}
    assert fp8[7]["overflow"] < 0.01
    assert fp8[8]["overflow"] > 0.3
    overflow = {labels["tensor"]: v for labels, v in samples(text)["lossguard_fp8_overflow_ratio"]}
    assert overflow["input"] == pytest.approx(fp8[8]["overflow"])


def _events(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_slow_and_corrupt_batch_faults_perturb_the_real_run(
    tmp_path: Path, corpus_cache: Path
) -> None:
    faults = [
        {"kind": "slow_step", "step": 21, "duration": 5, "seconds": 0.2},
        {"kind": "corrupt_batch", "step": 31, "duration": 5},
    ]
    cfg = config(tmp_path, corpus_cache, train={"max_steps": 40, "log_every": 5}, faults=faults)
    trainer, _ = train_and_scrape(cfg)
    train = {r["step"]: r for r in records(trainer.run_path, "train")}
    assert train[25]["step_time_seconds"] > 0.2 > train[20]["step_time_seconds"]
    assert train[35]["train_loss"] > train[30]["train_loss"] + 1.0  # random tokens: ~ln(256)
    kinds = [e["kind"] for e in _events(trainer.run_path) if e["event"] == "fault"]
    assert kinds == ["slow_step", "corrupt_batch"]


def test_hang_and_crash_faults_behave_like_the_real_thing(
    tmp_path: Path, corpus_cache: Path
) -> None:
    settings = sliced_settings(
        tmp_path / "runs",
        corpus_cache,
        train={"max_steps": 100, "log_every": 1},
        faults=[{"kind": "crash", "step": 8}],
    )
    crashed = run_cli("run", str(write_config(tmp_path / "crash.yaml", settings)))
    assert crashed.returncode == 70 and "crashing at step 8" in crashed.stderr
    run_dir = tmp_path / "runs/tiny"
    assert max(r["step"] for r in records(run_dir, "train")) == 7
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())

    settings["run"]["id"] = "hung"
    settings["faults"] = [{"kind": "hang", "step": 8}]
    hung = start_agent(write_config(tmp_path / "hang.yaml", settings))
    try:
        hung_dir = tmp_path / "runs/hung"
        wait_for(lambda: _hang_event(hung_dir), 120, "the hang fault to start")
        before = scrape(hung_dir)
        beat = samples(before)["lossguard_last_step_timestamp_seconds"][0][1]
        hung.send_signal(signal.SIGTERM)  # a hung loop never reaches poll(): no clean stop
        assert wait_for(
            lambda: samples(scrape(hung_dir))["lossguard_step"][0][1] == 7, 10, "a scrape"
        )
        assert samples(scrape(hung_dir))["lossguard_last_step_timestamp_seconds"][0][1] == beat
        assert hung.poll() is None  # still alive, stalled, still scrapable
    finally:
        hung.kill()
        hung.communicate()


def _hang_event(run_dir: Path) -> bool:
    return (run_dir / "events.jsonl").exists() and any(
        e["event"] == "fault" and e["kind"] == "hang" for e in _events(run_dir)
    )

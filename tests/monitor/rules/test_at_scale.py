"""The per-rank rules at 512 ranks: one alert per run, naming its worst ranks, in both engines.

Two simulated runs, r1 with 512 ranks on 64 nodes (8 a node) and r2 with 64 ranks on 8 nodes,
a few ranks of each bad in every way the per-rank rules look at (MFU, throughput, memory, FP8
saturation and fidelity, an XID error, a node whose agents stop answering), written as a
promtool rule test into tmp_path. The expected alerts are the monitor's own (its evaluator and
templates); ``promtool test rules`` must find exactly those, and the monitor's rule-test runner
must pass the same file with the same output.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from lossguard.monitor.promql import MemoryStorage, evaluate, expand_values, parse_series
from lossguard.monitor.rules.rulefile import load_rule_files
from lossguard.monitor.rules.ruleset import RuleSet
from tests.support.processes import monitor_cli
from tests.support.promserver import promtool_test_rules

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[3]
RULES = REPO / "alerts" / "lossguard.rules.yml"
STEP_MIN = 5  # minutes between samples and between evaluations
SAMPLES = 23  # 0m to 110m
CHECK_AT = "110m"
BAD_FROM = 18  # the sample (90m) from which the slow signals go bad
GPUS_PER_NODE = 8


def _series(
    run: str, ranks: int, bad: dict[str, dict[int, float]], down_node: int
) -> dict[str, str]:
    """Every rank's series; ``bad``: per signal, the ranks with a bad value (from 90m for MFU
    and throughput, throughout for the rest); the agents of ``down_node`` stop answering at
    100m. Healthy values differ a little by rank, so that no two ranks tie."""
    series: dict[str, str] = {}
    before, after = BAD_FROM, SAMPLES - BAD_FROM - 1
    for rank in range(ranks):
        node, gpu = divmod(rank, GPUS_PER_NODE)
        host = f"{run}-node{node:02d}"
        target = (
            f'job="lossguard-agent", instance="{host}:{9410 + gpu}", run_id="{run}", rank="{rank}"'
        )
        jitter = rank * 1e-5
        mfu = bad["mfu"].get(rank)
        series[f"lossguard_mfu_ratio{{{target}}}"] = (
            f"{0.4 + jitter}x{SAMPLES - 1}"
            if mfu is None
            else f"{0.4 + jitter}x{before - 1} {mfu}x{after}"
        )
        tokens = bad["tokens"].get(rank)
        healthy_tokens = 10000 + rank
        series[f"lossguard_tokens_per_second{{{target}}}"] = (
            f"{healthy_tokens}x{SAMPLES - 1}"
            if tokens is None
            else f"{healthy_tokens}x{before - 1} {tokens}x{after}"
        )
        allocated = bad["allocated"].get(rank, 0.6 + jitter)
        series[f'lossguard_device_memory_bytes{{{target}, kind="allocated"}}'] = (
            f"{allocated * 80e9}x{SAMPLES - 1}"
        )
        series[f"lossguard_device_memory_limit_bytes{{{target}}}"] = f"80e9x{SAMPLES - 1}"
        series[f"lossguard_memory_alloc_retries_total{{{target}}}"] = f"0x{SAMPLES - 1}"
        overflow = bad["overflow"].get(rank, 0.001 + jitter)
        series[f'lossguard_fp8_overflow_ratio{{{target}, tensor="input"}}'] = (
            f"{overflow}x{SAMPLES - 1}"
        )
        series[f'lossguard_fp8_overflow_ratio{{{target}, tensor="weight"}}'] = f"0x{SAMPLES - 1}"
        cosine = bad["cosine"].get(rank, 0.99 - jitter)
        series[f'lossguard_fp8_fidelity_min_grad_cosine{{{target}, layer="wte"}}'] = (
            f"{cosine}x{SAMPLES - 1}"
        )
        gpu_labels = f'Hostname="{host}", gpu="{gpu}", UUID="GPU-{run}-{rank}", modelName="H100"'
        series[f"lossguard_gpu_info{{{target}, {gpu_labels}}}"] = f"1x{SAMPLES - 1}"
        xid = bad["xid"].get(rank, 0)
        series[f'DCGM_FI_DEV_XID_ERRORS{{job="dcgm", instance="{host}:9400", {gpu_labels}}}'] = (
            f"{xid}x{SAMPLES - 1}"
        )
        up = f"1x{SAMPLES - 1}" if node != down_node else f"1x19 0x{SAMPLES - 21}"
        series[f"up{{{target}}}"] = up
    return series


R1_BAD: dict[str, dict[int, float]] = {
    "mfu": {17: 0.04, 301: 0.06, 444: 0.08},
    "tokens": {130: 5000},
    "allocated": {99: 0.97, 98: 0.96},
    "overflow": {5: 0.3, 6: 0.2, 500: 0.05},
    "cosine": {7: 0.5},
    "xid": {200: 79},
}
R2_BAD: dict[str, dict[int, float]] = {
    "mfu": {9: 0.05},
    "tokens": {},
    "allocated": {},
    "overflow": {},
    "cosine": {},
    "xid": {33: 48, 34: 79},
}
INPUT = {**_series("r1", 512, R1_BAD, down_node=40), **_series("r2", 64, R2_BAD, down_node=3)}


def _firing(at_min: int) -> list[tuple[dict[str, str], dict[str, str]]]:
    """The monitor's firing alerts at ``at_min``, evaluated as its rule-test runner does."""
    storage = MemoryStorage()
    for text, values in INPUT.items():
        labels, _ = parse_series(text)
        for i, value in enumerate(expand_values(values)):
            assert value is not None
            storage.add(labels, i * STEP_MIN * 60, value)
    ruleset = RuleSet(load_rule_files([RULES]))
    for minute in range(0, at_min + 1, STEP_MIN):
        ruleset.evaluate(
            lambda rule, t: evaluate(rule.query or rule.expr, storage, t),
            minute * 60,
            expr_query=lambda expr, t: evaluate(expr, storage, t),
        )
        assert not [e.rule.name for e in ruleset.rules if e.last_error], "a rule failed"
    return [(a.labels, a.annotations) for e in ruleset.rules for a in e.firing()]


@pytest.fixture(scope="module")
def firing() -> list[tuple[dict[str, str], dict[str, str]]]:
    return _firing(int(CHECK_AT.removesuffix("m")))


def test_one_alert_per_run_naming_the_worst_ranks(
    firing: list[tuple[dict[str, str], dict[str, str]]],
) -> None:
    count = Counter((labels["alertname"], labels.get("run_id")) for labels, _ in firing)
    assert count == {
        ("LowMFU", "r1"): 1,
        ("LowMFU", "r2"): 1,
        ("ThroughputDrop", "r1"): 1,
        ("DeviceMemoryHigh", "r1"): 1,
        ("FP8SaturationHigh", "r1"): 1,
        ("FP8FidelityLow", "r1"): 1,
        ("GPUXidError", "r1"): 1,
        ("GPUXidError", "r2"): 1,
        ("LossguardAgentDown", "r1"): 1,
        ("LossguardAgentDown", "r2"): 1,
    }
    texts = {
        (labels["alertname"], labels["run_id"]): annotations["summary"]
        + " | "
        + annotations["description"]
        for labels, annotations in firing
    }
    for labels, _ in firing:
        assert set(labels) <= {"alertname", "severity", "run_id", "tensor"}, labels
    expected = {
        ("LowMFU", "r1"): [
            "Low MFU in run r1: 4% on its lowest rank (rank 17)",
            "3 of the 512 ranks",
            "(lowest: rank 17 at 4%, rank 301 at 6%, rank 444 at 8%)",
        ],
        ("LowMFU", "r2"): ["1 of the 64 ranks", "lowest: rank 9 at 5%"],
        ("ThroughputDrop", "r1"): ["at 53.53% of its usual rate on its slowest rank (rank 130)"],
        ("DeviceMemoryHigh", "r1"): [
            "allocated up to 97% (rank 99)",
            "2 of the 512 ranks",
            "highest: rank 99 at 97%, rank 98 at 96%",
        ],
        ("FP8SaturationHigh", "r1"): [
            "30% of input values on its worst rank (rank 5)",
            "3 of the 512 ranks",
            "worst: rank 5 at 30%, rank 6 at 20%, rank 500 at 5%",
        ],
        ("FP8FidelityLow", "r1"): ["1 of the 512 ranks", "rank 7 at 0.500 in wte"],
        ("GPUXidError", "r1"): [
            "XID error on 1 GPU of run r1: XID 79 on GPU 0 of r1-node25",
            "of host r1-node25, rank 200.",
        ],
        ("GPUXidError", "r2"): [
            "XID error on 2 GPUs of run r2: XID 79 on GPU 2 of r2-node04 and others",
            "XID 48 on GPU 1 (H100, GPU-r2-33) of host r2-node04, rank 33; XID 79 on GPU 2",
        ],
        ("LossguardAgentDown", "r1"): [
            "8 of 512 lossguard agents of run r1 down, on r1-node40",
            "rank 320 on r1-node40:9410, rank 321 on r1-node40:9411",
        ],
        ("LossguardAgentDown", "r2"): ["8 of 64 lossguard agents of run r2 down, on r2-node03"],
    }
    for key, parts in expected.items():
        for part in parts:
            assert part in texts[key], (key, part, texts[key])


def test_promtool_and_the_monitor_find_exactly_these_alerts(
    tmp_path: Path, firing: list[tuple[dict[str, str], dict[str, str]]]
) -> None:
    names = sorted({labels["alertname"] for labels, _ in firing})
    cases: list[dict[str, Any]] = [
        {
            "eval_time": CHECK_AT,
            "alertname": name,
            "exp_alerts": [
                {
                    "exp_labels": {k: v for k, v in labels.items() if k != "alertname"},
                    "exp_annotations": annotations,
                }
                for labels, annotations in firing
                if labels["alertname"] == name
            ],
        }
        for name in names
    ]
    cases.append({"eval_time": CHECK_AT, "alertname": "TrainingStalled", "exp_alerts": []})
    test = {
        "rule_files": [str(RULES)],
        "evaluation_interval": f"{STEP_MIN}m",
        "tests": [
            {
                "name": "512 ranks",
                "interval": f"{STEP_MIN}m",
                "input_series": [{"series": s, "values": v} for s, v in INPUT.items()],
                "alert_rule_test": cases,
            }
        ],
    }
    path = tmp_path / "scale.test.yml"
    path.write_text(json.dumps(test))
    theirs = promtool_test_rules(path)
    assert theirs.returncode == 0, theirs.stdout[-4000:] + theirs.stderr[-8000:]
    ours = monitor_cli("rules", "test", str(path))
    assert ours.returncode == 0, ours.stdout + ours.stderr[-8000:]
    assert ours.stdout == theirs.stdout

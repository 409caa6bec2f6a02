"""The short version of ``python -m benchmarks.bench_healthy_warnings``: a tiny GPT trained 400
steps on CPU, fault-free and then with its learning rate multiplied by 1000 from step 150 (the
demo's fault), each scraped as the monitor scrapes it; the shipped LossSpike and GradNormSpike,
replayed at 1 s and at 10 s a step, stay quiet on the first; on the second LossSpike (info)
fires and GradNormSpike is held back, the loss being in an episode too (its rules act on it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.bench_healthy_warnings import PACES, SPIKE_WARNINGS, judge, train
from tests.support.runs import tiny_settings, write_config

pytestmark = pytest.mark.live

STEPS = 400
FAULT = "faults=[{kind: lr_scale, step: 150, duration: 1000, factor: 1000}]"


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("healthy")
    settings = tiny_settings(
        root / "runs",
        root / "cache",
        # the demo's log interval; evaluation and checkpoints out of the way
        train={"max_steps": STEPS, "log_every": 10, "eval_every": STEPS},
    )
    return write_config(root / "agent.yaml", settings)


def test_the_spike_warnings_stay_quiet_on_a_healthy_run_and_fire_on_a_fault(config: Path) -> None:
    runs = config.parent / "runs"
    runs.mkdir(exist_ok=True)
    one_thread = {"OMP_NUM_THREADS": "1"}  # the suite runs two workers on two cores
    healthy = train(config, runs, "healthy", seed=3, steps=STEPS, scrape_s=0.05, env=one_thread)
    faulty = train(
        config, runs, "faulty", seed=3, steps=STEPS, settings=[FAULT], scrape_s=0.05, env=one_thread
    )
    assert faulty.longest_episode("loss") >= 50 and faulty.longest_episode("grad_norm") >= 50
    for pace, _ in PACES:
        quiet = judge(healthy, pace)
        assert {name: quiet.fired[name] for name in SPIKE_WARNINGS} == {
            name: 0 for name in SPIKE_WARNINGS
        }, (pace, healthy.longest_episode("loss"), healthy.longest_episode("grad_norm"))
        loud = judge(faulty, pace)
        assert loud.fired["LossSpike"] >= 1, (pace, loud.fired)
        assert loud.fired["GradNormSpike"] == 0, (pace, loud.fired)

"""deploy/slurm/lossguard.sbatch on a real single-host Slurm (tests/support/slurm.py): a job sent
SIGUSR1 mid-run (as ``--signal=B:USR1@…`` does before its time limit) saves, exits 138, is
requeued, resumes from that checkpoint and ends with the weights of an uninterrupted run. A
job publishes its node's exporters for Prometheus (a file_sd file in LOSSGUARD_FILE_SD_DIR)
while it runs, with the control endpoints the monitor finds on lossguard_agent_info, and
withdraws them when it ends: completed, failed or cancelled."""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.bench_supervisor import weights_sha256
from lossguard.common.exitcodes import EXIT_PREEMPTED
from tests.support.processes import REPO, free_port, start_agent, stop_process, wait_for
from tests.support.runs import events, step_records, tiny_settings, write_config
from tests.support.slurm import Slurm, missing, single_host_slurm

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(missing() is not None, reason=str(missing())),
]

SBATCH = REPO / "deploy" / "slurm" / "lossguard.sbatch"


def test_a_job_signalled_mid_run_is_requeued_and_ends_with_uninterrupted_weights(
    tmp_path: Path, corpus_cache: Path
) -> None:
    def config(run_id: str) -> Path:
        settings = tiny_settings(
            tmp_path / "runs",
            corpus_cache,
            run={"id": run_id},
            train={"max_steps": 60, "log_every": 1, "eval_every": 10**6},
            checkpoint={"every": 20},
        )
        return write_config(tmp_path / f"{run_id}.yaml", settings)

    # the uninterrupted run trains while Slurm starts and the job runs
    plain = start_agent(config("plain"))
    try:
        run_dir = tmp_path / "runs" / "slurm"
        with single_host_slurm(tmp_path / "slurm") as slurm:
            bin_dir = str(Path(sys.executable).parent)
            slurm.env.update(
                PATH=f"{bin_dir}:{os.environ['PATH']}",
                OMP_NUM_THREADS="1",
                LOSSGUARD_LAUNCH=f"{sys.executable} -m lossguard.agent.cli",
                # free ports: the script's fixed defaults may be taken by tests beside it
                METRICS_PORT=str(free_port()),
                SUPERVISOR_METRICS_PORT=str(free_port()),
            )
            submitted = slurm.run(
                "sbatch",
                "--parsable",
                f"--chdir={REPO}",
                f"--output={tmp_path / 'job.out'}",
                str(SBATCH),
                str(run_dir),
                str(config("slurm")),
            )
            job = submitted.stdout.strip().split(";")[0]
            wait_for(lambda: max(step_records(run_dir), default=0) >= 5, 120, "training")
            slurm.run("scancel", "--signal=USR1", "--batch", job)
            requeued = {"JobState": "PENDING", "Restarts": "1"}
            wait_for(lambda: requeued.items() <= slurm.job(job).items(), 120, "the requeue")
            # a requeued job waits about two minutes before it is eligible again: make it so in 2 s
            # (slurmd refuses a job credential created in the second its old one was revoked)
            slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now+2")
            wait_for(lambda: slurm.job(job).get("JobState") == "COMPLETED", 180, "the job to end")
            assert slurm.job(job)["ExitCode"] == "0:0"
        _, plain_err = plain.communicate(timeout=240)
    finally:
        stop_process(plain)
    assert plain.returncode == 0, plain_err
    trail = events(run_dir)
    signal = next(e for e in trail if e["event"] == "signal")
    assert (signal["signal"], signal["preempted"]) == ("SIGUSR1", True)
    saved = next(e for e in trail if e["event"] == "checkpoint" and e["reason"] == "preempted")
    ends = [e for e in trail if e["event"] == "supervisor_exit"]
    assert [e["exit_code"] for e in ends] == [EXIT_PREEMPTED, 0]
    resumed = next(e for e in trail if e["event"] == "resumed")
    assert resumed["checkpoint"] == f"step_{saved['checkpoint_step']:08d}"
    assert 0 < saved["checkpoint_step"] < 60
    assert json.loads((run_dir / "agent.json").read_text())["exit"] == "completed"
    assert weights_sha256(run_dir) == weights_sha256(tmp_path / "runs" / "plain")


TOKEN = "slurm-test-control-token-0123456789"


def slurm_env(slurm_env: dict[str, str], launch: str, sd_dir: Path) -> dict[str, int]:
    """The job's environment: this Python's tools, the launcher, the file_sd folder, free
    ports (the script's defaults are the fixed 9408-9421), the control token; the ports."""
    ports = {
        name: free_port()
        for name in (
            "METRICS_PORT",
            "SUPERVISOR_METRICS_PORT",
            "CONTROL_PORT",
            "SUPERVISOR_CONTROL_PORT",
        )
    }
    slurm_env.update(
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        OMP_NUM_THREADS="1",
        LOSSGUARD_LAUNCH=launch,
        LOSSGUARD_FILE_SD_DIR=str(sd_dir),
        LOSSGUARD_CONTROL_TOKEN=TOKEN,
        **{name: str(port) for name, port in ports.items()},
    )
    return ports


def submit(slurm: Slurm, output: Path, *args: Path) -> str:
    done = slurm.run(
        "sbatch",
        "--parsable",
        f"--chdir={REPO}",
        f"--output={output}",
        str(SBATCH),
        *map(str, args),
    )
    return done.stdout.strip().split(";")[0]


def agent_info(url: str) -> dict[str, str] | None:
    """The labels of lossguard_agent_info at ``url`` (None: not served yet, or not announced)."""
    try:
        text = requests.get(url, timeout=5).text
    except requests.RequestException:
        return None
    for family in text_string_to_metric_families(text):
        if family.name == "lossguard_agent_info" and family.samples:
            return dict(family.samples[0].labels)
    return None  # not yet: rank 0 announces once its control server listens


def promtool_accepts(sd_dir: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``promtool check config`` on deploy/slurm/prometheus-file-sd.yml read from ``sd_dir``
    (promtool parses the file_sd files a glob matches)."""
    snippet = (REPO / "deploy/slurm/prometheus-file-sd.yml").read_text()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        re.sub(r"files: \['[^']*/\*\.json'\]", f"files: ['{sd_dir}/*.json']", snippet)
    )
    assert str(sd_dir) in config.read_text()
    return subprocess.run(
        ["promtool", "check", "config", str(config)], capture_output=True, text=True, timeout=60
    )


def test_a_job_publishes_its_node_for_prometheus_while_it_runs(
    tmp_path: Path, corpus_cache: Path
) -> None:
    """The node's file_sd file names the agent's and the supervisor's exporters at this host's
    name with job, run_id and node; both answer there; rank 0 announces its control and the
    supervisor's at the same host (what a monitor with source: prometheus acts on); the file
    is gone when the job has ended."""
    sd_dir = tmp_path / "file_sd"
    sd_dir.mkdir()
    settings = tiny_settings(
        tmp_path / "runs",
        corpus_cache,
        run={"id": "sd"},
        telemetry={"host": "0.0.0.0"},  # the port is the job's (METRICS_PORT)
        train={"max_steps": 20, "log_every": 1, "eval_every": 10**6},
        # half a second a step: the run lasts while the test looks at it
        faults=[{"kind": "slow_step", "step": 1, "duration": 20, "seconds": 0.5}],
    )
    config = write_config(tmp_path / "sd.yaml", settings)
    host = socket.gethostname()
    with single_host_slurm(tmp_path / "slurm") as slurm:
        ports = slurm_env(slurm.env, f"{sys.executable} -m lossguard.agent.cli", sd_dir)
        job = submit(slurm, tmp_path / "job.out", tmp_path / "runs" / "sd", config)
        published = sd_dir / f"lossguard-{job}-0.json"
        wait_for(published.exists, 120, "the node's file_sd file")
        labels = {"run_id": "sd", "node": "0"}
        assert json.loads(published.read_text()) == [
            {
                "targets": [f"{host}:{ports['METRICS_PORT']}"],
                "labels": {"job": "lossguard-agent", **labels},
            },
            {
                "targets": [f"{host}:{ports['SUPERVISOR_METRICS_PORT']}"],
                "labels": {"job": "lossguard-supervisor", **labels},
            },
        ]
        assert stat.S_IMODE(published.stat().st_mode) == 0o644  # Prometheus's user reads it
        assert sorted(sd_dir.iterdir()) == [published]  # no temporary file left
        checked = promtool_accepts(sd_dir, tmp_path)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        # what Prometheus scrapes there, while the job runs
        info = wait_for(
            lambda: agent_info(f"http://{host}:{ports['METRICS_PORT']}/metrics"),
            120,
            "the agent's lossguard_agent_info",
            interval=0.2,
        )
        assert info["run_id"] == "sd" and info["rank"] == "0" and info["protocol"] == "1"
        assert info["control"] == f"{host}:{ports['CONTROL_PORT']}"
        assert info["supervisor"] == f"{host}:{ports['SUPERVISOR_CONTROL_PORT']}"
        supervisor = requests.get(
            f"http://{host}:{ports['SUPERVISOR_METRICS_PORT']}/metrics", timeout=5
        )
        assert supervisor.status_code == 200 and "lossguard_supervisor" in supervisor.text
        assert published.exists(), "the job ended before the test looked: slow it down"
        wait_for(lambda: slurm.job(job).get("JobState") == "COMPLETED", 300, "the job to end")
        assert slurm.job(job)["ExitCode"] == "0:0"
        assert list(sd_dir.iterdir()) == []
    assert json.loads((tmp_path / "runs/sd/agent.json").read_text())["exit"] == "completed"


FAKE_TRAINING = """\
import pathlib, sys, time
go = pathlib.Path(sys.argv[1])
deadline = time.monotonic() + 300
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(int(go.read_text()) if go.exists() else 1)
"""


def start_fake_job(slurm: Slurm, tmp_path: Path, run_id: str) -> tuple[str, Path, Path]:
    """Submit a job whose training command runs until ``go`` holds its exit code; wait for
    its node's file_sd file. The job, the file and ``go``."""
    sd_dir = tmp_path / "file_sd"
    sd_dir.mkdir(exist_ok=True)
    fake = tmp_path / "fake_training.py"
    fake.write_text(FAKE_TRAINING)
    go = tmp_path / f"{run_id}.go"
    slurm_env(slurm.env, f"{sys.executable} {fake} {go}", sd_dir)
    job = submit(slurm, tmp_path / f"{run_id}.out", tmp_path / "runs" / run_id, fake)
    published = sd_dir / f"lossguard-{job}-0.json"
    wait_for(published.exists, 120, f"the {run_id} job's file_sd file")
    assert json.loads(published.read_text())[0]["labels"]["run_id"] == run_id
    return job, published, go


def test_a_failed_or_cancelled_job_withdraws_its_node(tmp_path: Path) -> None:
    """A stand-in for the training command that runs until the test tells it to exit: the
    file is there while it runs and gone after it failed (exit 2, a configuration error: the
    supervisor does not restart it), and after a job cancelled mid-run (SIGTERM to the step
    and the batch script)."""
    with single_host_slurm(tmp_path / "slurm") as slurm:
        job, published, go = start_fake_job(slurm, tmp_path, "failed")
        go.write_text("2")
        wait_for(lambda: slurm.job(job).get("JobState") == "FAILED", 120, "the failure")
        assert slurm.job(job)["ExitCode"] == "2:0"
        assert not published.exists()

        job, published, _ = start_fake_job(slurm, tmp_path, "cancelled")
        assert slurm.job(job)["JobState"] == "RUNNING"
        slurm.run("scancel", job)
        wait_for(lambda: not published.exists(), 60, "the cancelled job's file to go")
        wait_for(
            lambda: not slurm.run("squeue", "--noheader", check=False).stdout.strip(),
            60,
            "the cancelled job to end",
        )
        assert list(published.parent.iterdir()) == []

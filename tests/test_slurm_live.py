"""deploy/slurm/lossguard.sbatch on a real single-host Slurm (tests/slurm.py): a job sent
SIGUSR1 mid-run (as ``--signal=B:USR1@…`` does before its time limit) saves, exits 138, is
requeued, resumes from that checkpoint and ends with the weights of an uninterrupted run."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from lossguard.common.exitcodes import EXIT_PREEMPTED
from tests.bench_supervisor import weights_sha256
from tests.conftest import (
    REPO,
    events,
    start_agent,
    step_records,
    stop_process,
    tiny_settings,
    wait_for,
    write_config,
)
from tests.slurm import missing, single_host_slurm

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))

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

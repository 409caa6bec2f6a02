"""Faults on one rank, under real ``torchrun`` (gloo, CPU): every case ends or trains on within
its deadline, all ranks at the same step with the same weights (digests), every rank having
entered the same collectives in the same order (each rank's sequence is recorded as it goes:
tests/support/rank_drill.py), exit codes as docs/exit-codes.md says.

* The reported hang: a NaN on rank 1 only, then ``lossguard-ctl rollback last_good``.
* The matrix: a NaN, a spike and a corrupt batch on one rank, one slow rank, each followed by a
  rollback, the last with a save in flight; DDP and FSDP2, 2 and 4 ranks. Three of the four
  runs then end by a stop command, SIGTERM or SIGUSR1 (on one rank), the fourth at its last step.
* Rollbacks by the monitor's own rules (the built-in trainer, ``faults[].ranks``) and through
  the Alertmanager webhook, with the shipped monitor configs and rules.
* A rank stuck in a collective its peers never enter: SIGTERM, and the timeout, end it with the
  retryable exit code and a line naming the collective.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from benchmarks.bench_rank_chaos import chaos
from tests.support.drill_runs import ENV, TORCHRUN, finish_drill, same_collectives, start_drill
from tests.support.processes import (
    REPO,
    ctl_cli,
    free_port,
    start_monitor,
    stop_processes,
    wait_for,
)
from tests.support.runs import events, json_lines, sliced_settings, write_config

pytestmark = pytest.mark.live

ROLLBACK = {"target": "last_good", "skip_batches": "abandoned"}
TOKEN = "rank-faults-monitor-token"


def assert_identical(results: list[dict[str, Any]], step: int, exit_code: int) -> None:
    """Every rank at ``step`` with the same weights, ending with ``exit_code``."""
    assert [r["step"] for r in results] == [step] * len(results)
    assert len({r["digest"] for r in results}) == 1
    assert [r["exit_code"] for r in results] == [exit_code] * len(results)


def rolled_back(answer: dict[str, Any], nproc: int) -> None:
    """A rollback answer: every rank at the restored step with the same weights."""
    assert "error" not in answer, answer
    ranks = answer["ranks"]
    assert [r["step"] for r in ranks] == [answer["to_step"]] * nproc
    assert len({r["weights"] for r in ranks}) == 1


def test_rollback_after_a_nan_on_one_rank_trains_to_the_last_step(tmp_path: Path) -> None:
    """The report: a NaN at step 160 of rank 1 only, an operator's rollback at ~250 with
    ``lossguard-ctl``, then ``status`` within 5 s and training to step 300."""
    plan = {
        "steps": 300,
        "settings": {"train": {"log_every": 10}, "checkpoint": {"every": 100}},
        "faults": [{"kind": "nan", "ranks": [1], "step": 160}],
        "hold_at": 255,  # polls only, until released: the run is there for both commands
    }
    drill = start_drill(tmp_path, plan)
    run_dir = tmp_path / "run"
    try:
        wait_for(
            lambda: any(r["step"] >= 250 for r in json_lines(run_dir / "metrics.jsonl")),
            120,
            "step 250",
        )
        rollback = ctl(run_dir, "rollback", "last_good", "--skip-batches", "abandoned")
        assert rollback.returncode == 0, rollback.stderr
        assert rollback.stdout.startswith("rolled back from step 255 to step 250")
        status = ctl(run_dir, "--timeout", "5", "--json", "status")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["step"] == 250
        (tmp_path / "release").touch()
    finally:
        results = finish_drill(drill, tmp_path)
    assert_identical(results, 300, 0)
    (event,) = [e for e in events(run_dir) if e["event"] == "rollback"]
    rolled_back(event, 2)


def ctl(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``lossguard-ctl --run-dir RUN_DIR ARGS``, as an operator runs it."""
    return ctl_cli("--run-dir", str(run_dir), *args)


# how a matrix run ends: on its own at step 80 (exit 0), or by a stop after its last rollback
# at 74 (a command, or a signal to one rank), which every rank must meet at the same step
ENDINGS: dict[str, tuple[dict[str, Any], int]] = {
    "end": ({}, 0),
    "stop": ({"commands": [{"at": 74, "cmd": "stop"}]}, 3),
    "SIGTERM": ({"signals": [{"rank": 1, "at": 74, "signal": "SIGTERM"}]}, 3),
    "SIGUSR1": ({"signals": [{"rank": 0, "at": 74, "signal": "SIGUSR1"}]}, 138),
}


def matrix_plan(strategy: str, nproc: int, ending: str) -> dict[str, Any]:
    """A NaN, a spike, a corrupt batch on one rank each, one slow rank (1 s steps), each met by
    a rollback from rank 0's operator; the last one while a save is in flight; then the
    ``ending``."""
    last = nproc - 1
    stop = ENDINGS[ending][0]
    return {
        "strategy": strategy,
        "steps": 80,
        "settings": {
            "train": {"log_every": 5},
            "checkpoint": {"every": 20},
            "snapshot": {"every": 10},
        },
        "faults": [
            {"kind": "nan", "ranks": [last], "step": 12},
            {"kind": "spike", "ranks": [0], "step": 32},
            {"kind": "corrupt", "ranks": [1], "step": 52, "duration": 3},
            {"kind": "slow", "ranks": [last], "step": 66, "duration": 2, "seconds": 1.0},
        ],
        "commands": [
            {"at": 14, "cmd": "rollback", "args": ROLLBACK},
            {"at": 34, "cmd": "rollback", "args": {**ROLLBACK, "lr_scale": 0.5}},
            {"at": 55, "cmd": "rollback", "args": ROLLBACK},
            {"at": 65, "cmd": "save"},
            {"at": 65, "cmd": "rollback", "args": {"target": "latest"}},
            *stop.get("commands", []),
        ],
        "signals": stop.get("signals", []),
    }


@pytest.mark.parametrize(
    ("strategy", "nproc", "ending"),
    [("ddp", 2, "stop"), ("fsdp2", 2, "SIGTERM"), ("ddp", 4, "SIGUSR1"), ("fsdp2", 4, "end")],
)
def test_faults_on_one_rank_then_rollbacks(
    tmp_path: Path, strategy: str, nproc: int, ending: str
) -> None:
    """Each run ends its own way (``ENDINGS``): a stop after the faults and their rollbacks
    (a command, or a signal to one rank) stops every rank at the same step, saved, with the
    stop's exit code."""
    results = finish_drill(
        start_drill(tmp_path, matrix_plan(strategy, nproc, ending), nproc), tmp_path, nproc
    )
    code = ENDINGS[ending][1]
    if ending == "end":
        assert_identical(results, 80, 0)
    else:  # the stop is acted on at the step's boundary, or the next
        assert 74 <= results[0]["step"] < 80, results[0]
        assert_identical(results, results[0]["step"], code)
    answers = results[0]["answers"]
    assert len(answers) == 5 + (ending == "stop"), answers
    for answer in answers[:3] + answers[4:5]:
        rolled_back(answer, nproc)
    assert answers[3]["name"].startswith("step_")  # the save the last rollback overtook
    if ending == "stop":
        assert answers[5]["checkpoint"] == f"step_{answers[5]['step']:08d}", answers[5]


def test_chaos_short(tmp_path: Path) -> None:
    """The chaos benchmark's short version (benchmarks/bench_rank_chaos.py): random faults on random
    ranks, each met by an operator's action, and a random ending; no hang, every rank identical,
    the exit code the ending calls for."""
    (outcome,) = chaos(ranks=2, runs=1, steps=100, seed=3, root=tmp_path)
    assert not outcome.hung and outcome.identical and outcome.expected_exit, outcome
    assert outcome.rollbacks >= 2


def test_a_stop_while_a_peer_takes_a_long_step_is_not_taken_for_stuck(tmp_path: Path) -> None:
    """Rank 1 spends 12 s after its update (a slow host) while rank 0 waits in the step
    boundary's collective; SIGTERM reaches rank 0 2 s in. The wait ends inside
    ``distributed.stop_grace``: both ranks stop together at the next boundary, saved, exit 3
    (not 75)."""
    plan = {
        "steps": 100,
        "settings": {"train": {"log_every": 5}},
        "faults": [{"kind": "slow", "ranks": [1], "step": 20, "seconds": 12, "at_boundary": True}],
        "signals": [{"rank": 0, "at": 20, "signal": "SIGTERM", "after": 2.0}],
    }
    results = finish_drill(start_drill(tmp_path, plan), tmp_path)
    assert_identical(results, 21, 3)  # the signal is acted on at the next boundary
    assert "exiting 75" not in (tmp_path / "drill.log").read_text()


def deploy_env(token: str) -> dict[str, str]:
    """deploy/monitor.yml's environment: the webhook's token, and the password of the
    Alertmanager it posts its own alerts to (none runs here: those posts are retried)."""
    return {"LOSSGUARD_MONITOR_TOKEN": token, "LOSSGUARD_WEB_PASSWORD": "no-alertmanager-here"}


def shipped_monitor(tmp_path: Path, shipped: str, runs: Path) -> tuple[Path, str]:
    """A shipped monitor config with only its paths and port changed for this machine."""
    settings = yaml.safe_load((REPO / shipped).read_text())
    port = free_port()
    settings["scrape"].update(runs_root=str(runs))
    settings["scrape"].pop("file_sd_path", None)
    settings["rules"]["files"] = [str(REPO / "alerts/lossguard.rules.yml")]
    settings["state"]["path"] = str(tmp_path / "state.db")
    settings["listen"].update(host="127.0.0.1", port=port)
    path = write_config(tmp_path / "monitor.yml", settings)
    return path, f"http://127.0.0.1:{port}"


def test_the_monitors_rules_roll_back_a_nan_on_one_rank(tmp_path: Path, corpus_cache: Path) -> None:
    """The built-in trainer under torchrun with ``faults[].ranks``: a NaN on rank 1 only, the
    monitor with the shipped config and rules rolls back by itself; training goes on, and a
    stop ends every rank at the same step."""
    runs = tmp_path / "runs"
    run_dir = runs / "onerank"
    settings = sliced_settings(
        runs,
        corpus_cache,
        run={"id": "onerank"},
        train={"max_steps": 10**6, "log_every": 5, "eval_every": 10**6},
        snapshot={"every": 20},
        faults=[
            # NaNs that keep coming on rank 1 (gone on the replay): LossNonFinite at 40 steps
            {"kind": "nonfinite_loss", "step": 30, "ranks": [1], "duration": 10**6, "once": True},
            {"kind": "slow_step", "step": 25, "duration": 10**7, "seconds": 0.1},
        ],
    )
    config, _ = shipped_monitor(tmp_path, "configs/monitor.yml", runs)
    monitor = start_monitor(config)
    agent = subprocess.Popen(
        [
            *TORCHRUN,
            "--nproc_per_node=2",
            "-m",
            "tests.support.recorded_agent",
            str(write_config(tmp_path / "agent.yaml", settings)),
            "--no-progress",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "agent.log").open("w"),
        text=True,
        cwd=REPO,
        env={**ENV, "LOSSGUARD_TEST_COLLECTIVES": str(tmp_path)},
    )
    try:
        rollback = wait_for(
            lambda: [e for e in events(run_dir) if e["event"] == "rollback"], 120, "a rollback"
        )[0]
        assert rollback["to_step"] == 20 and rollback["from_step"] >= 69
        rolled_back(rollback, 2)
        commands = [e for e in events(run_dir) if e["event"] == "command"]
        assert commands[0]["cmd"] == "rollback"  # the monitor's, through the control socket
        replayed = rollback["to_step"] + 10  # logged before the rollback, then again after it
        wait_for(lambda: logged(run_dir, replayed) >= 2, 60, f"step {replayed} trained again")
        stop = ctl(run_dir, "stop")
        assert stop.returncode == 0, stop.stderr
        agent.wait(60)
    finally:
        stop_processes(agent, monitor)
    # torchrun lists each rank that did not exit 0: both stopped (3), at the same step
    assert (tmp_path / "agent.log").read_text().count("exitcode  : 3 (pid") == 2
    (closed,) = [e for e in events(run_dir) if e["event"] == "close"]
    assert closed["stop_requested"] is True
    same_collectives(tmp_path, 2)


def logged(run_dir: Path, step: int) -> int:
    """How many train records of ``step`` metrics.jsonl has."""
    records = json_lines(run_dir / "metrics.jsonl")
    return sum(1 for r in records if r["kind"] == "train" and r["step"] == step)


def test_the_alertmanager_webhook_rolls_back_a_nan_on_one_rank(tmp_path: Path) -> None:
    """The compose monitor config (actions from the Alertmanager webhook): the alert it
    confirms on its own scrape, posted as Alertmanager would, rolls a Guard loop back."""
    plan = {
        "steps": 100,
        "settings": {"train": {"log_every": 5}, "snapshot": {"every": 20}},
        # NaNs on rank 1 from step 25, 40 steps of them for LossNonFinite to fire
        "faults": [{"kind": "nan", "ranks": [1], "step": 25, "duration": 45}],
        "await_rollback_at": 70,
    }
    config, url = shipped_monitor(tmp_path, "deploy/monitor.yml", tmp_path)
    monitor = start_monitor(config, env=deploy_env(TOKEN))
    drill = start_drill(tmp_path, plan)
    try:
        firing = wait_for(lambda: firing_alerts(url, "LossNonFinite"), 120, "LossNonFinite")
        posted = requests.post(
            f"{url}/api/v1/alertmanager",
            json=webhook_body(firing),
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=30,
        )
        assert posted.status_code == 200 and posted.json()["actionable"] == 1, posted.text
        results = finish_drill(drill, tmp_path)
    finally:
        stop_processes(drill, monitor)
    assert_identical(results, 100, 0)
    (rollback,) = [e for e in events(tmp_path / "run") if e["event"] == "rollback"]
    assert rollback["from_step"] == 70 and rollback["to_step"] == 20
    rolled_back(rollback, 2)


def firing_alerts(url: str, name: str) -> list[dict[str, Any]]:
    try:
        alerts = requests.get(f"{url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    except requests.ConnectionError:  # not listening yet
        return []
    return [a for a in alerts if a["labels"]["alertname"] == name and a["state"] == "firing"]


def webhook_body(alerts: list[dict[str, Any]]) -> dict[str, Any]:
    """Alertmanager's webhook payload (v4) for ``alerts`` as the monitor reports them."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "version": "4",
        "groupKey": '{}:{alertname="LossNonFinite"}',
        "truncatedAlerts": 0,
        "status": "firing",
        "receiver": "lossguard-monitor",
        "groupLabels": {"alertname": "LossNonFinite"},
        "commonLabels": alerts[0]["labels"],
        "commonAnnotations": {},
        "externalURL": "http://alertmanager:9093",
        "alerts": [
            {
                "status": "firing",
                "labels": a["labels"],
                "annotations": a.get("annotations", {}),
                "startsAt": now,
                "endsAt": "0001-01-01T00:00:00Z",
                "generatorURL": "",
                "fingerprint": "",
            }
            for a in alerts
        ],
    }


def start_ranks(out: Path, plan: dict[str, Any], nproc: int = 2) -> list[subprocess.Popen[str]]:
    """The drill's ranks as separate processes (no torchrun: each one's exit code and log are
    its own), meeting through env:// on a free port."""
    out.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    processes = []
    for rank in range(nproc):
        env = {**ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc)}
        env.update(LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.support.rank_drill", str(out), json.dumps(plan)],
                stdout=subprocess.DEVNULL,
                stderr=(out / f"rank_{rank}.log").open("w"),
                text=True,
                cwd=REPO,
                env=env,
            )
        )
    return processes


def stuck_plan(timeout: str) -> dict[str, Any]:
    return {
        "steps": 10**6,
        "settings": {"train": {"log_every": 5}, "distributed": {"timeout": timeout}},
        "block": {"rank": 1, "at": 12},
    }


def ended(processes: list[subprocess.Popen[str]], within: float) -> list[int]:
    deadline = time.monotonic() + within
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            stop_processes(*processes)
            raise AssertionError(f"a rank did not end within {within} s") from None
    return codes


def test_sigterm_ends_a_rank_stuck_in_a_collective(tmp_path: Path) -> None:
    """Rank 1 enters a collective rank 0 never does; rank 0 waits in its next one. SIGTERM to
    both: each ends within 30 s, exit 75, with a line naming the collective it was in."""
    ranks = start_ranks(tmp_path, stuck_plan("10m"))
    try:
        wait_for(lambda: stuck_in(tmp_path), 120, "rank 1 in its stray collective")
        for process in ranks:
            process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert ended(ranks, 30) == [75, 75]
        assert time.monotonic() - signalled < 30
    finally:
        stop_processes(*ranks)
    logs = [(tmp_path / f"rank_{r}.log").read_text() for r in range(2)]
    ended_in(logs[0], 0, "all_reduce: commands and signals")
    ended_in(logs[1], 1, "all_reduce: the drill's stuck rank")
    assert "SIGTERM came" in logs[0] + logs[1]  # the first to go; its peer's then failed


def test_the_timeout_ends_a_rank_stuck_in_a_collective(tmp_path: Path) -> None:
    """``distributed.timeout: 10s``: rank 0, waiting in its next collective for rank 1 which is
    in another, ends at the timeout, exit 75; rank 1 then sees its peer gone and ends too."""
    ranks = start_ranks(tmp_path, stuck_plan("10s"))
    try:
        wait_for(lambda: stuck_in(tmp_path), 120, "rank 1 in its stray collective")
        assert ended(ranks, 60) == [75, 75]
    finally:
        stop_processes(*ranks)
    logs = [(tmp_path / f"rank_{r}.log").read_text() for r in range(2)]
    ended_in(logs[0], 0, "all_reduce: commands and signals failed after 10 s")
    ended_in(logs[1], 1, "all_reduce: the drill's stuck rank failed")


def stuck_in(out: Path) -> bool:
    """Rank 1 has entered the drill's stray collective."""
    return (out / "blocked_1").exists()


def ended_in(log: str, rank: int, collective: str) -> None:
    """The rank's last line names the collective it was in, and the exit code."""
    line = next(
        line for line in log.splitlines() if f"rank {rank}: " in line and "exiting 75" in line
    )
    assert collective in line, line
    assert line.endswith("exiting 75 (retryable)"), line

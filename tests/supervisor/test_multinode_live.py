"""Two "nodes" on this machine (two supervisors over one run directory, two torchruns with a
c10d rendezvous on 127.0.0.1): a SIGKILLed worker of node 1 restarts both nodes from one
checkpoint and the run ends bitwise identical to an uninterrupted one; a hung two-node run is
restarted on both nodes when the monitor's TrainingStalled fires (the long chaos:
``benchmarks/bench_multinode.py``)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from benchmarks.bench_multinode import chaos, node_report, start_nodes, two_nodes
from tests.support.processes import start_monitor, stop_processes, wait_for
from tests.support.runs import events, stalled_rules, write_monitor_config

pytestmark = pytest.mark.live


def test_a_killed_worker_of_node_1_restarts_both_nodes_from_one_checkpoint(
    tmp_path: Path, corpus_cache: Path
) -> None:
    result = chaos(tmp_path, corpus_cache, steps=40, kills=1, seed=5)
    assert result["statuses"] == [0, 0]
    assert result["kills"] == 1
    # one crash per crash, recorded by the node whose group ended first: node 1's (its torchrun
    # saw the worker die) or node 0's (its ranks saw the collective fail first), as
    # docs/supervisor.md says of the crash's node label
    assert result["crashes"] == 1 and result["crashed_nodes"] in ([0], [1]), result["crash_events"]
    assert result["restarts"] == 1
    # node 0 chose the checkpoint; node 0's rank resumed from it, and node 1 started from it
    assert result["resumed"] == result["resume_from"] == [result["node_1_resumed_from"]]
    assert result["identical"]


def test_a_monitor_restart_of_a_hung_two_node_run_restarts_both(
    tmp_path: Path, corpus_cache: Path
) -> None:
    rules_file = stalled_rules(tmp_path)
    run_dir, config = two_nodes(
        tmp_path, corpus_cache, "hung", 10**6, faults=[{"kind": "hang", "step": 25}]
    )
    monitor_config, _ = write_monitor_config(
        tmp_path / "monitor.yml", [rules_file], scrape={"runs_root": str(run_dir.parent)}
    )
    monitor = start_monitor(monitor_config)
    nodes = start_nodes(run_dir, config, "--kill-after", "2s", "--backoff", "100ms")
    try:
        restart = wait_for(
            lambda: next((e for e in events(run_dir) if e.get("event") == "restart"), None),
            180,
            "the requested restart",
        )
        node_1 = wait_for(
            lambda: (r := node_report(run_dir, 1)).get("generation") == 2 and r, 60, "node 1 again"
        )
        resumed = wait_for(
            lambda: next(
                (
                    e
                    for e in events(run_dir)
                    if e["event"] == "resumed" and e["time"] > restart["time"]
                ),
                None,
            ),
            120,
            "the resumed run",
        )
    finally:
        stop_processes(*nodes, monitor)
    assert restart["reason"] == "requested" and restart["resume_from"] == "step_00000020"
    assert node_1["resume_from"] == resumed["checkpoint"] == restart["resume_from"]
    assert not [e for e in events(run_dir) if e.get("event") == "crash"]
    command = next(e for e in events(run_dir) if e.get("cmd") == "restart")
    assert command["args"] == {"reason": "alert TrainingStalled"}
    with sqlite3.connect(tmp_path / "state.db") as db:
        kind, state = db.execute("SELECT kind, state FROM actions").fetchone()
    assert (kind, state) == ("restart", "applied")

"""The agent's heartbeat: how a monitor on another host tells a live run from a dead one
without probing a pid it cannot see (DESIGN.md "Run directory").

The process that wrote ``agent.json`` (rank 0) rewrites ``heartbeats/<hostname>-<pid>.json``
every :data:`HEARTBEAT_S` seconds, whatever training does (a pause, a long save). A monitor on
the same host probes the pid; on another host it reads this file: silent for longer than
:data:`REMOTE_DEAD_AFTER_S`, the process is dead (the hosts' clocks must agree to well within
that).
"""

from __future__ import annotations

import json
from pathlib import Path

from lossguard.common.rundir.names import HEARTBEAT_DIR

HEARTBEAT_S = 10.0
REMOTE_DEAD_AFTER_S = 60.0


def heartbeat_path(run_dir: Path, hostname: str, pid: int) -> Path:
    return run_dir / HEARTBEAT_DIR / f"{hostname}-{pid}.json"


def heartbeat_text(hostname: str, pid: int, now: float) -> str:
    return json.dumps({"hostname": hostname, "pid": pid, "time": now}) + "\n"


def last_beat(run_dir: Path, hostname: str, pid: int) -> float | None:
    """When the process last beat (Unix seconds); None when it never did (an agent from before
    heartbeats) or the file cannot be read."""
    try:
        data = json.loads(heartbeat_path(run_dir, hostname, pid).read_bytes())
    except (OSError, ValueError):
        return None
    beat = data.get("time") if isinstance(data, dict) else None
    return float(beat) if isinstance(beat, int | float) and not isinstance(beat, bool) else None

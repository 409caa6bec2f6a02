"""RunRecords: what rank 0 keeps open in the run directory for a Guard (the audit trail, the metric
sinks, the control server, the checkpoint store, ``agent.json``); on the other ranks an empty
one, whose calls do nothing, so that the Guard writes the same way on every rank."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from lossguard.agent.checkpoint.store import CheckpointStore
from lossguard.agent.telemetry.sinks import Sink
from lossguard.common.control.server import ControlServer
from lossguard.common.rundir.agent_file import RunExit
from lossguard.common.rundir.directory import RunDirectory
from lossguard.common.rundir.events import CLOSE


class RunRecords:
    """Rank 0's ``run_dir`` with its ``control`` server (None: not asked for), ``checkpoints``
    store and ``sinks``; all absent on the other ranks (``RunRecords()``)."""

    def __init__(
        self,
        run_dir: RunDirectory | None = None,
        *,
        control: ControlServer | None = None,
        checkpoints: CheckpointStore | None = None,
        sinks: Sequence[Sink] = (),
    ) -> None:
        self.run_dir = run_dir
        self.control = control
        self.checkpoints = checkpoints
        self.sinks = list(sinks)

    def event(self, step: int, kind: str, fields: dict[str, Any]) -> None:
        """Append to the audit trail, events.jsonl."""
        if self.run_dir is not None:
            record = {"time": time.time(), "step": step, "event": kind, **fields}
            self.run_dir.events.append(record)

    def emit(self, record: dict[str, Any], *, display: bool = True) -> None:
        """A metrics record to every sink (``display``: to the progress display too)."""
        for sink in self.sinks:
            sink.write(record, display=display)

    def stop_asked(self) -> str | None:
        """A stop command waiting at the control server (for the stuck-rank watch)."""
        return "stop" if self.control is not None and self.control.waiting("stop") else None

    def close(self, step: int, *, stop_requested: bool, outcome: RunExit) -> None:
        """Stop serving, close the sinks, audit the close and give ``agent.json`` its ``exit``:
        ``outcome``."""
        if self.control is not None:
            self.control.close()
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        if self.run_dir is not None:
            self.event(step, CLOSE, {"stop_requested": stop_requested})
            self.run_dir.mark_finished(outcome)
            self.run_dir.close()

"""Rank 0's heartbeat thread (``lossguard.common.rundir.heartbeat``): it beats while the process
lives, whatever the training loop does."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path

from lossguard.common.ownership import PRIVATE_DIR
from lossguard.common.rundir.files import write_atomically
from lossguard.common.rundir.heartbeat import HEARTBEAT_S, heartbeat_path, heartbeat_text


class Heartbeat:
    def __init__(
        self, run_dir: Path, interval_s: float = HEARTBEAT_S, *, dir_mode: int = PRIVATE_DIR
    ) -> None:
        """``dir_mode``: the run directory's (``run.mode``); the file gets it less execute."""
        self.hostname = socket.gethostname()
        self.pid = os.getpid()
        self.path = heartbeat_path(run_dir, self.hostname, self.pid)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.parent.chmod(dir_mode)
        self.file_mode = dir_mode & 0o666
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="lossguard-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        with contextlib.suppress(OSError):  # a full or lost disk: the monitor sees silence
            text = heartbeat_text(self.hostname, self.pid, time.time())
            write_atomically(self.path, text, mode=self.file_mode)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._beat()

    def close(self) -> None:
        """Stop beating and remove the file (``agent.json`` says how the run ended)."""
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self.path.unlink()

"""Run by tests/agent/checkpoint/test_sharded.py under ``torchrun``: the agent, with rank 1's
files capped at ``LOSSGUARD_TEST_FSIZE`` bytes (``RLIMIT_FSIZE``, ``SIGXFSZ`` ignored), so that
rank's checkpoint writes fail with EFBIG as they would on a full disk:

    torchrun --nproc_per_node 2 -m tests.support.fsize_limited_agent CONFIG \
        [lossguard-agent run options]
"""

from __future__ import annotations

import os
import resource
import signal
import sys

from lossguard.agent.cli import main

if __name__ == "__main__":
    if os.environ.get("RANK") == "1":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        limit = int(os.environ["LOSSGUARD_TEST_FSIZE"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    sys.exit(main(["run", *sys.argv[1:]]))

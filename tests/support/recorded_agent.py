"""``lossguard-agent run`` with every rank's collectives recorded (tests/support/rank_drill.py's
``record_collectives``) in ``$LOSSGUARD_TEST_COLLECTIVES/collectives_K.txt``:

    torchrun --nproc_per_node 2 -m tests.support.recorded_agent CONFIG [lossguard-agent run options]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lossguard.agent.cli import main
from tests.support.rank_drill import record_collectives

if __name__ == "__main__":
    out = Path(os.environ["LOSSGUARD_TEST_COLLECTIVES"])
    record_collectives(out / f"collectives_{os.environ['RANK']}.txt")
    sys.exit(main(["run", *sys.argv[1:]]))

"""Which checkpoint a restart resumes from: the newest healthy one; after a second crash at the
same step, an earlier one than the last resume used, and so on back."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lossguard.common.rundir.checkpoints import CheckpointMeta, list_checkpoints
from lossguard.common.rundir.metrics_log import last_logged
from lossguard.common.rundir.paths import RunPaths
from lossguard.common.rundir.targets import ordered


def step_reached(run_dir: Path) -> int | None:
    """How far the run got: its last logged step or its newest checkpoint, whichever is later."""
    metas = list_checkpoints(RunPaths.of(run_dir).checkpoints)
    logged = last_logged(run_dir).step
    steps = [s for s in (logged, metas[-1].step if metas else None) if s is not None]
    return max(steps) if steps else None


@dataclass
class ResumePlanner:
    """Remembers the last crash and the checkpoint the last start resumed from."""

    run_dir: Path
    below_step: int | None = None  # only checkpoints before this step qualify
    last_crash_step: int | None = None
    resumed_from: CheckpointMeta | None = None

    def choose(self) -> CheckpointMeta | None:
        """The checkpoint to resume from (None: there is none, start afresh). Healthy ones
        first; without one, the newest that qualifies (an unhealthy checkpoint still beats
        starting over)."""
        metas = [
            m
            for m in list_checkpoints(RunPaths.of(self.run_dir).checkpoints)
            if self.below_step is None or m.step < self.below_step
        ]
        chosen = next(iter(ordered(metas, "last_good") or ordered(metas, "latest")), None)
        self.resumed_from = chosen
        return chosen

    def crashed(self, step: int | None) -> bool:
        """Note a crash at ``step``; whether it repeats the last one (same step, after resuming
        from a checkpoint), which makes the next start go back past that checkpoint."""
        repeated = step is not None and step == self.last_crash_step
        if repeated and self.resumed_from is not None:
            self.below_step = self.resumed_from.step
        elif not repeated:
            self.below_step = None
        self.last_crash_step = step
        return repeated

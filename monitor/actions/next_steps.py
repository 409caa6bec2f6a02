"""What on-call can do next about a run, as the exact commands to type."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from lossguard.monitor.actions.model import ActionRecord


def next_steps(
    run_id: str,
    records: Sequence[ActionRecord],
    *,
    ctl_target: list[str] | None,
    config_path: str | None,
) -> tuple[str, ...]:
    """Commands for the run: look at it, undo what the monitor changed (resume a pause, restore
    the learning rate), after a rollback that found nothing to go back to save, pause or stop
    it, and hold further alerts and actions while a human works on it.
    ``ctl_target``: how ``lossguard-ctl`` reaches the run (``--run-dir DIR``), when known."""
    steps: list[str] = []
    if ctl_target is not None:
        ctl = shlex.join(["lossguard-ctl", *ctl_target])
        steps.append(f"look at the run: {ctl} status")
        applied = [r for r in records if r.state == "applied"]
        if any(r.kind == "pause" for r in applied):
            steps.append(f"resume it once fixed: {ctl} resume")
        scales = [r.result.get("lr_scale") for r in applied if r.kind == "rollback"]
        if scales and isinstance(scales[-1], int | float) and scales[-1] != 1:
            steps.append(f"restore the scheduled learning rate: {ctl} set-lr-scale 1")
        if any(r.kind == "rollback" for r in applied):
            steps.append(f"list the checkpoints: {ctl} checkpoints")
        if any(r.state == "nothing_to_restore" for r in records):
            steps.append(f"if the run looks healthy, save its state now: {ctl} save")
            steps.append(f"or hold it where it is: {ctl} pause")
            steps.append(f"or end it (it saves first): {ctl} stop")
    silence = ["lossguard-monitor", "silence", "add"]
    if config_path:
        silence += ["--config", config_path]
    silence += [f'run_id="{run_id}"', "--duration", "2h", "--comment", "investigating"]
    steps.append(f"hold this run's alerts and actions: {shlex.join(silence)}")
    return tuple(steps)

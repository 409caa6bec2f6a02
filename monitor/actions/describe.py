"""Actions and spike diagnoses in words, for notifications, the console and ``status``."""

from __future__ import annotations

from typing import Any

from lossguard.monitor.actions.model import ActionRecord

_VERB = {
    "rollback": "roll back",
    "pause": "pause",
    "stop": "stop",
    "checkpoint": "save a checkpoint",
    "restart": "restart the training process through its supervisor",
}


def describe(record: ActionRecord) -> str:
    """One line: what was done (or would be, or why not), and, for a rollback, which attempt."""
    attempt = (
        f", attempt {record.attempt} of {record.of_attempts}" if record.attempt is not None else ""
    )
    if record.state == "applied":
        abandoned = record.result.get("abandoned")
        why = f". {diagnosis_text(abandoned)}" if isinstance(abandoned, dict) else ""
        return _applied(record) + attempt + why
    if record.state == "pending":
        tried = f" ({record.tries} tries so far: {record.reason})" if record.tries else ""
        return f"sending: {_plan(record)}{attempt}{tried}"
    if record.state == "dry_run":
        return f"dry run, not sent: would {_plan(record)}{attempt}"
    if record.state in ("held", "dropped"):
        return f"not done, {record.reason}: would {_plan(record)}{attempt}"
    if record.state == "nothing_to_restore":
        return _nothing_to_restore(record.result)
    return f"did not {_VERB.get(record.kind, record.kind)}: {record.reason}"


def _plan(record: ActionRecord) -> str:
    if record.kind != "rollback":
        return _VERB.get(record.kind, record.kind)
    args = record.args
    skip = args.get("skip_batches", 0)
    skipping = (
        "skip the abandoned steps' batches"
        if skip == "abandoned"
        else f"skip {skip} batches"
        if skip
        else "skip no batches"
    )
    return (
        f"roll back to {args.get('target')}, {skipping}, lr scaled by {args.get('lr_scale', 1):g}"
    )


def _applied(record: ActionRecord) -> str:
    result = record.result
    if record.kind == "rollback":
        return (
            f"rolled back from step {result.get('from_step')} to step {result.get('to_step')} "
            f"({result.get('checkpoint')}), skipped {result.get('skipped_batches', 0)} batches, "
            f"lr scaled by {record.args.get('lr_scale', 1):g} (run's lr scale now "
            f"{result.get('lr_scale', 1):g})"
        )
    if record.kind == "pause":
        why = f": {record.reason}" if record.reason else ""
        return f"paused training at step {result.get('step')}{why}"
    if record.kind == "stop":
        saved = result.get("checkpoint")
        return f"stopped training at step {result.get('step')}" + (
            f" after saving {saved}" if saved else " (the final save failed)"
        )
    if record.kind == "restart":
        if not result.get("restarting"):
            return f"the supervisor did not restart the run ({result.get('reason')})"
        ended = result.get("killed_pid")
        how = f"ended process group {ended} ({result.get('exit')}) and " if ended else ""
        return f"the supervisor {how}restarted the run from its newest healthy checkpoint"
    healthy = "healthy" if result.get("healthy") else "marked unhealthy"
    return f"saved checkpoint {result.get('name')} at step {result.get('step')} ({healthy})"


def _nothing_to_restore(status: dict[str, Any]) -> str:
    """A rollback that found no state to go back to, and what the run does instead."""
    episode = status.get("episode")
    trouble = episode.get("step") if isinstance(episode, dict) else None
    before = f" before step {trouble}" if trouble is not None else ""
    text = (
        "nothing to roll back to: no healthy state (in-memory snapshot or checkpoint) exists"
        f"{before}, so the run was left as it is"
    )
    step = status.get("step")
    if step is None:
        return text + " (it did not answer a status request)"
    doing = "paused" if status.get("paused") else "training on"
    loss = status.get("last_train_loss")
    shown = f", last train loss {loss:.4g}" if isinstance(loss, int | float) else ""
    return f"{text}; it is at step {step}, {doing}{shown}"


def diagnosis_text(diagnosis: dict[str, Any]) -> str:
    """``At step 805 the loss was NaN (...). Probable cause: ...``"""
    signal = str(diagnosis.get("signal", "loss")).replace("_", " ")
    value = diagnosis.get("value")
    if diagnosis.get("nonfinite") or value is None:
        what = f"the {signal} was not finite"
    else:
        what = f"the {signal} spiked to {value:.4g}"
        zscore = diagnosis.get("zscore")
        if isinstance(zscore, int | float):
            what += (
                f" ({zscore:.1f} std above its window mean {diagnosis.get('window_mean', 0):.4g})"
            )
    causes = [str(c) for c in diagnosis.get("causes") or []]
    text = f"At step {diagnosis.get('step')} {what}"
    if causes:
        text += f"; probable cause{'s' if len(causes) > 1 else ''}: {'; '.join(causes)}"
    return text

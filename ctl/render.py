"""How ``lossguard-ctl`` prints a command's result: as JSON, or as text a person reads (a table
of checkpoints, a status sheet, one line for the rest)."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

from lossguard.common.console import format_duration
from lossguard.common.control.client import ControlError


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _lr(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def _local_time(epoch: float | None) -> str:
    return "-" if epoch is None else datetime.fromtimestamp(epoch).isoformat(timespec="seconds")


def _table(rows: list[list[str]], right: set[int]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
    return "\n".join(lines)


def _format_status(result: dict[str, Any]) -> str:
    checkpoint = result["checkpoint"]
    step = str(result["step"])
    if result["max_steps"] is not None:
        step += f" / {result['max_steps']}"
    state = [name for name in ("paused", "stopping") if result[name]] or ["running"]
    rows = [
        ("run", _text(result["run_id"])),
        ("step", step),
        ("tokens", f"{result['tokens']:,}"),
        ("state", ", ".join(state)),
        ("lr", _lr(result["lr"])),
        ("lr scale", f"{result['lr_scale']:g}"),
        ("train loss", _loss(result["last_train_loss"])),
        ("val loss", _loss(result["last_val_loss"])),
        ("world size", str(result["world_size"])),
        ("pid", str(result["pid"])),
        ("uptime", format_duration(result["uptime_seconds"])),
        ("latest", _text(checkpoint["latest"])),
        ("best", _text(checkpoint["best"])),
        ("last good", _text(checkpoint["last_good"])),
        ("saving", "yes" if checkpoint["in_progress"] else "no"),
    ]
    if result.get("episode"):  # agents before diagnoses leave it out
        rows.append(("episode", _diagnosis(result["episode"])))
    width = max(len(key) for key, _ in rows) + 1
    return "\n".join(f"{key:<{width}}{value}" for key, value in rows)


def _format_checkpoints(result: dict[str, Any]) -> str:
    if not result["checkpoints"]:
        return "no checkpoints"
    header = ["name", "step", "healthy", "val loss", "train loss", "created", "reason", "marks"]
    rows = [header]
    for ckpt in result["checkpoints"]:
        marks = [mark for mark in ("latest", "best", "last_good") if result[mark] == ckpt["name"]]
        rows.append(
            [
                ckpt["name"],
                str(ckpt["step"]),
                "yes" if ckpt["healthy"] else "no",
                _loss(ckpt["val_loss"]),
                _loss(ckpt["train_loss"]),
                _local_time(ckpt["created_at"]),
                _text(ckpt["reason"]),
                ", ".join(marks),
            ]
        )
    return _table(rows, right={1, 3, 4})


def _format_save(result: dict[str, Any]) -> str:
    health = "healthy" if result["healthy"] else "unhealthy"
    return f"saved {result['name']} (step {result['step']}, {health}) in {result['seconds']:.2f} s"


def _format_rollback(result: dict[str, Any]) -> str:
    text = (
        f"rolled back from step {result['from_step']} to step {result['to_step']} "
        f"({result['checkpoint']}); skipped {result['skipped_batches']} batches; "
        f"lr scale {result['lr_scale']:g}"
    )
    if result.get("abandoned"):
        text += f"\nabandoned: {_diagnosis(result['abandoned'])}"
    return text


def _diagnosis(diagnosis: dict[str, Any]) -> str:
    """``loss non-finite at step 805: <causes>`` or ``loss spike at step 9 (40, z 8.0): ...``"""
    signal = str(diagnosis["signal"]).replace("_", " ")
    if diagnosis["nonfinite"]:
        what = f"{signal} non-finite at step {diagnosis['step']}"
    else:
        what = f"{signal} spike at step {diagnosis['step']}"
        if diagnosis.get("value") is not None:
            zscore = diagnosis.get("zscore")
            z = f", z {zscore:.1f}" if zscore is not None else ""
            what += f" ({diagnosis['value']:.4g}{z})"
    causes = "; ".join(str(cause) for cause in diagnosis.get("causes") or [])
    return f"{what}: {causes}" if causes else what


def _format_pause_resume(result: dict[str, Any]) -> str:
    return f"{'paused' if result['paused'] else 'resumed'} at step {result['step']}"


def _format_set_lr_scale(result: dict[str, Any]) -> str:
    text = f"lr scale {result['lr_scale']:g}"
    return text if result["lr"] is None else f"{text} (lr {_lr(result['lr'])})"


def _format_expect_change(result: dict[str, Any]) -> str:
    return (
        f"change expected at step {result['step']}: the spike detectors start again from the "
        "current level"
    )


def _format_stop(result: dict[str, Any]) -> str:
    saved = result["checkpoint"]
    return f"stopping at step {result['step']}; " + (
        f"saved {saved}" if saved else "no checkpoint saved"
    )


_FORMATTERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "status": _format_status,
    "checkpoints": _format_checkpoints,
    "save": _format_save,
    "rollback": _format_rollback,
    "pause": _format_pause_resume,
    "resume": _format_pause_resume,
    "set_lr_scale": _format_set_lr_scale,
    "expect_change": _format_expect_change,
    "stop": _format_stop,
}


def render(cmd: str, result: dict[str, Any], as_json: bool) -> str:
    """The result as printed; a result of an unexpected shape is a ``bad_reply``."""
    if as_json:
        return json.dumps(result, indent=2)
    try:
        return _FORMATTERS[cmd](result)
    except (KeyError, TypeError, ValueError) as exc:
        raise ControlError(
            "bad_reply", f"unexpected {cmd} result ({type(exc).__name__}: {exc}); try --json"
        ) from None

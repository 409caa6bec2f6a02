"""Checkpoint names and ``meta.json``: the ``CheckpointMeta`` fields, their validation, reading.

Torch-free, so that checkpoints can be listed without torch.
"""

from __future__ import annotations

import json
import logging
import re
import reprlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

STATE_FILE = "state.pt"
META_FILE = "meta.json"
TORCH_FORMAT = "torch"
DCP_FORMAT = "dcp"
REQUIRED_FILE = {TORCH_FORMAT: STATE_FILE, DCP_FORMAT: ".metadata"}
"""Per checkpoint format, the file without which a checkpoint is unusable: ``torch`` is one
``state.pt``; ``dcp`` is torch.distributed.checkpoint's files (``.metadata`` and every rank's
shards) beside each rank's ``rank_K.pt``."""
MAX_STEP = 10**8 - 1
NAME_RE = re.compile(r"^step_([0-9]{8})$")
"""A checkpoint's folder name; the group is its step."""
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

log = logging.getLogger("lossguard.common.rundir")


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint of ``step``: ``step_00001200``."""
    if isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"checkpoint step must be an integer in 0..{MAX_STEP}, not {step!r}")
    return f"step_{step:08d}"


class CheckpointError(RuntimeError):
    """A checkpoint is missing or unusable; the one-line message names it and the problem."""


def error_line(exc: BaseException) -> str:
    """``exc`` for a one-line message: its type and the first line of its text, cut short."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__


@dataclass(frozen=True)
class CheckpointMeta:
    """The content of ``meta.json``."""

    name: str
    step: int
    seq: int
    tokens: int
    healthy: bool
    reason: str
    train_loss: float | None
    val_loss: float | None
    created_at: float
    files: dict[str, str]
    config_hash: str | None
    versions: dict[str, str | None]
    extra: dict[str, Any]
    format: str = TORCH_FORMAT
    """``torch`` or ``dcp``; absent in ``meta.json`` written before there were two: torch."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckpointMeta:
        """Validate parsed ``meta.json``; raises CheckpointError on missing or bad fields."""
        name = data.get("name") if isinstance(data, dict) else None
        try:
            return _parse_meta(data)
        except ValueError as exc:
            label = name if isinstance(name, str) else "?"
            raise CheckpointError(f"checkpoint {label}: {exc}") from None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_file_name(value: Any) -> bool:
    return isinstance(value, str) and value not in ("", ".", "..", META_FILE) and "/" not in value


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and _SHA256_RE.fullmatch(value) is not None


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _dict_of(key: Callable[[Any], bool], item: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: (
        isinstance(value, dict) and all(key(k) and item(v) for k, v in value.items())
    )


_FIELD_CHECKS: dict[str, Callable[[Any], bool]] = {
    "name": lambda value: isinstance(value, str) and NAME_RE.fullmatch(value) is not None,
    "step": lambda value: _is_count(value) and value <= MAX_STEP,
    "seq": _is_count,
    "tokens": _is_count,
    "healthy": lambda value: isinstance(value, bool),
    "reason": _is_str,
    "train_loss": _optional(_is_number),
    "val_loss": _optional(_is_number),
    "created_at": _is_number,
    "files": _dict_of(_is_file_name, _is_sha256),
    "config_hash": _optional(_is_str),
    "versions": _dict_of(_is_str, _optional(_is_str)),
    "extra": lambda value: isinstance(value, dict),
}
_FLOAT_FIELDS = ("train_loss", "val_loss", "created_at")


def _parse_meta(data: Any) -> CheckpointMeta:
    """A CheckpointMeta from parsed JSON; raises ValueError naming the bad field."""
    if not isinstance(data, dict):
        raise ValueError(f"{META_FILE} does not hold a JSON object")
    for key, valid in _FIELD_CHECKS.items():
        if key not in data:
            raise ValueError(f"{META_FILE} lacks the field {key!r}")
        if not valid(data[key]):
            raise ValueError(f"{META_FILE} has a bad {key!r}: {reprlib.repr(data[key])}")
    if data["name"] != checkpoint_name(data["step"]):
        raise ValueError(f"{META_FILE} name {data['name']!r} does not match step {data['step']}")
    values = {key: data[key] for key in _FIELD_CHECKS}
    values["format"] = data.get("format", TORCH_FORMAT)
    if values["format"] not in REQUIRED_FILE:
        raise ValueError(f"{META_FILE} has an unknown format: {reprlib.repr(values['format'])}")
    for key in _FLOAT_FIELDS:
        values[key] = None if values[key] is None else float(values[key])
    return CheckpointMeta(**values)


def read_meta(folder: Path) -> CheckpointMeta:
    """The meta of the checkpoint in ``folder``; raises CheckpointError naming the folder."""
    try:
        data = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
        meta = _parse_meta(data)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {folder.name}: {META_FILE} is missing") from None
    except (OSError, ValueError) as exc:  # JSON and UTF-8 decoding errors are ValueErrors
        raise CheckpointError(f"checkpoint {folder.name}: {error_line(exc)}") from None
    if meta.name != folder.name:
        raise CheckpointError(f"checkpoint {folder.name}: {META_FILE} names {meta.name}")
    return meta


def list_checkpoints(root: Path) -> list[CheckpointMeta]:
    """The visible checkpoints under ``root`` (a run's ``checkpoints/``) in creation order,
    read without torch; unreadable ones are skipped with a warning, a missing ``root`` is none."""
    if not root.is_dir():
        return []
    metas = []
    for entry in root.iterdir():
        if not NAME_RE.fullmatch(entry.name) or not entry.is_dir():
            continue
        try:
            metas.append(read_meta(entry))
        except CheckpointError as exc:
            if entry.is_dir():  # not deleted or replaced meanwhile
                log.warning("%s; ignoring it", exc)
    return sorted(metas, key=lambda m: m.seq)


def meta_fields(
    step: int,
    tokens: int,
    healthy: bool,
    reason: str,
    train_loss: float | None,
    val_loss: float | None,
    extra: dict[str, Any] | None,
) -> dict[str, Any]:
    """The caller-given meta fields as JSON-ready plain values; raises ValueError on a bad step."""
    return {
        "name": checkpoint_name(step),
        "step": step,
        "tokens": int(tokens),
        "healthy": bool(healthy),
        "reason": str(reason),
        "train_loss": None if train_loss is None else float(train_loss),
        "val_loss": None if val_loss is None else float(val_loss),
        "extra": dict(extra or {}),
    }

"""The checkpoint store: atomic, verified, retained checkpoints under ``run_dir/checkpoints``.

A checkpoint is a folder ``step_XXXXXXXX`` holding ``state.pt`` (one ``torch.save`` dict) and
``meta.json``. It is written under a hidden temporary name, fsynced and renamed into place, so it
is visible only when complete; deletion renames it to a hidden trash name first. Hidden leftovers
of a crash are removed when a store opens. Only one process writes to a store at a time.
"""

from __future__ import annotations

import builtins
import copy
import hashlib
import json
import logging
import math
import os
import re
import reprlib
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO, Any

import torch

from .rundir import package_versions

CHECKPOINT_DIR = "checkpoints"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
NAMED_TARGETS = ("latest", "best", "last_good")
MAX_STEP = 10**8 - 1
SUPERSEDED = "superseded"  # meta.extra flag, see CheckpointStore.supersede_after
_NAME_RE = re.compile(r"^step_[0-9]{8}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_HIDDEN_PREFIXES = (".tmp-", ".trash-")
_CHUNK = 1 << 20

log = logging.getLogger(__name__)

OnDone = Callable[["CheckpointMeta | BaseException"], None]


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint of ``step``: ``step_00001200``."""
    if isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"checkpoint step must be an integer in 0..{MAX_STEP}, not {step!r}")
    return f"step_{step:08d}"


class CheckpointError(RuntimeError):
    """A checkpoint is missing or unusable; the one-line message names it and the problem."""


class _Unusable(Exception):
    """The problem of one checkpoint, without its name."""


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
    "name": lambda value: isinstance(value, str) and _NAME_RE.fullmatch(value) is not None,
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
    for key in _FLOAT_FIELDS:
        values[key] = None if values[key] is None else float(values[key])
    return CheckpointMeta(**values)


def _read_meta(folder: Path) -> CheckpointMeta:
    """The meta of the checkpoint in ``folder``; raises CheckpointError naming the folder."""
    try:
        data = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
        meta = _parse_meta(data)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {folder.name}: {META_FILE} is missing") from None
    except (OSError, ValueError) as exc:  # JSON and UTF-8 decoding errors are ValueErrors
        raise CheckpointError(f"checkpoint {folder.name}: {_one_line(exc)}") from None
    if meta.name != folder.name:
        raise CheckpointError(f"checkpoint {folder.name}: {META_FILE} names {meta.name}")
    return meta


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _write_synced(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    with open(path, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())


def _write_json_synced(path: Path, data: dict[str, Any]) -> None:
    blob = (json.dumps(data, indent=2) + "\n").encode("utf-8")
    _write_synced(path, lambda fh: fh.write(blob))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def snapshot(obj: Any) -> Any:
    """A copy of ``obj`` for an async save: tensors become detached contiguous CPU clones.

    dicts, lists and tuples are copied recursively and keep their types; other values are
    returned as they are. CUDA tensors are copied without blocking into pinned memory, then
    each CUDA device seen is synchronised once.
    """
    cuda_devices: set[torch.device] = set()
    copied = _copy(obj, cuda_devices)
    for device in cuda_devices:
        torch.cuda.synchronize(device)
    return copied


def _copy(obj: Any, cuda_devices: set[torch.device]) -> Any:
    if isinstance(obj, torch.Tensor):
        return _copy_tensor(obj, cuda_devices)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the type and attributes such as a state dict's _metadata
        for key, value in obj.items():
            out[key] = _copy(value, cuda_devices)
        return out
    if isinstance(obj, (list, tuple)):
        items = [_copy(value, cuda_devices) for value in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _copy_tensor(tensor: torch.Tensor, cuda_devices: set[torch.device]) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cuda":
        return tensor.to("cpu", memory_format=torch.contiguous_format, copy=True)
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    out.copy_(tensor, non_blocking=True)
    cuda_devices.add(tensor.device)
    return out


def _meta_fields(
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


def is_superseded(meta: CheckpointMeta) -> bool:
    """Written on a timeline that a rollback (or a resume from an older checkpoint) left."""
    return bool(meta.extra.get(SUPERSEDED))


def _ordered(metas: list[CheckpointMeta], target: str | int) -> list[CheckpointMeta]:
    """The checkpoints that ``target`` may mean, most preferred first. Named targets and
    fallbacks skip superseded checkpoints; an explicit step still reaches one."""
    newest_first = sorted(metas, key=lambda m: m.seq, reverse=True)
    current = [m for m in newest_first if not is_superseded(m)]
    if target == "latest":
        return current
    if target == "best":
        scored = [
            (m.val_loss, m) for m in current if m.val_loss is not None and math.isfinite(m.val_loss)
        ]
        return [m for _, m in sorted(scored, key=lambda pair: pair[0])]  # stable: newer first
    if target == "last_good":
        return [m for m in current if m.healthy]
    if isinstance(target, int) and not isinstance(target, bool):
        exact = [m for m in newest_first if m.step == target]
        if not exact:
            return []
        earlier = [m for m in current if m.seq < exact[-1].seq and m.step < target]
        return exact + earlier
    raise CheckpointError(
        f"unknown checkpoint target {target!r}: use {', '.join(NAMED_TARGETS)} or a step number"
    )


class CheckpointStore:
    """Checkpoints of one run under ``root`` (``run_dir/checkpoints``), written by one process.

    ``save``/``save_async``/``wait`` are called from one thread (the training loop) and never
    from an ``on_done`` callback; ``list``, ``resolve``, ``load`` and ``pin`` from any thread.
    """

    def __init__(
        self,
        root: Path,
        *,
        keep_last: int,
        config_hash: str | None = None,
        versions: dict[str, str | None] | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, not {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.config_hash = config_hash
        self.versions = dict(package_versions() if versions is None else versions)
        self._lock = threading.RLock()  # seq, pins, and renames within root
        self._submit = threading.Lock()  # one save in flight
        self._pinned: set[str] = set()
        self._writer: threading.Thread | None = None
        self.root.mkdir(parents=True, exist_ok=True)
        for entry in self.root.iterdir():
            if entry.name.startswith(_HIDDEN_PREFIXES):
                _remove(entry)
        self._seq = max((m.seq for m in self.list()), default=0)

    def save(
        self,
        step: int,
        payload: dict[str, Any],
        *,
        tokens: int,
        healthy: bool,
        reason: str,
        train_loss: float | None = None,
        val_loss: float | None = None,
        extra: dict[str, Any] | None = None,
    ) -> CheckpointMeta:
        """Write a checkpoint now (after any save in flight), then apply retention."""
        fields = _meta_fields(step, tokens, healthy, reason, train_loss, val_loss, extra)
        self._check_caller()
        with self._submit:
            self.wait()
            return self._save_now(payload, fields)

    def save_async(
        self,
        step: int,
        payload: dict[str, Any],
        *,
        tokens: int,
        healthy: bool,
        reason: str,
        train_loss: float | None = None,
        val_loss: float | None = None,
        extra: dict[str, Any] | None = None,
        on_done: OnDone | None = None,
    ) -> None:
        """Write a checkpoint in a background thread once the save in flight, if any, is done.

        ``payload`` must be a ``snapshot``. ``on_done`` runs in the writer thread with the meta
        or the exception (a CheckpointError naming the checkpoint); the save counts as in flight
        until it returns. A failed save leaves no checkpoint behind.
        """
        fields = _meta_fields(step, tokens, healthy, reason, train_loss, val_loss, extra)
        self._check_caller()
        with self._submit:
            self.wait()
            self._writer = threading.Thread(
                target=self._write_in_background,
                args=(payload, fields, on_done),
                name=f"lossguard-checkpoint-{step}",
            )
            self._writer.start()

    def wait(self, timeout: float | None = None) -> None:
        """Block until no save is in flight, or ``timeout`` seconds (then see ``in_progress``)."""
        self._check_caller()
        writer = self._writer
        if writer is not None:
            writer.join(timeout)

    @property
    def in_progress(self) -> bool:
        writer = self._writer
        return writer is not None and writer.is_alive()

    def list(self) -> builtins.list[CheckpointMeta]:
        """Visible checkpoints in creation order; unreadable ones are skipped with a warning."""
        metas = []
        for entry in self.root.iterdir():
            if not _NAME_RE.fullmatch(entry.name) or not entry.is_dir():
                continue
            try:
                metas.append(_read_meta(entry))
            except CheckpointError as exc:
                if entry.is_dir():  # not deleted or replaced meanwhile
                    log.warning("%s; ignoring it", exc)
        return sorted(metas, key=lambda m: m.seq)

    def resolve(self, target: str | int) -> builtins.list[CheckpointMeta]:
        """Candidates for ``target`` (latest, best, last_good or a step), most preferred first."""
        candidates = _ordered(self.list(), target)
        if not candidates:
            raise CheckpointError(f"no checkpoint matches target {target!r} in {self.root}")
        return candidates

    def named(self) -> dict[str, CheckpointMeta | None]:
        """The latest, best and last good checkpoints (None where there is none)."""
        metas = self.list()
        return {target: next(iter(_ordered(metas, target)), None) for target in NAMED_TARGETS}

    def load(self, target: str | int) -> tuple[CheckpointMeta, dict[str, Any]]:
        """The first usable candidate for ``target`` and its state, loaded on the CPU.

        Each unusable candidate is logged as a warning naming it, the problem and the next one.
        """
        candidates = self.resolve(target)
        for index, meta in enumerate(candidates):
            try:
                return meta, self._read_state(meta)
            except _Unusable as exc:
                following = candidates[index + 1 : index + 2]
                instead = f"trying {following[0].name}" if following else "no other candidate"
                log.warning("checkpoint %s is unusable (%s); %s", meta.name, exc, instead)
        tried = ", ".join(m.name for m in candidates)
        raise CheckpointError(
            f"no usable checkpoint for target {target!r} in {self.root} (tried {tried})"
        )

    def verify(self, meta: CheckpointMeta) -> None:
        """Raise CheckpointError unless every file in ``meta.files`` exists and hashes right."""
        try:
            self._verify(meta)
        except _Unusable as exc:
            raise CheckpointError(f"checkpoint {meta.name}: {exc}") from None

    def pin(self, name: str) -> None:
        """Keep the checkpoint ``name`` from retention until ``unpin``."""
        with self._lock:
            if not _NAME_RE.fullmatch(name) or not (self.root / name / META_FILE).is_file():
                raise CheckpointError(f"cannot pin {name!r}: no such checkpoint in {self.root}")
            self._pinned.add(name)

    def unpin(self, name: str) -> None:
        with self._lock:
            self._pinned.discard(name)

    def retained(self, metas: builtins.list[CheckpointMeta]) -> set[str]:
        """Names kept: the newest ``keep_last``, the best, the last good and pinned ones."""
        keep = {m.name for m in sorted(metas, key=lambda m: m.seq)[-self.keep_last :]}
        for target in ("best", "last_good"):
            keep.update(m.name for m in _ordered(metas, target)[:1])
        with self._lock:
            return keep | (self._pinned & {m.name for m in metas})

    def apply_retention(self) -> builtins.list[str]:
        """Delete the checkpoints not retained; returns their names."""
        removed = []
        with self._lock:
            metas = self.list()
            keep = self.retained(metas)
            for meta in metas:
                if meta.name in keep:
                    continue
                try:
                    trash = self._hide(meta.name)
                except OSError as exc:
                    log.warning("cannot delete checkpoint %s: %s", meta.name, exc)
                    continue
                shutil.rmtree(trash, ignore_errors=True)
                removed.append(meta.name)
        return removed

    def supersede_after(self, kept: CheckpointMeta) -> builtins.list[str]:
        """Mark every checkpoint written after ``kept`` superseded: training went back to
        ``kept``, so ``latest``, ``best`` and ``last_good`` must not lead forward to the
        abandoned timeline. They stay listed (post-mortems) until retention removes them."""
        marked = []
        with self._lock:
            for meta in self.list():
                if meta.seq <= kept.seq or is_superseded(meta):
                    continue
                updated = replace(meta, extra={**meta.extra, SUPERSEDED: True})
                folder = self.root / meta.name
                tmp = folder / f".{META_FILE}.tmp"
                _write_json_synced(tmp, updated.to_dict())
                os.replace(tmp, folder / META_FILE)
                _fsync_dir(folder)
                marked.append(meta.name)
        return marked

    def _check_caller(self) -> None:
        if threading.current_thread() is self._writer:
            raise CheckpointError("checkpoint saves cannot be started or awaited from on_done")

    def _write_in_background(
        self, payload: dict[str, Any], fields: dict[str, Any], on_done: OnDone | None
    ) -> None:
        result: CheckpointMeta | BaseException
        try:
            result = self._save_now(payload, fields)
        except BaseException as exc:  # reported, never raised: a failed save must not kill the run
            result = exc
        if on_done is None:
            if isinstance(result, BaseException):
                log.error("%s", result)
            return
        try:
            on_done(result)
        except Exception:
            log.exception("checkpoint on_done callback failed")

    def _save_now(self, payload: dict[str, Any], fields: dict[str, Any]) -> CheckpointMeta:
        name = fields["name"]
        with self._lock:
            self._seq += 1
            seq = self._seq
        created_at = time.time()
        tmp = self.root / f".tmp-{name}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            _write_synced(tmp / STATE_FILE, lambda fh: torch.save(payload, fh))
            files = {STATE_FILE: sha256_file(tmp / STATE_FILE)}
            meta = CheckpointMeta(
                seq=seq,
                created_at=created_at,
                files=files,
                config_hash=self.config_hash,
                versions=dict(self.versions),
                **fields,
            )
            _write_json_synced(tmp / META_FILE, meta.to_dict())
            _fsync_dir(tmp)
            self._publish(tmp, name)
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"checkpoint {name}: save failed ({_one_line(exc)})") from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.apply_retention()
        return meta

    def _publish(self, tmp: Path, name: str) -> None:
        """Rename the complete ``tmp`` to ``name``, replacing a checkpoint of the same step."""
        final = self.root / name
        with self._lock:
            trash = self._hide(name) if final.exists() else None
            try:
                os.rename(tmp, final)
            except BaseException:
                if trash is not None:
                    os.rename(trash, final)
                raise
            _fsync_dir(self.root)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)

    def _hide(self, name: str) -> Path:
        """Rename a checkpoint to a trash name, which no reader sees; returns the new path."""
        trash = self.root / f".trash-{name}-{secrets.token_hex(4)}"
        os.rename(self.root / name, trash)
        return trash

    def _verify(self, meta: CheckpointMeta) -> None:
        if STATE_FILE not in meta.files:
            raise _Unusable(f"{STATE_FILE} is not listed in {META_FILE}")
        for file_name, expected in meta.files.items():
            try:
                actual = sha256_file(self.root / meta.name / file_name)
            except FileNotFoundError:
                raise _Unusable(f"{file_name} is missing") from None
            except OSError as exc:
                raise _Unusable(f"{file_name} is unreadable ({_one_line(exc)})") from None
            if actual != expected:
                raise _Unusable(f"sha256 mismatch in {file_name}")

    def _read_state(self, meta: CheckpointMeta) -> dict[str, Any]:
        self._verify(meta)
        path = self.root / meta.name / STATE_FILE
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # whatever the unpickler raises, the checkpoint is unusable
            raise _Unusable(f"cannot load {STATE_FILE}: {_one_line(exc)}") from None
        if not isinstance(state, dict):
            raise _Unusable(f"{STATE_FILE} holds a {type(state).__name__}, not a dict")
        return state

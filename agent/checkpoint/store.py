"""``CheckpointStore``: atomic, verified, retained checkpoints under ``run_dir/checkpoints``.

A checkpoint is a folder ``step_XXXXXXXX`` holding ``state.pt`` (one ``torch.save`` dict) and
``meta.json``; a ``dcp`` checkpoint (``dcp_format``) holds every rank's files instead, written
into a ``temp_folder`` and published by ``commit``. It is written under a hidden temporary
name, fsynced and renamed into place, so it is visible only when complete; deletion renames it
to a hidden trash name first. Hidden leftovers of a crash are removed when a store opens. Only
one process publishes to a store at a time.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from lossguard.agent.checkpoint.background import start_writer
from lossguard.agent.checkpoint.reader import CheckpointReader
from lossguard.common.ownership import PRIVATE_DIR
from lossguard.common.rundir.checkpoints import (
    META_FILE,
    NAME_RE,
    STATE_FILE,
    TORCH_FORMAT,
    CheckpointError,
    CheckpointMeta,
    error_line,
    meta_fields,
)
from lossguard.common.rundir.directory import package_versions
from lossguard.common.rundir.files import (
    fsync_dir,
    remove,
    sha256_file,
    write_atomically,
    write_json_synced,
    write_synced,
)
from lossguard.common.rundir.targets import SUPERSEDED, is_in_memory, is_superseded, ordered

_HIDDEN_PREFIXES = (".tmp-", ".trash-")

# the package's name, as before it was split: log records and logging settings keep their logger
log = logging.getLogger("lossguard.agent.checkpoint")

OnDone = Callable[[CheckpointMeta | BaseException], None]


class CheckpointStore(CheckpointReader):
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
        dir_mode: int = PRIVATE_DIR,
    ) -> None:
        """``dir_mode``: the run directory's (``run.mode``): its checkpoint folders get it, their
        files it less execute, whatever the umask."""
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, not {keep_last}")
        super().__init__(root)
        self.keep_last = keep_last
        self.config_hash = config_hash
        self.versions = dict(package_versions() if versions is None else versions)
        self._lock = threading.RLock()  # seq, pins, and renames within root
        self._submit = threading.Lock()  # one save in flight
        self._pinned: set[str] = set()
        self._writer: threading.Thread | None = None
        self.write_delay_s = 0.0
        """Seconds added to each write (the ``slow_save`` fault drill: a slow filesystem)."""
        self.dir_mode = dir_mode
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(dir_mode)
        for entry in self.root.iterdir():
            if entry.name.startswith(_HIDDEN_PREFIXES):
                remove(entry)
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
        fields = meta_fields(step, tokens, healthy, reason, train_loss, val_loss, extra)
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
        fields = meta_fields(step, tokens, healthy, reason, train_loss, val_loss, extra)
        self._check_caller()
        with self._submit:
            self.wait()
            self._writer = start_writer(
                lambda: self._write_in_background(payload, fields, on_done),
                name=f"lossguard-checkpoint-{step}",
            )

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

    def pin(self, name: str) -> None:
        """Keep the checkpoint ``name`` from retention until ``unpin``."""
        with self._lock:
            if not NAME_RE.fullmatch(name) or not (self.root / name / META_FILE).is_file():
                raise CheckpointError(f"cannot pin {name!r}: no such checkpoint in {self.root}")
            self._pinned.add(name)

    def unpin(self, name: str) -> None:
        with self._lock:
            self._pinned.discard(name)

    def retained(self, metas: builtins.list[CheckpointMeta]) -> set[str]:
        """Names kept: the newest ``keep_last``, the best, the last good and pinned ones."""
        keep = {m.name for m in sorted(metas, key=lambda m: m.seq)[-self.keep_last :]}
        for target in ("best", "last_good"):
            keep.update(m.name for m in ordered(metas, target)[:1])
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
        abandoned timeline. They stay listed (post-mortems) until retention removes them.
        For a snapshot ``kept`` (in memory): the current checkpoints of later steps."""
        marked = []
        with self._lock:
            for meta in self.list():
                earlier = meta.step <= kept.step if is_in_memory(kept) else meta.seq <= kept.seq
                if earlier or is_superseded(meta):
                    continue
                updated = replace(meta, extra={**meta.extra, SUPERSEDED: True})
                text = json.dumps(updated.to_dict(), indent=2) + "\n"
                write_atomically(self.root / meta.name / META_FILE, text)
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
        tmp = self.temp_folder(fields["name"])
        try:
            write_synced(tmp / STATE_FILE, lambda fh: torch.save(payload, fh))
            if self.write_delay_s:
                time.sleep(self.write_delay_s)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, Exception):
                raise CheckpointError(
                    f"checkpoint {fields['name']}: save failed ({error_line(exc)})"
                ) from exc
            raise
        return self.commit(tmp, fields)

    def temp_folder(self, name: str) -> Path:
        """A new hidden folder for the files of checkpoint ``name``, invisible to readers
        (and removed when a store opens) until ``commit``."""
        tmp = self.root / f".tmp-{name}-{secrets.token_hex(4)}"
        tmp.mkdir(mode=PRIVATE_DIR)
        return tmp

    def commit(
        self,
        tmp: Path,
        fields: dict[str, Any],
        checkpoint_format: str = TORCH_FORMAT,
        *,
        digests: dict[str, str] | None = None,
    ) -> CheckpointMeta:
        """Publish the complete files in ``tmp`` as a checkpoint: hash every file (but those
        ``digests`` already has, hashed by the ranks that wrote them), write ``meta.json``,
        fsync, rename into place, fsync the root; then apply retention. On failure ``tmp`` is
        removed and CheckpointError names the checkpoint."""
        name = fields["name"]
        with self._lock:
            self._seq += 1
            seq = self._seq
        created_at = time.time()
        try:
            known = digests or {}
            files = {
                f.name: known.get(f.name) or sha256_file(f)
                for f in sorted(tmp.iterdir())
                if f.is_file()
            }
            meta = CheckpointMeta(
                seq=seq,
                created_at=created_at,
                files=files,
                config_hash=self.config_hash,
                versions=dict(self.versions),
                format=checkpoint_format,
                **fields,
            )
            write_json_synced(tmp / META_FILE, meta.to_dict())
            for written in tmp.iterdir():  # as the writers' umask made them: the run's modes
                if written.is_file():
                    written.chmod(self.dir_mode & 0o666)
            tmp.chmod(self.dir_mode)
            fsync_dir(tmp)
            self._publish(tmp, name)
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"checkpoint {name}: save failed ({error_line(exc)})") from exc
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
            fsync_dir(self.root)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)

    def _hide(self, name: str) -> Path:
        """Rename a checkpoint to a trash name, which no reader sees; returns the new path."""
        trash = self.root / f".trash-{name}-{secrets.token_hex(4)}"
        os.rename(self.root / name, trash)
        return trash

"""A run's JSON-lines logs (``metrics.jsonl``, ``events.jsonl``): appended line by line
(``JsonlLog``), read whole (``read_jsonl``), read from the end (``read_tail``) or followed as
they grow (``JsonlFollower``). Every reader takes a line as a JSON object or nothing (a line
torn by a crash, cut by a tail, or garbled: ``json_object``)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any


def json_object(line: bytes | str) -> dict[str, Any] | None:
    """``line`` as a JSON object; None when it is not one."""
    try:
        record = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def parse_json_object(data: bytes | str) -> dict[str, Any]:
    """A whole file's contents as a JSON object; ValueError names what is wrong, on one line."""
    try:
        record = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    return record


class JsonlLog:
    """An append-only JSON-lines file, safe to write from several threads; each line is
    flushed, so a crash loses at most the line being written."""

    def __init__(self, path: Path, mode: int = 0o600) -> None:
        self.path = path
        self.mode = mode  # of the file, when this creates it
        self._lock = threading.Lock()
        self._file: IO[str] | None = None

    def append(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(record, allow_nan=True, default=str) + "\n"
        with self._lock:
            if self._file is None:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, self.mode)
                self._file = open(fd, "a", encoding="utf-8")  # noqa: SIM115
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


@dataclass(frozen=True)
class JsonLines:
    """The objects of a JSON-lines file, in file order, and how many lines were unreadable."""

    records: tuple[dict[str, Any], ...]
    unreadable: int


def read_jsonl(path: Path) -> JsonLines:
    """``path``'s JSON objects; a missing file has none. Blank lines are ignored; a line that
    is not a JSON object (torn, cut, garbled) is counted and skipped."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return JsonLines((), 0)
    records: list[dict[str, Any]] = []
    unreadable = 0
    for line in data.splitlines():
        if not line.strip():
            continue
        record = json_object(line)
        if record is not None:
            records.append(record)
        else:
            unreadable += 1
    return JsonLines(tuple(records), unreadable)


def read_tail(path: Path, max_bytes: int) -> list[dict[str, Any]]:
    """The JSON objects on the lines of the last ``max_bytes`` of ``path``, in file order (a
    line cut by the start of the tail is left out); a missing file has none."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            fh.seek(max(0, size - max_bytes))
            lines = fh.read().split(b"\n")
    except OSError:
        return []
    if size > max_bytes:
        lines = lines[1:]  # the first may be cut
    return [record for line in lines if (record := json_object(line)) is not None]


class JsonlFollower:
    """The JSON objects appended to a file since the last read (a line still being written
    waits for its end)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._rest = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        *lines, self._rest = (self._rest + data).split(b"\n")
        return [record for line in lines if (record := json_object(line)) is not None]

"""Whose files to believe. A run directory, its ``agent.json`` and its ``supervisor.json`` say
where a run's exporters and control sockets are: whoever can write them can point a monitor
elsewhere. They are trusted only when owned by a trusted user (the reader's own, root's, or
one allowed by name or uid) and writable by no one else; a symbolic link is not followed."""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Iterable
from pathlib import Path

SHARED_WRITE = stat.S_IWGRP | stat.S_IWOTH
PRIVATE_DIR = 0o700


def user_ids(names: Iterable[str | int]) -> frozenset[int]:
    """The uids of users given by name or uid (ValueError: no such user, named)."""
    found = set()
    for name in names:
        if isinstance(name, int) or str(name).isdigit():
            found.add(int(name))
            continue
        try:
            found.add(pwd.getpwnam(str(name)).pw_uid)
        except KeyError:
            raise ValueError(f"no such user {name!r}") from None
    return frozenset(found)


def trusted_owners(allowed: Iterable[int] = ()) -> frozenset[int]:
    """This process's user, root, and ``allowed``."""
    return frozenset({os.geteuid(), 0, *allowed})


def user_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def distrust(path: Path, owners: frozenset[int]) -> str | None:
    """Why ``path`` is not to be believed (one line), None when it is: a symbolic link, owned
    by a user not in ``owners``, or writable by its group or by others."""
    try:
        found = os.lstat(path)
    except OSError as exc:
        return f"{path}: cannot be read ({exc.strerror})"
    if stat.S_ISLNK(found.st_mode):
        return f"{path} is a symbolic link"
    if found.st_uid not in owners:
        return (
            f"{path} is owned by {user_name(found.st_uid)}, not a trusted user "
            f"({', '.join(user_name(uid) for uid in sorted(owners))})"
        )
    if found.st_mode & SHARED_WRITE:
        return f"{path} is writable by others (mode {stat.S_IMODE(found.st_mode):04o})"
    return None


def distrust_file(path: Path, owners: frozenset[int]) -> str | None:
    """Why the file ``path`` or its directory is not to be believed (None: both are)."""
    return distrust(path.parent, owners) or distrust(path, owners)


def replaceable(path: Path) -> str | None:
    """Why another user could rename ``path`` away and put their own in its place while it is
    in use (its folder is writable by all, without the sticky bit of ``/tmp``), or None."""
    folder = path.parent
    try:
        found = os.stat(folder)
    except OSError:
        return None  # made below, by this user
    if found.st_mode & stat.S_IWOTH and not found.st_mode & stat.S_ISVTX:
        return (
            f"{folder} is writable by everyone without the sticky bit (mode "
            f"{stat.S_IMODE(found.st_mode):04o}): another user could replace {path.name} while "
            f"it is in use; chmod +t {folder}, or use a folder of your own"
        )
    return None


def shared_file_mode(folder: Path) -> int:
    """The mode for a file about ``folder``'s run: readable by its group where the folder is,
    never by others."""
    return stat.S_IMODE(os.stat(folder).st_mode) & 0o640


def claim_directory(
    path: Path, mode: int | None, *, instead: str = "use a run directory of your own"
) -> None:
    """Make ``path`` a directory of this user's (created with ``mode``, default 0700) or check
    that the existing one is (owned by this user, writable by no one else; ValueError names
    what is wrong); then give it ``mode`` when one is asked for, keeping its setgid bit (files
    then take the directory's group, as a team's shared runs folder wants). Its folder must not
    let other users replace it (``replaceable``). ``instead``: the advice that ends a refusal."""
    why_not = replaceable(path)
    if why_not is not None:
        raise ValueError(why_not)
    try:
        path.mkdir(mode=PRIVATE_DIR if mode is None else mode)
    except FileExistsError:
        why = distrust(path, frozenset({os.geteuid()}))
        if why is not None:
            raise ValueError(f"{why}; {instead}") from None
    if mode is not None:
        path.chmod(mode | (path.stat().st_mode & stat.S_ISGID))

"""The tokenised-text cache cannot be poisoned or read by another local user (docs/security.md):
it is this user's own folder in the runs folder (``.cache-<uid>``), private (0700, files 0600),
and an existing one that is another user's, shared-writable or a symbolic link is refused in
one line, before anything is read from it. The attack: in a shared runs folder (mode 1777),
``nobody`` plants ``train.bin``/``val.bin`` of one token where the agent's cache would be."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import numpy as np
import pytest

from lossguard.agent.config import parse_config
from lossguard.agent.train.corpus import (
    TOKEN_DTYPE,
    DataError,
    _corpus_key,
    cache_dir,
    load_data,
    stdlib_source_dir,
    text_files,
)
from tests.support.processes import run_cli
from tests.support.runs import write_config

pytestmark = pytest.mark.live

NOBODY = 65534
POISON = 65  # the token the attacker's files hold


@pytest.fixture
def shared_runs(tmp_path: Path) -> Path:
    runs = tmp_path / "runs"
    runs.mkdir()
    runs.chmod(0o1777)
    return runs


def config(runs: Path, **data: object) -> object:
    return parse_config({"run": {"dir": str(runs)}, "data": {"max_bytes": 50_000, **data}})


def plant(folder: Path, key: str) -> Path:
    """``nobody``'s poisoned cache entry in ``folder``, everything owned by nobody."""
    poisoned = folder / f"text-{key}"
    poisoned.mkdir(parents=True)
    for name in ("train.bin", "val.bin"):
        np.full(4096, POISON, dtype=TOKEN_DTYPE).tofile(poisoned / name)
    for path in (folder, poisoned, *poisoned.iterdir()):
        os.chown(path, NOBODY, -1)
    return poisoned


def key_of(cfg: object) -> str:
    data = cfg.data  # type: ignore[attr-defined]
    return _corpus_key(stdlib_source_dir(), text_files(stdlib_source_dir(), data.include), data)


def test_another_users_planted_cache_is_refused(shared_runs: Path) -> None:
    cfg = config(shared_runs)
    where = cache_dir(cfg.data, shared_runs)  # type: ignore[attr-defined]
    assert where == shared_runs / f".cache-{os.geteuid()}"
    plant(where, key_of(cfg))
    with pytest.raises(DataError) as refused:
        load_data(cfg.data, where, None)  # type: ignore[attr-defined]
    assert str(refused.value) == (
        f"data cache: {where} is owned by nobody (uid {NOBODY}), not a trusted user "
        f"(root (uid 0)); set data.cache_dir to a folder of your own"
    )


def test_the_agent_refuses_it_in_one_line(shared_runs: Path, tmp_path: Path) -> None:
    cfg = config(shared_runs)
    plant(cache_dir(cfg.data, shared_runs), key_of(cfg))  # type: ignore[attr-defined]
    settings = {"run": {"dir": str(shared_runs)}, "data": {"max_bytes": 50_000}}
    result = run_cli("run", str(write_config(tmp_path / "c.yaml", settings)), "--no-progress")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lossguard-agent: error: data cache: ")
    assert "is owned by nobody" in lines[0]


def test_the_old_shared_location_is_not_read(shared_runs: Path) -> None:
    """Where earlier versions cached (``<run.dir>/.cache``, shared by every user) a planted
    cache is no longer looked at: the run tokenises into its own."""
    cfg = config(shared_runs)
    plant(shared_runs / ".cache", key_of(cfg))
    data = load_data(cfg.data, cache_dir(cfg.data, shared_runs), None)  # type: ignore[attr-defined]
    assert data.train is not None and not np.all(data.train == POISON)


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda d: d.symlink_to(d.parent / "elsewhere"), "is a symbolic link"),
        (lambda d: (d.mkdir(), d.chmod(0o777)), "is writable by others (mode 0777)"),
    ],
)
def test_a_cache_folder_that_is_a_link_or_shared_writable_is_refused(
    tmp_path: Path, make, why: str
) -> None:
    (tmp_path / "elsewhere").mkdir()
    folder = tmp_path / "cache"
    make(folder)
    cfg = config(tmp_path, cache_dir=str(folder))
    with pytest.raises(DataError, match=re.escape(why)):
        load_data(cfg.data, folder, None)  # type: ignore[attr-defined]


def test_the_cache_is_private(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    where = cache_dir(cfg.data, tmp_path)  # type: ignore[attr-defined]
    load_data(cfg.data, where, None)  # type: ignore[attr-defined]
    (tokens,) = where.glob("text-*")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (where, tokens, *tokens.iterdir())}
    assert modes == {where.name: 0o700, tokens.name: 0o700, "train.bin": 0o600, "val.bin": 0o600}


def test_a_cache_in_a_folder_others_could_swap_it_in_is_refused(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    runs.chmod(0o777)
    cfg = config(runs)
    with pytest.raises(DataError, match=r"^data cache: .* is writable by everyone without the"):
        load_data(cfg.data, cache_dir(cfg.data, runs), None)  # type: ignore[attr-defined]

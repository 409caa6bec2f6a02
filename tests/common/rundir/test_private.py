"""Run directories are private by default: 0700, the records in them 0600 (``run.mode`` lets
a group read); one another user owns, or others may write, is refused in one line and nothing
is written into it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lossguard.agent.config import RunConfig
from lossguard.common.config import ConfigError
from lossguard.common.rundir.directory import RunDirectory
from tests.support.processes import run_cli
from tests.support.runs import tiny_settings, write_config

pytestmark = pytest.mark.live

NOBODY = 65534
RECORDS = ("config.yaml", "env.json", "agent.json", "metrics.jsonl", "events.jsonl")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def write_records(run: RunDirectory) -> None:
    run.write_config({"run": {"id": "r"}})
    run.write_env({"type": "cpu"}, 1)
    run.write_discovery(run_id="r", socket_path=None, metrics_urls=[], world_size=1)
    run.metrics.append({"step": 1})
    run.events.append({"event": "start"})
    run.close()


@pytest.mark.parametrize(
    ("run_mode", "dir_mode", "file_mode"), [(None, 0o700, 0o600), (0o750, 0o750, 0o640)]
)
def test_a_new_run_directory_is_private_unless_a_mode_shares_it(
    tmp_path: Path, run_mode: int | None, dir_mode: int, file_mode: int
) -> None:
    old = os.umask(0o002)  # a permissive umask changes nothing
    try:
        run = RunDirectory(tmp_path / "runs" / "r", run_mode)
        write_records(run)
    finally:
        os.umask(old)
    assert mode(run.path) == dir_mode
    assert {name: mode(run.path / name) for name in RECORDS} == dict.fromkeys(RECORDS, file_mode)


def test_an_existing_run_directory_of_ones_own_is_made_private(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir(mode=0o755)
    assert mode(RunDirectory(tmp_path / "r", 0o700).path) == 0o700


@pytest.mark.parametrize(
    ("prepare", "why"),
    [
        (lambda d: os.chown(d, NOBODY, -1), "is owned by nobody (uid 65534), not a trusted user"),
        (lambda d: d.chmod(0o777), "is writable by others (mode 0777)"),
        (lambda d: d.chmod(0o775), "is writable by others (mode 0775)"),
    ],
)
def test_a_foreign_or_shared_run_directory_is_refused(tmp_path: Path, prepare, why: str) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir(mode=0o700)
    prepare(run_dir)
    before = mode(run_dir)
    with pytest.raises(ConfigError, match=r"run\.dir: ") as refused:
        RunDirectory(run_dir, 0o700)
    assert why in str(refused.value) and "use a run directory of your own" in str(refused.value)
    assert list(run_dir.iterdir()) == [] and mode(run_dir) == before


def test_the_agent_refuses_another_users_run_directory_in_one_line(
    tmp_path: Path, corpus_cache: Path
) -> None:
    settings = tiny_settings(tmp_path / "runs", corpus_cache)
    run_dir = tmp_path / "runs" / "tiny"
    run_dir.mkdir(parents=True, mode=0o777)  # a group-writable runs folder: planted first
    os.chown(run_dir, NOBODY, -1)
    done = run_cli("run", str(write_config(tmp_path / "c.yaml", settings)), "--no-progress")
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("lossguard-agent: error: run.dir: ") and "owned by nobody" in line
    assert list(run_dir.iterdir()) == []


@pytest.mark.parametrize(
    ("given", "taken"), [("0700", "0700"), ("750", "0750"), (0o750, "0750"), ("0700", "0700")]
)
def test_run_mode_is_an_octal_mode(given: object, taken: str) -> None:
    assert RunConfig.model_validate({"mode": given}).mode == taken


@pytest.mark.parametrize(
    ("given", "says"),
    [("0770", "must not let the group or others write"), ("0500", "owner rwx"), ("rw", "octal")],
)
def test_a_run_mode_others_may_write_is_refused(given: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        RunConfig.model_validate({"mode": given})


def test_a_team_folder_with_setgid_shares_the_run_with_its_group(tmp_path: Path) -> None:
    """docs/security.md, "Sharing a run with a team": the group and setgid bit of the runs
    folder reach the run directory and its records."""
    team = tmp_path / "runs"
    team.mkdir()
    os.chown(team, -1, NOBODY)  # the team's group
    team.chmod(0o2775)
    run = RunDirectory(team / "r", 0o750)
    write_records(run)
    assert stat.S_IMODE(os.stat(run.path).st_mode) == 0o2750
    assert {os.stat(p).st_gid for p in (run.path, *(run.path / n for n in RECORDS))} == {NOBODY}
    assert {mode(run.path / name) for name in RECORDS} == {0o640}


@pytest.mark.parametrize(
    ("run_mode", "dir_mode", "file_mode"), [(None, 0o700, 0o600), ("0750", 0o750, 0o640)]
)
def test_everything_a_run_writes_takes_the_runs_modes(
    tmp_path: Path, run_mode: str | None, dir_mode: int, file_mode: int
) -> None:
    """Checkpoints (folders and files) and the report, whatever the umask: the
    run's modes (0700/0600 by default), as its records."""
    import torch

    from lossguard.agent import Guard
    from lossguard.agent.config import parse_config
    from lossguard.monitor.report import write_report
    from tests.agent.checkpoint.test_snapshots import train

    old = os.umask(0o022)
    try:
        run = {"mode": run_mode} if run_mode else {}
        cfg = parse_config({"run": run, "telemetry": {"host": "127.0.0.1", "port": 0}})
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        opt = torch.optim.AdamW(model.parameters(), fused=True)
        run_dir = tmp_path / "r"
        with Guard(run_dir, model=model, optimizer=opt, config=cfg, progress=False) as guard:
            train(guard, model, opt, 3)
            guard.save(wait=True)
        write_report(run_dir, tmp_path / "report")
    finally:
        os.umask(old)
    (checkpoint,) = [p for p in (run_dir / "checkpoints").iterdir() if p.name == "step_00000003"]
    folders = [run_dir / "checkpoints", checkpoint]
    assert {str(p): mode(p) for p in folders} == {str(p): dir_mode for p in folders}
    files = [*checkpoint.iterdir(), *(tmp_path / "report").iterdir()]
    assert {p.name: mode(p) for p in files} == dict.fromkeys(
        ["meta.json", "state.pt", "report.html", "report.png"], file_mode
    )


def test_the_supervisor_refuses_another_users_run_directory_and_makes_its_own_private(
    tmp_path: Path,
) -> None:
    """The probe's supervisor: a run directory ``nobody`` made in a shared runs folder was
    refused with a traceback (exit 1); one it made was 0755 and its supervisor.json 0644."""
    runs = tmp_path / "runs"
    runs.mkdir(mode=0o1777)
    runs.chmod(0o1777)
    planted = runs / "planted"
    planted.mkdir()
    os.chown(planted, NOBODY, -1)
    supervise = [sys.executable, "-m", "lossguard.supervisor.cli", "run", "--run-dir"]
    refused = subprocess.run(
        [*supervise, str(planted), "--", "true"], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [
        f"lossguard-supervise: error: run.dir: {planted} is owned by nobody (uid {NOBODY}), "
        "not a trusted user (root (uid 0)); use a run directory of your own"
    ]
    assert list(planted.iterdir()) == []
    made = runs / "made"
    ran = subprocess.run(
        [*supervise, str(made), "--", "true"], capture_output=True, text=True, timeout=60
    )
    assert ran.returncode == 0, ran.stderr
    assert mode(made) == 0o700 and mode(made / "supervisor.json") == 0o600


def test_a_run_directory_others_could_replace_while_it_runs_is_refused(tmp_path: Path) -> None:
    """The probe's time-of-check/time-of-use: in a runs folder everyone may write without the
    sticky bit, another user can rename a live run directory away and put theirs in its place;
    the agent refuses such a folder. With the sticky bit (``install -d -m 1777``) they cannot."""
    runs = tmp_path / "runs"
    runs.mkdir()
    runs.chmod(0o777)
    with pytest.raises(ConfigError) as refused:
        RunDirectory(runs / "r")
    assert str(refused.value) == (
        f"run.dir: {runs} is writable by everyone without the sticky bit (mode 0777): another "
        f"user could replace r while it is in use; chmod +t {runs}, or use a folder of your own"
    )
    runs.chmod(0o1777)
    run = RunDirectory(runs / "r")
    swap = "import os, sys; os.setuid(65534); os.rename(sys.argv[1], sys.argv[1] + '.gone')"
    tried = subprocess.run(
        [sys.executable, "-c", swap, str(run.path)], capture_output=True, text=True, timeout=30
    )
    assert tried.returncode != 0 and "PermissionError" in tried.stderr
    assert run.path.is_dir()
    run.close()

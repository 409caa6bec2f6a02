"""A real single-host Slurm for tests: ``munged``, ``slurmctld`` and ``slurmd`` from Debian's
``munge`` and ``slurm-wlm`` (scripts/test.sh installs them), started in a temporary folder
with a configuration of their own (``SLURM_CONF``), their own munge socket and key, and free
ports; stopped and removed on exit. Needs root (the daemons run as root, munged as ``munge``).
See /work/shared/notes/slurm-on-one-host.md for the facts behind the configuration."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.processes import free_port, stop_process, wait_for

DAEMONS = ("munged", "slurmctld", "slurmd")


def missing() -> str | None:
    """Why a Slurm cannot be started here (None: it can)."""
    absent = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if absent:
        return f"not installed: {', '.join(absent)} (apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "the Slurm daemons need root"
    return None


@dataclass
class Slurm:
    folder: Path
    env: dict[str, str]

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=60, check=check
        )

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (``JobState``, ``Restarts``, ``ExitCode``...)."""
        text = self.run("scontrol", "show", "job", "--oneliner", job_id).stdout
        fields = {}
        for word in text.split():
            key, sep, value = word.partition("=")
            if sep:
                fields[key] = value
        return fields


def _config(folder: Path, host: str, munge_socket: Path) -> str:
    cpus = os.cpu_count() or 1
    return "\n".join(
        [
            "ClusterName=lossguard",
            f"SlurmctldHost={host}",
            "SlurmUser=root",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket}",
            f"StateSaveLocation={folder / 'state'}",
            f"SlurmdSpoolDir={folder / 'spool'}",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={folder / 'slurmd.pid'}",
            f"SlurmctldLogFile={folder / 'slurmctld.log'}",
            f"SlurmdLogFile={folder / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "JobRequeue=1",
            "ReturnToService=2",
            "KillWait=10",
            "SchedulerParameters=sched_interval=2",  # a requeued job starts soon after eligible
            f"NodeName={host} CPUs={cpus} RealMemory=1024 State=UNKNOWN",
            f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


@contextmanager
def single_host_slurm(folder: Path) -> Iterator[Slurm]:
    """Start munged, slurmctld and slurmd; yield once the node is idle; stop them all."""
    host = socket.gethostname().split(".")[0]
    munge = pwd.getpwnam("munge")
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True)
    # munged runs as munge: a folder of its own outside the test's (root-only) tmp_path
    outer = Path(tempfile.mkdtemp(prefix="lossguard-munge-"))
    outer.chmod(0o711)
    munge_dir = outer / "munge"
    munge_dir.mkdir()
    os.chown(munge_dir, munge.pw_uid, munge.pw_gid)
    munge_dir.chmod(0o700)
    key = munge_dir / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chown(key, munge.pw_uid, munge.pw_gid)
    key.chmod(0o400)
    munge_socket = munge_dir / "munge.socket"
    conf = folder / "slurm.conf"
    conf.write_text(_config(folder, host, munge_socket))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    processes: list[subprocess.Popen[bytes]] = []
    try:
        munged = [
            "runuser", "-u", "munge", "--", "munged", "--foreground", "--force",
            f"--socket={munge_socket}", f"--key-file={key}", f"--pid-file={munge_dir / 'pid'}",
            f"--log-file={munge_dir / 'log'}", f"--seed-file={munge_dir / 'seed'}",
        ]  # fmt: skip
        processes.append(_start(munged, folder / "munged.out", env))
        wait_for(munge_socket.exists, 30, "munged's socket", interval=0.1)
        processes.append(_start(["slurmctld", "-D", "-i"], folder / "slurmctld.out", env))
        processes.append(_start(["slurmd", "-D"], folder / "slurmd.out", env))
        slurm = Slurm(folder, env)
        wait_for(lambda: _idle(slurm), 60, "the Slurm node to be idle", interval=0.5)
        yield slurm
    finally:
        if len(processes) == len(DAEMONS):
            _cancel_jobs(Slurm(folder, env))
        for process in reversed(processes):
            stop_process(process, timeout=20)
        shutil.rmtree(outer, ignore_errors=True)


def _cancel_jobs(slurm: Slurm) -> None:
    """Cancel every job and wait until none is left (a job step outlives slurmd)."""
    slurm.run("scancel", "--user=root", check=False)
    wait_for(
        lambda: not slurm.run("squeue", "--noheader", check=False).stdout.strip(),
        60,
        "the jobs to end",
        interval=0.5,
    )


def _start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)


def _idle(slurm: Slurm) -> bool:
    done = slurm.run("sinfo", "--noheader", "--format=%t", check=False)
    return done.returncode == 0 and done.stdout.strip() == "idle"

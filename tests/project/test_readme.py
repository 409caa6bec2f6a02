"""Every command in the README is run: the walkthrough below runs them, verbatim and in the
README's order, in a scratch copy of the checkout's configs; the few that take minutes or need
what CI has not (a Docker engine) name the test that runs them."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from lossguard.common.exitcodes import EXIT_COMPLETED, EXIT_STOPPED
from tests.support.processes import REPO, stop_process, wait_for
from tests.support.runs import corpus_slice, throttle

pytestmark = pytest.mark.live

README = REPO / "README.md"
BIN = Path(sys.executable).parent

# Commands the walkthrough does not run itself: the file that runs them, and what it names.
ELSEWHERE = {
    # lossguard-monitor demo, what the script runs, with a shorter scenario
    "bash scripts/demo.sh": ("tests/monitor/demo/test_demo.py", "demo"),
    "bash scripts/test.sh": (".ci/run", "bash scripts/test.sh"),  # CI itself
    "cp .env.example .env": ("tests/deploy/test_compose_files.py", ".env.example"),
    # the compose file validated, and the same stack run natively from the same files
    "docker compose up": ("tests/deploy/test_stack.py", "deploy"),
    "torchrun --nproc_per_node 2 -m lossguard.agent.cli run configs/demo.yaml "
    "--set train.max_steps=20": ("tests/agent/checkpoint/test_resume.py", "torchrun"),
    "torchrun --nproc_per_node 2 -m lossguard.agent.cli run configs/demo.yaml "
    "--set train.max_steps=20 --set distributed.strategy=fsdp2 --set run.id=sharded": (
        "tests/agent/checkpoint/test_sharded.py",
        "torchrun",
    ),
}
# Commands that run until stopped: started in the background, then waited for.
LONG_RUNNING = ("lossguard-agent run", "lossguard-supervise run", "lossguard-monitor run")


def commands(markdown: str) -> list[str]:
    """The commands of every ```bash block, in order: continuation lines joined, comments and
    blank lines dropped."""
    found = []
    for block in re.findall(r"^```bash\n(.*?)^```", markdown, flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            command = " ".join(re.sub(r"\s+#\s.*$", "", line).split())
            if command:
                found.append(command)
    return found


def test_readme_has_the_two_setup_commands_first() -> None:
    assert commands(README.read_text())[:2] == ["bash scripts/demo.sh", "bash scripts/test.sh"]


def test_commands_run_elsewhere_are_still_in_the_readme_and_their_tests_exist() -> None:
    found = commands(README.read_text())
    for command, (where, names) in ELSEWHERE.items():
        assert command in found, f"README no longer has {command!r}: drop it from ELSEWHERE"
        assert names in (REPO / where).read_text(), (command, where)


@dataclass
class Walkthrough:
    """The README's commands, run in order in ``home`` (a copy of configs/ and alerts/)."""

    home: Path
    background: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
            "OMP_NUM_THREADS": "1",
            "PYTHONFAULTHANDLER": "1",  # a crash prints its traceback into the command's log
        }

    def run(self, command: str) -> None:
        if command.startswith(LONG_RUNNING):
            self.start(command)
            return
        done = subprocess.run(
            command,
            shell=True,  # globs (alerts/tests/*.test.yml) expand as in a shell
            cwd=self.home,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
        words = shlex.split(command)
        if words[0] == "lossguard-ctl" and words[-1] == "stop":
            self.finished(words[words.index("--run-dir") + 1])

    def start(self, command: str) -> None:
        """Start a long-running command; a run started while another trains stops that one first
        (SIGTERM: it saves and exits 3, stopped, as the README says)."""
        words = shlex.split(command)
        key = self.run_dir(words)
        if words[0] != "lossguard-monitor":
            for other in [k for k in self.background if k != "monitor"]:
                self.background[other].send_signal(signal.SIGTERM)
                self.finished(other)
        assert key not in self.background, f"{key} is still running"
        before = self.agent_pid(key)
        self.background[key] = subprocess.Popen(
            words,
            cwd=self.home,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=open(self.home / f"{key.replace('/', '-')}.log", "ab"),  # noqa: SIM115
        )
        if words[0] == "lossguard-monitor":
            wait_for(self.monitor_answers, 60, "the monitor's HTTP server", interval=0.2)
            return
        wait_for(lambda: self.agent_pid(key) not in (None, before), 120, f"{key}'s agent", 0.2)
        if "checkpoint.every=50" in words:  # a checkpoint for the README's rollback
            checkpoints = self.home / key / "checkpoints"
            wait_for(lambda: any(checkpoints.glob("step_*")), 120, f"{key}'s checkpoint", 0.2)

    def agent_pid(self, key: str) -> int | None:
        """The pid in the run's agent.json while that agent lives (None before and after)."""
        try:
            agent = json.loads((self.home / key / "agent.json").read_text())
        except (OSError, ValueError):
            return None
        return None if agent.get("exit") else agent.get("pid")

    @staticmethod
    def run_dir(words: list[str]) -> str:
        if "--run-dir" in words:
            return words[words.index("--run-dir") + 1]
        if words[0] == "lossguard-monitor":
            return "monitor"
        run_id = next(w.split("=", 1)[1] for w in words if w.startswith("run.id="))
        return f"runs/{run_id}"

    @staticmethod
    def monitor_answers() -> bool:
        try:
            return requests.get("http://127.0.0.1:9409/metrics", timeout=2).ok
        except requests.RequestException:
            return False

    def finished(self, key: str) -> None:
        process = self.background.pop(key)
        code = process.wait(180)
        log = self.home / f"{key.replace('/', '-')}.log"
        ended = (EXIT_COMPLETED, EXIT_STOPPED)  # it completed before the stop, or stopped
        assert code in ended, f"{key} exited with {code}; its log ends:\n{log.read_text()[-2000:]}"

    def close(self) -> None:
        """Stop what still runs: SIGTERM; the monitor exits 0, a run 3 (stopped; a supervisor
        forwards the signal and ends with the run's code) or 0 if it completed first."""
        for key in list(self.background):
            process = self.background[key]
            expected = (EXIT_COMPLETED,) if key == "monitor" else (EXIT_COMPLETED, EXIT_STOPPED)
            assert stop_process(process, timeout=120) in expected, key
            del self.background[key]


def walkthrough_demo(settings: dict[str, Any], cache: Path) -> dict[str, Any]:
    """The scratch demo.yaml the walkthrough's commands read: the README's commands as written,
    on the tiny model and corpus slice of every other test (one file: no walk over the
    standard library at each start), with steps enough that a run started in the background
    is still training when the README's next commands drive it (it ends when the walkthrough
    stops it), and steps of at least 0.05 s: a run waiting on the next command need not take a
    core from the other tests."""
    settings["model"].update(n_layer=2, n_head=2, n_embd=64, block_size=64)
    settings["data"].update(path=str(corpus_slice(cache)), cache_dir=str(cache))
    settings["train"].update(max_steps=1_000_000, eval_batches=2)
    settings["faults"] = [throttle(0.05)]
    return settings


def test_every_readme_command_runs(tmp_path: Path, corpus_cache: Path) -> None:
    for folder in ("configs", "alerts"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    demo = tmp_path / "configs" / "demo.yaml"
    demo.write_text(
        yaml.safe_dump(walkthrough_demo(yaml.safe_load(demo.read_text()), corpus_cache))
    )
    walk = Walkthrough(tmp_path)
    ran = []
    try:
        for command in commands(README.read_text()):
            if command in ELSEWHERE:
                continue
            walk.run(command)
            ran.append(command)
    finally:
        walk.close()
    assert len(ran) >= 15
    assert (tmp_path / "runs" / "exp-1" / "report.html").is_file()

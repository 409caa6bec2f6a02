"""deploy/slurm/ without Slurm: the Prometheus snippet passes ``promtool check config``, the
monitor's config loads with the monitor's own loader and names no runs folder and no static
map of runs, and the batch script is valid bash. tests/deploy/test_slurm_live.py runs the script on
a real Slurm (its file_sd files while a job runs, gone after it)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from lossguard.monitor.config import load_monitor_config
from tests.support.processes import REPO

pytestmark = pytest.mark.live

SLURM = REPO / "deploy" / "slurm"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_the_file_sd_snippet_passes_promtool() -> None:
    done = subprocess.run(
        ["promtool", "check", "config", str(SLURM / "prometheus-file-sd.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (job,) = yaml.safe_load((SLURM / "prometheus-file-sd.yml").read_text())["scrape_configs"]
    assert job["honor_labels"] is True  # as deploy/prometheus.yml
    assert "relabel_configs" not in job  # instance stays the HOST:PORT the job wrote
    ((files,),) = [sd["files"] for sd in job["file_sd_configs"]]
    assert files.endswith("/*.json")  # the folder LOSSGUARD_FILE_SD_DIR names


def test_the_monitor_config_needs_no_runs_folder_and_no_map() -> None:
    path = SLURM / "monitor.yml"
    config = load_monitor_config(path)
    assert config.source == "prometheus" and config.prometheus is not None
    assert config.scrape.runs_root is None and config.scrape.file_sd_path is None
    assert config.actions.agents == {}
    assert config.actions.token_env == "LOSSGUARD_CONTROL_TOKEN"
    assert "agents" not in yaml.safe_load(path.read_text())["actions"]
    assert all(f.exists() for f in config.rules.files)


def test_the_batch_script_is_valid_bash() -> None:
    script = SLURM / "lossguard.sbatch"
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "LOSSGUARD_FILE_SD_DIR" in script.read_text()

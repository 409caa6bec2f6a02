"""The monitor benchmark's baseline: Debian's ``prometheus`` over the same simulated agents,
with the same rule files and interval, its CPU and memory read from ``/proc``.

Prometheus starts with the rules and no targets (its memory then is the baseline), is given the
targets by a configuration reload, and is measured once every target is up and the warm-up
cycles have passed. It stores every series the agents expose (as an operator's Prometheus
does); its own metrics say whether it kept time: rule-group iterations missed, and the 99th
percentile of the intervals between a target's scrapes.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
ON_TIME_SLACK = 1.1
"""A scrape interval's 99th percentile at most this many intervals counts as on time."""


def cpu_seconds(pid: int | str = "self") -> float:
    """CPU time (user and system) a process has used so far; NaN where /proc is missing."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident memory now (0 where /proc is missing)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass(frozen=True)
class PrometheusBenchResult:
    """What Prometheus did over the measured window."""

    version: str
    agents: int
    interval_s: float
    wall_s: float
    cpu_share: float  # of one core
    scrape_interval_p99_s: float  # between consecutive scrapes of a target
    rule_group_p99_s: float  # the slowest group's evaluation, 99th percentile
    missed_iterations: int  # rule-group evaluations skipped because the last overran
    series: int  # in the head block: every series the targets expose, and the rules' results
    targets_up: int
    rss_start_bytes: int  # with the rules loaded, before any target
    rss_end_bytes: int

    @property
    def on_time(self) -> bool:
        return self.missed_iterations == 0 and (
            self.scrape_interval_p99_s <= self.interval_s * ON_TIME_SLACK
        )

    @property
    def bytes_per_series(self) -> float:
        """Resident memory grown per stored series since before the first scrape."""
        return (self.rss_end_bytes - self.rss_start_bytes) / self.series if self.series else 0


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        raise RuntimeError("the prometheus binary is not installed: apt-get install prometheus")
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _config(urls: Sequence[str], interval_s: float, rule_files: Sequence[Path]) -> dict[str, Any]:
    interval = f"{round(interval_s * 1000)}ms"
    jobs = []
    if urls:
        jobs.append(
            {
                "job_name": "lossguard-agent",
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [url.split("/")[2] for url in urls]}],
            }
        )
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(path.resolve()) for path in rule_files],
        "scrape_configs": jobs,
    }


class _Prometheus:
    """A Prometheus process on a free port of 127.0.0.1, in a directory of its own."""

    def __init__(self, directory: Path, interval_s: float, rule_files: Sequence[Path]) -> None:
        self.interval_s = interval_s
        self.rule_files = rule_files
        self.config = directory / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(_config([], interval_s, rule_files)))
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.log = directory / "prometheus.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [
                    prometheus_binary(),
                    f"--config.file={self.config}",
                    f"--storage.tsdb.path={directory / 'data'}",
                    f"--web.listen-address={self.url.removeprefix('http://')}",
                    "--web.enable-lifecycle",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait(self, what: str, done: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if self.process.poll() is not None:
                tail = self.log.read_text(errors="replace")[-500:]
                raise RuntimeError(f"prometheus exited {self.process.returncode}: {tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus: {what} within {timeout_s:g} s")
            time.sleep(0.2)

    def ready(self) -> bool:
        try:
            return requests.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def scrape_targets(self, urls: Sequence[str]) -> None:
        """Reload the configuration with ``urls`` as targets."""
        self.config.write_text(yaml.safe_dump(_config(urls, self.interval_s, self.rule_files)))
        self.process.send_signal(signal.SIGHUP)

    def target_health(self) -> list[str]:
        """Each active target's health: up, down or unknown (not scraped yet)."""
        try:
            reply = requests.get(f"{self.url}/api/v1/targets", timeout=5).json()
        except (requests.RequestException, ValueError):
            return []
        return [target["health"] for target in reply["data"]["activeTargets"]]

    def own_metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """Prometheus's ``/metrics``: samples by name."""
        text = requests.get(f"{self.url}/metrics", timeout=10).text
        found: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                found.setdefault(sample.name, []).append((sample.labels, sample.value))
        return found

    def version(self) -> str:
        try:
            info = requests.get(f"{self.url}/api/v1/status/buildinfo", timeout=5).json()
        except (requests.RequestException, ValueError):
            return "?"
        return str(info["data"]["version"])

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _total(metrics: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(value for _, value in metrics.get(name, []))


def _worst(
    metrics: dict[str, list[tuple[dict[str, str], float]]], name: str, quantile: str
) -> float:
    values = [v for labels, v in metrics.get(name, []) if labels.get("quantile") == quantile]
    values = [v for v in values if not math.isnan(v)]
    return max(values, default=math.nan)


def run_prometheus_baseline(
    urls: Sequence[str],
    *,
    seconds_measured: float,
    interval_s: float,
    rule_files: Sequence[str | Path],
    warmup_cycles: int,
) -> PrometheusBenchResult:
    """Run Prometheus over the agents at ``urls`` and measure it for ``seconds_measured``."""
    with tempfile.TemporaryDirectory(prefix="lossguard-bench-prometheus-") as directory:
        server = _Prometheus(Path(directory), interval_s, [Path(f) for f in rule_files])
        try:
            server.wait("ready", server.ready, READY_TIMEOUT_S)
            rss_start = rss_bytes(server.process.pid)
            server.scrape_targets(urls)
            server.wait(
                f"all {len(urls)} targets scraped",
                lambda: (
                    (health := server.target_health()).count("unknown") == 0
                    and len(health) == len(urls)
                ),
                READY_TIMEOUT_S,
            )
            time.sleep(warmup_cycles * interval_s)  # the warm-up: cycles not measured
            before = server.own_metrics()
            cpu_start, wall_start = cpu_seconds(server.process.pid), time.perf_counter()
            time.sleep(seconds_measured)  # the measured window
            cpu = cpu_seconds(server.process.pid) - cpu_start
            wall = time.perf_counter() - wall_start
            after = server.own_metrics()
            rss_end = rss_bytes(server.process.pid)
            missed = "prometheus_rule_group_iterations_missed_total"
            return PrometheusBenchResult(
                version=server.version(),
                agents=len(urls),
                interval_s=interval_s,
                wall_s=wall,
                cpu_share=cpu / wall,
                scrape_interval_p99_s=_worst(
                    after, "prometheus_target_interval_length_seconds", "0.99"
                ),
                rule_group_p99_s=_worst(after, "prometheus_rule_group_duration_seconds", "0.99"),
                missed_iterations=round(_total(after, missed) - _total(before, missed)),
                series=round(_total(after, "prometheus_tsdb_head_series")),
                targets_up=server.target_health().count("up"),
                rss_start_bytes=rss_start,
                rss_end_bytes=rss_end,
            )
        finally:
            server.close()

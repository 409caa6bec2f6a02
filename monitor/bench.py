"""The monitor's benchmark: the default rules over N simulated agents, scraped and evaluated on
the daemon's schedule. The agents are served by a child process, so only the monitor's own work
counts against its CPU share.

``python -m lossguard.monitor.bench --agents 256 --seconds 30 --interval 1s``
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import os
import random
import resource
import select
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import generate_latest
from rich.console import Console
from rich.table import Table

from lossguard.common.catalogue import CHECKPOINT_KINDS, FP8_TENSORS, MEMORY_KINDS
from lossguard.common.config import seconds
from lossguard.common.registry import AgentMetrics
from lossguard.monitor.daemon import RETENTION_MARGIN_S
from lossguard.monitor.promql import Value
from lossguard.monitor.rules.rulefile import (
    AlertingRule,
    RuleError,
    load_rule_files,
    longest_range_s,
    metric_names,
)
from lossguard.monitor.rules.ruleset import RuleSet, Schedule
from lossguard.monitor.sources.scrape import ScrapeSource

HOST = "127.0.0.1"
LAYERS = ("blocks.0.attn.c_attn", "blocks.5.mlp.c_fc", "blocks.11.mlp.c_proj", "lm_head")
TOKENS_PER_STEP = 8 * 1024
CHILD_START_TIMEOUT_S = 60.0
CHILD_STOP_TIMEOUT_S = 5.0
SERIES_QUERY = 'count({__name__=~".+"})'
SAMPLES_QUERY = "sum(scrape_samples_scraped)"


class SimulatedAgent:
    """One GPU agent's catalogue, advanced by one training step at every scrape."""

    def __init__(self, index: int) -> None:
        self.metrics = AgentMetrics(run_id=f"sim{index:03d}", rank=0, nvml=True)
        self.random = random.Random(index)
        self.step = 0
        self.loss = 10.0
        m = self.metrics
        m.set("run_info", 1, model="gpt2-124m", precision="fp8", device="cuda:0",
              world_size="1", version="0.1.0", git_commit="0000000")  # fmt: skip
        m.set("step_target", 100_000)
        m.set("peak_flops", 989e12, source="table")
        m.set("device_memory_limit_bytes", 80e9)
        m.set("paused", 0)
        m.set("checkpoint_in_progress", 0)
        m.set("checkpoint_timestamp_seconds", time.time())
        m.observe("checkpoint_save_duration_seconds", 4.2)
        for kind in CHECKPOINT_KINDS:
            m.set("checkpoint_step", 0, kind=kind)

    def advance(self) -> None:
        """One step later: step and tokens grow, loss drifts down, the rest jitters."""
        m, jitter = self.metrics, self.random.uniform
        self.step += 1
        self.loss = max(1.5, self.loss * 0.999 + jitter(-0.02, 0.02))
        m.set("step", self.step)
        m.set("last_step_timestamp_seconds", time.time())
        m.observe("step_duration_seconds", jitter(0.2, 0.4))
        m.inc("tokens", TOKENS_PER_STEP)
        m.set("tokens_per_second", TOKENS_PER_STEP / 0.3 * jitter(0.95, 1.05))
        m.set("model_flops_per_second", 4e14 * jitter(0.95, 1.05))
        m.set("mfu_ratio", 0.4 * jitter(0.95, 1.05))
        m.set("train_loss", self.loss)
        m.set("learning_rate", 3e-4)
        m.set("grad_norm", jitter(0.5, 1.5))
        m.set("loss_zscore", jitter(-2, 2))
        m.set("grad_norm_zscore", jitter(-2, 2))
        for signal in ("loss", "grad_norm"):
            m.set("spike_active", 0, signal=signal)
            m.set("spike_duration_steps", 0, signal=signal)
        for tensor in FP8_TENSORS:
            m.set("fp8_amax", jitter(1, 400), tensor=tensor)
            m.set("fp8_overflow_ratio", jitter(0, 1e-4), tensor=tensor)
            m.set("fp8_underflow_ratio", jitter(0, 1e-3), tensor=tensor)
        for kind in MEMORY_KINDS:
            m.set("device_memory_bytes", 40e9 * jitter(0.9, 1.1), kind=kind)
        m.set("gpu_utilization_ratio", jitter(0.9, 1.0))
        m.set("gpu_power_watts", jitter(500, 700))
        m.set("gpu_temperature_celsius", jitter(60, 75))
        for layer in LAYERS:
            m.set("grad_layer_norm", jitter(0.01, 0.5), layer=layer)
        m.set("grad_vanishing_layers", 0)
        m.set("grad_exploding_layers", 0)
        m.set("grad_dead_neuron_ratio", jitter(0, 0.01))
        if self.step % 100 == 0:
            for kind in ("latest", "last_good"):
                m.set("checkpoint_step", self.step, kind=kind)
            m.set("checkpoint_timestamp_seconds", time.time())

    def exposition(self) -> bytes:
        self.advance()
        return generate_latest(self.metrics.registry)


async def _answer(
    agent: SimulatedAgent, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """Serve ``/metrics`` (any path) over one keep-alive connection."""
    try:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            body = agent.exposition()
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        pass
    finally:
        writer.close()


async def serve_agents(count: int) -> None:
    """Serve ``count`` agents on loopback ports, print their URLs on one line, and run until
    stdin closes (the parent ended or hung up)."""
    servers = []
    for index in range(count):
        agent = SimulatedAgent(index)
        servers.append(
            await asyncio.start_server(functools.partial(_answer, agent), HOST, 0, backlog=64)
        )
    ports = [server.sockets[0].getsockname()[1] for server in servers]
    print(" ".join(f"http://{HOST}:{port}/metrics" for port in ports), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


class AgentFleet:
    """The child process serving the simulated agents; a context manager that always ends it."""

    def __init__(self, count: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lossguard.monitor.bench", "--serve-agents", str(count)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def __enter__(self) -> AgentFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def urls(self, timeout_s: float = CHILD_START_TIMEOUT_S) -> list[str]:
        """The agents' URLs, once the child serves them all."""
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else ""
        if not line.strip():
            state = "timed out" if not ready else f"exited {self.process.poll()}"
            raise RuntimeError(f"the simulated agents did not start ({state})")
        return line.split()

    def cpu_seconds(self) -> float:
        """CPU time the child has used so far (user and system; NaN where /proc is missing)."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            return math.nan
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        """Hang up on the child, then terminate it, then kill it."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(CHILD_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            try:
                self.process.wait(CHILD_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


class TimedScrapeSource(ScrapeSource):
    """A scrape source that records how long each whole cycle took."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.cycle_seconds: list[float] = []

    def scrape_once(self, t: float | None = None) -> None:
        started = time.perf_counter()
        super().scrape_once(t)
        self.cycle_seconds.append(time.perf_counter() - started)


@dataclass(frozen=True)
class Latency:
    """A latency distribution in seconds."""

    p50: float
    p95: float
    max: float

    @classmethod
    def of(cls, durations: Sequence[float]) -> Latency:
        if not durations:
            return cls(math.nan, math.nan, math.nan)
        ordered = sorted(durations)
        p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
        return cls(statistics.median(ordered), p95, ordered[-1])


@dataclass(frozen=True)
class MonitorBenchResult:
    """What one benchmark run measured, after the warm-up."""

    agents: int
    rules: int
    interval_s: float
    wall_s: float
    eval_cycles: int
    scrape_cycles: int
    cpu_share: float  # of one core, scraping and evaluation together
    agents_cpu_share: float  # of one core, the child serving the simulated agents
    evaluation: Latency
    scrape: Latency
    cycles_over_interval: int  # evaluation or scrape cycles longer than the interval
    series: int  # stored (only the metric names the rules select)
    samples_per_cycle: int  # exposed by all targets in one scrape cycle
    targets_up: int
    retention_s: float
    peak_rss_bytes: int

    @property
    def projected_sample_bytes(self) -> float:
        """Sample memory at full retention: 16 bytes per sample per stored series."""
        return self.series * self.retention_s / self.interval_s * 16


def run_benchmark(
    *,
    agents: int,
    seconds_measured: float,
    interval_s: float = 1.0,
    rule_files: Sequence[str | Path] = ("alerts/lossguard.rules.yml",),
    warmup_cycles: int = 3,
) -> MonitorBenchResult:
    """Scrape ``agents`` simulated agents in the background and evaluate the rules on aligned
    ticks, as the daemon does, for ``warmup_cycles`` then ``seconds_measured``."""
    groups = load_rule_files(rule_files)
    ruleset = RuleSet(groups)
    retention_s = longest_range_s(groups) + RETENTION_MARGIN_S
    with AgentFleet(agents) as fleet:
        source = TimedScrapeSource(
            static_targets=fleet.urls(),
            runs_root=None,
            interval_s=interval_s,
            retention_s=retention_s,
            keep_names=metric_names(groups),
        )

        def query(rule: AlertingRule, t: float) -> Value:
            return source.query(rule.expr, t)

        evaluations: list[float] = []
        wake = threading.Event()
        schedule = Schedule(interval_s)

        def cycle() -> float:
            """One evaluation of the due groups, as the daemon runs it; its duration."""
            wake.wait(max(0.0, schedule.wake_time(time.time()) - time.time()))
            now = time.time()
            due = schedule.due(groups, now)
            started = time.perf_counter()
            ruleset.evaluate(query, now, groups=due)
            schedule.done(groups, due, now)
            return time.perf_counter() - started

        source.start()
        try:
            for _ in range(warmup_cycles):
                cycle()
            scrapes_before = len(source.cycle_seconds)
            cpu_start, wall_start = time.process_time(), time.perf_counter()
            agents_cpu_start = fleet.cpu_seconds()
            end = time.time() + seconds_measured
            while schedule.wake_time(time.time()) <= end:
                evaluations.append(cycle())
            cpu, wall = time.process_time() - cpu_start, time.perf_counter() - wall_start
            agents_cpu = fleet.cpu_seconds() - agents_cpu_start
            scrapes = source.cycle_seconds[scrapes_before:]
            statuses = source.targets()
            series = _count(source, SERIES_QUERY)
            samples = _count(source, SAMPLES_QUERY)
        finally:
            source.close()
    return MonitorBenchResult(
        agents=agents,
        rules=len(ruleset.rules),
        interval_s=interval_s,
        wall_s=wall,
        eval_cycles=len(evaluations),
        scrape_cycles=len(scrapes),
        cpu_share=cpu / wall,
        agents_cpu_share=agents_cpu / wall,
        evaluation=Latency.of(evaluations),
        scrape=Latency.of(scrapes),
        cycles_over_interval=sum(1 for d in [*evaluations, *scrapes] if d > interval_s),
        series=series,
        samples_per_cycle=samples,
        targets_up=sum(1 for status in statuses if status.up),
        retention_s=retention_s,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )


def _count(source: ScrapeSource, expr: str) -> int:
    """The single value of an aggregating ``expr`` now (0 when it finds nothing)."""
    found = source.query(expr, time.time())
    return int(found[0].value) if isinstance(found, list) and found else 0


def results_table(result: MonitorBenchResult) -> Table:
    def ms(value: float) -> str:
        return f"{value * 1000:.1f} ms"

    table = Table(
        title=f"lossguard-monitor: {result.rules} rules over {result.agents} simulated agents, "
        f"every {result.interval_s:g} s"
    )
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("measured (after warm-up)", f"{result.wall_s:.1f} s"),
        ("evaluation / scrape cycles", f"{result.eval_cycles} / {result.scrape_cycles}"),
        ("monitor CPU (share of one core)", f"{result.cpu_share:.1%}"),
        ("simulated agents' CPU (child process)", f"{result.agents_cpu_share:.1%}"),
        ("rule evaluation p50 / p95 / max", " / ".join(map(ms, _points(result.evaluation)))),
        ("scrape cycle p50 / p95 / max", " / ".join(map(ms, _points(result.scrape)))),
        ("every cycle within the interval", "yes" if not result.cycles_over_interval else "NO"),
        ("targets up", f"{result.targets_up} / {result.agents}"),
        ("samples exposed per cycle", f"{result.samples_per_cycle:,}"),
        ("series stored", f"{result.series:,}"),
        ("peak RSS", f"{result.peak_rss_bytes / 2**20:.0f} MiB"),
        (
            f"samples at full retention ({result.retention_s / 60:g} min)",
            f"{result.projected_sample_bytes / 2**20:.0f} MiB",
        ),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def _points(latency: Latency) -> tuple[float, float, float]:
    return latency.p50, latency.p95, latency.max


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lossguard.monitor.bench",
        description="Benchmark the monitor: the rules over simulated agents on a fixed interval.",
    )
    parser.add_argument("--agents", type=int, default=256, help="simulated agents (256)")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured seconds (30)")
    parser.add_argument("--interval", default="1s", help="scrape and evaluation interval (1s)")
    parser.add_argument("--warmup", type=int, default=3, help="cycles not measured (3)")
    parser.add_argument(
        "--rules", action="append", help="rule file (repeatable; alerts/lossguard.rules.yml)"
    )
    parser.add_argument("--serve-agents", type=int, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.serve_agents is not None:
        asyncio.run(serve_agents(args.serve_agents))
        return 0
    try:
        interval_s = seconds(args.interval)
        if args.agents < 1 or not args.seconds > 0 or args.warmup < 0 or not interval_s > 0:
            raise ValueError("--agents, --seconds and --interval must be positive, --warmup ≥ 0")
        result = run_benchmark(
            agents=args.agents,
            seconds_measured=args.seconds,
            interval_s=interval_s,
            rule_files=args.rules or ["alerts/lossguard.rules.yml"],
            warmup_cycles=args.warmup,
        )
    except (ValueError, RuleError, RuntimeError) as exc:
        print(f"lossguard.monitor.bench: {exc}", file=sys.stderr)
        return 2
    console = Console()
    console.print(results_table(result))
    command = shlex.join(["python", "-m", "lossguard.monitor.bench", *sys.argv[1:]])
    console.print(f"command: {command}", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

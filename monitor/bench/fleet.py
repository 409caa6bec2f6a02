"""The benchmark's simulated fleet: N GPU agents' catalogue-sized expositions, each advanced by
one training step per scrape, served on loopback ports by a child process (so that serving them
does not count against the engine measured)."""

from __future__ import annotations

import asyncio
import functools
import random
import select
import subprocess
import sys
import time

from prometheus_client import generate_latest

from lossguard.common.catalogue import CHECKPOINT_KINDS, FP8_TENSORS, MEMORY_KINDS
from lossguard.common.registry import AgentMetrics
from lossguard.monitor.bench.prometheus import cpu_seconds
from lossguard.monitor.sources.fetch import raise_open_files_limit

HOST = "127.0.0.1"
LAYERS = ("blocks.0.attn.c_attn", "blocks.5.mlp.c_fc", "blocks.11.mlp.c_proj", "lm_head")
TOKENS_PER_STEP = 8 * 1024
CHILD_START_TIMEOUT_S = 60.0
CHILD_STOP_TIMEOUT_S = 5.0


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
        host = f"gpu{index:03d}"
        m.set("agent_info", 1, host=host, node="0", control=f"{host}:9420",
              supervisor=f"{host}:9421", protocol="1")  # fmt: skip
        for signal in ("loss", "grad_norm"):
            m.set("nonfinite_step", -1, signal=signal)
        m.set("level_shift_step", -1, signal="loss")

    def advance(self) -> None:
        """One step later: step and tokens grow, loss drifts down, the rest jitters."""
        m, jitter = self.metrics, self.random.uniform
        self.step += 1
        self.loss = max(1.5, self.loss * 0.999 + jitter(-0.02, 0.02))
        m.set("step", self.step)
        m.set("last_step_timestamp_seconds", time.time())
        m.set("last_step_age_seconds", jitter(0.0, 0.3))
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


class FastExposition:
    """A simulated agent's exposition at a fraction of the cost of rendering its registry
    (which would make the fleet, not the engine measured, the bottleneck): two steps of the
    agent tell which samples move; then each scrape adds a counter's step again, jitters a
    moving gauge by up to 5 % around its first value, sets a timestamp to now, and keeps the
    rest."""

    def __init__(self, agent: SimulatedAgent, seed: int) -> None:
        first, second = (agent.exposition().decode().splitlines() for _ in range(2))
        self.random = random.Random(seed)
        self.lines: list[str] = []  # comment lines whole; sample lines up to the value
        self.slots: list[tuple[int, str, float, float]] = []  # line, how it moves, value, step
        for line, later in zip(first, second, strict=True):
            if line.startswith("#"):
                self.lines.append(line + "\n")
                continue
            head, _, value = line.rpartition(" ")
            start, end = float(value), float(later.rpartition(" ")[2])
            name = head.partition("{")[0]
            if end == start:
                kind = "constant"
            elif name.endswith("_timestamp_seconds"):
                kind = "now"
            elif end > start and name.endswith(("_total", "_count", "_sum", "_bucket", "_step")):
                kind = "counter"
            else:
                kind = "gauge"
            self.slots.append((len(self.lines), kind, end, end - start))
            self.lines.append(head + " ")

    def render(self) -> bytes:
        lines = list(self.lines)
        jitter = self.random.uniform
        for index, (line, kind, value, step) in enumerate(self.slots):
            if kind == "counter":
                value += step
                self.slots[index] = (line, kind, value, step)
            elif kind == "gauge":
                value *= jitter(0.95, 1.05)
            elif kind == "now":
                value = time.time()
            lines[line] += f"{value!r}\n"
        return "".join(lines).encode()


async def _answer(
    agent: FastExposition, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """Serve ``/metrics`` (any path) over one keep-alive connection."""
    try:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            body = agent.render()
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
    raise_open_files_limit()  # a listening and an accepted socket per agent
    servers = []
    for index in range(count):
        agent = FastExposition(SimulatedAgent(index), index)
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
            [sys.executable, "-m", "lossguard.monitor.bench.fleet", str(count)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._urls: list[str] = []

    def __enter__(self) -> AgentFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def urls(self, timeout_s: float = CHILD_START_TIMEOUT_S) -> list[str]:
        """The agents' URLs, once the child serves them all."""
        if self._urls:
            return self._urls
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else ""
        if not line.strip():
            state = "timed out" if not ready else f"exited {self.process.poll()}"
            raise RuntimeError(f"the simulated agents did not start ({state})")
        self._urls = line.split()
        return self._urls

    def cpu_seconds(self) -> float:
        """CPU time the child has used so far (user and system; NaN where /proc is missing)."""
        return cpu_seconds(self.process.pid)

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


if __name__ == "__main__":
    asyncio.run(serve_agents(int(sys.argv[1])))

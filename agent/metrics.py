"""The agent's Prometheus metrics (DESIGN.md "Metric catalogue") on their own registry, and the
exporter that serves them. Torch-free: the monitor and the tests import the names from here.

Every catalogue series carries ``run_id`` and ``rank``; the client's process, platform and GC
collectors are served beside them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.metrics import MetricWrapperBase

from .config import ConfigError

PREFIX = "lossguard_"
BASE_LABELS = ("run_id", "rank")
SIGNALS = ("loss", "grad_norm")
FP8_TENSORS = ("input", "weight", "grad_output")
MEMORY_KINDS = ("allocated", "reserved", "peak_allocated")
CHECKPOINT_KINDS = ("latest", "best", "last_good")

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
SAVE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

# name (without prefix) -> (type, help, extra label names)
CATALOGUE: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "run_info": (
        "gauge",
        "What is running (value 1).",
        ("model", "precision", "device", "world_size", "version", "git_commit"),
    ),
    "step": ("gauge", "Last completed optimizer step.", ()),
    "step_target": ("gauge", "Planned last step.", ()),
    "tokens": ("counter", "Tokens trained on by this rank.", ()),
    "last_step_timestamp_seconds": ("gauge", "Wall time of the last completed step.", ()),
    "step_duration_seconds": ("histogram", "Step wall time, measured on the host.", ()),
    "tokens_per_second": ("gauge", "Tokens per second over the last log interval.", ()),
    "model_flops_per_second": ("gauge", "Model FLOP/s over the last log interval.", ()),
    "mfu_ratio": ("gauge", "Model FLOPs utilisation against the dense peak.", ()),
    "peak_flops": ("gauge", "Dense peak FLOP/s that MFU is taken against.", ("source",)),
    "train_loss": ("gauge", "Mean training loss over the last log interval.", ()),
    "val_loss": ("gauge", "Last validation loss.", ()),
    "learning_rate": ("gauge", "Learning rate of the first parameter group.", ()),
    "grad_norm": ("gauge", "Global gradient norm before clipping, last step.", ()),
    "amp_loss_scale": ("gauge", "fp16 GradScaler loss scale.", ()),
    "loss_zscore": ("gauge", "Last loss against the rolling window, in std.", ()),
    "grad_norm_zscore": ("gauge", "Last grad norm against the rolling window, in std.", ()),
    "spikes": ("counter", "Spike episodes started.", ("signal",)),
    "spike_active": ("gauge", "1 while a spike episode is unrecovered.", ("signal",)),
    "spike_duration_steps": ("gauge", "Length of the current spike episode.", ("signal",)),
    "nonfinite": ("counter", "Non-finite values seen.", ("signal",)),
    "skipped_steps": ("counter", "Optimizer updates skipped (non-finite step).", ()),
    "fp8_amax": ("gauge", "FP8 amax, worst Float8Linear layer.", ("tensor",)),
    "fp8_overflow_ratio": ("gauge", "Fraction saturating in FP8, worst layer.", ("tensor",)),
    "fp8_underflow_ratio": ("gauge", "Fraction flushed to zero in FP8, worst layer.", ("tensor",)),
    "device_memory_bytes": ("gauge", "Device memory (host RSS on CPU).", ("kind",)),
    "device_memory_limit_bytes": ("gauge", "Device memory capacity.", ()),
    "memory_alloc_retries": ("counter", "CUDA allocator retries after a failed allocation.", ()),
    "oom": ("counter", "CUDA out-of-memory errors.", ()),
    "gpu_utilization_ratio": ("gauge", "NVML GPU utilisation.", ()),
    "gpu_power_watts": ("gauge", "NVML power draw.", ()),
    "gpu_temperature_celsius": ("gauge", "NVML GPU temperature.", ()),
    "checkpoint_step": ("gauge", "Step of the latest, best and last good checkpoint.", ("kind",)),
    "checkpoint_timestamp_seconds": ("gauge", "Wall time of the last completed checkpoint.", ()),
    "checkpoint_in_progress": ("gauge", "1 while a checkpoint is being written.", ()),
    "checkpoint_save_duration_seconds": ("histogram", "Checkpoint save wall time.", ()),
    "rollbacks": ("counter", "Rollbacks applied.", ()),
    "control_commands": ("counter", "Control commands by outcome.", ("command", "result")),
    "paused": ("gauge", "1 while training is paused.", ()),
    "grad_layer_norm": ("gauge", "Gradient L2 norm of the top-k layers.", ("layer",)),
    "grad_vanishing_layers": ("gauge", "Layers with a vanishing gradient.", ()),
    "grad_exploding_layers": ("gauge", "Layers with an exploding gradient.", ()),
    "grad_dead_neuron_ratio": ("gauge", "Largest fraction of rows with all-zero gradient.", ()),
}
COUNTER_LABELS: dict[str, list[dict[str, str]]] = {
    "spikes": [{"signal": s} for s in SIGNALS],
    "nonfinite": [{"signal": s} for s in SIGNALS],
    "control_commands": [],  # created by the first command
}
NVML_METRICS = ("gpu_utilization_ratio", "gpu_power_watts", "gpu_temperature_celsius")


def exposed_name(name: str) -> str:
    """The series name as scraped: counters gain ``_total``."""
    kind = CATALOGUE[name][0]
    return PREFIX + name + ("_total" if kind == "counter" else "")


class AgentMetrics:
    """The catalogue on a private registry, bound to one run and rank."""

    def __init__(self, run_id: str, rank: int, *, nvml: bool) -> None:
        disable_created_metrics()  # no *_created series: they double the counters for nothing
        self.registry = CollectorRegistry(auto_describe=True)
        self.base = {"run_id": run_id, "rank": str(rank)}
        self._metrics: dict[str, MetricWrapperBase] = {}
        for name, (kind, doc, extra) in CATALOGUE.items():
            if name in NVML_METRICS and not nvml:
                continue  # cleanly absent where there is no GPU
            labels = BASE_LABELS + extra
            self._metrics[name] = _make(kind, PREFIX + name, doc, labels, self.registry)
            if kind == "counter":  # counters start at 0, so rate() and increase() see the first
                for values in COUNTER_LABELS.get(name, [{}]):
                    self.child(name, **values)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.registry.register(GC_COLLECTOR)

    def has(self, name: str) -> bool:
        return name in self._metrics

    def child(self, name: str, **labels: str) -> Any:
        """The series of ``name`` for this run and rank (and the given extra labels)."""
        return self._metrics[name].labels(**self.base, **labels)

    def set(self, name: str, value: float, **labels: str) -> None:
        self.child(name, **labels).set(value)

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        if amount > 0:
            self.child(name, **labels).inc(amount)

    def observe(self, name: str, value: float) -> None:
        self.child(name).observe(value)

    def remove(self, name: str, **labels: str) -> None:
        """Drop one labelled series (bounded cardinality: a layer that left the top-k)."""
        self._metrics[name].remove(*(self.base | labels).values())


def _make(
    kind: str, name: str, doc: str, labels: tuple[str, ...], registry: CollectorRegistry
) -> MetricWrapperBase:
    if kind == "gauge":
        return Gauge(name, doc, labels, registry=registry)
    if kind == "counter":
        return Counter(name, doc, labels, registry=registry)
    buckets = SAVE_BUCKETS if "checkpoint" in name else STEP_BUCKETS
    return Histogram(name, doc, labels, registry=registry, buckets=buckets)


@dataclass
class Exporter:
    """An HTTP server for ``/metrics`` in a daemon thread."""

    host: str
    port: int
    _server: Any

    @classmethod
    def start(cls, registry: CollectorRegistry, host: str, port: int) -> Exporter:
        try:
            server, _ = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise ConfigError(
                f"telemetry.port: cannot serve metrics on {host}:{port} ({exc.strerror}); "
                "another agent may hold it: set telemetry.port=0 for any free port"
            ) from None
        return cls(host, int(server.server_address[1]), server)

    def url(self, public_host: str) -> str:
        return f"http://{public_host}:{self.port}/metrics"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

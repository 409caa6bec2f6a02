"""The metric catalogue (``lossguard.common.catalogue``) on its own Prometheus registry, bound to
one run and rank. Torch-free.

Every catalogue series carries ``run_id`` and ``rank``; the client's process, platform and GC
collectors are served beside them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.metrics import MetricWrapperBase

from lossguard.common.catalogue import (
    BASE_LABELS,
    CATALOGUE,
    CONTROL_REFUSALS,
    LEVEL_SHIFT_SIGNALS,
    NVML_METRICS,
    OPTIMIZER_COUNTERS,
    PREFIX,
    SIGNALS,
    SKIP_REASONS,
    register_metric,
)

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
SAVE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

COUNTER_LABELS: dict[str, list[dict[str, str]]] = {
    "spikes": [{"signal": s} for s in SIGNALS],
    "nonfinite": [{"signal": s} for s in SIGNALS],
    "level_shifts": [{"signal": s} for s in LEVEL_SHIFT_SIGNALS],
    "skipped_steps": [{"reason": r} for r in SKIP_REASONS],
    "control_commands": [],  # created by the first command
    "control_refusals": [{"reason": r} for r in CONTROL_REFUSALS],
    **{name: [] for name in OPTIMIZER_COUNTERS},  # created when the optimizer counts them
}


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
            buckets = SAVE_BUCKETS if "checkpoint" in name else STEP_BUCKETS
            self._metrics[name] = register_metric(
                kind, PREFIX + name, doc, labels, self.registry, buckets
            )
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

    def track(self, name: str, value: Callable[[], float]) -> None:
        """Let the gauge ``name`` read ``value()`` at each scrape."""
        self.child(name).set_function(value)

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        if amount > 0:
            self.child(name, **labels).inc(amount)

    def observe(self, name: str, value: float) -> None:
        self.child(name).observe(value)

    def clear(self, name: str) -> None:
        """Drop every series of ``name`` (an info series about to be replaced)."""
        self._metrics[name].clear()

    def remove(self, name: str, **labels: str) -> None:
        """Drop one labelled series (bounded cardinality: a layer that left the top-k)."""
        self._metrics[name].remove(*(self.base | labels).values())

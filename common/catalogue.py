"""The agent's metric catalogue (docs/design.md "Metric catalogue"): every series the agent exports,
with its type, help and labels. The agent registers it; the monitor, the rules and the dashboards
read these names, so a metric is declared here once. The monitor's own catalogue has the same
shape; ``register_metric`` puts an entry of either on a registry.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

PREFIX = "lossguard_"
BASE_LABELS = ("run_id", "rank")
SIGNALS = ("loss", "grad_norm")
LEVEL_SHIFT_SIGNALS = ("loss",)  # judged for level shifts (agent/telemetry/level_shift.py)
FP8_TENSORS = ("input", "weight", "grad_output")
MEMORY_KINDS = ("allocated", "reserved", "peak_allocated")
CHECKPOINT_KINDS = ("latest", "best", "last_good")
SKIP_REASONS = ("nonfinite", "spike")
CONTROL_REFUSALS = ("timeout", "unauthorized", "busy")


# name (without prefix) -> (type, help, extra label names)
CATALOGUE: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "run_info": (
        "gauge",
        "What is running (value 1).",
        ("model", "precision", "device", "world_size", "version", "git_commit"),
    ),
    "agent_info": (
        "gauge",
        "Where this rank runs and how a monitor on another host reaches its run (value 1): "
        "host name, node rank, rank 0's advertised TCP control address and its supervisor's "
        "(empty: none), control protocol version. Never a secret.",
        ("host", "node", "control", "supervisor", "protocol"),
    ),
    "step": ("gauge", "Last completed optimizer step.", ()),
    "step_target": ("gauge", "Planned last step.", ()),
    "tokens": ("counter", "Tokens trained on by this rank.", ()),
    "last_step_timestamp_seconds": ("gauge", "Wall time of the last completed step.", ()),
    "last_step_age_seconds": (
        "gauge",
        "Seconds since the last completed step (since start before the first), on the "
        "agent's own monotonic clock at scrape time: liveness without clocks in sync.",
        (),
    ),
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
    "level_shifts": (
        "counter",
        "Spike episodes taken as a lasting level shift and ended (a flat or falling step-up, "
        "all finite, with a calm grad norm).",
        ("signal",),
    ),
    "level_shift_step": (
        "gauge",
        "First step of the last episode taken as a level shift in this timeline, -1 when none.",
        ("signal",),
    ),
    "nonfinite_step": (
        "gauge",
        "Step of the last non-finite value in this timeline, -1 when none.",
        ("signal",),
    ),
    "skipped_steps": (
        "counter",
        "Optimizer updates skipped: a non-finite step, or a spike (mitigation.skip_spikes).",
        ("reason",),
    ),
    "optimizer_momentum_resets": (
        "counter",
        "Momentum resets of the SPAM optimizer (optim.name spam; absent with AdamW).",
        (),
    ),
    "optimizer_clipped_entries": (
        "counter",
        "Gradient entries the SPAM optimizer clipped as spikes, of this rank's parameters "
        "(its shards under fsdp2/hsdp); absent with AdamW.",
        (),
    ),
    "fp8_amax": ("gauge", "FP8 amax, worst Float8Linear layer.", ("tensor",)),
    "fp8_overflow_ratio": ("gauge", "Fraction saturating in FP8, worst layer.", ("tensor",)),
    "fp8_underflow_ratio": ("gauge", "Fraction flushed to zero in FP8, worst layer.", ("tensor",)),
    "fp8_fidelity_min_grad_cosine": (
        "gauge",
        "Lowest per-layer cosine of FP8 and high-precision gradients, last check.",
        ("layer",),
    ),
    "fp8_fidelity_loss_rel_error": (
        "gauge",
        "Relative error of the FP8 loss against the high-precision loss, last check.",
        (),
    ),
    "fp8_fidelity_checks": ("counter", "FP8 fidelity checks run.", ()),
    "device_memory_bytes": ("gauge", "Device memory (host RSS on CPU).", ("kind",)),
    "device_memory_limit_bytes": ("gauge", "Device memory capacity.", ()),
    "memory_alloc_retries": ("counter", "CUDA allocator retries after a failed allocation.", ()),
    "oom": ("counter", "CUDA out-of-memory errors.", ()),
    "gpu_utilization_ratio": ("gauge", "NVML GPU utilisation.", ()),
    "gpu_power_watts": ("gauge", "NVML power draw.", ()),
    "gpu_temperature_celsius": ("gauge", "NVML GPU temperature.", ()),
    "gpu_info": (
        "gauge",
        "The GPU this rank trains on, labelled as DCGM's exporter labels it (value 1).",
        ("Hostname", "gpu", "UUID", "modelName"),
    ),
    "checkpoint_step": (
        "gauge",
        "Step of the latest, best and last good state (checkpoint or in-memory snapshot).",
        ("kind",),
    ),
    "snapshots_enabled": ("gauge", "1 while in-memory snapshots are taken.", ()),
    "snapshot_bytes": ("gauge", "Host memory held by in-memory snapshots.", ()),
    "checkpoint_timestamp_seconds": ("gauge", "Wall time of the last completed checkpoint.", ()),
    "checkpoint_in_progress": ("gauge", "1 while a checkpoint is being written.", ()),
    "checkpoint_save_duration_seconds": ("histogram", "Checkpoint save wall time.", ()),
    "rollbacks": ("counter", "Rollbacks applied.", ()),
    "control_commands": ("counter", "Control commands by outcome.", ("command", "result")),
    "control_refusals": (
        "counter",
        "Control connections and requests refused before authentication (TCP): no token line "
        "in time (timeout), a wrong or missing token (unauthorized), no free slot (busy).",
        ("reason",),
    ),
    "paused": ("gauge", "1 while training is paused.", ()),
    "grad_layer_norm": ("gauge", "Gradient L2 norm of the top-k layers.", ("layer",)),
    "grad_vanishing_layers": ("gauge", "Layers with a vanishing gradient.", ()),
    "grad_exploding_layers": ("gauge", "Layers with an exploding gradient.", ()),
    "grad_dead_neuron_ratio": ("gauge", "Largest fraction of rows with all-zero gradient.", ()),
}
NVML_METRICS = (
    "gpu_utilization_ratio",
    "gpu_power_watts",
    "gpu_temperature_celsius",
    "gpu_info",
)

OPTIMIZER_COUNTERS = ("optimizer_momentum_resets", "optimizer_clipped_entries")
"""Counted by an optimizer that keeps them (``metric_totals``, agent/train/spam.py): exported
only for such an optimizer."""


def exposed_name(name: str) -> str:
    """The series name as scraped: counters gain ``_total``."""
    kind = CATALOGUE[name][0]
    return PREFIX + name + ("_total" if kind == "counter" else "")


# Series the monitor reads by name (what a notification says about a run).
STEP = exposed_name("step")
ROLLBACKS_TOTAL = exposed_name("rollbacks")
SKIPPED_STEPS_TOTAL = exposed_name("skipped_steps")


def register_metric(
    kind: str,
    name: str,
    doc: str,
    labels: tuple[str, ...],
    registry: CollectorRegistry,
    buckets: Sequence[float] | None = None,
) -> MetricWrapperBase:
    """A catalogue entry (``kind``: gauge, counter or histogram, which needs ``buckets``) as a
    metric on ``registry``."""
    if kind == "histogram":
        assert buckets is not None, f"{name}: a histogram needs buckets"
        return Histogram(name, doc, labels, registry=registry, buckets=buckets)
    metric_class = {"gauge": Gauge, "counter": Counter}[kind]
    return metric_class(name, doc, labels, registry=registry)

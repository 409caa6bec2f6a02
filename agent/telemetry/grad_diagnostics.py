"""Per-layer gradient diagnostics, sampled: L2 norm, max |g| and dead neurons of every parameter.

``collect()`` runs after a sampled step's backward and before its optimizer step, while the
gradients are present. It needs no hooks and costs nothing on other steps. Each statistic is a
torch op on the gradient's device; all of them are stacked and read to the host once. Under
FSDP2 / HSDP each rank takes the statistics of its shards and two collectives (a sum, a max)
combine them, on sampled steps only.

Per parameter tensor with a gradient:

- ``l2``: the L2 norm of the gradient (float32); ``max``: max |g|.
- ``dead_fraction``: for the weight of an ``nn.Linear`` (torchao's Float8Linear included), the
  fraction of rows (output neurons) whose gradient is entirely zero, as for a ReLU unit that never
  fires; 0.0 for every other parameter (embedding rows are tokens, not neurons).

Over all parameters: ``vanishing`` counts those with ``l2 < cfg.vanishing``, ``exploding`` those
with ``l2 > cfg.exploding`` or a non-finite ``l2``; ``top`` lists the ``cfg.top_k`` largest by
``l2`` (non-finite first), a label set of bounded size for Prometheus.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lossguard.agent.config import GradDiagnosticsConfig
from lossguard.agent.dtensors import DTensor, reduce_shard_stats, shard_stats

STATS = ("l2", "max", "dead_fraction")


def _rank(l2: float) -> float:
    """Sort key that puts a non-finite norm above every finite one."""
    return l2 if math.isfinite(l2) else math.inf


class GradDiagnostics:
    """Gradient statistics per parameter of a model, read on sampled steps."""

    def __init__(self, model: nn.Module, cfg: GradDiagnosticsConfig) -> None:
        self.cfg = cfg
        self._params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
        self._neuron_rows = {
            name for name, p in self._params if id(p) in linear_weights and p.dim() == 2
        }

    @torch.no_grad()
    def collect(self) -> dict[str, Any]:
        """Per-parameter statistics, the vanishing/exploding counts and the top-k by L2."""
        names: list[str] = []
        rows: list[torch.Tensor] = []
        sharded_names: list[str] = []
        sharded: list[tuple[torch.Tensor, float]] = []
        for name, param in self._params:
            grad = param.grad
            if grad is None or grad.is_sparse or grad.numel() == 0:
                continue
            if isinstance(grad, DTensor):  # FSDP2 / HSDP: this rank's shard, reduced below
                sharded_names.append(name)
                sharded.append(shard_stats(grad, name in self._neuron_rows))
                continue
            grad = grad.detach()
            l2 = torch.linalg.vector_norm(grad, dtype=torch.float32)
            gmax = grad.abs().amax().float()
            if name in self._neuron_rows:
                dead = (grad == 0).all(dim=1).float().mean()
            else:
                dead = torch.zeros((), device=grad.device)
            names.append(name)
            rows.append(torch.stack([l2, gmax, dead]))
        if sharded:
            names += sharded_names
            rows += list(reduce_shard_stats(sharded))
        if not rows:
            return {"layers": {}, "vanishing": 0, "exploding": 0, "top": []}
        device = rows[0].device
        values = torch.stack([row.to(device) for row in rows]).tolist()  # the one host read
        layers = {
            name: dict(zip(STATS, row, strict=True))
            for name, row in zip(names, values, strict=True)
        }
        norms = [layer["l2"] for layer in layers.values()]
        ranked = sorted(layers.items(), key=lambda item: _rank(item[1]["l2"]), reverse=True)
        return {
            "layers": layers,
            "vanishing": sum(l2 < self.cfg.vanishing for l2 in norms),
            "exploding": sum(l2 > self.cfg.exploding or not math.isfinite(l2) for l2 in norms),
            "top": [
                {"layer": name, "l2": stats["l2"], "max": stats["max"]}
                for name, stats in ranked[: self.cfg.top_k]
            ],
        }

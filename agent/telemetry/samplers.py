"""The samplers of one rank: FP8 health, the FP8 fidelity check and gradient diagnostics. Armed
before the forward of a sampled step, read after its backward and published, each keeping its
series bounded; ``None`` where off."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from lossguard.agent.config import GuardConfig
from lossguard.agent.dtensors import is_sharded
from lossguard.agent.telemetry.fp8_fidelity import Fp8Fidelity, Replay
from lossguard.agent.telemetry.fp8_health import TENSORS as FP8_TENSORS
from lossguard.agent.telemetry.fp8_health import Fp8Health
from lossguard.agent.telemetry.grad_diagnostics import GradDiagnostics
from lossguard.common.config import ConfigError
from lossguard.common.registry import AgentMetrics

log = logging.getLogger("lossguard.agent")


class Samplers:
    """FP8 health, FP8 fidelity and gradient diagnostics, published to ``metrics``."""

    def __init__(self, config: GuardConfig, model: nn.Module, metrics: AgentMetrics) -> None:
        cfg = config.telemetry
        self.config = cfg
        self.metrics = metrics
        precision = config.precision.dtype
        self.fp8 = None
        if precision == "fp8" and config.compiled_model:
            log.warning("FP8 health sampling needs an eager model: off under model.compile")
        elif precision == "fp8":
            self.fp8 = Fp8Health(model, config.precision.fp8_recipe)
        fidelity = cfg.fp8_fidelity
        on = fidelity.enabled and precision == "fp8"
        if on and is_sharded(model):
            raise ConfigError(
                "telemetry.fp8_fidelity.enabled: the check's shadow is a whole copy of the "
                "model: not with a sharded (FSDP2 / HSDP) model"
            )
        self.fidelity = Fp8Fidelity(model, fidelity.dtype) if on else None
        self._fidelity_layer: str | None = None
        self._warned_no_replay = False
        diagnostics = cfg.grad_diagnostics
        self.grads = GradDiagnostics(model, diagnostics) if diagnostics.enabled else None
        self._grad_layers: set[str] = set()
        self.fp8_overflow: tuple[str, float] | None = None
        """The last FP8 sample's worst overflow ratio and its tensor (None before one)."""

    def arm(self, next_step: int) -> None:
        """Arm the samplers whose sampled steps include ``next_step``."""
        if self.fp8 is not None and next_step % self.config.fp8.every == 0:
            self.fp8.arm()
        if self.fidelity is not None and next_step % self.config.fp8_fidelity.every == 0:
            self.fidelity.arm()

    def collect(self, step: int, loss: torch.Tensor, replay: Replay | None) -> list[dict[str, Any]]:
        """The records of what was sampled at ``step``, published."""
        records = []
        if self.fp8 is not None:
            health = self.fp8.collect()
            if health is not None:
                self._publish_fp8(health)
                records.append({"kind": "fp8", "step": step, **health})
        if self.fidelity is not None and self.fidelity.armed:
            fidelity = self._check_fidelity(loss, replay)
            if fidelity is not None:
                records.append({"kind": "fp8_fidelity", "step": step, **fidelity})
        if self.grads is not None and step % self.config.grad_diagnostics.every == 0:
            diagnostics = self.grads.collect()
            self._publish_grads(diagnostics)
            records.append({"kind": "grad_diagnostics", "step": step, **diagnostics})
        return records

    def _publish_fp8(self, health: dict[str, Any]) -> None:
        overflow = [(tensor, float(health["worst"][tensor]["overflow"])) for tensor in FP8_TENSORS]
        self.fp8_overflow = max(overflow, key=lambda item: item[1])
        for tensor in FP8_TENSORS:
            worst = health["worst"][tensor]
            self.metrics.set("fp8_amax", worst["amax"], tensor=tensor)
            self.metrics.set("fp8_overflow_ratio", worst["overflow"], tensor=tensor)
            self.metrics.set("fp8_underflow_ratio", worst["underflow"], tensor=tensor)

    def _check_fidelity(self, loss: torch.Tensor, replay: Replay | None) -> dict[str, Any] | None:
        """Run the armed fidelity check and publish it; without ``replay``, skip it (warned
        once)."""
        assert self.fidelity is not None
        if replay is None:
            self.fidelity.disarm()
            if not self._warned_no_replay:
                self._warned_no_replay = True
                log.warning(
                    "telemetry.fp8_fidelity: Guard.after_backward got no replay function, so "
                    "no fidelity check runs (pass replay=...: docs/telemetry.md#fp8-fidelity)"
                )
            return None
        result = self.fidelity.check(loss, replay)
        if result is None:
            return None
        layer, previous = result["layer"], self._fidelity_layer
        if previous is not None and previous != layer:  # bounded cardinality: one series
            self.metrics.remove("fp8_fidelity_min_grad_cosine", layer=previous)
        self._fidelity_layer = layer
        self.metrics.set("fp8_fidelity_min_grad_cosine", result["min_grad_cosine"], layer=layer)
        self.metrics.set("fp8_fidelity_loss_rel_error", result["loss_rel_error"])
        self.metrics.inc("fp8_fidelity_checks")
        return result

    def _publish_grads(self, diagnostics: dict[str, Any]) -> None:
        top = {entry["layer"]: entry["l2"] for entry in diagnostics["top"]}
        for gone in self._grad_layers - top.keys():  # bounded cardinality: only the top-k
            self.metrics.remove("grad_layer_norm", layer=gone)
        for layer, value in top.items():
            self.metrics.set("grad_layer_norm", value, layer=layer)
        self._grad_layers = set(top)
        self.metrics.set("grad_vanishing_layers", diagnostics["vanishing"])
        self.metrics.set("grad_exploding_layers", diagnostics["exploding"])
        dead = [layer["dead_fraction"] for layer in diagnostics["layers"].values()]
        self.metrics.set("grad_dead_neuron_ratio", max(dead, default=0.0))

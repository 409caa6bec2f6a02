"""Per-layer gradient diagnostics on a small MLP."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lossguard.agent.config import GradDiagnosticsConfig
from lossguard.agent.telemetry.grad_diagnostics import GradDiagnostics
from tests.support.host_reads import count_host_reads

DEAD = 4  # neurons of fc1 whose bias keeps them below zero for every input


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def mlp() -> MLP:
    torch.manual_seed(0)
    model = MLP()
    with torch.no_grad():
        model.fc1.bias[:DEAD] = -100.0
    return model


def grad(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None
    return param.grad


def backward(model: nn.Module) -> None:
    model.zero_grad(set_to_none=True)
    model(torch.randn(32, 8)).pow(2).mean().backward()


def test_dead_relu_neurons_show_as_zero_gradient_rows() -> None:
    model = mlp()
    backward(model)
    result = GradDiagnostics(model, GradDiagnosticsConfig()).collect()
    layers = result["layers"]
    assert set(layers) == {f"fc{i}.{kind}" for i in (1, 2, 3) for kind in ("weight", "bias")}
    assert layers["fc1.weight"]["dead_fraction"] == DEAD / 16
    assert layers["fc2.weight"]["dead_fraction"] == 0.0  # inputs dead, rows alive
    assert layers["fc1.bias"]["dead_fraction"] == 0.0  # not a weight matrix
    for stats in layers.values():
        assert stats["l2"] > 0 and stats["max"] > 0
        assert stats["max"] <= stats["l2"] + 1e-6


def test_vanishing_exploding_and_top_k() -> None:
    model = mlp()
    backward(model)
    grad(model.fc2.weight).mul_(1e-12)
    grad(model.fc3.weight).mul_(1e6)
    grad(model.fc3.bias).fill_(math.nan)
    cfg = GradDiagnosticsConfig(top_k=3, vanishing=1e-7, exploding=1e2)
    result = GradDiagnostics(model, cfg).collect()

    assert result["vanishing"] == 1
    assert result["exploding"] == 2  # the huge one and the NaN one
    top = result["top"]
    assert len(top) == 3
    assert [entry["layer"] for entry in top[:2]] == ["fc3.bias", "fc3.weight"]
    finite = [entry["l2"] for entry in top[1:]]
    assert finite == sorted(finite, reverse=True)
    assert all(set(entry) == {"layer", "l2", "max"} for entry in top)
    assert "fc2.weight" not in [entry["layer"] for entry in top]


def test_parameters_without_grads_are_left_out() -> None:
    model = mlp()
    diagnostics = GradDiagnostics(model, GradDiagnosticsConfig(top_k=50))
    assert diagnostics.collect() == {"layers": {}, "vanishing": 0, "exploding": 0, "top": []}
    model.fc1.requires_grad_(False)
    backward(model)
    result = GradDiagnostics(model, GradDiagnosticsConfig(top_k=50)).collect()
    assert "fc1.weight" not in result["layers"] and len(result["top"]) == 4


def test_collect_reads_the_host_once(monkeypatch: pytest.MonkeyPatch) -> None:
    model = mlp()
    backward(model)
    diagnostics = GradDiagnostics(model, GradDiagnosticsConfig())
    reads = count_host_reads(monkeypatch)
    diagnostics.collect()
    assert reads == ["tolist"]

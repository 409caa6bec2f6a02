"""Rung 1 of the ladder (``mitigation.skip_spikes``): a spike's update is skipped on the device,
leaving the optimizer (fused AdamW or SPAM) exactly as if the batch had never been seen; a run
of spikes ends it; the signals judged are the configured ones (the loss by default)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from lossguard.agent import Guard
from lossguard.agent.config import parse_config
from lossguard.agent.mitigation import SpikeSkipper
from lossguard.agent.telemetry.spikes import SpikeDetector
from lossguard.agent.train.spam import SPAM
from tests.support.host_reads import count_host_reads


def batches(count: int, corrupt: set[int]) -> list[torch.Tensor]:
    """``count`` seeded batches; those at the indices in ``corrupt`` scaled up 1000x."""
    generator = torch.Generator().manual_seed(1)
    out = [torch.randn(16, 8, generator=generator) for _ in range(count)]
    return [x * 1000 if i in corrupt else x for i, x in enumerate(out)]


def train(
    run_dir: Path, data: list[torch.Tensor], optimizer: str = "adamw", **mitigation: object
) -> tuple[Guard, nn.Module]:
    """A fused AdamW (or SPAM) on a linear regression over ``data``, one batch per step."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    if optimizer == "spam":
        opt: torch.optim.Optimizer = SPAM(model.parameters(), lr=1e-2, reset_every=50)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    cfg = parse_config(
        {
            "telemetry": {"host": "127.0.0.1", "port": 0},
            "train": {"log_every": 10},
            "snapshot": {"every": None},
            "mitigation": {"skip_spikes": True, **mitigation},
        }
    )
    with Guard(run_dir, model=model, optimizer=opt, config=cfg, progress=False) as guard:
        for x in data:
            loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            loss.backward()
            guard.after_backward(loss, tokens=16)
            opt.step()
            opt.zero_grad()
            guard.end_step()
            guard.poll()
    return guard, model


def skipped(run_dir: Path) -> tuple[int, int]:
    """(non-finite, spike) skips of the run, from its last metrics line."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    last = [json.loads(line) for line in lines if '"kind": "train"' in line][-1]
    return last["skipped_steps"], last["skipped_spikes"]


@pytest.mark.parametrize("optimizer", ["adamw", "spam"])
def test_a_skipped_spike_leaves_the_run_as_if_it_never_saw_the_batch(
    tmp_path: Path, optimizer: str
) -> None:
    clean = batches(100, set())
    spiked = clean[:80] + batches(100, {80})[80:81] + clean[80:]
    guard, with_spike = train(tmp_path / "a", spiked, optimizer)
    _, without = train(tmp_path / "b", clean, optimizer)
    assert skipped(tmp_path / "a") == (0, 1) and skipped(tmp_path / "b") == (0, 0)
    for mine, theirs in zip(with_spike.parameters(), without.parameters(), strict=True):
        assert torch.equal(mine, theirs)  # the same weights: same step count, same moments
    assert guard.telemetry is not None
    registry = guard.telemetry.metrics.registry
    labels = {"run_id": "a", "rank": "0"}
    assert registry.get_sample_value("lossguard_skipped_steps_total", {**labels, "reason": "spike"})
    assert (
        registry.get_sample_value(
            "lossguard_skipped_steps_total", {**labels, "reason": "nonfinite"}
        )
        == 0
    )


def test_more_spikes_in_a_row_than_allowed_end_the_rung(tmp_path: Path) -> None:
    data = batches(90, {70, 71, 72, 73, 74})
    train(tmp_path / "run", data, max_consecutive=3)
    assert skipped(tmp_path / "run") == (0, 3)


def test_no_spike_is_skipped_before_the_window_holds_min_history(tmp_path: Path) -> None:
    train(tmp_path / "run", batches(60, {50}))  # 50 values < the default min_history of 64
    assert skipped(tmp_path / "run") == (0, 0)


def test_the_rung_adds_no_host_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = count_host_reads(monkeypatch)
    train(tmp_path / "run", batches(30, set()))
    assert reads.count("tolist") == 3 and set(reads) <= {"tolist"}


@pytest.mark.parametrize(("signals", "skips"), [(["loss"], False), (["loss", "grad_norm"], True)])
def test_a_gradient_norm_excursion_with_an_ordinary_loss_is_skipped_only_if_asked(
    signals: list[str], skips: bool
) -> None:
    """The fault-free tiny GPT's gradient norm jumps to 4-5x its mean now and then, with an
    ordinary loss: by default (the loss only) that step is applied."""
    cfg = parse_config({"mitigation": {"skip_spikes": True, "signals": signals}})
    detectors = {name: SpikeDetector(cfg.telemetry.spikes, "cpu") for name in ("loss", "grad_norm")}
    skipper = SpikeSkipper(cfg.mitigation, torch.device("cpu"), distributed=False)
    noise = torch.Generator().manual_seed(3)
    for _ in range(100):
        jitter = torch.rand((2,), generator=noise) * 0.1
        detectors["loss"].update(2.0 + jitter[0])
        detectors["grad_norm"].update(0.9 + jitter[1])
        assert not skipper.flag(detectors)
    detectors["loss"].update(torch.tensor(2.0))
    detectors["grad_norm"].update(torch.tensor(4.5))
    assert bool(skipper.flag(detectors)) is skips
    detectors["loss"].update(torch.tensor(5.5))  # a batch of random tokens: the loss jumps
    detectors["grad_norm"].update(torch.tensor(0.9))
    assert skipper.flag(detectors)

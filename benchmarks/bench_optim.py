"""SPAM against fused AdamW: the optimizer step alone, on the same model and gradients.

    python -m benchmarks.bench_optim [--config configs/demo.yaml] [--device cpu|cuda] [--steps N]
                                [--rounds R] [--set KEY=VALUE]...

Builds the trainer's GPT and parameter groups from the config (``optim`` knobs included), gives
every parameter a seeded random gradient and, as the trainer does with telemetry on, a device
``found_inf`` of 0; then times ``N`` steps of each optimizer, alternating them for ``R`` rounds
(the device synchronised at both ends of each timing), and prints the median step time of each
and SPAM's ratio to AdamW.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lossguard.agent.config import load_config
from lossguard.agent.train.model import GPT
from lossguard.agent.train.optim import build_optimizer
from tests.support.processes import REPO


def timed_steps(optimizer: torch.optim.Optimizer, steps: int, device: torch.device) -> float:
    """Seconds per step over ``steps`` steps."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs/demo.yaml"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(cfg.model, cfg.model.vocab_size or 256).to(device)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-2
    optimizers = {
        name: build_optimizer(model, cfg.train, cfg.optim.model_copy(update={"name": name}))
        for name in ("adamw", "spam")
    }
    for optimizer in optimizers.values():
        optimizer.found_inf = torch.zeros((), device=device)  # type: ignore[attr-defined]
        timed_steps(optimizer, 3, device)  # state allocated, kernels warm
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for _ in range(args.rounds):
        for name, optimizer in optimizers.items():
            times[name].append(timed_steps(optimizer, args.steps, device))
    adamw, spam = (statistics.median(times[name]) for name in ("adamw", "spam"))
    params = sum(p.numel() for p in model.parameters())
    tensors = sum(1 for _ in model.parameters())
    where = f"{device}, torch {torch.__version__}"
    print(f"model {params / 1e6:.2f}M params in {tensors} tensors, {where}")
    print("| optimizer | step ms (median of rounds) |")
    print("|---|---|")
    print(f"| fused AdamW | {adamw * 1e3:.3f} |")
    print(f"| SPAM | {spam * 1e3:.3f} |")
    print(f"SPAM / AdamW: {spam / adamw:.2f}x")


if __name__ == "__main__":
    main()

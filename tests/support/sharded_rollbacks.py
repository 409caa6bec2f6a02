"""Run by tests/agent/checkpoint/test_sharded.py under ``torchrun --nproc_per_node 2`` (gloo, CPU):

    python -m tests.support.sharded_rollbacks OUT [cuda]

An FSDP2 model (dropout, so the per-rank RNG states matter; each rank its own batches) in a
Guard loop with a checkpoint and a snapshot every 10 steps: 25 steps, a rollback to step 10
from memory, 15 steps, the snapshots dropped, a rollback to step 10 from disk, 15 steps. Each
rank writes its losses and the rollback answers to ``OUT/rank_K.json``; the test judges them.
``cuda``: on each rank's GPU (nccl; the snapshots' pinned buffers and side stream).
Then rank 1's snapshot budget shrinks to a byte (a host with less memory) and 10 more steps run:
the snapshot of step 30 is refused there, so snapshots turn off on both ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from lossguard.agent import Guard
from lossguard.agent.config import parse_config
from tests.agent.checkpoint.test_snapshots import train


def main(out: Path, device: str) -> None:
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo")
    rank = dist.get_rank()
    if device == "cuda":
        torch.cuda.set_device(rank)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 1))
    model = model.to(device)
    fully_shard(model[0])
    fully_shard(model[3])
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + rank)
    cfg = parse_config(
        {
            "run": {"device": device},
            "telemetry": {"host": "127.0.0.1", "port": 0},
            "train": {"log_every": 5},
            "checkpoint": {"every": 10, "async": False},
            "snapshot": {"every": 10, "keep": 2},
        }
    )
    guard = Guard(out / "run", model=model, optimizer=opt, config=cfg, progress=False)
    with guard:
        first = train(guard, model, opt, 25)
        from_memory = guard.rollback(10, skip_batches=0, lr_scale=1.0)
        after_memory = train(guard, model, opt, 15)
        assert guard.recovery.snapshots is not None
        guard.recovery.snapshots.clear()
        from_disk = guard.rollback(10, skip_batches=0, lr_scale=1.0)
        after_disk = train(guard, model, opt, 15)
        if rank == 1:
            guard.recovery.snapshots.budget_bytes = 1
        train(guard, model, opt, 10)
        assert guard.telemetry is not None
        labels = {"run_id": guard.run_id, "rank": str(rank)}
        registry = guard.telemetry.metrics.registry
        budget = {
            "enabled": guard.recovery.snapshots.enabled,
            "metric": registry.get_sample_value("lossguard_snapshots_enabled", labels),
            "kept": [m.name for m in guard.recovery.snapshots.list()],
        }
    result = {
        "snapshots_after_budget": budget,
        "first": first,
        "from_memory": from_memory,
        "after_memory": after_memory,
        "from_disk": from_disk,
        "after_disk": after_disk,
    }
    (out / f"rank_{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "cpu")

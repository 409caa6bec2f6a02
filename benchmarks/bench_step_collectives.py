"""What the one collective of every step boundary costs: ``Guard.poll()`` with nothing due (one
gloo all-reduce of two integers on the control group: the commands rank 0 has queued and any
rank's stop signal), at 2 and 4 ranks on CPU:

    python -m benchmarks.bench_step_collectives [--ranks 2,4] [--polls 2000] [--steps 200]

Each rank times ``--polls`` polls back to back (each waits for the all-reduce the one before
started: the latency of one, as a synchronous boundary would pay it every step), then ``--steps``
steps of tests/support/rank_drill.py's model (DDP, batch 8 x 16 tokens) with and without a poll
after each: the difference is what the boundary adds to a step when its all-reduce runs during the
step. Rank 0 prints the medians of five rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROUNDS = 5


def rank_main(out: Path, polls: int, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from lossguard.agent import Guard
    from lossguard.agent.config import parse_config
    from tests.support.rank_drill import CONTEXT, VOCAB, TinyLM

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = TinyLM()
    trained = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    config = parse_config(
        {"telemetry": {"host": "127.0.0.1", "port": 0}, "snapshot": {"every": None}}
    )
    guard = Guard(out / "run", model=model, optimizer=opt, config=config, progress=False)
    tokens = torch.randint(0, VOCAB, (8, CONTEXT + 1))

    def step(boundary: bool = True) -> None:
        loss = nn.functional.cross_entropy(
            trained(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
        )
        loss.backward()
        guard.after_backward(loss, tokens=tokens[:, :-1].numel())
        opt.step()
        opt.zero_grad()
        guard.end_step()
        if boundary:
            guard.poll()

    step()
    poll_us: list[float] = []
    step_ms: list[float] = []
    bare_ms: list[float] = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(polls):
            guard.poll()
        poll_us.append((time.perf_counter() - start) / polls * 1e6)
        for timed, boundary in ((step_ms, True), (bare_ms, False)):
            start = time.perf_counter()
            for _ in range(steps):
                step(boundary)
            timed.append((time.perf_counter() - start) / steps * 1e3)
    guard.close()
    if dist.get_rank() == 0:
        result = {
            "poll_us": statistics.median(poll_us),
            "step_ms": statistics.median(step_ms),
            "bare_ms": statistics.median(bare_ms),
        }
        (out / "result.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--polls", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print(
        f"{'ranks':>5}  {'polls back to back (us)':>23}  {'step, no poll (ms)':>18}  "
        f"{'step + poll (ms)':>16}  {'poll in the step (us)':>21}"
    )
    for ranks in [int(r) for r in args.ranks.split(",")]:
        with tempfile.TemporaryDirectory() as root:
            subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={ranks}", "-m", "benchmarks.bench_step_collectives",
                 "--rank", root, str(args.polls), str(args.steps)],
                check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            result = json.loads((Path(root) / "result.json").read_text())
        poll_us, step_ms, bare_ms = result["poll_us"], result["step_ms"], result["bare_ms"]
        added = (step_ms - bare_ms) * 1e3
        print(f"{ranks:>5}  {poll_us:>23.0f}  {bare_ms:>18.2f}  {step_ms:>16.2f}  {added:>21.0f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()

"""A Guard loop written from the README's "Your own loop", run by tests/agent/test_rank_faults.py
and benchmarks/bench_rank_chaos.py under ``torchrun`` (gloo, CPU), with faults on chosen ranks:

    python -m torch.distributed.run --standalone --nproc_per_node N \
        -m tests.support.rank_drill OUT PLAN

PLAN is JSON: ``strategy`` (ddp, fsdp2), ``steps``, ``settings`` (the Guard's config on top of
the shipped defaults), ``faults`` (``kind``: nan, spike, corrupt, slow; ``ranks``, ``step``,
``duration``, ``seconds``; a slow step ``at_boundary`` is slow after its update, so that the
other ranks wait in the step boundary's collective), ``commands`` (sent by rank 0's operator
thread through the real control socket once the loop reaches ``at``: ``cmd``, ``args``),
``signals`` (``rank`` sends itself ``signal`` at step ``at``, ``after`` seconds later),
``block`` (``rank`` enters a collective its peers never enter at step ``at``: a stuck rank)
``await_rollback_at`` (at that step the loop only polls, as at an idle boundary, until a
rollback moves it: for an operator outside) and ``hold_at`` (at that step the loop only polls
until the file ``OUT/release`` exists).

Every rank records its sequence of collectives (every ``torch.distributed`` collective it
calls, by thread) in ``OUT/collectives_K.txt`` as it makes them, so a test can compare the
ranks' sequences even after a hang; at the end it writes ``OUT/rank_K.json`` (step, a digest of
the full weights, the commands' answers, the exit code) and exits with ``guard.exit_code()``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset

from lossguard.agent import Guard, SkippableDataLoader
from lossguard.agent.config import parse_config
from lossguard.agent.distributed import collective
from lossguard.agent.dtensors import full_value
from lossguard.common.control.client import ControlClient, ControlError

VOCAB, CONTEXT, BATCH = 64, 16, 8
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "barrier",
    "monitored_barrier",
    "new_group",
)


def record_collectives(path: Path) -> None:
    """From now on, append each ``torch.distributed`` collective this process enters (its
    name, the thread) to ``path``, line by line, before it runs."""
    out = path.open("a", buffering=1)
    lock = threading.Lock()
    for name in COLLECTIVES:
        original = getattr(dist, name)

        @functools.wraps(original)
        def recorded(*args: Any, _original: Any = original, _name: str = name, **kw: Any) -> Any:
            with lock:
                out.write(f"{threading.current_thread().name} {_name}\n")
            return _original(*args, **kw)

        setattr(dist, name, recorded)


class TinyLM(nn.Module):
    """Next-token prediction over random tokens: an embedding, a block and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.block = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        return self.head(hidden + self.block(hidden))


def digest(model: nn.Module) -> str:
    """A sha256 of the full (unsharded) weights."""
    sha = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        sha.update(name.encode())
        sha.update(full_value(value.detach()).contiguous().numpy().tobytes())
    return sha.hexdigest()


def operator(socket_path: Path, commands: list[dict[str, Any]], reached: Any) -> list[Any]:
    """Rank 0's operator: each command once the loop has reached its step, over the socket."""
    answers: list[Any] = []

    def run() -> None:
        for command in commands:
            reached(command["at"]).wait()
            try:
                with ControlClient(socket_path=socket_path, timeout=300) as client:
                    answers.append(client.request(command["cmd"], command.get("args")))
            except ControlError as exc:
                answers.append({"error": exc.code, "message": str(exc)})

    threading.Thread(target=run, name="operator", daemon=True).start()
    return answers


class Steps:
    """Events for the steps the loop reaches (first time only)."""

    def __init__(self) -> None:
        self.events: dict[int, threading.Event] = {}
        self.lock = threading.Lock()

    def __call__(self, step: int) -> threading.Event:
        with self.lock:
            return self.events.setdefault(step, threading.Event())

    def reached(self, step: int) -> None:
        with self.lock:
            for at, event in self.events.items():
                if at <= step:
                    event.set()


def idle_until(guard: Guard, done: Callable[[], bool]) -> None:
    """Only poll, as at an idle boundary, until ``done`` (the same on every rank) or a stop."""
    while not done() and not guard.stop_requested:
        threading.Event().wait(0.01)
        guard.poll()


def moved(guard: Guard, step: int) -> bool:
    """Whether a rollback moved the loop off ``step``."""
    return guard.step != step


def released(flag: Path) -> bool:
    """Whether ``flag`` exists on any rank's view (one all-reduce: every rank leaves the hold
    at the same poll)."""
    seen = torch.tensor([int(flag.exists())])
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    return bool(seen.item())


def perturb(loss: torch.Tensor, faults: list[dict[str, Any]]) -> Any:
    """This rank's faults of the step about to run: the loss (NaN, spike) and the batch."""
    for fault in faults:
        if fault["kind"] == "nan":
            loss = loss * float("nan")
        elif fault["kind"] == "spike":
            loss = loss * fault.get("factor", 1000.0)
    return loss


def main(out: Path, plan: dict[str, Any]) -> int:
    record_collectives(out / f"collectives_{os.environ['RANK']}.txt")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model: nn.Module = TinyLM()
    if plan.get("strategy", "ddp") == "fsdp2":
        fully_shard(cast(nn.Module, model.block))
        fully_shard(model)
        trained = model
    else:
        trained = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    data = torch.randint(0, VOCAB, (4096, CONTEXT + 1), generator=torch.Generator().manual_seed(1))
    sampler: DistributedSampler[Any] = DistributedSampler(TensorDataset(data), shuffle=True, seed=2)
    loader = SkippableDataLoader(TensorDataset(data), batch_size=BATCH, sampler=sampler)
    settings = {"telemetry": {"host": "127.0.0.1", "port": 0}, **plan.get("settings", {})}
    steps = int(plan["steps"])
    guard = Guard(
        out / "run",
        model=model,
        optimizer=opt,
        data=loader,
        config=parse_config(settings),
        max_steps=steps,
        grad_clip=1.0,
        progress=False,
    )
    reached = Steps()
    commands = plan.get("commands", [])
    answers = operator(out / "run/control.sock", commands, reached) if rank == 0 else []
    mine = [f for f in plan.get("faults", []) if rank in f.get("ranks", range(world))]
    signals = [s for s in plan.get("signals", []) if s["rank"] == rank]
    block = plan.get("block")
    awaiting = plan.get("await_rollback_at")
    holding = plan.get("hold_at")
    done = False
    while not done and not guard.stop_requested:
        for (window,) in loader:
            step = guard.step + 1
            now = [f for f in mine if f["step"] <= step < f["step"] + f.get("duration", 1)]
            tokens = window[:, :-1]
            if any(f["kind"] == "corrupt" for f in now):
                tokens = torch.randint_like(tokens, VOCAB)
            slow = [f for f in now if f["kind"] == "slow"]
            if any(not f.get("at_boundary") for f in slow):
                threading.Event().wait(max(f.get("seconds", 1.0) for f in slow))
            logits = trained(tokens)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
            loss = perturb(loss, now)
            loss.backward()
            guard.after_backward(loss, tokens=tokens.numel(), inputs=tokens)
            opt.step()
            opt.zero_grad()
            guard.end_step()
            if block is not None and block["rank"] == rank and guard.step == block["at"]:
                (out / f"blocked_{rank}").touch()
                with collective("all_reduce: the drill's stuck rank"):
                    dist.all_reduce(torch.zeros(1))  # its peers never enter it: stuck
            for sent in [s for s in signals if s["at"] == guard.step]:
                signals.remove(sent)  # once: a replay of the step sends none
                kill = functools.partial(os.kill, os.getpid(), getattr(signal, sent["signal"]))
                threading.Timer(sent.get("after", 0.0), kill).start()
            if any(f.get("at_boundary") for f in slow):  # the peers wait in poll's collective
                threading.Event().wait(max(f.get("seconds", 1.0) for f in slow))
            guard.poll()
            if guard.step == awaiting:  # once: the replayed steps train on
                awaiting = None
                idle_until(guard, functools.partial(moved, guard, step))
            if guard.step == holding:
                holding = None
                idle_until(guard, lambda: released(out / "release"))
            reached.reached(guard.step)
            if guard.stop_requested or guard.step >= steps:
                done = True
                break
    guard.finish()
    guard.close()
    result = {
        "rank": rank,
        "step": guard.step,
        "digest": digest(model),
        "answers": answers,
        "exit_code": guard.exit_code(),
        "sent": rank != 0 or len(answers) == len(commands),
    }
    (out / f"rank_{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    return guard.exit_code()


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), json.loads(sys.argv[2])))

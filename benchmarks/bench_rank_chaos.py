"""Chaos benchmark: many random (rank, fault, moment, action) injections into Guard loops under
``torchrun`` (tests/support/rank_drill.py), counting hangs (goal 0), rollbacks, and runs whose
ranks did not end identical (goal 0):

    python -m benchmarks.bench_rank_chaos [--ranks 4] [--runs 10] [--steps 150] [--seed 1]

Each run draws faults (a NaN, a spike, a corrupt batch or a slow step, each on one random rank
at a random step), each followed a few steps later by an action of rank 0's operator (a rollback
to ``last_good`` or ``latest``, a save then a rollback while it is in flight, a snapshot's
rollback target by step), and ends in one of: training to its last step, a stop command, SIGTERM
or SIGUSR1 on one random rank. A run that does not end within its deadline is a hang. Prints a
table; ``test_rank_faults.py`` runs the short version (2 ranks, one run).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.drill_runs import divergence, finish_drill, start_drill

FAULTS = ("nan", "spike", "corrupt", "slow")
ENDINGS = {"train": 0, "stop": 3, "SIGTERM": 3, "SIGUSR1": 138}
ROLLBACK = {"target": "last_good", "skip_batches": "abandoned"}


@dataclass
class Outcome:
    hung: bool
    identical: bool
    rollbacks: int
    ending: str
    expected_exit: bool
    seconds: float


def chaos_plan(rng: random.Random, ranks: int, steps: int) -> tuple[dict[str, Any], str]:
    """A random plan: faults on random ranks, each met by an operator action, one ending."""
    faults: list[dict[str, Any]] = []
    commands: list[dict[str, Any]] = []
    at = rng.randint(8, 20)
    while at < steps - 40:
        kind = rng.choice(FAULTS)
        fault: dict[str, Any] = {"kind": kind, "ranks": [rng.randrange(ranks)], "step": at}
        if kind == "slow":
            fault.update(duration=2, seconds=0.5)
        faults.append(fault)
        act = at + rng.randint(1, 4)
        action = rng.choice(("last_good", "latest", "save_then_rollback", "by_step"))
        if action == "save_then_rollback":
            commands.append({"at": act, "cmd": "save"})
            commands.append({"at": act, "cmd": "rollback", "args": {"target": "latest"}})
        elif action == "by_step":
            commands.append({"at": act, "cmd": "rollback", "args": {"target": act - act % 10}})
        else:
            commands.append({"at": act, "cmd": "rollback", "args": {**ROLLBACK, "target": action}})
        at = act + rng.randint(8, 25)
    ending = rng.choice(list(ENDINGS))
    plan: dict[str, Any] = {
        "steps": steps,
        "settings": {
            "train": {"log_every": rng.choice((1, 5, 10))},
            "checkpoint": {"every": rng.choice((10, 20, 50))},
            "snapshot": {"every": 10},
        },
        "faults": faults,
        "commands": commands,
    }
    stop_at = rng.randint(steps // 2, steps - 10)
    if ending == "stop":
        commands.append({"at": stop_at, "cmd": "stop"})
    elif ending != "train":
        plan["signals"] = [{"rank": rng.randrange(ranks), "at": stop_at, "signal": ending}]
    return plan, ending


def run_once(out: Path, plan: dict[str, Any], ending: str, ranks: int, deadline: float) -> Outcome:
    started = time.monotonic()
    process = start_drill(out, plan, ranks)
    try:
        results = finish_drill(process, out, ranks, timeout=deadline)
    except AssertionError as failure:
        hung = str(failure).startswith("hung")
        print(f"  {out.name}: {failure}")
        return Outcome(hung, False, 0, ending, False, time.monotonic() - started)
    identical = len({(r["step"], r["digest"]) for r in results}) == 1
    codes = {r["exit_code"] for r in results}
    rollbacks = sum(1 for a in results[0]["answers"] if "to_step" in a)
    return Outcome(
        False, identical, rollbacks, ending, codes == {ENDINGS[ending]}, time.monotonic() - started
    )


def chaos(ranks: int, runs: int, steps: int, seed: int, root: Path) -> list[Outcome]:
    rng = random.Random(seed)
    outcomes = []
    for i in range(runs):
        plan, ending = chaos_plan(rng, ranks, steps)
        out = root / f"run{i}"
        outcome = run_once(out, plan, ending, ranks, deadline=120 + 2 * steps)
        if not outcome.identical and not outcome.hung:
            print(f"  run{i}: {divergence(out, ranks)}")
        outcomes.append(outcome)
    return outcomes


def table(outcomes: list[Outcome], ranks: int) -> str:
    rows = [
        ("runs", len(outcomes)),
        ("ranks", ranks),
        ("hangs", sum(o.hung for o in outcomes)),
        ("ranks not identical at the end", sum(not o.identical for o in outcomes)),
        ("exit codes not as the contract says", sum(not o.expected_exit for o in outcomes)),
        ("faults' rollbacks applied", sum(o.rollbacks for o in outcomes)),
        ("endings (train/stop/SIGTERM/SIGUSR1)", "/".join(
            str(sum(o.ending == e for o in outcomes)) for e in ENDINGS
        )),
        ("mean seconds a run", f"{sum(o.seconds for o in outcomes) / max(1, len(outcomes)):.1f}"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        outcomes = chaos(args.ranks, args.runs, args.steps, args.seed, Path(root))
    print(table(outcomes, args.ranks))


if __name__ == "__main__":
    main()

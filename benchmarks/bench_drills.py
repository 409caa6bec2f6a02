"""The drill catalog as a benchmark: each drill of tests/support/drill_catalog.py run with the real
agent, monitor (the shipped rules, routes, timers and actions) and supervisor, Slack and
PagerDuty stand-ins, then one table row: what was expected, what happened, whether it matches.

    python -m benchmarks.bench_drills [--drills a,b] [--seeds N] [--slow-step-s S] [--steps N]
                                 [--skip-long] [--jobs 2] [--keep DIR] [--markdown FILE]

At most ``--jobs`` drills train at once; drills that are idle by design (slow steps, a hang,
a crash loop's backoff) and drills waiting for the monitor's last notifications run beside
them. The shipped group timers make a drill with an alert take minutes (group_interval 5m
after its last change); the slow divergence takes about
(max_attempts + 1) x (300 x S + 60) seconds. Results are in docs/benchmarks.md."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tests.support.drill_catalog import CATALOG, Drill, Outcome, counted, select
from tests.support.drill_runner import Options, catalog_folder, run_catalog

COLUMNS = ("drill", "seed", "expected", "rollbacks", "Slack", "pages", "steps lost", "val loss")


def cells(outcome: Outcome) -> list[str]:
    """The row's cells after the drill's name and seed, ending with the verdict."""
    drill = CATALOG[outcome.drill]
    expected = str(drill.expected)
    if outcome.not_runnable is not None:
        return [expected, f"not runnable: {outcome.not_runnable}", "", "", "", "", "-"]
    if outcome.error is not None:
        return [expected, f"harness error: {outcome.error}", "", "", "", "", "-"]
    rollbacks = str(outcome.rollbacks)
    if outcome.restarts:
        rollbacks += f" (+{outcome.restarts} restart{'s' * (outcome.restarts > 1)})"
    if outcome.paused:
        rollbacks += ", paused"
    return [
        expected,
        rollbacks,
        counted(outcome.slack),
        counted(outcome.pages),
        str(outcome.steps_lost),
        val_text(outcome),
        verdict(drill, outcome),
    ]


def val_text(outcome: Outcome) -> str:
    if outcome.val is None:
        return "-"
    step, loss = outcome.val
    change = outcome.val_change
    versus = "" if change is None else f" ({change:+.1%})"
    return f"{loss:.3f} @{step}{versus}"


def verdict(drill: Drill, outcome: Outcome) -> str:
    if outcome.not_runnable is not None or outcome.error is not None:
        return "-"
    mark = "✗" if drill.expected.misses(outcome) else "✓"
    return mark if outcome.settled else f"{mark} (unsettled)"


def table(outcomes: Sequence[Outcome]) -> Table:
    shown = Table(title="Drill catalog", show_lines=False)
    for column in (*COLUMNS, "match"):
        shown.add_column(column, overflow="fold")
    for outcome in outcomes:
        shown.add_row(outcome.drill, str(outcome.seed), *cells(outcome))
    return shown


def markdown(outcomes: Sequence[Outcome]) -> str:
    lines = [
        "| " + " | ".join((*COLUMNS, "match")) + " |",
        "|" + "---|" * (len(COLUMNS) + 1),
    ]
    for outcome in outcomes:
        row = [outcome.drill, str(outcome.seed), *cells(outcome)]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
    return "\n".join(lines)


def details(outcomes: Sequence[Outcome]) -> list[str]:
    """A line or two per drill: what missed, what the monitor did, what the harness noted."""
    lines = []
    for o in outcomes:
        if o.not_runnable is not None or o.error is not None:
            continue
        misses = CATALOG[o.drill].expected.misses(o)
        said = [
            f"{o.seconds / 60:.1f} min",
            f"missed: {'; '.join(misses)}" if misses else "as expected",
            f"monitor actions: {', '.join(o.actions) or 'none'}",
            f"PagerDuty events: {o.pagerduty_events}",
            *o.notes,
        ]
        lines.append(f"{o.drill} (seed {o.seed}): " + "; ".join(said))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drills", help=f"comma-separated, of: {', '.join(CATALOG)}")
    parser.add_argument(
        "--seeds", type=int, help="seeds per drill (default: fault-free 3, others 1)"
    )
    parser.add_argument("--slow-step-s", type=float, default=Options.slow_step_s)
    parser.add_argument("--steps", type=int, default=Options.steps, help="the judged step")
    parser.add_argument("--skip-long", action="store_true", help="leave out the long drills")
    parser.add_argument("--jobs", type=int, default=Options.jobs, help="drills training at once")
    parser.add_argument("--settle-limit", type=float, default=Options.settle_limit_s)
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an agent override for every drill (after the catalog's), e.g. "
        "telemetry.spikes.zscore=6",
    )
    parser.add_argument("--keep", type=Path, help="keep the drills' folders here")
    parser.add_argument("--markdown", type=Path, help="also write the table as Markdown here")
    parser.add_argument("--list", action="store_true", help="list the drills and exit")
    args = parser.parse_args(argv)
    if args.list:
        for drill in CATALOG.values():
            print(f"{drill.name}: {drill.title}")
            print(f"    {drill.expected.kind}: {drill.expected}; stops when {drill.stop}")
        return 0
    try:
        drills = select(args.drills.split(",") if args.drills else None)
    except KeyError as exc:
        parser.error(str(exc.args[0]))
    if args.skip_long:
        drills = [d for d in drills if not d.long]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    options = Options(
        steps=args.steps,
        slow_step_s=args.slow_step_s,
        settle_limit_s=args.settle_limit,
        jobs=args.jobs,
        seeds=args.seeds,
        sets=tuple(args.sets),
    )
    console = Console(width=None if sys.stdout.isatty() else 220)
    started = time.monotonic()

    def told(outcome: Outcome) -> None:
        mark = verdict(CATALOG[outcome.drill], outcome)
        minutes = (time.monotonic() - started) / 60
        print(f"[{minutes:5.1f} min] {outcome.drill} seed {outcome.seed}: {mark}", file=sys.stderr)

    with catalog_folder(args.keep) as work:
        outcomes = run_catalog(drills, options, work, CATALOG["fault-free"], told)
    console.print(table(outcomes))
    for line in details(outcomes):
        console.print(line, highlight=False)
    console.print(f"{len(outcomes)} drill runs in {(time.monotonic() - started) / 60:.1f} min")
    if args.markdown is not None:
        args.markdown.write_text(markdown(outcomes) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

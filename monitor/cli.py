"""``lossguard-monitor``: run the monitor daemon; check and unit-test rule files; manage
silences; show the monitor's status; write a run's report; run the demo."""

from __future__ import annotations

import argparse
import getpass
import logging
import math
import sqlite3
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lossguard.common.cli import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    add_override_option,
    quiet_on_closed_pipe,
)
from lossguard.common.config import ConfigError
from lossguard.common.console import setup_logging
from lossguard.monitor.alert_store import AlertStore, AlertStoreError
from lossguard.monitor.rules.rulefile import RuleError, load_rule_file

if TYPE_CHECKING:
    from lossguard.monitor.notify.silences import Silence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lossguard-monitor",
        description="Watch lossguard agents: evaluate alert rules, keep alert state.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the monitor daemon")
    run.add_argument("--config", required=True, help="monitor.yml")
    add_override_option(run, "listen.port=0")
    rules = sub.add_parser("rules", help="check or unit-test Prometheus rule files")
    rules_sub = rules.add_subparsers(dest="rules_command", required=True)
    check = rules_sub.add_parser("check", help="validate rule files (like promtool check rules)")
    check.add_argument("files", nargs="+", metavar="FILE")
    test = rules_sub.add_parser(
        "test", help="run promtool-format rule unit tests on the embedded evaluator"
    )
    test.add_argument("files", nargs="+", metavar="FILE")
    _silence_parsers(sub)
    outbox = sub.add_parser("outbox", help="send dead letters again, or drop them")
    outbox_sub = outbox.add_subparsers(dest="outbox_command", required=True)
    for name, what in (
        ("retry", "deliver again (e.g. after fixing the webhook)"),
        ("drop", "forget"),
    ):
        action = outbox_sub.add_parser(name, help=f"dead letters: {what}")
        action.add_argument("ids", nargs="+", type=int, metavar="ID", help="as status shows: #ID")
        action.add_argument("--config", required=True, help="monitor.yml")
    status = sub.add_parser("status", help="targets, firing alerts, silences, outbox, dead letters")
    status.add_argument("--config", required=True, help="monitor.yml")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    _demo_parser(sub)
    report = sub.add_parser("report", help="a run's plots and audit trail as HTML and PNG")
    report.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (runs/<run_id>)")
    report.add_argument("--out", default=None, metavar="DIR", help="default: RUN_DIR")
    report.add_argument(
        "--state", default=None, metavar="PATH", help="monitor state database: alerts, actions"
    )
    return parser


def _demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = sub.add_parser(
        "demo",
        help="the whole story on CPU: a tiny GPT diverges, the monitor rolls it back and "
        "announces it",
    )
    demo.add_argument(
        "--steps",
        type=int,
        default=300,
        help="the run is stopped once it has been rolled back and evaluated at or past this "
        "step; the fault comes at a third of it (default 300)",
    )
    demo.add_argument(
        "--fault",
        choices=("lr", "nan"),
        default="lr",
        help="lr: the learning rate x1000 (LossSpikeNotRecovering, about 2 minutes); "
        "nan: NaN losses for 40 steps (LossNonFinite, within seconds of the 40th)",
    )
    demo.add_argument("--plain", action="store_true", help="plain lines, no live view")
    demo.add_argument(
        "--out", type=Path, default=None, help="a new folder (default: runs/demo-<time>)"
    )
    add_override_option(demo, "model.n_layer=2 (the agent's config)")


def _silence_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    silence = sub.add_parser("silence", help="add, list or expire silences (like amtool)")
    silence_sub = silence.add_subparsers(dest="silence_command", required=True)
    add = silence_sub.add_parser("add", help="silence the alerts that match every matcher")
    add.add_argument("matchers", nargs="+", metavar="MATCHER", help='e.g. run_id="abc" or a=b')
    add.add_argument("--duration", default="1h", help="how long (default 1h)")
    add.add_argument("--start", type=_unix_time, default=None, help="Unix time (default now)")
    add.add_argument("--author", default=None, help="default: your user name")
    add.add_argument("--comment", required=True, help="why (shown to everyone)")
    listing = silence_sub.add_parser("list", help="active and pending silences")
    listing.add_argument("--expired", action="store_true", help="also the expired ones")
    expire = silence_sub.add_parser("expire", help="end silences now")
    expire.add_argument("ids", nargs="+", metavar="ID")
    for parser in (add, listing, expire):
        parser.add_argument("--config", required=True, help="monitor.yml")


def _unix_time(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"not a Unix time in seconds: {text!r}")
    return value


def check_rules(files: Sequence[str]) -> int:
    """promtool's ``check rules`` output: SUCCESS with the rule count, or FAILED and why."""
    failed = False
    for path in files:
        print(f"Checking {path}")
        try:
            groups = load_rule_file(path)
        except RuleError as exc:
            print("  FAILED:", file=sys.stderr)
            print(exc, file=sys.stderr)
            failed = True
        else:
            print(f"  SUCCESS: {sum(len(g.rules) for g in groups)} rules found")
        print()
    return EXIT_FAILED if failed else EXIT_OK


def _run(config_path: str, overrides: Sequence[str]) -> int:
    from lossguard.monitor.config import load_monitor_config
    from lossguard.monitor.daemon import Monitor

    config = load_monitor_config(config_path, list(overrides))
    logging.getLogger("lossguard").setLevel(config.log_level.upper())
    try:
        monitor = Monitor(config)
    except RuleError as exc:
        raise ConfigError(f"rules.files: {exc}") from None
    except AlertStoreError as exc:
        raise ConfigError(f"state.path: {exc}") from None
    monitor.install_signal_handlers()
    monitor.run()
    return EXIT_OK


def _state(config_path: str, create: bool = False) -> AlertStore:
    """The state database of ``config_path``'s monitor; only ``create`` makes a new one."""
    from lossguard.monitor.config import load_monitor_config

    path = load_monitor_config(config_path).state.path
    if not create and not path.exists():
        raise ConfigError(f"state.path: no state database at {path}; has the monitor run?")
    try:
        return AlertStore(path)
    except AlertStoreError as exc:
        raise ConfigError(f"state.path: {exc}") from None


def silence(args: argparse.Namespace) -> int:
    """``silence add|list|expire``: amtool's output (an id; a table; nothing)."""
    from lossguard.common.config import seconds
    from lossguard.monitor.notify.silences import SilenceError, SilenceStore

    now = time.time()
    store = SilenceStore(_state(args.config, create=args.silence_command == "add"))
    try:
        if args.silence_command == "add":
            start = now if args.start is None else args.start
            try:
                length = seconds(args.duration)
            except ValueError as exc:
                raise SilenceError(f"--duration: {exc}") from None
            author = args.author or getpass.getuser()
            added = store.add(args.matchers, start, start + length, author, args.comment, now)
            print(added.id)
        elif args.silence_command == "list":
            _print_silences([s for s in store.all() if args.expired or s.state(now) != "expired"])
        else:
            for silence_id in args.ids:
                store.expire(silence_id, now)
    except (SilenceError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    finally:
        store.state.close()
    return EXIT_OK


def outbox(args: argparse.Namespace) -> int:
    """``outbox retry|drop ID...``: every id must be a dead letter (else exit 2, naming it)."""
    from lossguard.monitor.notify.store import NotifyStore

    state = _state(args.config)
    try:
        store = NotifyStore(state)
        if args.outbox_command == "retry":
            moved = store.requeue(args.ids, time.time())
            for old, new in moved.items():
                print(f"#{old} queued again as #{new}")
            done = list(moved)
        else:
            done = store.drop(args.ids)
    finally:
        state.close()
    missing = [i for i in args.ids if i not in done]
    if missing:
        raise ConfigError(f"not a dead letter: #{missing[0]} (see lossguard-monitor status)")
    return EXIT_OK


def _print_silences(silences: Sequence[Silence]) -> None:
    rows = [("ID", "MATCHERS", "STARTS AT", "ENDS AT", "CREATED BY", "COMMENT")]
    for s in silences:
        rows.append(
            (
                s.id,
                " ".join(str(m) for m in s.matchers),
                _time(s.starts_at),
                _time(s.ends_at),
                s.created_by,
                s.comment,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])


def _time(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t))


def status(config_path: str, as_json: bool) -> int:
    """``status``: exit 0 when the daemon answered, 1 when it did not."""
    from lossguard.monitor.status import collect, render, to_json

    state = _state(config_path)
    try:
        report = collect(state)
    finally:
        state.close()
    print(to_json(report) if as_json else render(report))
    return EXIT_OK if report["monitor"]["reachable"] else EXIT_FAILED


def report(args: argparse.Namespace) -> int:
    """``report RUN_DIR``: write report.html and report.png, print their paths."""
    from lossguard.monitor.report import ReportError, write_report

    out = None if args.out is None else Path(args.out)
    state = None if args.state is None else Path(args.state)
    try:
        files = write_report(Path(args.run_dir), out, state_db=state)
    except ReportError as exc:
        raise ConfigError(str(exc)) from None
    print(files.html)
    print(files.png)
    return EXIT_OK


@quiet_on_closed_pipe
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        if args.command == "run":
            return _run(args.config, args.overrides)
        if args.command == "silence":
            return silence(args)
        if args.command == "outbox":
            return outbox(args)
        if args.command == "status":
            return status(args.config, args.json)
        if args.command == "report":
            return report(args)
        if args.command == "demo":
            from lossguard.monitor.demo.runner import DemoOptions, run_demo

            options = DemoOptions(
                args.steps, args.fault, args.plain, args.out, tuple(args.overrides)
            )
            return run_demo(options)
        if args.rules_command == "check":
            return check_rules(args.files)
        from lossguard.monitor.rules.ruletest import run_test_files

        return run_test_files(args.files)
    except ConfigError as exc:
        print(f"lossguard-monitor: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except sqlite3.Error as exc:
        print(f"lossguard-monitor: error: state database: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

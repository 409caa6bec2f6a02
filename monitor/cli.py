"""``lossguard-monitor``: run the monitor daemon, or check and unit-test rule files."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from lossguard.agent.cli import add_override_option
from lossguard.agent.config import ConfigError
from lossguard.agent.progress import setup_logging
from lossguard.monitor.rules import RuleError, load_rule_file

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


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
    return parser


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
    from lossguard.monitor.state import StateError

    config = load_monitor_config(config_path, list(overrides))
    logging.getLogger("lossguard").setLevel(config.log_level.upper())
    try:
        monitor = Monitor(config)
    except RuleError as exc:
        raise ConfigError(f"rules.files: {exc}") from None
    except StateError as exc:
        raise ConfigError(f"state.path: {exc}") from None
    monitor.install_signal_handlers()
    monitor.run()
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        if args.command == "run":
            return _run(args.config, args.overrides)
        if args.rules_command == "check":
            return check_rules(args.files)
        from lossguard.monitor.ruletest import run_test_files

        return run_test_files(args.files)
    except ConfigError as exc:
        print(f"lossguard-monitor: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

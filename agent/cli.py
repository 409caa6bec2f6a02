"""``lossguard-agent``: run a training job or benchmark one, or check a config.

This module imports little (no pydantic, no torch): ``run`` catches the stop signals as soon
as the command line is parsed, before the config, torch and the model are loaded."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from lossguard.agent.quick_exit import exit_without_teardown
from lossguard.agent.stop_signals import caught_for_guard, ignore_stop_signals
from lossguard.common.cli import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    add_override_option,
    quiet_on_closed_pipe,
)
from lossguard.common.exitcodes import EXIT_PERMANENT
from lossguard.common.rundir.supervisor_file import RESUME_ENV

if TYPE_CHECKING:
    from lossguard.agent.config import Config
    from lossguard.common.control.protocol import Target

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lossguard-agent", description="Train a GPT under lossguard, or benchmark it."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add_config_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("config", help="YAML config file")
        add_override_option(p, "train.lr=3e-4")

    run = sub.add_parser("run", help="train from a config")
    add_config_args(run)
    run.add_argument("--no-progress", action="store_true", help="no progress display")
    run.add_argument(
        "--resume",
        metavar="TARGET",
        help="continue run.id from a checkpoint: latest, best, last_good, a step number or a "
        f"checkpoint name (step_00000150); ${RESUME_ENV}, when set, wins",
    )
    run.add_argument(
        "--skip-batches",
        type=int,
        default=0,
        metavar="N",
        help="with --resume: pass over the next N batches (e.g. ones that made the loss spike)",
    )
    run.add_argument(
        "--overwrite",
        action="store_true",
        help="start run.id over although it has checkpoints (the old run is moved aside)",
    )

    check = sub.add_parser("check", help="validate a config and print it resolved (YAML)")
    add_config_args(check)

    bench = sub.add_parser("bench", help="measure tokens/s and step time")
    add_config_args(bench)
    bench.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    bench.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    bench.add_argument(
        "--precision",
        default=None,
        help="comma-separated precisions to compare, e.g. bf16,fp8 (default: the config's)",
    )
    bench.add_argument(
        "--checkpoint",
        action="store_true",
        help="measure checkpoint save, async-save stall and load times instead",
    )
    bench.add_argument("--repeats", type=int, default=3, help="with --checkpoint (default 3)")
    bench.add_argument(
        "--overhead",
        action="store_true",
        help="compare step time with telemetry off and fully on (scraped every second)",
    )
    bench.add_argument("--rounds", type=int, default=20, help="with --overhead (default 20)")
    bench.add_argument(
        "--fp8-fidelity",
        action="store_true",
        help="with --overhead: telemetry on in both runs, the FP8 fidelity check in one "
        "(every telemetry.fp8_fidelity.every steps; --steps a multiple of it)",
    )
    return parser


def _precisions(arg: str | None, cfg: Config) -> list[str]:
    from lossguard.common.config import ConfigError

    if arg is None:
        return [cfg.precision.dtype]
    chosen = [p.strip() for p in arg.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in PRECISIONS]
    if unknown or not chosen:
        raise ConfigError(f"--precision: must be a list of {', '.join(PRECISIONS)}")
    return chosen


def _resume_target(args: argparse.Namespace) -> Target | None:
    from lossguard.common.config import ConfigError
    from lossguard.common.control.protocol import parse_target

    if args.skip_batches < 0:
        raise ConfigError("--skip-batches: must be >= 0")
    if args.resume is None:
        if args.skip_batches:
            raise ConfigError("--skip-batches: only with --resume")
        return None
    if args.overwrite:
        raise ConfigError("--overwrite: not with --resume")
    try:
        return parse_target(args.resume)
    except ValueError as exc:
        raise ConfigError(f"--resume: {exc}") from None


def _run(args: argparse.Namespace, cfg: Config) -> int:
    from lossguard.agent.resume_plan import CheckpointsExist, check_start, command_plan, run_path
    from lossguard.common.config import ConfigError

    resume = _resume_target(args)
    try:
        if os.environ.get("WORLD_SIZE", "1") == "1":  # one process: refused before torch loads
            start = command_plan(resume, args.skip_batches, args.overwrite)
            check_start(run_path(cfg), start, afresh=True)
        return _train(args, cfg, resume)
    except CheckpointsExist as exc:
        raise ConfigError(
            f"run.id: run directory {exc.run_dir} already has checkpoints (newest: "
            f"{exc.newest}): use --resume latest (or a checkpoint name) to continue the run, or "
            "--overwrite to start over"
        ) from None


def _train(args: argparse.Namespace, cfg: Config, resume: Target | None) -> int:
    from lossguard.agent.checkpoint.formats import RestoreError
    from lossguard.agent.train.trainer import Trainer

    try:
        trainer = Trainer(
            cfg,
            progress=not args.no_progress,
            resume=resume,
            skip_batches=args.skip_batches,
            overwrite=args.overwrite,
        )
    except RestoreError as exc:
        print(f"lossguard-agent: error: cannot resume: {exc}", file=sys.stderr)
        return EXIT_PERMANENT
    try:
        result = trainer.fit()
    except KeyboardInterrupt:
        trainer.close(failed=True)
        raise
    except Exception:
        trainer.close(failed=True)
        logging.getLogger("lossguard.agent").exception("training failed")
        return trainer.guard.exit_code(failed=True)
    trainer.close()
    ignore_stop_signals()
    if trainer.dist.is_main:
        logging.getLogger("lossguard.agent").info(
            "done: %d steps (%s); run directory %s",
            result.steps,
            result.stop_reason,
            result.run_dir,
        )
    return trainer.guard.exit_code()


def _check(args: argparse.Namespace, cfg: Config) -> int:
    import yaml

    print(yaml.safe_dump(cfg.resolved(), sort_keys=False), end="")
    return EXIT_OK


def _bench(args: argparse.Namespace, cfg: Config) -> int:
    from lossguard.agent.train.bench import (
        checkpoint_table,
        overhead_table,
        print_table,
        results_table,
        run_benchmark,
        run_checkpoint_benchmark,
        run_overhead_benchmark,
    )
    from lossguard.common.config import ConfigError

    if args.steps < 1 or args.warmup < 0 or args.repeats < 1 or args.rounds < 1:
        raise ConfigError("--steps, --repeats and --rounds must be >= 1, --warmup >= 0")
    if args.fp8_fidelity and not args.overhead:
        raise ConfigError("--fp8-fidelity: only with --overhead")
    if args.overhead:
        result = run_overhead_benchmark(
            cfg, args.rounds, args.steps, args.warmup, fidelity=args.fp8_fidelity
        )
        print_table(overhead_table(result))
        return EXIT_OK
    if args.checkpoint:
        print_table(checkpoint_table(run_checkpoint_benchmark(cfg, args.repeats), args.repeats))
        return EXIT_OK
    precisions = _precisions(args.precision, cfg)
    results = run_benchmark(cfg, precisions, args.steps, args.warmup)
    print_table(results_table(results, args.steps))
    return EXIT_OK


@quiet_on_closed_pipe
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # run: a stop signal from here on is acted on at the first step boundary (the Guard takes
    # this catcher over), not lost to the default action while torch loads and the model builds
    with caught_for_guard() if args.command == "run" else contextlib.nullcontext():
        return _command(args)


def _command(args: argparse.Namespace) -> int:
    from lossguard.agent.config import check_host, load_config
    from lossguard.common.config import ConfigError
    from lossguard.common.console import setup_logging

    setup_logging()
    try:
        cfg = load_config(args.config, args.overrides)
        check_host(cfg)
        handler = {"run": _run, "check": _check, "bench": _bench}[args.command]
        return handler(args, cfg)
    except ConfigError as exc:
        print(f"lossguard-agent: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("lossguard-agent: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def console_main() -> NoReturn:
    """The ``lossguard-agent`` command: :func:`main`; a run that ended well exits without the
    interpreter's teardown (:mod:`lossguard.agent.quick_exit`)."""
    exit_without_teardown(main())


if __name__ == "__main__":
    console_main()

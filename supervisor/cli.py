"""``lossguard-supervise``: run a training command and keep it alive; ask a running supervisor
for its status or for a restart.

    lossguard-supervise run --run-dir runs/gpt -- lossguard-agent run configs/demo.yaml
    lossguard-supervise run --run-dir runs/gpt -- torchrun --nproc-per-node 8 train.py
    lossguard-supervise run --run-dir /shared/gpt -- torchrun --nnodes 4 --rdzv-backend c10d ...
    lossguard-supervise status --run-dir runs/gpt
    lossguard-supervise restart --run-dir runs/gpt --reason "hung after the NFS outage"
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from lossguard.common.cli import EXIT_FAILED, EXIT_OK
from lossguard.common.config import ConfigError, seconds
from lossguard.common.console import setup_logging
from lossguard.common.control.client import (
    ControlClient,
    ControlError,
    ControlTimeout,
    ControlUnavailable,
)
from lossguard.common.exitcodes import EXIT_CONFIG, EXIT_PERMANENT
from lossguard.common.rundir.names import SUPERVISOR_SOCKET
from lossguard.supervisor.follower import Follower
from lossguard.supervisor.multinode import PlacementError, placement
from lossguard.supervisor.supervisor import (
    Supervisor,
    SupervisorError,
    SupervisorOptions,
)


def _duration(text: str) -> float:
    try:
        return seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, not {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lossguard-supervise",
        description="Keep a training run alive: restart it from its newest healthy checkpoint "
        "after a crash, or when the monitor finds it hung.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run CMD (after --) and restart it when it dies")
    run.add_argument("--run-dir", type=Path, required=True, help="the run's directory")
    run.add_argument("--run-id", help="the run's id (default: the run directory's name)")
    run.add_argument("--max-restarts", type=_count, default=10, help="per window (default 10)")
    run.add_argument("--window", type=_duration, default="1h", help="(default 1h)")
    run.add_argument(
        "--backoff", type=_duration, default="5s", help="first delay; doubles (default 5s)"
    )
    run.add_argument("--backoff-max", type=_duration, default="5m", help="(default 5m)")
    run.add_argument(
        "--kill-after",
        type=_duration,
        default="30s",
        help="a requested restart sends SIGTERM to the process group, then SIGKILL after this",
    )
    run.add_argument("--metrics-host", default="127.0.0.1", help="exporter address")
    run.add_argument(
        "--metrics-port", type=_count, default=0, help="exporter port (default 0: any free one)"
    )
    run.add_argument("--no-metrics", action="store_true", help="no exporter")
    run.add_argument(
        "--give-up",
        action="store_true",
        help="when the restart budget is spent, exit 1 (permanent failure) instead of waiting "
        "for a restart request (for a scheduler's job)",
    )
    run.add_argument(
        "--term-is-preemption",
        action="store_true",
        help="take SIGTERM as preemption (Kubernetes): the run saves and exits 138, to be "
        "started again, instead of stopping (3)",
    )
    nodes = run.add_argument_group(
        "multi-node (one supervisor per node over a shared run directory; node 0 leads)"
    )
    nodes.add_argument(
        "--node-rank",
        type=_count,
        help="this node (default: SLURM_NODEID, else torchrun's --node-rank, else 0)",
    )
    nodes.add_argument(
        "--nnodes",
        type=_count,
        help="the node count (default: torchrun's --nnodes, else SLURM_JOB_NUM_NODES, else 1)",
    )
    nodes.add_argument(
        "--join-timeout",
        type=_duration,
        default="10m",
        help="node 0 waits this long for the others to join, the others this long for node 0 "
        "(default 10m)",
    )
    nodes.add_argument(
        "--leader-timeout",
        type=_duration,
        default="1m",
        help="another node ends when node 0 is silent this long (default 1m)",
    )
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    for name, text in (("status", "show a supervisor's state"), ("restart", "restart the run")):
        client = sub.add_parser(name, help=text)
        client.add_argument("--run-dir", type=Path, required=True)
        client.add_argument("--json", action="store_true", help="print the reply as JSON")
        if name == "restart":
            client.add_argument("--reason", default="requested on the command line")
    return parser


def _command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, ...]:
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        parser.error("run: the training command is missing (put it after --)")
    return tuple(command)


def _options(args: argparse.Namespace, command: tuple[str, ...], nnodes: int) -> SupervisorOptions:
    return SupervisorOptions(
        run_dir=args.run_dir.resolve(),
        command=command,
        run_id=args.run_id or args.run_dir.resolve().name,
        max_restarts=args.max_restarts,
        window_s=args.window,
        backoff_s=args.backoff,
        backoff_max_s=max(args.backoff, args.backoff_max),
        kill_after_s=args.kill_after,
        metrics_host=args.metrics_host,
        metrics_port=None if args.no_metrics else args.metrics_port,
        nnodes=nnodes,
        join_timeout_s=args.join_timeout,
        give_up=args.give_up,
        term_is_preemption=args.term_is_preemption,
    )


def _supervise(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    command = _command(parser, args)
    try:
        where = placement(command, args.node_rank, args.nnodes)
    except PlacementError as exc:
        print(f"lossguard-supervise: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    run_dir = args.run_dir.resolve()
    if where.node > 0:
        follower = Follower(
            run_dir,
            command,
            where.node,
            args.leader_timeout,
            args.join_timeout,
            args.kill_after,
            args.term_is_preemption,
        )
        return follower.run()
    try:
        return Supervisor(_options(args, command, where.nnodes)).run()
    except SupervisorError as exc:
        print(f"lossguard-supervise: error: {exc}", file=sys.stderr)
        return EXIT_PERMANENT
    except ConfigError as exc:  # a run directory another user owns, or others may write
        print(f"lossguard-supervise: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG


def _ask(args: argparse.Namespace) -> int:
    socket_path = args.run_dir / SUPERVISOR_SOCKET
    request = {"reason": args.reason} if args.command == "restart" else {}
    try:
        with ControlClient(socket_path=socket_path, timeout=120) as client:
            result = client.request(args.command, request)
    except (ControlUnavailable, ControlTimeout, OSError) as exc:
        print(
            f"lossguard-supervise: error: no supervisor answers at {socket_path} ({exc})",
            file=sys.stderr,
        )
        return EXIT_FAILED
    except ControlError as exc:
        print(f"lossguard-supervise: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(", ".join(f"{key}: {value}" for key, value in result.items()))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging()
    if args.command != "run":
        return _ask(args)
    return _supervise(parser, args)


if __name__ == "__main__":
    sys.exit(main())

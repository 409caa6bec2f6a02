"""``lossguard-supervise``: run a training command and keep it alive; ask a running supervisor
for its status or for a restart.

    lossguard-supervise run --run-dir runs/gpt -- lossguard-agent run configs/demo.yaml
    lossguard-supervise run --run-dir runs/gpt -- torchrun --nproc-per-node 8 train.py
    lossguard-supervise run --run-dir /shared/gpt -- torchrun --nnodes 4 --rdzv-backend c10d ...
    lossguard-supervise run --run-dir runs/gpt --control-tcp 0.0.0.0:7071 -- lossguard-agent ...
    lossguard-supervise status --run-dir runs/gpt
    lossguard-supervise restart --run-dir runs/gpt --reason "hung after the NFS outage"
    lossguard-supervise restart --tcp gpu-node-3:7071 --reason "hung"  # $LOSSGUARD_CONTROL_TOKEN
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from lossguard.common.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, quiet_on_closed_pipe
from lossguard.common.config import ConfigError, seconds
from lossguard.common.console import setup_logging
from lossguard.common.control.address import join_address, split_address
from lossguard.common.control.bearer import DEFAULT_TOKEN_ENV, token_from_env
from lossguard.common.control.client import (
    ControlClient,
    ControlError,
    ControlTimeout,
    ControlUnavailable,
)
from lossguard.common.exitcodes import EXIT_CONFIG, EXIT_PERMANENT
from lossguard.common.rundir.paths import RunPaths
from lossguard.supervisor.follower import Follower
from lossguard.supervisor.multinode import PlacementError, placement
from lossguard.supervisor.supervisor import (
    Supervisor,
    SupervisorError,
    SupervisorOptions,
    TcpControl,
)

log = logging.getLogger("lossguard.supervisor")
REPLY_TIMEOUT_S = 120.0


class UsageError(ValueError):
    """An option's value cannot be used: one line that names the option (exit 2)."""


def _duration(text: str) -> float:
    try:
        return seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, not {text!r}")
    return int(text)


def _add_token_env(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--token-env",
        default=DEFAULT_TOKEN_ENV,
        metavar="NAME",
        help="the environment variable that holds the TCP control token (default "
        f"{DEFAULT_TOKEN_ENV}, as the agent's)",
    )


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
    control = run.add_argument_group(
        "control over TCP (status and restart for a monitor on another host; multi-node: "
        "served by node 0 only, as supervisor.sock)"
    )
    control.add_argument(
        "--control-tcp",
        metavar="HOST:PORT",
        help="also serve the control on HOST:PORT (port 0: any free one); every request must "
        "carry the token in --token-env's variable (at least 16 characters)",
    )
    control.add_argument(
        "--control-advertise",
        metavar="HOST:PORT",
        help="the address others should use, as given (default: the bound one, a wildcard "
        "host such as 0.0.0.0 as this host's name)",
    )
    _add_token_env(control)
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    for name, text in (("status", "show a supervisor's state"), ("restart", "restart the run")):
        client = sub.add_parser(name, help=text)
        where = client.add_mutually_exclusive_group(required=True)
        where.add_argument("--run-dir", type=Path, help="the run's directory (its supervisor.sock)")
        where.add_argument(
            "--tcp", metavar="HOST:PORT", help="the supervisor's TCP control (--control-tcp)"
        )
        _add_token_env(client)
        client.add_argument("--json", action="store_true", help="print the reply as JSON")
        if name == "restart":
            client.add_argument("--reason", default="requested on the command line")
    return parser


def _command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, ...]:
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        parser.error("run: the training command is missing (put it after --)")
    return tuple(command)


def _address(option: str, text: str, *, any_port: bool) -> tuple[str, int]:
    """``HOST:PORT`` as host and port; ``any_port``: port 0 (any free one) is allowed."""
    try:
        host, port = split_address(text)
    except ValueError as exc:
        raise UsageError(f"{option}: {exc}") from None
    if port == 0 and not any_port:
        raise UsageError(f"{option}: port must be 1 to 65535, not 0")
    return host, port


def _token(option: str, token_env: str) -> str:
    try:
        return token_from_env(token_env)
    except ValueError as exc:
        raise UsageError(f"{option}: {exc}") from None


def _tcp_control(args: argparse.Namespace) -> TcpControl | None:
    """What ``--control-tcp`` and ``--control-advertise`` ask for (None: the socket only)."""
    if args.control_tcp is None:
        if args.control_advertise is not None:
            raise UsageError("--control-advertise: needs --control-tcp")
        return None
    bind = _address("--control-tcp", args.control_tcp, any_port=True)
    advertise = None
    if args.control_advertise is not None:
        advertise = join_address(
            *_address("--control-advertise", args.control_advertise, any_port=False)
        )
    return TcpControl(bind, _token("--control-tcp", args.token_env), advertise)


def _options(
    args: argparse.Namespace,
    command: tuple[str, ...],
    nnodes: int,
    control_tcp: TcpControl | None,
) -> SupervisorOptions:
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
        control_tcp=control_tcp,
    )


def _supervise(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    command = _command(parser, args)
    control_tcp = _tcp_control(args)  # checked on every node: they share one command line
    try:
        where = placement(command, args.node_rank, args.nnodes)
    except PlacementError as exc:
        print(f"lossguard-supervise: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    run_dir = args.run_dir.resolve()
    if where.node > 0:
        if control_tcp is not None:
            log.info("node %d: node 0 serves the control; --control-tcp is not", where.node)
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
        return Supervisor(_options(args, command, where.nnodes, control_tcp)).run()
    except SupervisorError as exc:
        print(f"lossguard-supervise: error: {exc}", file=sys.stderr)
        return EXIT_PERMANENT
    except ConfigError as exc:  # a run directory another user owns, or others may write
        print(f"lossguard-supervise: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG


def _client(args: argparse.Namespace) -> ControlClient:
    """A client for the supervisor that ``--run-dir`` or ``--tcp`` names."""
    if args.tcp is None:
        socket_path = RunPaths.of(args.run_dir).supervisor_socket
        return ControlClient(socket_path=socket_path, timeout=REPLY_TIMEOUT_S)
    address = _address("--tcp", args.tcp, any_port=False)
    token = _token("--tcp", args.token_env)
    return ControlClient(tcp=address, token=token, timeout=REPLY_TIMEOUT_S)


def _ask(args: argparse.Namespace) -> int:
    request = {"reason": args.reason} if args.command == "restart" else {}
    client = _client(args)
    try:
        with client:
            result = client.request(args.command, request)
    except (ControlUnavailable, ControlTimeout, OSError) as exc:
        print(
            f"lossguard-supervise: error: no supervisor answers at {client.address} ({exc})",
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


@quiet_on_closed_pipe
def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging()
    try:
        return _ask(args) if args.command != "run" else _supervise(parser, args)
    except UsageError as exc:
        print(f"lossguard-supervise: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

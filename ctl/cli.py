"""``lossguard-ctl``: send one control command to a running agent and print its result; with
``--run-dir``, list a run's checkpoints from disk or say why its agent is gone when none answers.
Torch-free: it imports only ``lossguard.common`` beside itself."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lossguard.common.cli import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, quiet_on_closed_pipe
from lossguard.common.control.address import split_address
from lossguard.common.control.bearer import DEFAULT_TOKEN_ENV
from lossguard.common.control.client import (
    ControlClient,
    ControlError,
    ControlTimeout,
    ControlUnavailable,
)
from lossguard.common.control.protocol import ABANDONED, COMMAND_ARGS, ProtocolError, validate_args
from lossguard.common.rundir.names import SOCKET_NAME
from lossguard.common.rundir.paths import RunPaths
from lossguard.ctl.offline import checkpoints_on_disk, dead_agent
from lossguard.ctl.render import render

EXIT_REFUSED = 1
EXIT_UNREACHABLE = 3
EXIT_TIMEOUT = 4

EPILOG = f"""\
The agent replies once the command is applied at a step boundary (a save, once the checkpoint
is on disk); --timeout bounds that wait. With --run-dir and no agent answering, `checkpoints`
lists the run directory's checkpoints, and other commands say whether the agent's process is
gone and how to resume the run.

exit status:
  {EXIT_OK}    the agent applied the command
  {EXIT_REFUSED}    the agent refused or failed the command, or its reply could not be read
  {EXIT_USAGE}    usage error; nothing was sent
  {EXIT_UNREACHABLE}    cannot reach the agent (or its process is gone), or it closed the connection
       without replying
  {EXIT_TIMEOUT}    no reply within --timeout (the command may still be applied)
  {EXIT_INTERRUPTED}  interrupted
"""


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0, not {text!r}")
    return value


def _skip_batches(text: str) -> int | str:
    """``abandoned`` or a count (the agent's rules check the rest, before anything is sent)."""
    if text == ABANDONED:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a number of batches or {ABANDONED!r}, not {text!r}"
        ) from None


def _host_port(text: str) -> tuple[str, int]:
    try:
        host, port = split_address(text)
    except ValueError:
        host, port = "", 0
    if port == 0:  # a client dials a port, never "any free one"
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, e.g. 127.0.0.1:7070, not {text!r}")
    return host, port


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lossguard-ctl",
        description="Send a control command to a running lossguard agent.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--run-dir", type=Path, metavar="DIR", help=f"use DIR/{SOCKET_NAME}")
    where.add_argument("--socket", type=Path, metavar="PATH", help="the agent's Unix socket")
    where.add_argument(
        "--tcp", type=_host_port, metavar="HOST:PORT", help="the agent's TCP address"
    )
    parser.add_argument(
        "--token-env",
        default=DEFAULT_TOKEN_ENV,
        metavar="VAR",
        help=f"environment variable that holds the TCP token (default {DEFAULT_TOKEN_ENV})",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=30.0,
        metavar="SECONDS",
        help="how long to wait for the reply (default 30)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("status", help="show the run's state")
    sub.add_parser("checkpoints", help="list the checkpoints and in-memory snapshots")
    sub.add_parser("save", help="save a checkpoint now")
    rollback = sub.add_parser("rollback", help="restore a checkpoint and train on from it")
    rollback.add_argument(
        "target",
        metavar="TARGET",
        help="last_good, best, latest, a step or a checkpoint name (step_00001600)",
    )
    rollback.add_argument(
        "--skip-batches",
        type=_skip_batches,
        metavar="N",
        help=f"skip the next N batches (default 0), or {ABANDONED!r}: exactly the batches the "
        "abandoned steps trained on",
    )
    rollback.add_argument("--lr-scale", type=float, metavar="X", help="lr multiplier (default 1)")
    sub.add_parser("pause", help="pause training at the next step boundary")
    sub.add_parser("resume", help="resume a paused run")
    sub.add_parser("stop", help="save, then end training cleanly")
    set_lr_scale = sub.add_parser("set-lr-scale", help="multiply the scheduled lr by SCALE")
    set_lr_scale.add_argument("scale", type=float, metavar="SCALE")
    expect_change = sub.add_parser(
        "expect-change",
        help="the loss is to change level (e.g. a planned data-mix change): the spike "
        "detectors start again from the current level",
    )
    expect_change.add_argument(
        "--reason", metavar="TEXT", help="why, for the audit trail (at most 200 characters)"
    )
    return parser


def _command_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, cmd: str
) -> dict[str, Any]:
    """The command's arguments, checked with the agent's own rules before anything is sent."""
    given = {name: getattr(args, name) for name in COMMAND_ARGS[cmd].model_fields}
    try:
        return validate_args(cmd, {k: v for k, v in given.items() if v is not None})
    except ProtocolError as exc:
        parser.error(f"{args.command}: {exc.message}")


def _client(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ControlClient:
    if args.tcp is None:
        socket_path = args.socket or RunPaths.of(args.run_dir).socket
        return ControlClient(socket_path=socket_path, timeout=args.timeout)
    token = os.environ.get(args.token_env)
    if not token:
        parser.error(f"--tcp needs the agent's token in ${args.token_env}, which is not set")
    return ControlClient(tcp=args.tcp, token=token, timeout=args.timeout)


def _fail(code: int, message: str) -> int:
    print(f"lossguard-ctl: error: {message}", file=sys.stderr)
    return code


def _without_agent(run_dir: Path, cmd: str, as_json: bool, exc: ControlUnavailable) -> int:
    """No agent answers for ``run_dir``: list its checkpoints from disk, or say why (a dead
    agent: one line with its pid, last step and how it is being or can be resumed)."""
    if cmd == "checkpoints" and run_dir.is_dir():
        paths = RunPaths.of(run_dir)
        note = f"no agent answered at {paths.socket}: checkpoints read from {paths.checkpoints}"
        print(note, file=sys.stderr if as_json else sys.stdout)
        print(render(cmd, checkpoints_on_disk(run_dir), as_json))
        return EXIT_OK
    return _fail(EXIT_UNREACHABLE, dead_agent(run_dir) or str(exc))


@quiet_on_closed_pipe
def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        cmd = args.command.replace("-", "_")
        cmd_args = _command_args(parser, args, cmd)
        client = _client(parser, args)
    except SystemExit as exc:  # argparse: --help, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    with client:
        try:
            print(render(cmd, client.request(cmd, cmd_args), args.json))
        except ControlError as exc:
            return _fail(EXIT_REFUSED, f"{exc.code}: {exc.message}")
        except ControlUnavailable as exc:
            if args.run_dir is not None:
                return _without_agent(args.run_dir, cmd, args.json, exc)
            return _fail(EXIT_UNREACHABLE, str(exc))
        except ControlTimeout as exc:
            return _fail(EXIT_TIMEOUT, str(exc))
        except KeyboardInterrupt:
            print("lossguard-ctl: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

"""``lossguard-ctl``: send one control command to a running agent and print its result; with
``--run-dir``, list a run's checkpoints from disk or say why its agent is gone when none answers."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from lossguard.agent.control.offline import checkpoints_on_disk, dead_agent
from lossguard.common.cli import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, quiet_on_closed_pipe
from lossguard.common.console import format_duration
from lossguard.common.control.address import split_address
from lossguard.common.control.bearer import DEFAULT_TOKEN_ENV
from lossguard.common.control.client import (
    ControlClient,
    ControlError,
    ControlTimeout,
    ControlUnavailable,
)
from lossguard.common.control.protocol import ABANDONED, COMMAND_ARGS, ProtocolError, validate_args
from lossguard.common.rundir.names import CHECKPOINT_DIR, SOCKET_NAME

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
        socket_path = args.socket or args.run_dir / SOCKET_NAME
        return ControlClient(socket_path=socket_path, timeout=args.timeout)
    token = os.environ.get(args.token_env)
    if not token:
        parser.error(f"--tcp needs the agent's token in ${args.token_env}, which is not set")
    return ControlClient(tcp=args.tcp, token=token, timeout=args.timeout)


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _lr(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def _local_time(epoch: float | None) -> str:
    return "-" if epoch is None else datetime.fromtimestamp(epoch).isoformat(timespec="seconds")


def _table(rows: list[list[str]], right: set[int]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
    return "\n".join(lines)


def _format_status(result: dict[str, Any]) -> str:
    checkpoint = result["checkpoint"]
    step = str(result["step"])
    if result["max_steps"] is not None:
        step += f" / {result['max_steps']}"
    state = [name for name in ("paused", "stopping") if result[name]] or ["running"]
    rows = [
        ("run", _text(result["run_id"])),
        ("step", step),
        ("tokens", f"{result['tokens']:,}"),
        ("state", ", ".join(state)),
        ("lr", _lr(result["lr"])),
        ("lr scale", f"{result['lr_scale']:g}"),
        ("train loss", _loss(result["last_train_loss"])),
        ("val loss", _loss(result["last_val_loss"])),
        ("world size", str(result["world_size"])),
        ("pid", str(result["pid"])),
        ("uptime", format_duration(result["uptime_seconds"])),
        ("latest", _text(checkpoint["latest"])),
        ("best", _text(checkpoint["best"])),
        ("last good", _text(checkpoint["last_good"])),
        ("saving", "yes" if checkpoint["in_progress"] else "no"),
    ]
    if result.get("episode"):  # agents before diagnoses leave it out
        rows.append(("episode", _diagnosis(result["episode"])))
    width = max(len(key) for key, _ in rows) + 1
    return "\n".join(f"{key:<{width}}{value}" for key, value in rows)


def _format_checkpoints(result: dict[str, Any]) -> str:
    if not result["checkpoints"]:
        return "no checkpoints"
    header = ["name", "step", "healthy", "val loss", "train loss", "created", "reason", "marks"]
    rows = [header]
    for ckpt in result["checkpoints"]:
        marks = [mark for mark in ("latest", "best", "last_good") if result[mark] == ckpt["name"]]
        rows.append(
            [
                ckpt["name"],
                str(ckpt["step"]),
                "yes" if ckpt["healthy"] else "no",
                _loss(ckpt["val_loss"]),
                _loss(ckpt["train_loss"]),
                _local_time(ckpt["created_at"]),
                _text(ckpt["reason"]),
                ", ".join(marks),
            ]
        )
    return _table(rows, right={1, 3, 4})


def _format_save(result: dict[str, Any]) -> str:
    health = "healthy" if result["healthy"] else "unhealthy"
    return f"saved {result['name']} (step {result['step']}, {health}) in {result['seconds']:.2f} s"


def _format_rollback(result: dict[str, Any]) -> str:
    text = (
        f"rolled back from step {result['from_step']} to step {result['to_step']} "
        f"({result['checkpoint']}); skipped {result['skipped_batches']} batches; "
        f"lr scale {result['lr_scale']:g}"
    )
    if result.get("abandoned"):
        text += f"\nabandoned: {_diagnosis(result['abandoned'])}"
    return text


def _diagnosis(diagnosis: dict[str, Any]) -> str:
    """``loss non-finite at step 805: <causes>`` or ``loss spike at step 9 (40, z 8.0): ...``"""
    signal = str(diagnosis["signal"]).replace("_", " ")
    if diagnosis["nonfinite"]:
        what = f"{signal} non-finite at step {diagnosis['step']}"
    else:
        what = f"{signal} spike at step {diagnosis['step']}"
        if diagnosis.get("value") is not None:
            zscore = diagnosis.get("zscore")
            z = f", z {zscore:.1f}" if zscore is not None else ""
            what += f" ({diagnosis['value']:.4g}{z})"
    causes = "; ".join(str(cause) for cause in diagnosis.get("causes") or [])
    return f"{what}: {causes}" if causes else what


def _format_pause_resume(result: dict[str, Any]) -> str:
    return f"{'paused' if result['paused'] else 'resumed'} at step {result['step']}"


def _format_set_lr_scale(result: dict[str, Any]) -> str:
    text = f"lr scale {result['lr_scale']:g}"
    return text if result["lr"] is None else f"{text} (lr {_lr(result['lr'])})"


def _format_expect_change(result: dict[str, Any]) -> str:
    return (
        f"change expected at step {result['step']}: the spike detectors start again from the "
        "current level"
    )


def _format_stop(result: dict[str, Any]) -> str:
    saved = result["checkpoint"]
    return f"stopping at step {result['step']}; " + (
        f"saved {saved}" if saved else "no checkpoint saved"
    )


_FORMATTERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "status": _format_status,
    "checkpoints": _format_checkpoints,
    "save": _format_save,
    "rollback": _format_rollback,
    "pause": _format_pause_resume,
    "resume": _format_pause_resume,
    "set_lr_scale": _format_set_lr_scale,
    "expect_change": _format_expect_change,
    "stop": _format_stop,
}


def _render(cmd: str, result: dict[str, Any], as_json: bool) -> str:
    """The result as printed; a result of an unexpected shape is a ``bad_reply``."""
    if as_json:
        return json.dumps(result, indent=2)
    try:
        return _FORMATTERS[cmd](result)
    except (KeyError, TypeError, ValueError) as exc:
        raise ControlError(
            "bad_reply", f"unexpected {cmd} result ({type(exc).__name__}: {exc}); try --json"
        ) from None


def _fail(code: int, message: str) -> int:
    print(f"lossguard-ctl: error: {message}", file=sys.stderr)
    return code


def _without_agent(run_dir: Path, cmd: str, as_json: bool, exc: ControlUnavailable) -> int:
    """No agent answers for ``run_dir``: list its checkpoints from disk, or say why (a dead
    agent: one line with its pid, last step and how it is being or can be resumed)."""
    if cmd == "checkpoints" and run_dir.is_dir():
        note = (
            f"no agent answered at {run_dir / SOCKET_NAME}: "
            f"checkpoints read from {run_dir / CHECKPOINT_DIR}"
        )
        print(note, file=sys.stderr if as_json else sys.stdout)
        print(_render(cmd, checkpoints_on_disk(run_dir), as_json))
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
            print(_render(cmd, client.request(cmd, cmd_args), args.json))
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

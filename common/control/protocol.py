"""Control protocol v1 (torch-free): newline-delimited JSON, one request per line, 64 KiB max.

    -> {"id": "r1", "cmd": "rollback", "args": {"target": "last_good", "skip_batches": 200}}
    -> {"id": "r2", "cmd": "rollback", "args": {"skip_batches": "abandoned", "lr_scale": 0.5}}
    <- {"id": "r1", "ok": true, "result": {"from_step": 1840, "to_step": 1600, ...}}
    <- {"id": "r2", "ok": false, "error": {"code": "bad_request", "message": "..."}}

Over TCP every request also carries ``"token"``: the bearer token the agent was started with.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from lossguard.common.config import describe_validation_error
from lossguard.common.jsondepth import TooDeep, load_bounded
from lossguard.common.rundir.checkpoints import NAME_RE
from lossguard.common.rundir.targets import MEMORY_PREFIX, NAMED_TARGETS

PROTOCOL_VERSION = 1
MAX_LINE_BYTES = 64 * 1024
MAX_ID_LENGTH = 128


MIN_TOKEN_LENGTH = 16
"""The shortest bearer token a TCP control listener accepts (``openssl rand -hex 32`` makes 64)."""


class ErrorCode(str, Enum):
    BAD_REQUEST = "bad_request"  # malformed JSON, wrong field types, bad arguments
    UNKNOWN_COMMAND = "unknown_command"
    TOO_LARGE = "too_large"  # a line over MAX_LINE_BYTES; the connection is then closed
    UNAUTHORIZED = "unauthorized"  # TCP without the right token
    NOT_FOUND = "not_found"  # no such (usable) checkpoint
    BUSY = "busy"  # too many connections
    FAILED = "failed"  # the command was valid but applying it failed
    SHUTTING_DOWN = "shutting_down"  # training ended before the command could be applied


class ProtocolError(Exception):
    """A request that gets an error reply; ``request_id`` is echoed when it could be read."""

    def __init__(self, code: ErrorCode, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


Target = int | Literal["last_good", "best", "latest"]


def parse_target(value: Any) -> Target:
    """A checkpoint target: last_good, best, latest, a step number or a checkpoint's or
    in-memory snapshot's name (``step_00000150``, ``memory/step_00000150``: step 150); never a
    path."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        if value in NAMED_TARGETS:
            return value  # type: ignore[return-value]
        if value.isdigit():
            return int(value)
        if named := NAME_RE.fullmatch(value.removeprefix(MEMORY_PREFIX)):
            return int(named.group(1))
    raise ValueError(
        f"must be one of {', '.join(reversed(NAMED_TARGETS))}, a step number or a checkpoint name "
        f"(step_00000150), never a path, not {value!r}"
    )


ABANDONED: Literal["abandoned"] = "abandoned"
SkipBatches = int | Literal["abandoned"]
"""Batches to pass over after a rollback: a count, or ``"abandoned"``: exactly the batches that
the abandoned steps trained on (the data position before the rollback less the restored one)."""


def parse_skip_batches(value: Any) -> SkipBatches:
    """A count >= 0 or ``"abandoned"``; a count must be a JSON integer, not a string."""
    if value == ABANDONED:
        return ABANDONED
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"must be >= 0 or {ABANDONED!r}, not {value}")
        return value
    raise ValueError(f"must be an integer >= 0 or {ABANDONED!r}, not {value!r}")


def _json_number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be a number")
    if not math.isfinite(value):
        raise ValueError("must be finite")
    return float(value)


JsonNumber = Annotated[float, BeforeValidator(_json_number)]


class CommandArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NoArgs(CommandArgs):
    pass


class RollbackArgs(CommandArgs):
    target: Annotated[Target, BeforeValidator(parse_target)] = "last_good"
    skip_batches: Annotated[SkipBatches, BeforeValidator(parse_skip_batches)] = 0
    lr_scale: JsonNumber = Field(default=1.0, gt=0)


class SetLrScaleArgs(CommandArgs):
    scale: JsonNumber = Field(gt=0)


MAX_REASON_LENGTH = 200


def check_reason(text: str) -> str:
    """An ``expect_change`` reason: printable text on one line, at most MAX_REASON_LENGTH
    characters (ValueError otherwise)."""
    if len(text) > MAX_REASON_LENGTH:
        raise ValueError(f"must be at most {MAX_REASON_LENGTH} characters, not {len(text)}")
    if not text.isprintable():
        raise ValueError("must be printable text on one line")
    return text


class ExpectChangeArgs(CommandArgs):
    reason: Annotated[str, AfterValidator(check_reason)] = ""


COMMAND_ARGS: dict[str, type[CommandArgs]] = {
    "status": NoArgs,
    "checkpoints": NoArgs,
    "save": NoArgs,
    "rollback": RollbackArgs,
    "pause": NoArgs,
    "resume": NoArgs,
    "set_lr_scale": SetLrScaleArgs,
    "expect_change": ExpectChangeArgs,
    "stop": NoArgs,
}
COMMANDS = tuple(COMMAND_ARGS)


class RestartArgs(CommandArgs):
    reason: str = Field(default="requested", min_length=1, max_length=200)


SUPERVISOR_COMMAND_ARGS: dict[str, type[CommandArgs]] = {"status": NoArgs, "restart": RestartArgs}
"""The supervisor's socket (``supervisor.sock``) speaks the same protocol with these commands:
``restart`` ends the training command's process group and starts it again from its newest
healthy checkpoint (the monitor's ``restart`` action, for a hung run)."""


@dataclass(frozen=True)
class Request:
    id: str
    cmd: str
    args: dict[str, Any]
    token: str | None = None


def _request_id(raw: Any) -> str:
    if isinstance(raw, bool) or not isinstance(raw, (str, int)):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "id: must be a string or an integer")
    text = str(raw)
    if not text or len(text) > MAX_ID_LENGTH:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"id: must be 1 to {MAX_ID_LENGTH} characters")
    return text


def validate_args(
    cmd: str,
    args: dict[str, Any],
    request_id: str | None = None,
    commands: Mapping[str, type[CommandArgs]] = COMMAND_ARGS,
) -> dict[str, Any]:
    """Check a command's arguments against ``commands`` (the agent's by default); returns them
    normalised (defaults filled in)."""
    schema = commands.get(cmd)
    if schema is None:
        raise ProtocolError(
            ErrorCode.UNKNOWN_COMMAND,
            f"unknown command {cmd!r}; commands: {', '.join(commands)}",
            request_id,
        )
    try:
        return schema.model_validate(args).model_dump()
    except ValidationError as exc:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, describe_validation_error(exc), request_id
        ) from None


def parse_request(line: bytes, commands: Mapping[str, type[CommandArgs]] = COMMAND_ARGS) -> Request:
    """Decode and validate one request line (without its newline) against ``commands``."""
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"request exceeds {MAX_LINE_BYTES} bytes")
    try:
        message = load_bounded(line)
    except TooDeep as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"not valid JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a request must be a JSON object")
    if "id" not in message:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "id: required")
    request_id = _request_id(message["id"])
    unknown = set(message) - {"id", "cmd", "args", "token"}
    if unknown:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"unknown field {sorted(unknown)[0]!r}", request_id
        )
    cmd = message.get("cmd")
    if not isinstance(cmd, str):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "cmd: must be a string", request_id)
    args = message.get("args", {})
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "args: must be an object", request_id)
    token = message.get("token")
    if token is not None and not isinstance(token, str):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "token: must be a string", request_id)
    return Request(request_id, cmd, validate_args(cmd, args, request_id, commands), token)


def encode(message: dict[str, Any]) -> bytes:
    """One protocol line; a non-finite number (a diverged loss) becomes null: JSON has none."""
    return json.dumps(_finite(message), separators=(",", ":"), allow_nan=False).encode() + b"\n"


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def ok_reply(request_id: str, result: dict[str, Any]) -> dict[str, Any]:
    return {"id": request_id, "ok": True, "result": result}


def error_reply(request_id: str | None, code: ErrorCode, message: str) -> dict[str, Any]:
    return {"id": request_id, "ok": False, "error": {"code": code.value, "message": message}}


def make_request(
    cmd: str, args: dict[str, Any] | None = None, *, request_id: str, token: str | None = None
) -> dict[str, Any]:
    """A request message as a client sends it."""
    message: dict[str, Any] = {"id": request_id, "cmd": cmd, "args": args or {}}
    if token is not None:
        message["token"] = token
    return message

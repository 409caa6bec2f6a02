"""``POST /api/v1/runs/{run_id}/control``: one control command, ``{"cmd": ..., "args": {...}}``
(and optionally the request ``id``), checked as the control protocol checks it and forwarded to
the run's agent through the endpoints the actions use; the answer is the agent's reply.

Only with ``Authorization: Bearer <token>`` (``$listen.token_env``), even on loopback: without
a token set, control is off. Every request is an audit line in the monitor's log; the token
never is."""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path

from lossguard.common.control.client import ControlError, ControlTimeout, ControlUnavailable
from lossguard.common.control.gate import PeerGate
from lossguard.common.control.protocol import ErrorCode, ProtocolError, encode, parse_request
from lossguard.common.control.protocol import Request as Command
from lossguard.common.jsondepth import load_bounded
from lossguard.common.printable import escaped
from lossguard.monitor.actions.endpoints import Endpoints, NoEndpoint
from lossguard.monitor.http.messages import (
    Request,
    Response,
    Route,
    api_data,
    api_error,
    token_refusal,
)
from lossguard.monitor.runs import read_runs

log = logging.getLogger("lossguard.monitor.http")
BODY_FIELDS = ("id", "cmd", "args")


def control_route(
    runs_root: Path | None, endpoints: Endpoints, *, token: str | None, token_env: str
) -> Route:
    """The control endpoint; refused (403, saying how to enable it) while ``token`` is None."""

    gate = PeerGate()  # the back-off of wrong tokens, by client address

    def control(request: Request) -> Response:
        run_id = request.params["run_id"]
        refused = token_refusal(request, token, token_env, "control", gate)
        if refused is not None:
            status, message, headers = refused
            log.warning(
                "control: refused a request for run %s from %s: %s",
                escaped(run_id),
                request.client,
                message,
            )
            return api_error(status, message, headers=headers)
        try:
            command = _command(request.body)
        except ProtocolError as exc:
            return api_error(400, exc.message)
        files = read_runs(runs_root).get(run_id)
        if files is None and not endpoints.knows(run_id):
            return api_error(404, f"run {run_id!r} is not known to the monitor")
        if files is not None and files.agent.ended_cleanly:
            return api_error(503, f"run {run_id!r} has ended ({files.agent.exit}): no agent")
        log.info(
            "control %s: %s %s to run %s, asked by %s",
            escaped(command.id),
            command.cmd,
            json.dumps(command.args, sort_keys=True),
            escaped(run_id),
            request.client,
        )
        answer = {"id": command.id, "run_id": run_id, "cmd": command.cmd, "args": command.args}
        try:
            with endpoints.client(run_id) as client:
                result = client.request(command.cmd, command.args, request_id=command.id)
        except ControlError as exc:
            log.warning("control %s: the agent refused it: %s", escaped(command.id), escaped(exc))
            failed = {**answer, "code": exc.code, "message": exc.message}
            return api_error(422, f"the agent refused {command.cmd}: {exc}", data=failed)
        except ControlTimeout as exc:
            log.warning("control %s: %s", escaped(command.id), escaped(exc))
            return api_error(503, str(exc), error_type="timeout", data=answer)
        except (ControlUnavailable, NoEndpoint, OSError) as exc:
            log.warning("control %s: not delivered: %s", escaped(command.id), escaped(exc))
            return api_error(503, f"not delivered: {exc}", data=answer)
        log.info("control %s: applied: %s", escaped(command.id), escaped(json.dumps(result), 300))
        return api_data({**answer, "result": result})

    return control


def _command(body: bytes) -> Command:
    """The body as a control request, checked by the protocol (ProtocolError: why not); its
    ``id`` is made up unless the body gives one."""
    try:
        message = load_bounded(body)
    except ValueError as exc:
        raise _bad(f"body: not JSON ({exc})") from None
    if not isinstance(message, dict):
        raise _bad('body: expected a JSON object {"cmd": ..., "args": {...}}')
    unknown = sorted(set(message) - set(BODY_FIELDS))
    if unknown:
        raise _bad(f"unknown field {unknown[0]!r}; expected {', '.join(BODY_FIELDS)}")
    return parse_request(encode({"id": f"api-{uuid.uuid4().hex[:12]}", **message}).rstrip())


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, message)

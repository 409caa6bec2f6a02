"""The route table's parts: a route is a function from :class:`Request` to :class:`Response`,
under ``(method, path)``; API answers and errors in the shape of Prometheus's HTTP API; the
bearer-token check."""

from __future__ import annotations

import hmac
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from lossguard.common.control.gate import PeerGate
from lossguard.common.control.protocol import encode

API_PREFIX = "/api/"
ERROR_TYPES = {
    400: "bad_data",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    411: "bad_data",
    413: "bad_data",
    415: "bad_data",
    422: "execution",
    429: "too_many_requests",
    500: "internal",
    503: "unavailable",
}
"""The ``errorType`` of each status of an API error (Prometheus's names where it has one)."""


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # without the query string
    headers: Mapping[str, str] = field(default_factory=dict)  # names in lower case
    body: bytes = b""
    query: Mapping[str, list[str]] = field(default_factory=dict)  # decoded, blanks kept
    params: Mapping[str, str] = field(default_factory=dict)  # the path's {name} segments
    client: str = ""  # the peer's address


@dataclass(frozen=True)
class Response:
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def json(
        cls, payload: object, status: int = 200, headers: tuple[tuple[str, str], ...] = ()
    ) -> Response:
        return cls(status, "application/json", json.dumps(payload).encode() + b"\n", headers)

    @classmethod
    def text(cls, message: str, status: int, headers: tuple[tuple[str, str], ...] = ()) -> Response:
        return cls(status, "text/plain", f"{message}\n".encode(), headers)


Route = Callable[[Request], Response]
Routes = Mapping[tuple[str, str], Route]


def api_data(data: object) -> Response:
    """A successful API answer; non-finite numbers become null (JSON has none)."""
    return Response(200, "application/json", encode({"status": "success", "data": data}))


def api_error(
    status: int,
    message: str,
    *,
    error_type: str | None = None,
    data: object = None,
    headers: tuple[tuple[str, str], ...] = (),
) -> Response:
    """An API error: ``errorType`` from the status unless given, ``error`` one line."""
    payload: dict[str, object] = {
        "status": "error",
        "errorType": error_type or ERROR_TYPES.get(status, "internal"),
        "error": message,
    }
    if data is not None:
        payload["data"] = data
    return Response(status, "application/json", encode(payload), headers)


def error_for(
    path: str, status: int, message: str, headers: tuple[tuple[str, str], ...] = ()
) -> Response:
    """An error in the form the path's clients read: JSON under ``/api/``, else text."""
    if path.startswith(API_PREFIX):
        return api_error(status, message, headers=headers)
    return Response.text(message, status, headers)


def bearer_refusal(
    headers: Mapping[str, str], expected: str
) -> tuple[int, str, tuple[tuple[str, str], ...]] | None:
    """Why a request without ``Authorization: Bearer <expected>`` is refused: ``(status,
    message, headers)``, 401 without a bearer token and 403 with a wrong one; None: it has it."""
    scheme, _, given = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        challenge = (("WWW-Authenticate", 'Bearer realm="lossguard-monitor"'),)
        return 401, "unauthorized: send Authorization: Bearer <token>", challenge
    if not hmac.compare_digest(given.strip().encode(), expected.encode()):
        return 403, "forbidden: wrong token", ()
    return None


def token_refusal(
    request: Request, token: str | None, token_env: str, what: str, gate: PeerGate
) -> tuple[int, str, tuple[tuple[str, str], ...]] | None:
    """Why a request to ``what`` (an endpoint that can make the monitor act) is refused:
    403 while no token is set (saying how to set one); 429 with ``Retry-After`` while the
    client's address waits out the back-off its wrong tokens earned (``gate``: the agent's
    back-off, one try at a time, doubling to 5 s); else as :func:`bearer_refusal`."""
    if token is None:
        return (
            403,
            f"forbidden: {what} is off; set ${token_env} (listen.token_env) to a secret token, "
            "restart the monitor and send Authorization: Bearer <token>",
            (),
        )
    scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return bearer_refusal(request.headers, token)  # no token tried: 401, no turn taken
    wait = gate.turn_now(request.client)
    if wait > 0:
        retry = str(math.ceil(wait))
        message = f"too many requests: wrong tokens from {request.client}; retry in {retry} s"
        return 429, message, (("Retry-After", retry),)
    refused = bearer_refusal(request.headers, token)
    if refused is not None and refused[0] == 403:
        gate.failed(request.client)
    elif refused is None:
        gate.succeeded(request.client)
    return refused

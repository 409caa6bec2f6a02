"""One HTTP POST to a receiver and what it means for delivery: delivered, retry later, or dead.

Error texts name the failure, never the URL: webhook URLs and keys are secrets."""

from __future__ import annotations

import email.utils
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

import requests

if TYPE_CHECKING:
    from lossguard.monitor.notify.model import Notification

Result = Literal["delivered", "retry", "dead"]
PERMANENT = frozenset({400, 401, 403, 404, 405, 410, 413, 422})
MAX_BODY_IN_ERROR = 300
SECRET_PIECE = 8  # path parts this long or longer may be tokens


@dataclass(frozen=True)
class Outcome:
    """The result of one delivery attempt; ``detail`` is one line, free of secrets."""

    result: Result
    detail: str
    status: int | None = None
    retry_after_s: float | None = None


DELIVERED = Outcome("delivered", "delivered")


class HttpIntegration:
    """An integration that POSTs one JSON body per notification to its URL (a secret)."""

    kind: str
    pace_s: float  # least seconds between two requests to the same destination
    per_alert: bool  # one notification (outbox row) per alert
    auth: tuple[str, str] | None = None  # basic auth (user, password: a secret)

    def __init__(self, url: str, send_resolved: bool) -> None:
        self.url = url
        self.send_resolved = send_resolved

    def body(self, notification: Notification, notification_id: int) -> Any:
        """What to send (ValueError: this notification cannot be sent, ever)."""
        raise NotImplementedError

    def accept(self, reply: requests.Response) -> Outcome | None:
        """A verdict on a 2xx reply other than delivered, or None."""
        return None

    def destination(self) -> str:
        return self.url

    def secrets(self) -> list[str]:
        """What an outcome's detail must never show: the URL and its longer path parts and
        query (where webhook tokens live)."""
        parts = urlsplit(self.url)
        pieces = [p for p in parts.path.split("/") if len(p) >= SECRET_PIECE]
        password = [] if self.auth is None else [self.auth[1]]
        return [self.url, *pieces, *([parts.query] if parts.query else []), *password]

    def deliver(
        self,
        notification: Notification,
        notification_id: int,
        session: requests.Session,
        timeout_s: float,
    ) -> Outcome:
        try:
            body = self.body(notification, notification_id)
        except ValueError as exc:
            return Outcome("dead", str(exc))
        outcome = post_json(session, self.url, body, timeout_s, accept=self.accept, auth=self.auth)
        return replace(outcome, detail=redact(outcome.detail, self.secrets()))


def redact(text: str, secrets: list[str]) -> str:
    """``text`` with every secret, longest first, replaced by ``<secret>``: a receiver that
    echoes its URL or key in an error does not get it into the log."""
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, "<secret>")
    return text


def post_json(
    session: requests.Session,
    url: str,
    body: Any,
    timeout_s: float,
    accept: Callable[[requests.Response], Outcome | None] | None = None,
    auth: tuple[str, str] | None = None,
) -> Outcome:
    """POST ``body`` as JSON (with basic ``auth`` when given). 2xx is delivered unless
    ``accept`` says otherwise; 408, 425, 429 and 5xx are retried (429 after its Retry-After);
    other 4xx are dead; so are redirects. Timeouts, refused and dropped connections are
    retried."""
    try:
        reply = session.post(url, json=body, timeout=timeout_s, allow_redirects=False, auth=auth)
    except requests.Timeout:
        return Outcome("retry", f"no reply within {timeout_s:g}s")
    except requests.ConnectionError as exc:
        return Outcome("retry", _connection_problem(exc))
    except requests.RequestException as exc:
        return Outcome("retry", f"request failed ({type(exc).__name__})")
    return classify(reply, accept)


def classify(
    reply: requests.Response,
    accept: Callable[[requests.Response], Outcome | None] | None = None,
) -> Outcome:
    """What an HTTP reply means for delivery."""
    status = reply.status_code
    detail = f"HTTP {status} {_body_excerpt(reply)}".rstrip()
    if 200 <= status < 300:
        verdict = accept(reply) if accept else None
        return verdict or Outcome("delivered", detail, status)
    if status == 429 or status in (408, 425) or status >= 500:
        return Outcome("retry", detail, status, retry_after(reply.headers.get("Retry-After")))
    if status in PERMANENT or 300 <= status < 500:
        return Outcome("dead", detail, status)
    return Outcome("retry", detail, status)


def retry_after(header: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header: delay-seconds or an HTTP date (RFC 9110)."""
    if not header:
        return None
    header = header.strip()
    if header.isdigit():
        return float(header)
    try:
        when = email.utils.parsedate_to_datetime(header)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _body_excerpt(reply: requests.Response) -> str:
    text = " ".join(reply.text.split())
    return text if len(text) <= MAX_BODY_IN_ERROR else text[: MAX_BODY_IN_ERROR - 3] + "..."


def _connection_problem(exc: requests.ConnectionError) -> str:
    text = str(exc).lower()
    if "refused" in text:
        return "connection refused"
    if "reset" in text or "aborted" in text or "remotedisconnected" in text:
        return "connection dropped"
    if "name or service" in text or "resolve" in text:
        return "host not found"
    return "connection failed"

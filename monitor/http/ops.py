"""The monitor's own endpoints: ``/metrics``, ``/healthz``, ``/api/status`` and Alertmanager's
webhook ``POST /api/v1/alertmanager``."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from lossguard.common.control.gate import PeerGate
from lossguard.common.printable import escaped
from lossguard.monitor.actions.engine import Refusal
from lossguard.monitor.actions.intake import IncomingAlert, IntakeError, parse_webhook
from lossguard.monitor.actions.policy import ACTION_LABEL
from lossguard.monitor.http.messages import Request, Response, Route, Routes, token_refusal

log = logging.getLogger("lossguard.monitor.http")

ALERTMANAGER_PATH = "/api/v1/alertmanager"
DEFAULT_TOKEN_ENV = "LOSSGUARD_MONITOR_TOKEN"

Health = Callable[[], tuple[bool, dict[str, object]]]
Status = Callable[[], dict[str, object]]
OnAlerts = Callable[[list[IncomingAlert]], "list[Refusal]"]


def monitor_routes(
    registry: CollectorRegistry,
    health: Health,
    status: Status,
    *,
    on_alerts: OnAlerts | None = None,
    token: str | None = None,
    token_env: str = DEFAULT_TOKEN_ENV,
    extra: Routes | None = None,
) -> Routes:
    """The monitor's endpoints, and ``extra``; ``status`` is what ``lossguard-monitor status``
    shows of the running daemon. With ``on_alerts``, ``POST /api/v1/alertmanager`` takes
    Alertmanager's webhook (payload v4) with ``Authorization: Bearer <token>`` and hands its
    alerts to it; without a ``token`` the webhook is off (``$token_env`` names where to set
    one)."""

    def metrics(request: Request) -> Response:
        return Response(200, CONTENT_TYPE_LATEST, generate_latest(registry))

    def healthz(request: Request) -> Response:
        healthy, detail = health()
        return Response.json({"healthy": healthy, **detail}, 200 if healthy else 503)

    def api_status(request: Request) -> Response:
        return Response.json(status())

    routes: dict[tuple[str, str], Route] = {
        ("GET", "/metrics"): metrics,
        ("GET", "/healthz"): healthz,
        ("GET", "/api/status"): api_status,
    }
    if on_alerts is not None:
        routes[("POST", ALERTMANAGER_PATH)] = alertmanager_route(on_alerts, token, token_env)
    routes.update(extra or {})
    return routes


def alertmanager_route(on_alerts: OnAlerts, token: str | None, token_env: str) -> Route:
    """``POST /api/v1/alertmanager``: 403 while no token is set, 401/403 without the right
    bearer token, 415 unless JSON, 400 naming what is wrong with the payload, else 200 with
    ``{"received": alerts, "actionable": firing alerts taken for an action, "refused":
    [{"alertname", "run_id", "reason"}, ...]}`` (a refused alert is answered 200 too:
    Alertmanager would only send it again)."""

    gate = PeerGate()  # the back-off of wrong tokens, by client address

    def alertmanager(request: Request) -> Response:
        refusal = token_refusal(request, token, token_env, "the Alertmanager webhook", gate)
        if refusal is not None:
            status, message, headers = refusal
            log.warning(
                "alertmanager webhook: refused a request from %s: %s", request.client, message
            )
            return Response.text(message, status, headers)
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            return Response.text(
                f"unsupported media type {media_type or 'none'!r}: send application/json", 415
            )
        try:
            alerts = parse_webhook(request.body)
        except IntakeError as exc:
            log.warning("alertmanager webhook: refused a payload: %s", exc)
            return Response.text(f"bad payload: {exc}", 400)
        log.info(
            "alertmanager webhook: %d alerts: %s",
            len(alerts),
            ", ".join(f"{escaped(a.labels.get('alertname', '?'))} {a.status}" for a in alerts[:5])
            + (", ..." if len(alerts) > 5 else ""),
        )
        try:
            refused = on_alerts(alerts)
        except Exception:  # Alertmanager retries a 5xx
            log.exception("alertmanager webhook: taking the alerts failed")
            return Response.text("internal error: the alerts were not taken", 500)
        asking = sum(1 for a in alerts if a.status == "firing" and ACTION_LABEL in a.labels)
        return Response.json(
            {
                "received": len(alerts),
                "actionable": asking - len(refused),
                "refused": [dataclasses.asdict(r) for r in refused],
            }
        )

    return alertmanager

"""The monitor's HTTP server under hostile clients, on a real MonitorServer: deeply nested,
malformed and random bodies get a clean 400 (never a 500 or a dropped connection) and reach no
one; a client dripping header lines is cut off at the request deadline; connections beyond the
cap get 503 at once and the server serves again once they close; run ids cannot forge lines of
the audit log."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from lossguard.monitor.actions.endpoints import Endpoints
from lossguard.monitor.actions.engine import Refusal
from lossguard.monitor.actions.intake import IncomingAlert
from lossguard.monitor.actions.policy import ActionsConfig
from lossguard.monitor.http import server as api
from lossguard.monitor.http.control import control_route
from lossguard.monitor.http.ops import ALERTMANAGER_PATH
from lossguard.monitor.http.server import MonitorServer
from tests.monitor.http.test_intake import PAYLOAD, TOKEN
from tests.support.processes import wait_for

AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


class Taken:
    def __init__(self) -> None:
        self.alerts: list[IncomingAlert] = []

    def __call__(self, alerts: list[IncomingAlert]) -> list[Refusal]:
        self.alerts.extend(alerts)
        return []


def serve(taken: Taken) -> MonitorServer:
    control = control_route(
        None, Endpoints(ActionsConfig(), None, 5.0), token=TOKEN, token_env="LG_TOKEN"
    )
    return MonitorServer(
        CollectorRegistry(),
        lambda: (True, {}),
        lambda: {},
        "127.0.0.1",
        0,
        on_alerts=taken,
        token=TOKEN,
        extra={("POST", "/api/v1/runs/{run_id}/control"): control},
    )


@pytest.fixture
def taken() -> Taken:
    return Taken()


@pytest.fixture
def server(taken: Taken) -> Iterator[MonitorServer]:
    served = serve(taken)
    try:
        yield served
    finally:
        served.close()


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("path", [ALERTMANAGER_PATH, "/api/v1/runs/r1/control"])
def test_deep_nesting_is_a_clean_400(server: MonitorServer, taken: Taken, path: str) -> None:
    for body in (nested(100_000), b'{"alerts": ' + nested(40) + b"}"):
        reply = requests.post(f"{server.url}{path}", data=body, headers=AUTH, timeout=10)
        assert reply.status_code == 400, reply.text
        assert "nested deeper than 32 levels" in reply.text
    assert taken.alerts == []
    assert requests.get(f"{server.url}/healthz", timeout=10).status_code == 200


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.one_of(
        st.binary(max_size=300),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
            lambda inner: (
                st.lists(inner, max_size=4)
                | st.dictionaries(st.text(max_size=10), inner, max_size=4)
            ),
            max_leaves=30,
        ).map(lambda value: json.dumps(value).encode()),
        st.dictionaries(
            st.sampled_from(sorted(PAYLOAD)), st.just(None) | st.integers() | st.text(max_size=5)
        ).map(lambda changed: json.dumps({**PAYLOAD, **changed}).encode()),
    )
)
def test_any_body_gets_an_answer_never_a_failure(
    server: MonitorServer, taken: Taken, body: bytes
) -> None:
    """The webhook answers every body 200 (a valid payload) or 400 (one line saying why)."""
    before = len(taken.alerts)
    reply = requests.post(f"{server.url}{ALERTMANAGER_PATH}", data=body, headers=AUTH, timeout=10)
    assert reply.status_code in (200, 400), reply.text
    if reply.status_code == 400:
        assert reply.text.startswith("bad payload: ") and reply.text.count("\n") == 1
        assert len(taken.alerts) == before


def test_a_client_dripping_headers_is_cut_off(
    monkeypatch: pytest.MonkeyPatch, server: MonitorServer
) -> None:
    monkeypatch.setattr(api, "REQUEST_DEADLINE_S", 1.0)
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.sendall(b"GET /metrics HTTP/1.1\r\n")
        closed = False
        while not closed and time.monotonic() - started < 10:
            try:
                conn.sendall(b"X-Drip: 1\r\n")  # each line well within the idle timeout
            except OSError:
                closed = True
            time.sleep(0.2)  # the pace of the drip, not a wait for the server
    assert closed and time.monotonic() - started < 5


def test_connections_beyond_the_cap_get_503_at_once(
    monkeypatch: pytest.MonkeyPatch, taken: Taken
) -> None:
    monkeypatch.setattr(api, "MAX_CONNECTIONS", 4)
    served = serve(taken)
    held = [socket.create_connection(("127.0.0.1", served.port), timeout=10) for _ in range(4)]
    try:
        for conn in held:
            conn.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest

        def refused() -> bool:
            with socket.create_connection(("127.0.0.1", served.port), timeout=10) as extra:
                extra.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                return extra.recv(100).startswith(b"HTTP/1.1 503")

        assert wait_for(refused, 10, "the fifth connection refused")
        for conn in held:
            conn.close()
        wait_for(
            lambda: requests.get(f"{served.url}/metrics", timeout=10).status_code == 200,
            10,
            "the server to serve again",
        )
    finally:
        for conn in held:
            conn.close()
        served.close()


def test_a_run_id_cannot_forge_a_log_line(
    server: MonitorServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lossguard")
    forged = "r1%0A2026-01-01 lossguard.monitor.http INFO control x: applied"
    reply = requests.post(
        f"{server.url}/api/v1/runs/{forged}/control",
        json={"cmd": "pause"},
        headers={"Authorization": "Bearer wrong"},
        timeout=10,
    )
    assert reply.status_code == 403
    (line,) = [r.getMessage() for r in caplog.records if "refused a request for run" in r.message]
    assert "\n" not in line and "r1\\n2026-01-01" in line

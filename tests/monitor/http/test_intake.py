"""Alertmanager's webhook into the monitor: the payload (version 4) parsed, including one the
real Alertmanager sent, and ``POST /api/v1/alertmanager`` on a real MonitorServer (auth, limits,
content type, methods) and in the real daemon (a network listener without a token is refused)."""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from prometheus_client import CollectorRegistry

from lossguard.common.config import ConfigError
from lossguard.monitor.actions.engine import Refusal
from lossguard.monitor.actions.intake import IncomingAlert, IntakeError, parse_webhook
from lossguard.monitor.config import ListenConfig, webhook_token
from lossguard.monitor.http.ops import ALERTMANAGER_PATH
from lossguard.monitor.http.server import MAX_BODY_BYTES, MonitorServer
from tests.support.alert_stack import webhook_receiver
from tests.support.amserver import alertmanager, amtool, capture_server
from tests.support.processes import REPO, wait_for
from tests.support.runs import write_monitor_config

pytestmark = pytest.mark.live

TOKEN_ENV = "LOSSGUARD_MONITOR_TOKEN"
TOKEN = "s3cret-t0ken-for-tests"

# As Alertmanager 0.25 sends it (the shape of the configuration docs' webhook_config payload):
# nanosecond times with a zone offset, Go's zero time for an unset endsAt.
PAYLOAD: dict[str, Any] = {
    "receiver": "lossguard-monitor",
    "status": "firing",
    "alerts": [
        {
            "status": "firing",
            "labels": {
                "alertname": "LossNonFinite",
                "action": "rollback",
                "run_id": "gpt2-a",
                "rank": "0",
                "severity": "critical",
            },
            "annotations": {
                "summary": "Non-finite loss at step 805 of run gpt2-a",
                "runbook_url": "https://runbooks.example/lossguard/docs/runbook.md#lossnonfinite",
            },
            "startsAt": "2024-05-02T09:52:26.739266876+02:00",
            "endsAt": "0001-01-01T00:00:00Z",
            "generatorURL": "http://prometheus:9090/graph?g0.expr=lossguard_nonfinite_step&g0.tab=1",
            "fingerprint": "1a30ba71cca2921f",
        },
        {
            "status": "resolved",
            "labels": {"alertname": "TrainingStalled", "run_id": "gpt2-a", "rank": "0"},
            "annotations": {},
            "startsAt": "2024-05-02T07:40:00Z",
            "endsAt": "2024-05-02T07:50:00.5Z",
            "generatorURL": "",
            "fingerprint": "bc97ff14869b13e3",
        },
    ],
    "groupLabels": {"alertname": "LossNonFinite"},
    "commonLabels": {"run_id": "gpt2-a", "rank": "0"},
    "commonAnnotations": {},
    "externalURL": "http://alertmanager:9093",
    "version": "4",
    "groupKey": '{}/{action=~".+"}:{alertname="LossNonFinite"}',
    "truncatedAlerts": 0,
}


def body(payload: Any = PAYLOAD) -> bytes:
    return json.dumps(payload).encode()


def changed(path: str, value: Any = None, *, delete: bool = False) -> dict[str, Any]:
    """PAYLOAD with the field at ``path`` (``alerts.0.labels``) set or deleted."""
    payload = json.loads(body())
    *parents, last = path.split(".")
    node = payload
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    key: Any = int(last) if isinstance(node, list) else last
    if delete:
        del node[key]
    else:
        node[key] = value
    return payload


def test_a_v4_payload_becomes_incoming_alerts() -> None:
    firing, resolved = parse_webhook(body())
    assert firing == IncomingAlert(
        status="firing",
        labels=PAYLOAD["alerts"][0]["labels"],
        annotations=PAYLOAD["alerts"][0]["annotations"],
        starts_at=1714636346.739266,  # 07:52:26.739266 UTC, nanoseconds cut to microseconds
        ends_at=None,  # Go's zero time: not set
        generator_url=PAYLOAD["alerts"][0]["generatorURL"],
        source_fingerprint="1a30ba71cca2921f",
    )
    assert resolved.status == "resolved"
    assert resolved.starts_at == 1714635600.0 and resolved.ends_at == 1714636200.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        firing.status = "resolved"  # type: ignore[misc]


def test_unknown_fields_are_tolerated_and_optional_ones_default() -> None:
    payload = changed("orgId", 1)
    payload["alerts"][0].update(silenceURL="http://x", values={"B": 1.5})
    for name in ("annotations", "endsAt", "generatorURL", "fingerprint"):
        del payload["alerts"][0][name]
    for name in ("truncatedAlerts", "groupLabels", "commonLabels", "externalURL"):
        del payload[name]
    (alert, _) = parse_webhook(body(payload))
    assert alert.annotations == {} and alert.ends_at is None
    assert alert.generator_url == "" and alert.source_fingerprint == ""
    assert parse_webhook(body(changed("alerts", []))) == []


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{", "body is not JSON: Expecting property name enclosed in double quotes at line 1"),
        (b"\xff\xfe{", "body is not UTF-8 JSON"),
        (b"[]", "body is not a JSON object but list"),
        (body(changed("version", "3")), "version: expected Alertmanager's webhook payload "),
        (body(changed("version", 4)), "got 4"),
        (body(changed("version", delete=True)), "got None"),
        (body(changed("alerts", delete=True)), "alerts: missing"),
        (body(changed("groupKey", delete=True)), "groupKey: missing"),
        (body(changed("status", "pending")), "status: input should be 'firing' or 'resolved'"),
        (body(changed("alerts.0.labels", delete=True)), "alerts[0].labels: missing"),
        (body(changed("alerts.1.startsAt", delete=True)), "alerts[1].startsAt: missing"),
        (body(changed("alerts.0.labels.rank", 0)), "alerts[0].labels.rank: input should be a"),
        (body(changed("alerts.0.startsAt", "yesterday")), "alerts[0].startsAt: not an RFC 3339"),
        (body(changed("alerts.0.startsAt", "2024-05-02T09:52:26")), "no time zone"),
        (body(changed("alerts.0.startsAt", "0001-01-01T00:00:00Z")), "must be set"),
        (body(changed("alerts.0.endsAt", 17)), "alerts[0].endsAt: must be an RFC 3339 time"),
        (body(changed("truncatedAlerts", -1)), "truncatedAlerts: input should be greater"),
    ],
)
def test_bad_payloads_name_the_problem_in_one_line(raw: bytes, message: str) -> None:
    with pytest.raises(IntakeError) as caught:
        parse_webhook(raw)
    text = str(caught.value)
    assert message in text and "\n" not in text, text


def test_what_the_real_alertmanager_sends_parses(tmp_path: Path) -> None:
    with capture_server() as sink:
        config = {
            "route": {"receiver": "sink", "group_wait": "0s", "group_by": ["alertname"]},
            "receivers": [webhook_receiver("sink", sink.url("/hook"))],
        }
        with alertmanager(tmp_path / "am", config) as am:
            am.post_alerts(
                [
                    {
                        "labels": PAYLOAD["alerts"][0]["labels"],
                        "annotations": {"summary": "NaN"},
                        "startsAt": "2024-05-02T09:52:26.739266876+02:00",
                        "generatorURL": "http://prometheus:9090/graph",
                    }
                ]
            )
            (sent,) = wait_for(lambda: sink.bodies("/hook"), 20, "the webhook")
    (alert,) = parse_webhook(body(sent))
    assert alert.status == "firing" and alert.labels == PAYLOAD["alerts"][0]["labels"]
    assert alert.starts_at == 1714636346.739266 and alert.annotations == {"summary": "NaN"}
    assert alert.generator_url == "http://prometheus:9090/graph"
    assert len(alert.source_fingerprint) == 16  # Alertmanager's label fingerprint


# ---------------------------------------------------------------------- the route, served


class Received:
    def __init__(self) -> None:
        self.batches: list[list[IncomingAlert]] = []

    def __call__(self, alerts: list[IncomingAlert]) -> list[Refusal]:
        self.batches.append(alerts)
        return []


@pytest.fixture
def received() -> Received:
    return Received()


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch, received: Received) -> Iterator[MonitorServer]:
    """A MonitorServer on a free port with the token from the environment, as the daemon
    builds it."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    served = MonitorServer(
        CollectorRegistry(),
        lambda: (True, {}),
        lambda: {},
        "127.0.0.1",
        0,
        on_alerts=received,
        token=webhook_token(ListenConfig()),
    )
    try:
        yield served
    finally:
        served.close()


def post(
    server: MonitorServer, data: bytes = body(), headers: dict[str, str] | None = None
) -> requests.Response:
    """POST to the webhook, with the token and as JSON unless ``headers`` say otherwise (an
    empty value: no such header)."""
    sent = {
        "Content-Type": "application/json",
        "Authorization": f"Bearer {TOKEN}",
        **(headers or {}),
    }
    return requests.post(
        f"{server.url}{ALERTMANAGER_PATH}",
        data=data,
        headers={k: v for k, v in sent.items() if v},
        timeout=10,
    )


def test_the_webhook_takes_alerts_with_the_token(
    server: MonitorServer, received: Received, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="lossguard")
    reply = post(server)
    assert reply.status_code == 200, reply.text
    # firing, with an action label
    assert reply.json() == {"received": 2, "actionable": 1, "refused": []}
    assert received.batches == [parse_webhook(body())]
    utf8 = post(server, headers={"Content-Type": "application/json; charset=utf-8"})
    assert utf8.status_code == 200 and len(received.batches) == 2
    refused = post(server, headers={"Authorization": f"Bearer {TOKEN}x"})
    assert refused.status_code == 403
    assert TOKEN not in caplog.text, "the token is never logged"


@pytest.mark.parametrize(
    ("headers", "status", "says"),
    [
        ({"Authorization": ""}, 401, "Bearer"),
        ({"Authorization": "Basic dXNlcjpwdw=="}, 401, "Bearer"),
        ({"Authorization": "Bearer "}, 401, "Bearer"),
        ({"Authorization": "Bearer wrong"}, 403, "wrong token"),
        ({"Authorization": f"Bearer {TOKEN[:-1]}"}, 403, "wrong token"),
        ({"Content-Type": "text/plain"}, 415, "application/json"),
        ({"Content-Type": ""}, 415, "application/json"),
    ],
)
def test_auth_and_content_type(
    server: MonitorServer, received: Received, headers: dict[str, str], status: int, says: str
) -> None:
    reply = post(server, headers=headers)
    assert reply.status_code == status and says in reply.text, reply.text
    if status == 401:
        assert reply.headers["WWW-Authenticate"].startswith("Bearer")
    assert received.batches == []


def test_a_bad_payload_is_400_with_the_reason(server: MonitorServer, received: Received) -> None:
    reply = post(server, body(changed("version", "3")))
    assert reply.status_code == 400
    assert reply.text.strip() == (
        "bad payload: version: expected Alertmanager's webhook payload version '4', got '3'"
    )
    missing = post(server, body(changed("alerts.0.startsAt", delete=True)))
    assert missing.status_code == 400 and "alerts[0].startsAt: missing" in missing.text
    assert received.batches == []


def raw_request(server: MonitorServer, method: str, headers: dict[str, str], data: bytes = b""):
    """A request exactly as given (no Content-Length added), and its response."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.putrequest(method, ALERTMANAGER_PATH, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders(data or None)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def test_body_limits(server: MonitorServer, received: Received) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    too_large = post(server, b" " * (MAX_BODY_BYTES + 1))
    assert too_large.status_code == 413 and str(MAX_BODY_BYTES) in too_large.text
    # a claimed length beyond the limit is refused before the body is read
    status, _, text = raw_request(server, "POST", {**auth, "Content-Length": str(10**9)})
    assert status == 413 and b"payload too large" in text
    status, _, text = raw_request(server, "POST", auth, body())
    assert status == 411 and b"Content-Length" in text
    status, _, _ = raw_request(server, "POST", {**auth, "Content-Length": "-5"})
    assert status == 400
    status, _, text = raw_request(server, "POST", {**auth, "Content-Length": "many"})
    assert status == 400 and b"Content-Length" in text
    # exactly at the limit is read (and then judged as a payload)
    padded = body() + b" " * (MAX_BODY_BYTES - len(body()))
    assert post(server, padded).json() == {"received": 2, "actionable": 1, "refused": []}
    assert len(received.batches) == 1


def test_wrong_method_is_405_with_allow_and_unknown_paths_404(server: MonitorServer) -> None:
    for method in ("GET", "PUT", "DELETE"):
        reply = requests.request(method, f"{server.url}{ALERTMANAGER_PATH}", timeout=10)
        assert reply.status_code == 405, (method, reply.text)
        assert reply.headers["Allow"] == "POST"
    metrics = requests.post(f"{server.url}/metrics", data=b"{}", timeout=10)
    assert metrics.status_code == 405 and metrics.headers["Allow"] == "GET"
    assert requests.get(f"{server.url}/api/v2/alerts", timeout=10).status_code == 404
    assert requests.get(f"{server.url}/metrics", timeout=10).status_code == 200


def test_without_a_token_the_webhook_is_off_on_loopback_too(
    monkeypatch: pytest.MonkeyPatch, received: Received
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert webhook_token(ListenConfig()) is None
    served = MonitorServer(
        CollectorRegistry(), lambda: (True, {}), lambda: {}, "127.0.0.1", 0, on_alerts=received
    )
    try:
        for headers in ({"Authorization": ""}, {"Authorization": "Bearer anything"}):
            reply = post(served, headers=headers)
            assert reply.status_code == 403, reply.text
            assert f"set ${TOKEN_ENV} (listen.token_env)" in reply.text
            assert "webhook is off" in reply.text
        assert received.batches == []
    finally:
        served.close()


SHIPPED_AM_CONFIG = REPO / "alerts" / "alertmanager.yml"


def test_the_shipped_alertmanager_config_sends_action_alerts_to_the_monitor_only() -> None:
    """The monitor acts on them, then announces what it did or pages (it raises those alerts
    itself), so whatever their severity they go nowhere else."""
    checked = amtool("check-config", str(SHIPPED_AM_CONFIG))
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr
    routes = {
        "alertname=LossNonFinite action=rollback severity=info": "lossguard-monitor",
        "alertname=TrainingStalled action=stop severity=critical": "lossguard-monitor",
        "alertname=LowMFU severity=warning": "slack",
    }
    for labels, receivers in routes.items():
        tested = amtool(
            "config", "routes", "test", f"--config.file={SHIPPED_AM_CONFIG}", *labels.split()
        )
        assert tested.stdout.strip() == receivers, (labels, tested.stdout, tested.stderr)
    config = yaml.safe_load(SHIPPED_AM_CONFIG.read_text())
    (action_route,) = [r for r in config["route"]["routes"] if r["receiver"] == "lossguard-monitor"]
    assert "continue" not in action_route and action_route["group_wait"] == "0s"
    assert action_route["group_by"] == ["alertname", "run_id", "rank"]
    (receiver,) = [r for r in config["receivers"] if r["name"] == "lossguard-monitor"]
    (webhook,) = receiver["webhook_configs"]
    assert webhook["url"].endswith(ALERTMANAGER_PATH) and webhook["send_resolved"] is True
    assert "credentials_file" in webhook["http_config"]["authorization"]


@pytest.mark.parametrize("short", ["a", "REPLACE-ME", "fifteen-chars-x"])
def test_a_short_monitor_token_is_refused_at_start(short: str, tmp_path: Path) -> None:
    """The agent's minimum length holds for the monitor's token too: ``a`` or the Kubernetes
    Secret's placeholder would be guessed. The monitor does not start (exit 2, one line)."""
    with pytest.raises(ConfigError) as refused:
        webhook_token(ListenConfig(), {TOKEN_ENV: short})
    assert str(refused.value) == (
        f"${TOKEN_ENV} (listen.token_env): the token must be at least 16 characters, not "
        f"{len(short)} (make one with openssl rand -hex 32)"
    )
    assert webhook_token(ListenConfig(), {TOKEN_ENV: "x" * 16}) == "x" * 16
    secret = yaml.safe_load((REPO / "deploy/kubernetes/secret.yaml").read_text())
    assert short != "REPLACE-ME" or secret["stringData"]["monitor-token"] == short
    if short == "a":
        rules = [REPO / "alerts/lossguard.rules.yml"]
        scrape = {"runs_root": str(tmp_path)}
        config, _ = write_monitor_config(tmp_path / "monitor.yml", rules, scrape=scrape)
        started = subprocess.run(
            [sys.executable, "-m", "lossguard.monitor.cli", "run", "--config", str(config)],
            capture_output=True, text=True, timeout=60, env={**os.environ, TOKEN_ENV: short},
        )  # fmt: skip
        assert started.returncode == 2
        assert started.stderr.splitlines() == [f"lossguard-monitor: error: {refused.value}"]


def test_wrong_tokens_back_off_as_the_agents_do(server: MonitorServer, received: Received) -> None:
    """The probe: 300 wrong tokens answered in 1.3 s. Now an address's tokens are judged one
    at a time, after a back-off that doubles with each wrong one (0.25 s, 0.5 s, 1 s, ...);
    meanwhile its requests get 429 with Retry-After, unjudged, and nothing is taken. Sent
    without pause for 3.4 s (between the turns at 1.75 s and 3.75 s; a loaded machine that
    answers a turn late delays the next ones as much): exactly 4 are judged."""
    wrong = {"Authorization": "Bearer wrong-token-guess"}
    replies = [post(server, headers=wrong)]
    started = time.monotonic()
    while time.monotonic() - started < 3.4:
        replies.append(post(server, headers=wrong))
    codes = [reply.status_code for reply in replies]
    assert codes[:2] == [403, 429] and set(codes) == {403, 429}
    assert codes.count(403) == 4, Counter(codes)  # the turns at 0, 0.25, 0.75 and 1.75 s
    held = replies[1]  # right after the first wrong token: 0.25 s to wait
    assert held.text.startswith("too many requests: wrong tokens from 127.0.0.1; retry in 1 s")
    assert held.headers["Retry-After"] == "1"
    assert received.batches == []

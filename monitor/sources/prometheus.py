"""Rule expressions answered by a Prometheus server's instant-query API."""

from __future__ import annotations

import math
import time
from typing import Any

import requests

from lossguard.monitor.promql import Sample, Value, make_labels
from lossguard.monitor.sources import SourceError, TargetStatus
from lossguard.monitor.sources.discovery import instance_of, redact_url
from lossguard.monitor.sources.fetch import printable_line


def request_error(exc: requests.RequestException, timeout_s: float) -> str:
    """The reason a request failed, short: "connection refused", "timed out after 2 s"."""
    if isinstance(exc, requests.Timeout):
        return f"timed out after {timeout_s:g} s"
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror[:1].lower() + cause.strerror[1:]
        cause = cause.__cause__ or cause.__context__
    return printable_line(str(exc))


class PrometheusSource:
    """Sends each expression to ``{url}/api/v1/query``; its one target is the server itself."""

    def __init__(self, url: str, *, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._endpoint = f"{self.url}/api/v1/query"
        self._session = requests.Session()
        self._session.headers["User-Agent"] = "lossguard-monitor"
        self._status = TargetStatus(
            redact_url(self.url), "prometheus", instance_of(self.url), None, None, None, None, None
        )

    def start(self) -> None:
        """Nothing to start: queries are sent as they come."""

    def history_start(self) -> float | None:
        """Prometheus keeps its own history: all of it is there from the start."""
        return -math.inf

    def close(self) -> None:
        self._session.close()

    def targets(self) -> list[TargetStatus]:
        return [self._status]

    def query(self, expr: str, t: float) -> Value:
        """The value of ``expr`` at ``t``; SourceError names the server and its reason."""
        started = time.perf_counter()
        try:
            value = self._query(expr, t)
        except SourceError as exc:
            self._record(False, str(exc), started)
            raise
        self._record(True, None, started)
        return value

    def _query(self, expr: str, t: float) -> Value:
        where = f"POST {redact_url(self._endpoint)}"
        try:
            response = self._session.post(
                self._endpoint, data={"query": expr, "time": f"{t:.3f}"}, timeout=self.timeout_s
            )
        except requests.RequestException as exc:
            raise SourceError(f"{where}: {request_error(exc, self.timeout_s)}") from None
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise SourceError(f"{where}: HTTP {response.status_code}, not a Prometheus API reply")
        if body.get("status") != "success":
            reason = f"{body.get('errorType', 'error')}: {body.get('error', 'no reason given')}"
            raise SourceError(f"{where}: {printable_line(reason, limit=500)}")
        try:
            return _value(body["data"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SourceError(f"{where}: unexpected reply ({printable_line(str(exc))})") from None

    def _record(self, up: bool, error: str | None, started: float) -> None:
        self._status = TargetStatus(
            url=self._status.url,
            job=self._status.job,
            instance=self._status.instance,
            run_id=None,
            up=up,
            last_scrape=time.time(),
            last_error=error,
            scrape_duration_s=time.perf_counter() - started,
        )


def _value(data: dict[str, Any]) -> Value:
    """The evaluator's value for an API ``data`` object (a vector or a scalar)."""
    kind = data["resultType"]
    if kind == "scalar":
        return _number(data["result"][1])
    if kind == "vector":
        return [
            Sample(make_labels(item["metric"]), _number(item["value"][1]))
            for item in data["result"]
        ]
    raise ValueError(f"result type {kind!r} is not a rule's")


def _number(text: str) -> float:
    """A sample value as the API writes it: "1.5", "NaN", "+Inf", "-Inf"."""
    if not isinstance(text, str):
        raise ValueError(f"sample value {text!r} is not a string")
    return float(text)

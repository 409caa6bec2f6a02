"""The agent's /metrics server: serves its registry, stops, and names a bad host or port."""

from __future__ import annotations

import socket

import pytest
import requests
from prometheus_client import CollectorRegistry, Gauge

from lossguard.agent.telemetry.exporter import Exporter
from lossguard.common.config import ConfigError


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Gauge("lossguard_up_test", "A test gauge.", registry=registry).set(3)
    return registry


def test_serves_its_registry_and_frees_the_port_on_stop() -> None:
    host = "127.0.0.1"
    exporter = Exporter.start(_registry(), host, 0)
    url = exporter.url(host)
    assert "lossguard_up_test 3.0" in requests.get(url, timeout=10).text
    exporter.stop()
    with pytest.raises(requests.ConnectionError):
        requests.get(url, timeout=10)
    with socket.socket() as probe:  # nothing listens there (the scrape's TIME_WAIT may)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, exporter.port))


def test_a_taken_port_and_an_unknown_host_are_one_line_naming_the_setting() -> None:
    taken = Exporter.start(_registry(), "127.0.0.1", 0)
    try:
        with pytest.raises(ConfigError, match=r"^telemetry\.port: cannot serve metrics on "):
            Exporter.start(_registry(), "127.0.0.1", taken.port)
    finally:
        taken.stop()
    with pytest.raises(
        ConfigError, match=r"^telemetry\.host: cannot resolve 'no-such-host\.invalid'"
    ):
        Exporter.start(_registry(), "no-such-host.invalid", 0)

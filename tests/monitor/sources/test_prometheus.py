"""Rule expressions answered by a real Prometheus 2.42 scraping a real exporter."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import pytest

from lossguard.monitor.promql import Sample
from lossguard.monitor.sources import SourceError
from lossguard.monitor.sources.prometheus import PrometheusSource
from tests.support.processes import wait_for
from tests.support.promserver import (
    ExpositionServer,
    PromServer,
    exposition_server,
    free_port,
    prometheus,
)

pytestmark = pytest.mark.live

EXPOSITION = """\
# TYPE lossguard_step gauge
lossguard_step{run_id="r1",rank="0"} 7
lossguard_train_loss{run_id="r1",rank="0"} NaN
lossguard_grad_norm{run_id="r1",rank="0"} +Inf
"""


@pytest.fixture(scope="module")
def exporter() -> Iterator[ExpositionServer]:
    with exposition_server(EXPOSITION) as server:
        yield server


@pytest.fixture(scope="module")
def server(
    exporter: ExpositionServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PromServer]:
    with prometheus(tmp_path_factory.mktemp("prometheus"), [exporter.url]) as running:
        running.wait_until_up()
        yield running


@pytest.fixture
def source(server: PromServer) -> Iterator[PrometheusSource]:
    source = PrometheusSource(server.url, timeout_s=5)
    source.start()
    yield source
    source.close()


def vector(source: PrometheusSource, expr: str) -> list[Sample]:
    value = source.query(expr, time.time())
    assert isinstance(value, list)
    return value


def test_a_vector_comes_back_with_its_labels(
    source: PrometheusSource, server: PromServer, exporter: ExpositionServer
) -> None:
    (sample,) = wait_for(lambda: vector(source, "lossguard_step"), 10, "the first scrape")
    assert dict(sample.labels) == {
        "__name__": "lossguard_step",
        "job": "lossguard-agent",
        "instance": exporter.instance,
        "run_id": "r1",
        "rank": "0",
    }
    assert sample.value == 7.0
    (doubled,) = vector(source, "lossguard_step * 2")
    assert "__name__" not in dict(doubled.labels) and doubled.value == 14.0
    (loss,) = vector(source, "lossguard_train_loss")
    assert math.isnan(loss.value)
    (norm,) = vector(source, "-lossguard_grad_norm")
    assert norm.value == -math.inf
    assert vector(source, "lossguard_step > 100") == []
    (status,) = source.targets()
    assert status.up is True and status.last_error is None
    assert (status.url, status.instance) == (server.url, f"127.0.0.1:{server.port}")


def test_a_scalar_comes_back_as_a_float(source: PrometheusSource) -> None:
    assert source.query("1 + 1", 1_700_000_000) == 2.0
    wait_for(lambda: vector(source, "lossguard_step"), 10, "the first scrape")
    assert source.query("scalar(lossguard_step) / 2", time.time()) == 3.5


def test_a_bad_expression_reports_prometheus_error(source: PrometheusSource) -> None:
    with pytest.raises(SourceError) as raised:
        source.query("sum(lossguard_step", time.time())
    message = str(raised.value)
    assert message.startswith(f"POST {source.url}/api/v1/query: bad_data: ")
    assert "parse error" in message and "\n" not in message
    (status,) = source.targets()
    assert status.up is False and status.last_error == message


def test_a_server_that_is_down_is_a_source_error() -> None:
    port = free_port()
    source = PrometheusSource(f"http://monitor:s3cret@127.0.0.1:{port}/", timeout_s=2)
    with pytest.raises(SourceError) as raised:
        source.query("up", time.time())
    assert str(raised.value) == (
        f"POST http://monitor:***@127.0.0.1:{port}/api/v1/query: connection refused"
    )
    (status,) = source.targets()
    assert status.up is False and "s3cret" not in status.url + str(status.last_error)


def test_a_reply_that_is_not_the_api_is_a_source_error(exporter: ExpositionServer) -> None:
    source = PrometheusSource(f"http://{exporter.instance}", timeout_s=2)
    with pytest.raises(SourceError, match=r"HTTP 501, not a Prometheus API reply"):
        source.query("up", time.time())

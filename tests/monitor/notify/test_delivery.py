"""The delivery workers against fake Slack and PagerDuty servers: retries with backoff and
Retry-After, dead letters, each service's pace, order within a lane, and a restart."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lossguard.monitor.alert_store import AlertStore
from lossguard.monitor.notify.delivery import Backoff, Deliverer
from lossguard.monitor.notify.integrations import Integration
from lossguard.monitor.notify.integrations.pagerduty import PagerDutyIntegration
from lossguard.monitor.notify.integrations.slack import SlackIntegration
from lossguard.monitor.notify.links import Links
from lossguard.monitor.notify.model import AlertInfo, Notification, Status
from lossguard.monitor.notify.store import DEAD, DELIVERED, PENDING, NotifyStore
from tests.support.fake_receivers import FakePagerDuty, FakeSlack
from tests.support.processes import wait_for

TIMEOUT_S = 0.5
SLACK, PAGER = "ops/slack[0]", "pager/pagerduty[0]"


@pytest.fixture
def slack() -> Iterator[FakeSlack]:
    with FakeSlack() as server:
        yield server


@pytest.fixture
def pager() -> Iterator[FakePagerDuty]:
    with FakePagerDuty() as server:
        yield server


@pytest.fixture
def store(tmp_path: Path) -> Iterator[NotifyStore]:
    state = AlertStore(tmp_path / "state.db")
    yield NotifyStore(state)
    state.close()


def integrations(slack: FakeSlack, pager: FakePagerDuty) -> dict[str, Integration]:
    links = Links("", "", "")
    return {
        SLACK: SlackIntegration(slack.webhook_url, True, links),
        PAGER: PagerDutyIntegration(pager.enqueue_url, pager.routing_key, True, links),
    }


def queue(store: NotifyStore, lane: str, status: Status = "firing", alert: str = "A") -> int:
    receiver, rest = lane.split("/")
    info = AlertInfo(
        fingerprint=f"{abs(hash(alert)):016x}"[:16],
        status=status,
        labels={"alertname": alert, "severity": "critical", "run_id": "r"},
        annotations={"summary": f"{alert} happened"},
        value=1.0,
        starts_at=time.time(),
        ends_at=time.time() if status == "resolved" else None,
    )
    notification = Notification(
        receiver=receiver,
        integration=rest.split("[")[0],
        index=0,
        group_key=f'{{}}:{{alertname="{alert}"}}',
        group_labels={"alertname": alert},
        alerts=(info,),
        created_at=time.time(),
    )
    with store.state.transaction() as db:
        return NotifyStore.queue(db, notification)


def queue_group(store: NotifyStore, lane: str, statuses: list[Status]) -> int:
    """One notification of a group of alerts (a node's ranks, one per status)."""
    receiver, rest = lane.split("/")
    alerts = tuple(
        AlertInfo(
            fingerprint=f"{rank:016x}",
            status=status,
            labels={"alertname": "Down", "severity": "critical", "run_id": "r", "rank": str(rank)},
            annotations={"summary": f"rank {rank} down"},
            value=0.0,
            starts_at=time.time(),
            ends_at=time.time() if status == "resolved" else None,
        )
        for rank, status in enumerate(statuses)
    )
    notification = Notification(
        receiver=receiver,
        integration=rest.split("[")[0],
        index=0,
        group_key='{}:{alertname="Down", run_id="r"}',
        group_labels={"alertname": "Down", "run_id": "r"},
        alerts=alerts,
        created_at=time.time(),
    )
    with store.state.transaction() as db:
        return NotifyStore.queue(db, notification)


def deliver_until(
    store: NotifyStore, lanes: dict[str, Integration], done: Callable[[], bool], what: str
) -> list[tuple[str, str]]:
    """Run a deliverer until ``done``; the (lane, result) of every attempt."""
    results: list[tuple[str, str]] = []
    deliverer = Deliverer(
        store,
        lanes,
        timeout_s=TIMEOUT_S,
        backoff=Backoff(0.05, 0.2, random.Random(1)),
        observe=lambda n, result: results.append((n.lane, result)),
    )
    deliverer.start()
    try:
        wait_for(done, 15, what)
    finally:
        deliverer.stop()
    return results


def states(store: NotifyStore) -> dict[int, str]:
    return {e.id: e.state for state in (PENDING, DELIVERED, DEAD) for e in store.entries(state)}


def test_transient_failures_are_retried_until_delivered_once(
    store: NotifyStore, slack: FakeSlack, pager: FakePagerDuty
) -> None:
    slack.script([500, "drop", (429, 1)])
    first = queue(store, SLACK)
    results = deliver_until(
        store, integrations(slack, pager), lambda: states(store)[first] == DELIVERED, "delivered"
    )
    assert slack.accepted_ids() == [first]
    exchanges = slack.exchanges
    assert [x.status for x in exchanges] == [500, None, 429, 200]
    limited_at = exchanges[2].replied_at
    assert limited_at is not None and exchanges[3].arrived_at - limited_at >= 0.95  # Retry-After
    (entry,) = store.entries(DELIVERED)
    assert entry.attempts == 4 and entry.last_error is None
    assert results.count((SLACK, "retry")) == 3


def test_permanent_failures_become_dead_letters_and_the_lane_goes_on(
    store: NotifyStore, slack: FakeSlack, pager: FakePagerDuty
) -> None:
    slack.script([404, 410])
    ids = [queue(store, SLACK, alert=name) for name in ("A", "B", "C")]
    deliver_until(
        store,
        integrations(slack, pager),
        lambda: PENDING not in states(store).values(),
        "all settled",
    )
    assert states(store) == {ids[0]: DEAD, ids[1]: DEAD, ids[2]: DELIVERED}
    errors = {e.id: str(e.last_error) for e in store.entries(DEAD)}
    assert "HTTP 404" in errors[ids[0]] and "HTTP 410 channel_is_archived" in errors[ids[1]]
    for error in errors.values():
        assert slack.token not in error and str(slack.port) not in error
    assert slack.accepted_ids() == [ids[2]]


def test_slow_replies_are_retried_and_pagerduty_folds_the_repeat_into_one_incident(
    store: NotifyStore, slack: FakeSlack, pager: FakePagerDuty
) -> None:
    pager.script([("slow", TIMEOUT_S + 0.5)])
    first = queue(store, PAGER)
    deliver_until(
        store, integrations(slack, pager), lambda: states(store)[first] == DELIVERED, "delivered"
    )
    (entry,) = store.entries(DELIVERED)
    assert entry.attempts == 2
    (incident,) = pager.incidents
    assert incident.open and incident.triggers >= 2


def test_each_lane_keeps_its_services_pace_and_its_order(
    store: NotifyStore, slack: FakeSlack, pager: FakePagerDuty
) -> None:
    pager.script([500, 500])
    for name in ("A", "B", "C"):
        queue(store, SLACK, alert=name)
    queue(store, PAGER, "firing", "A")
    queue(store, PAGER, "resolved", "A")
    queue(store, PAGER, "firing", "B")
    deliver_until(
        store,
        integrations(slack, pager),
        lambda: PENDING not in states(store).values(),
        "all delivered",
    )
    slack_times = [x.arrived_at for x in slack.exchanges]
    assert len(slack_times) == 3
    assert min(b - a for a, b in itertools.pairwise(slack_times)) >= 0.95
    pd_times = [x.arrived_at for x in pager.exchanges]
    assert min(b - a for a, b in itertools.pairwise(pd_times)) >= 0.45
    # the firing event was retried twice, and the resolve still came after it
    actions = [(e.body["event_action"], e.body["dedup_key"]) for e in pager.events]
    assert [a for a, _ in actions] == ["trigger", "resolve", "trigger"]
    incidents = {i.dedup_key: i for i in pager.incidents}
    assert len(incidents) == 2 and not incidents[actions[0][1]].open


def test_a_group_is_one_pagerduty_incident_resolved_with_its_last_alert(
    store: NotifyStore, slack: FakeSlack, pager: FakePagerDuty
) -> None:
    pager.script([502])  # the first trigger is retried
    firing: list[Status] = ["firing"] * 4
    resolved: list[Status] = ["resolved"] * 4
    queue_group(store, PAGER, firing + firing)
    queue_group(store, PAGER, firing + resolved)  # the group still fires
    queue_group(store, PAGER, resolved)
    deliver_until(
        store,
        integrations(slack, pager),
        lambda: PENDING not in states(store).values(),
        "all delivered",
    )
    assert [e.body["event_action"] for e in pager.events] == ["trigger", "trigger", "resolve"]
    (incident,) = pager.incidents
    assert incident.triggers == 2 and not incident.open
    assert incident.summary.startswith("[critical] 8 alerts firing: Down run=r rank=0: rank 0")
    assert incident.log[1].startswith("[critical] 4 alerts firing: ")


def test_a_new_deliverer_finishes_what_a_stopped_one_left(
    store: NotifyStore, slack: FakeSlack, pager: FakePagerDuty
) -> None:
    slack.script([(429, 60)])  # the first worker is told to wait a minute
    first = queue(store, SLACK)
    deliver_until(store, integrations(slack, pager), lambda: len(slack.exchanges) == 1, "a try")
    assert states(store)[first] == PENDING
    with store.state.transaction() as db:  # as if a minute had passed
        db.execute("UPDATE outbox SET next_attempt = 0")
    deliver_until(
        store,
        integrations(slack, pager),
        lambda: states(store)[first] == DELIVERED,
        "delivered after restart",
    )
    assert slack.accepted_ids() == [first]


def test_notifications_for_a_receiver_no_longer_configured_are_dead_letters(
    store: NotifyStore, slack: FakeSlack, pager: FakePagerDuty
) -> None:
    gone = queue(store, "old/slack[0]")
    deliver_until(store, integrations(slack, pager), lambda: True, "a start")
    (entry,) = store.entries(DEAD)
    assert entry.id == gone and entry.last_error == "receiver old/slack[0] is no longer configured"


def test_backoff_doubles_with_jitter_up_to_its_ceiling() -> None:
    backoff = Backoff(1.0, 8.0, random.Random(0))
    for attempt, ceiling in [(1, 1), (2, 2), (3, 4), (4, 8), (5, 8), (100, 8)]:
        delays = [backoff.delay(attempt) for _ in range(50)]
        assert all(ceiling / 2 <= d < ceiling for d in delays)
        assert max(delays) - min(delays) > ceiling / 10  # jittered


def test_a_receiver_that_echoes_its_secret_does_not_get_it_into_the_outbox(
    store: NotifyStore, slack: FakeSlack, pager: FakePagerDuty
) -> None:
    slack.script([(404, f"no_service: {slack.webhook_url}")])
    pager.script([(400, f'{{"errors": ["unknown routing_key {pager.routing_key}"]}}')])
    ids = [queue(store, SLACK), queue(store, PAGER)]
    lanes = integrations(slack, pager)
    deliver_until(store, lanes, lambda: len(store.entries(DEAD)) == 2, "both dead")
    errors = {e.id: str(e.last_error) for e in store.entries(DEAD)}
    assert errors[ids[0]] == "HTTP 404 no_service: <secret>"
    assert errors[ids[1]] == 'HTTP 400 {"errors": ["unknown routing_key <secret>"]}'


def test_two_receivers_on_one_webhook_share_its_pace(
    store: NotifyStore, slack: FakeSlack, pager: FakePagerDuty
) -> None:
    links = Links("", "", "")
    lanes: dict[str, Integration] = {
        lane: SlackIntegration(slack.webhook_url, True, links)
        for lane in ("ops/slack[0]", "ml/slack[0]")
    }
    for lane in lanes:
        for name in ("A", "B"):
            queue(store, lane, alert=name)
    deliver_until(store, lanes, lambda: PENDING not in states(store).values(), "delivered")
    times = sorted(x.arrived_at for x in slack.exchanges)
    assert len(times) == 4
    assert min(b - a for a, b in itertools.pairwise(times)) >= 0.95

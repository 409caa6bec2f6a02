"""Runs found where the monitor already looks: every agent exports ``lossguard_agent_info``
(its host, node, rank 0's TCP control address, its supervisor's, the protocol version), so a
monitor that reads only its source (its own scrapes, or a Prometheus server) learns each run's
endpoints within one scrape and forgets them ``discovery.forget`` after the series is gone.

An announcement is believed only when it can be acted on safely: a known protocol version,
addresses that are HOST:PORT, rank 0's control on the host rank 0 was scraped from (its
``instance``), the supervisor's on a host one of the run's ranks was scraped from (node 0's
supervisor serves a run whose rank 0 may be on another node), and one rank 0 per run.
Anything else is refused: one log line per run and problem, and
``lossguard_monitor_discovery_refusals_total{reason}``; it is never acted on."""

from __future__ import annotations

import functools
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from lossguard.common.catalogue import exposed_name
from lossguard.common.control.address import split_address
from lossguard.common.control.protocol import PROTOCOL_VERSION
from lossguard.monitor.promql import Sample, Value
from lossguard.monitor.promql.model import label_value
from lossguard.monitor.sources import SourceError

log = logging.getLogger(__name__)

AGENT_INFO = exposed_name("agent_info")
QUERY = f'{AGENT_INFO}{{rank="0"}}'
HOSTS_QUERY = f"count by (run_id, instance) ({AGENT_INFO})"
"""Where every rank of each run was scraped: the hosts a run's supervisor may be on."""
REFUSAL_REASONS = ("protocol", "address", "host", "conflict")
"""Why an announcement is not believed: an unknown protocol version, an address that is not
HOST:PORT, an address on another host than the scraped one, two rank 0s of one run."""

Refused = Callable[[str], None]
"""Counts one refusal by reason."""


@dataclass(frozen=True)
class AnnouncedRun:
    """How to reach one run, as its rank 0 announced it, and when it was last seen."""

    run_id: str
    host: str  # the host its series was scraped from
    control: tuple[str, int] | None  # rank 0's TCP control; None: none announced
    supervisor: tuple[str, int] | None  # its supervisor's TCP control
    last_seen: float


class AnnouncedRuns:
    """The runs that announce themselves on the source, kept ``forget_after_s`` after their
    last announcement. Updated by the evaluation loop, read by the actions thread."""

    def __init__(self, forget_after_s: float, refused: Refused) -> None:
        self.forget_after_s = forget_after_s
        self._refused = refused
        self._runs: dict[str, AnnouncedRun] = {}
        self._lock = threading.Lock()

    def update(self, query: Callable[[str, float], Value], t: float) -> None:
        """Read the announcements at ``t``; a source that cannot answer changes nothing."""
        try:
            rank0 = _samples(query(QUERY, t))
            ranks = _samples(query(HOSTS_QUERY, t))
        except SourceError:
            return
        by_run: dict[str, list[Sample]] = {}
        for sample in rank0:
            run_id = label_value(sample.labels, "run_id")
            if run_id:
                by_run.setdefault(run_id, []).append(sample)
        hosts: dict[str, set[str]] = {}
        for sample in ranks:
            instance = _host_of(label_value(sample.labels, "instance"))
            hosts.setdefault(label_value(sample.labels, "run_id"), set()).add(instance)
        found: dict[str, AnnouncedRun] = {}
        for run_id, announced in by_run.items():
            run = self._believe(run_id, announced, hosts.get(run_id, set()), t)
            if run is not None:
                found[run_id] = run
        with self._lock:
            kept = {
                run_id: run
                for run_id, run in self._runs.items()
                if t - run.last_seen <= self.forget_after_s and run_id not in by_run
            }
            self._runs = kept | found

    def get(self, run_id: str) -> AnnouncedRun | None:
        with self._lock:
            return self._runs.get(run_id)

    def run_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._runs)

    def _believe(
        self, run_id: str, samples: list[Sample], run_hosts: set[str], t: float
    ) -> AnnouncedRun | None:
        hosts = sorted({_host_of(label_value(s.labels, "instance")) for s in samples})
        if len(hosts) > 1:
            return self._refuse(run_id, "conflict", f"rank 0 announced from {', '.join(hosts)}")
        labels = samples[0].labels
        protocol = label_value(labels, "protocol")
        if protocol != str(PROTOCOL_VERSION):
            return self._refuse(run_id, "protocol", f"control protocol {protocol!r} is not known")
        host = hosts[0]
        addresses: list[tuple[str, int] | None] = []
        for role, allowed in (("control", {host}), ("supervisor", run_hosts | {host})):
            text = label_value(labels, role)
            if not text:
                addresses.append(None)
                continue
            try:
                address = split_address(text)
            except ValueError as exc:
                return self._refuse(run_id, "address", f"{role}: {exc}")
            if not any(same_host(address[0], h) for h in sorted(allowed)):
                where = ", ".join(sorted(allowed))
                return self._refuse(
                    run_id,
                    "host",
                    f"{role} {text!r} is not on a host the run was scraped at ({where})",
                )
            addresses.append(address)
        return AnnouncedRun(run_id, host, addresses[0], addresses[1], t)

    def _refuse(self, run_id: str, reason: str, why: str) -> AnnouncedRun | None:
        """Count and log (once) an announcement not believed: it gives no run (None)."""
        self._refused(reason)
        _warn(run_id, reason, why)
        return None


def _samples(value: Value) -> list[Sample]:
    return value if isinstance(value, list) else []


def _host_of(instance: str) -> str:
    """The host of an ``instance`` label (``host:port``, ``[v6]:port``, or a bare host)."""
    try:
        return split_address(instance)[0].lower()
    except ValueError:
        return instance.lower()


def same_host(address_host: str, scraped_host: str) -> bool:
    """Whether an announced address names the host its series came from: the same name, or
    names that resolve to a common address."""
    a, b = address_host.lower(), scraped_host.lower()
    return a == b or bool(_addresses(a) & _addresses(b))


@functools.lru_cache(maxsize=1024)
def _addresses(host: str) -> frozenset[str]:
    """The addresses ``host`` resolves to here (empty: it does not)."""
    try:
        return frozenset(str(info[4][0]) for info in socket.getaddrinfo(host, None))
    except (OSError, UnicodeError):
        return frozenset()


@functools.lru_cache(maxsize=1024)
def _warn(run_id: str, reason: str, why: str) -> None:
    """One line per run and problem: announcements are read every cycle."""
    log.warning("run %s: its announcement (%s) is not believed: %s", run_id, AGENT_INFO, why)

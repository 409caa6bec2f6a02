"""The monitor's own scrapes of agents' ``/metrics``, with the semantics of Prometheus's scrape
loop: target labels ``job`` and ``instance`` (clashing exposed labels become ``exported_*``),
the synthetic ``up``, ``scrape_duration_seconds`` and ``scrape_samples_scraped``, and staleness
markers for series that disappear, for every series of a failed scrape and for targets that go.

A discovered target is one rank of one run: it also has the target labels ``run_id`` and
``rank``, and an exposition whose series name another run or rank is not its data (the scrape
fails), so a new run on a reused port never stands in for a dead one. A run whose process is
known dead is not scraped: it has the series ``lossguard_run_exited_timestamp_seconds`` instead
(:mod:`lossguard.monitor.sources.liveness`). A live supervisor's exporter is a target too, with
``job="lossguard-supervisor"`` and ``run_id``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from lossguard.monitor.promql import (
    METRIC_NAME,
    STALE_NAN,
    Labels,
    MemoryStorage,
    Value,
    evaluate,
    make_labels,
    parse,
)
from lossguard.monitor.promql.storage import Series
from lossguard.monitor.sources import TargetStatus
from lossguard.monitor.sources.discovery import (
    SUPERVISOR_JOB,
    discover,
    instance_of,
    redact_url,
)
from lossguard.monitor.sources.exposition import ExpositionParser
from lossguard.monitor.sources.fetch import Connection, ScrapeError, ScrapeLoop
from lossguard.monitor.sources.file_sd import read_file_sd
from lossguard.monitor.sources.liveness import (
    DEFAULT_FORGET_AFTER_S,
    RUN_EXITED,
    DeadRun,
    Incarnation,
)

log = logging.getLogger(__name__)

REPORT_NAMES = ("up", "scrape_duration_seconds", "scrape_samples_scraped")
MAX_TIMEOUT_S = 10.0

TargetKey = tuple[str, str, str] | str
"""A discovered target's job, run and rank (empty for a supervisor), or a static target's URL."""

_parse_cached = functools.lru_cache(maxsize=1024)(parse)


class _Target:
    """One scrape target: its connection, what it exposed last, how its last scrape went."""

    def __init__(
        self,
        url: str,
        *,
        job: str,
        owner: Mapping[str, str],
        timeout_s: float,
        keep_names: frozenset[str] | None,
        storage: MemoryStorage,
    ) -> None:
        self.url = url
        self.owner = owner  # run_id and rank from discovery; empty for a static target
        self.storage = storage
        instance = instance_of(url)
        labels = {"job": job, "instance": instance}
        self.report = [
            storage.series(make_labels({**labels, **owner, METRIC_NAME: name}))
            for name in REPORT_NAMES
        ]
        self.parser = ExpositionParser(storage, labels, keep_names, owner)
        self.exposed: set[Series] = set()
        self.connection = Connection(url, timeout_s)
        status = TargetStatus(redact_url(url), job, instance, None, None, None, None, None)
        self.status = replace(status, run_id=owner.get("run_id"), rank=owner.get("rank"))

    async def scrape(self, t: float) -> None:
        """Scrape once and store the samples at ``t``, all at once; a failure stores ``up`` 0
        and ends every series the target exposed."""
        started = time.perf_counter()
        error: str | None = None
        try:
            body = await self.connection.get()
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError:
                raise ScrapeError("parse error: the body is not UTF-8") from None
            total, samples = self.parser.parse(text)
        except ScrapeError as exc:
            error = f"GET {self.status.url}: {exc}"
            total, samples = 0, {}
        duration = time.perf_counter() - started
        report = (0.0 if error else 1.0, duration, float(total))
        ended = [(series, STALE_NAN) for series in self.exposed.difference(samples)]
        reported = zip(self.report, report, strict=True)
        self.storage.append(itertools.chain(samples.items(), ended, reported), t)
        self.exposed = set(samples)
        self.status = TargetStatus(
            url=self.status.url,
            job=self.status.job,
            instance=self.status.instance,
            run_id=self.owner.get("run_id", self.parser.run_id),
            up=error is None,
            last_scrape=t,
            last_error=error,
            scrape_duration_s=duration,
            rank=self.owner.get("rank", self.parser.rank),
        )

    def forget(self, t: float) -> None:
        """The target is gone: end all its series, ``up`` included."""
        if self.status.up is not None:
            ended = [*self.exposed, *self.report]
            self.storage.append([(series, STALE_NAN) for series in ended], t)
        self.connection.close()


class _Written:
    """Series the scraper writes itself each cycle: one no longer written gets a staleness
    marker, as a series that leaves a target's exposition."""

    def __init__(self) -> None:
        self.keys: set[Labels] = set()

    def write(self, storage: MemoryStorage, samples: dict[Labels, float], t: float) -> None:
        ended = [(key, STALE_NAN) for key in self.keys.difference(samples)]
        storage.add_many(itertools.chain(samples.items(), ended), t)
        self.keys = set(samples)


class ScrapeSource:
    """Scrapes static and discovered agents every ``interval_s`` into memory and answers rule
    expressions over what it keeps (``retention_s`` of history). A cycle scrapes its targets
    concurrently on one event loop, at most ``max_concurrent`` at once, each within
    ``timeout_s``; only the series named ``keep_names`` are stored. Runs whose process died on
    this host are not scraped: they get a :data:`RUN_EXITED` series until
    ``forget_dead_after_s`` after their last sign of life."""

    def __init__(
        self,
        *,
        static_targets: list[str],
        runs_root: Path | None,
        file_sd_files: list[str] | None = None,
        interval_s: float = 1.0,
        timeout_s: float | None = None,
        job: str = "lossguard-agent",
        retention_s: float,
        keep_names: frozenset[str] | None = None,
        forget_dead_after_s: float = DEFAULT_FORGET_AFTER_S,
        max_concurrent: int = 256,
        clock: Callable[[], float] = time.time,
    ) -> None:
        for name, seconds in [
            ("interval_s", interval_s),
            ("retention_s", retention_s),
            ("forget_dead_after_s", forget_dead_after_s),
        ]:
            if not seconds > 0:
                raise ValueError(f"{name} must be a positive number of seconds, not {seconds}")
        for url in static_targets:
            instance_of(url)  # a bad URL fails here, not at the first scrape
        self.static_targets = list(dict.fromkeys(static_targets))
        self.file_sd_files = list(file_sd_files or [])
        self.runs_root = runs_root
        self.interval_s = interval_s
        self.timeout_s = min(interval_s, MAX_TIMEOUT_S) if timeout_s is None else timeout_s
        self.job = job
        self.retention_s = retention_s
        self.forget_dead_after_s = forget_dead_after_s
        self._keep_names = keep_names
        self.storage = MemoryStorage()
        self._clock = clock
        self._targets: dict[TargetKey, _Target] = {}
        self._dead: tuple[list[DeadRun], list[TargetStatus]] = ([], [])
        self._rank0: dict[TargetKey, Incarnation] = {}  # the process each rank 0 target is
        self._answered: dict[Incarnation, float] = {}  # its last successful scrape
        self._exits = _Written()
        self._loop = ScrapeLoop(max_concurrent)
        self._cycle = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._history_start: float | None = None

    def history_start(self) -> float | None:
        """When the first scrape cycle was stored (None before it): what is older is unknown."""
        return self._history_start

    def start(self) -> None:
        """Scrape in a background thread, on multiples of the interval."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lossguard-scraper", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop scraping (an ongoing cycle finishes first) and release the connections."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._loop.close([target.connection for target in self._targets.values()])

    @property
    def keep_names(self) -> frozenset[str] | None:
        """The metric names stored (None: all); settable, say after a rules reload: series no
        longer kept end at the next scrape."""
        return self._keep_names

    @keep_names.setter
    def keep_names(self, names: frozenset[str] | None) -> None:
        with self._cycle:
            self._keep_names = names
            for target in self._targets.values():
                target.parser.keep(names)

    def query(self, expr: str, t: float) -> Value:
        """Evaluate ``expr`` at ``t``; raises PromQLError for a bad expression."""
        return evaluate(_parse_cached(expr), self.storage, t)

    def targets(self) -> list[TargetStatus]:
        """The scraped targets as last seen, then the ranks of dead runs (not scraped)."""
        return [target.status for target in self._targets.values()] + self._dead[1]

    def dead_runs(self) -> list[DeadRun]:
        """The runs known dead at the last cycle (their :data:`RUN_EXITED` series)."""
        return self._dead[0]

    def scrape_once(self, t: float | None = None) -> None:
        """One whole cycle now: discover, scrape every target concurrently, store the samples at
        ``t`` (default: the clock), forget history older than the retention."""
        with self._cycle:
            t = round((self._clock() if t is None else t) * 1000) / 1000
            targets = self._sync(t)
            self._loop.run([functools.partial(target.scrape, t) for target in targets])
            self._note_answers(t)
            self.storage.truncate(self._cut(t))
            if self._history_start is None:
                self._history_start = t

    def _sync(self, t: float) -> list[_Target]:
        """The targets to scrape now: one per rank of each discovered live run (the newest
        run's, where two name the same run and rank) and one per live supervisor, then the
        static URLs no run names. Those no longer wanted, or whose URL changed, are forgotten;
        the dead runs' series are written."""
        wanted: dict[TargetKey, tuple[str, str, dict[str, str]]] = {}
        dead: list[DeadRun] = []
        if self.runs_root is not None:
            found = discover(
                self.runs_root,
                now=t,
                forget_after_s=self.forget_dead_after_s,
                answered_at=self._answered.get,
            )
            self._rank0 = {}
            for agent in found.agents:
                owner = {"run_id": agent.run_id, "rank": str(agent.rank)}
                rank_key = (self.job, agent.run_id, str(agent.rank))
                wanted.setdefault(rank_key, (agent.url, self.job, owner))
                if agent.rank == 0:
                    self._rank0.setdefault(rank_key, (agent.run_id, agent.host, agent.pid))
            for supervisor in found.supervisors:
                owner = {"run_id": supervisor.run_id}
                wanted[(SUPERVISOR_JOB, supervisor.run_id, "")] = (
                    supervisor.url,
                    SUPERVISOR_JOB,
                    owner,
                )
            dead = found.dead
        discovered = {url for url, _, _ in wanted.values()}
        listed = self.static_targets + read_file_sd(self.file_sd_files)
        static = (url for url in dict.fromkeys(listed) if url not in discovered)
        wanted.update((url, (url, self.job, {})) for url in static)
        current = self._targets
        targets: dict[TargetKey, _Target] = {}
        for key, (url, job, owner) in wanted.items():
            target = current.get(key)
            if target is None or target.url != url:
                target = _Target(
                    url,
                    job=job,
                    owner=owner,
                    timeout_s=self.timeout_s,
                    keep_names=self.keep_names,
                    storage=self.storage,
                )
            targets[key] = target
        self._targets = targets
        for key, old in current.items():
            if targets.get(key) is not old:
                old.forget(t)
        self._write_dead(dead, t)
        return list(targets.values())

    def _note_answers(self, t: float) -> None:
        """Remember when each run's rank 0 process last answered (the monitor's clock: how a
        run on another host is judged alive); forget what is older than a dead run is kept."""
        for key, incarnation in self._rank0.items():
            target = self._targets.get(key)
            if target is not None and target.status.up:
                self._answered[incarnation] = t
        horizon = t - self.forget_dead_after_s
        self._answered = {k: at for k, at in self._answered.items() if at >= horizon}

    def _write_dead(self, dead: list[DeadRun], t: float) -> None:
        """Each dead run's :data:`RUN_EXITED` sample (its last sign of life) and its ranks'
        statuses; the series of a run no longer dead end."""
        samples = {
            make_labels({METRIC_NAME: RUN_EXITED, "job": self.job, **run.labels()}): run.last_seen
            for run in dead
        }
        self._exits.write(self.storage, samples, t)
        statuses = [
            TargetStatus(
                url=redact_url(url),
                job=self.job,
                instance=instance_of(url),
                run_id=run.run_id,
                up=False,
                last_scrape=None,
                last_error=run.describe(),
                scrape_duration_s=None,
                rank=str(rank),
            )
            for run in dead
            for rank, url in enumerate(run.metrics_urls)
        ]
        self._dead = (dead, statuses)

    def _cut(self, t: float) -> float:
        """Where history may be cut: ``retention_s`` back, rounded down to a tenth of the
        retention, so that a whole pass over the series happens once per tenth, not per cycle."""
        step = max(self.interval_s, self.retention_s / 10)
        return math.floor((t - self.retention_s) / step) * step

    def _run(self) -> None:
        tick = math.floor(self._clock() / self.interval_s) + 1
        while not self._stop.wait(max(0.0, tick * self.interval_s - self._clock())):
            try:
                self.scrape_once(tick * self.interval_s)
            except Exception:  # the loop must outlive any one cycle
                log.exception("scrape cycle failed")
            tick = max(tick + 1, math.floor(self._clock() / self.interval_s) + 1)

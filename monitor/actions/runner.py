"""Sending recorded actions to the agents, one at a time, on a thread of its own.

An action is sent with its recorded request id until the agent answers: a timeout, a refused
connection or an agent that is down means trying again (the agent applies a repeated id once
and answers from the first result, across its own restarts too), until ``retry_for`` has passed
since the action was recorded. The agent's answer is recorded the moment it is read."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from lossguard.common.control.client import ControlError, ControlTimeout, ControlUnavailable
from lossguard.common.control.protocol import ErrorCode
from lossguard.monitor.actions.describe import describe
from lossguard.monitor.actions.endpoints import Endpoints, NoEndpoint, NoSupervisor
from lossguard.monitor.actions.model import ActionRecord, ActionState
from lossguard.monitor.actions.planner import Observe
from lossguard.monitor.actions.policy import COMMAND_OF, SUPERVISOR_ACTIONS
from lossguard.monitor.actions.store import ActionStore

log = logging.getLogger("lossguard.monitor.actions")
Done = Callable[[ActionRecord], None]
MAX_BACKOFF_S = 10.0


class ActionRunner:
    """Delivers the open actions of ``store``; ``on_done`` hears of each answered one."""

    def __init__(
        self,
        store: ActionStore,
        endpoints: Endpoints,
        *,
        retry_for_s: float,
        observe: Observe,
        on_done: Done,
    ) -> None:
        self.store = store
        self.endpoints = endpoints
        self.retry_for_s = retry_for_s
        self.observe = observe
        self.on_done = on_done
        self._next_try: dict[str, float] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lossguard-actions", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                wait = self.run_due(time.time())
            except Exception:  # the thread outlives any one failure
                log.exception("actions: delivery cycle failed")
                wait = MAX_BACKOFF_S
            self._wake.wait(wait)
            self._wake.clear()

    def run_due(self, now: float) -> float:
        """Send every pending action that is due; seconds until the next retry."""
        waits = [60.0]
        for record in self.store.open():
            if record.state != "pending" or self._stop.is_set():
                continue
            due = self._next_try.get(record.id, 0.0)
            if due > now:
                waits.append(due - now)
                continue
            retry_in = self.send(record)
            if retry_in is not None:
                waits.append(retry_in)
            now = time.time()
        return max(0.05, min(waits))

    def send(self, record: ActionRecord) -> float | None:
        """Send one action and record the outcome; seconds until it is tried again, or None
        when it is settled."""
        to_supervisor = record.kind in SUPERVISOR_ACTIONS
        try:
            connect = self.endpoints.supervisor_client if to_supervisor else self.endpoints.client
            with connect(record.run_id) as client:
                result = client.request(COMMAND_OF[record.kind], record.args, request_id=record.id)
        except ControlError as exc:
            if record.kind == "rollback" and exc.code == ErrorCode.NOT_FOUND.value:
                status = self._status(record.run_id)
                self._finish(record, "nothing_to_restore", reason=exc.message, result=status)
                return None
            who = "supervisor" if to_supervisor else "agent"
            self._finish(record, "failed", reason=f"the {who} refused it: {exc}")
            return None
        except NoSupervisor as exc:
            self._finish(record, "failed", reason=str(exc))
            return None
        except (ControlUnavailable, ControlTimeout, NoEndpoint, OSError) as exc:
            return self._retry(record, str(exc))
        self._finish(record, "applied", result=result)
        return None

    def _status(self, run_id: str) -> dict[str, Any]:
        """The run's ``status`` now (what it is doing after a rollback found nothing), or {}."""
        try:
            with self.endpoints.client(run_id) as client:
                return client.request("status")
        except (ControlError, ControlUnavailable, ControlTimeout, NoEndpoint, OSError) as exc:
            log.warning("status of run %s after an empty rollback: %s", run_id, exc)
            return {}

    def _retry(self, record: ActionRecord, error: str) -> float | None:
        now = time.time()
        if now - record.created_at >= self.retry_for_s:
            self._finish(
                record, "failed", reason=f"gave up after {record.tries + 1} tries: {error}"
            )
            return None
        self.store.update(record.id, "pending", now, reason=error, tried=True)
        self.observe(record.kind, "retry")
        backoff = min(MAX_BACKOFF_S, 0.5 * 2**record.tries)
        self._next_try[record.id] = now + backoff
        log.warning(
            "%s for run %s not delivered (%s); trying again in %.1f s",
            record.kind,
            record.run_id,
            error,
            backoff,
        )
        return backoff

    def _finish(
        self,
        record: ActionRecord,
        state: ActionState,
        *,
        reason: str | None = None,  # None: keep the recorded one (why it was sent)
        result: dict[str, Any] | None = None,
    ) -> None:
        now = time.time()
        self.store.update(record.id, state, now, reason=reason, result=result, tried=True)
        self._next_try.pop(record.id, None)
        done = self.store.get(record.id)
        assert done is not None
        self.observe(record.kind, state)
        level = logging.WARNING if state in ("applied", "nothing_to_restore") else logging.ERROR
        log.log(
            level,
            "action %s for run %s (%s): %s",
            record.id,
            record.run_id,
            record.alertname,
            describe(done),
        )
        self.on_done(done)
        return None

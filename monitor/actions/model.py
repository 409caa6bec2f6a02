"""What the actions pipeline works on: a firing alert that asks for an action, and the record of
one action (what was asked of which run, and what came of it)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from lossguard.monitor.notify.model import RUN_LABEL

Origin = Literal["rules", "alertmanager"]
ActionState = Literal[
    "held", "pending", "applied", "failed", "dry_run", "dropped", "refused", "nothing_to_restore"
]
"""held: a silence holds it back; pending: recorded, to be sent (again) until answered;
applied: the agent applied it; failed: refused by the agent or given up; dry_run: announced
only; dropped: held until its alert ended, never sent; refused: an alert from Alertmanager the
monitor did not corroborate (:mod:`lossguard.monitor.actions.corroborate`), never sent;
nothing_to_restore: a rollback found no state (snapshot or checkpoint) to go back to, and the
run trains on as it was (``result``: its ``status`` then, when it answered)."""
OPEN_STATES: tuple[ActionState, ...] = ("held", "pending")


@dataclass(frozen=True)
class ActionAlert:
    """A firing alert with an ``action`` label, from the rules or from Alertmanager."""

    fingerprint: str
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: float  # when the alert became active: with the fingerprint, the instance
    value: float
    origin: Origin = "rules"

    @property
    def name(self) -> str:
        return self.labels.get("alertname", "")

    @property
    def run_id(self) -> str:
        return self.labels.get(RUN_LABEL, "")

    @property
    def request_id(self) -> str:
        """The id of the action this alert instance asks for: the same on every evaluation,
        after a monitor restart and for every re-send of an Alertmanager alert."""
        return f"lg-{self.fingerprint}-{round(self.starts_at * 1000)}"


@dataclass(frozen=True)
class ActionRecord:
    """One action in the state database."""

    id: str  # the control request id
    run_id: str
    kind: str  # rollback | pause | stop | checkpoint
    alertname: str
    fingerprint: str
    labels: dict[str, str]
    origin: Origin
    args: dict[str, Any]
    state: ActionState
    created_at: float
    updated_at: float
    attempt: int | None = None  # of a rollback: attempt i of max_attempts
    of_attempts: int | None = None
    reason: str = ""  # why held, failed, dry run, or sent after the budget was spent
    result: dict[str, Any] = field(default_factory=dict)  # the agent's reply
    tries: int = 0

    def replace(self, **changes: Any) -> ActionRecord:
        return dataclasses.replace(self, **changes)

    @property
    def is_open(self) -> bool:
        return self.state in OPEN_STATES

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "run_id": self.run_id,
            "kind": self.kind,
            "alertname": self.alertname,
            "fingerprint": self.fingerprint,
            "origin": self.origin,
            "args": self.args,
            "state": self.state,
            "attempt": self.attempt,
            "of_attempts": self.of_attempts,
            "reason": self.reason,
            "result": self.result,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "tries": self.tries,
        }


def dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)

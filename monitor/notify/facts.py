"""What a notification says about the run beyond the alert's own labels: the run's last step and
what has been done about it so far, read from the same source the rules read (for a dead run,
whose series are gone, the step is its alert's ``last_step`` label)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

from lossguard.common.catalogue import ROLLBACKS_TOTAL, SKIPPED_STEPS_TOTAL, STEP
from lossguard.monitor.notify.model import RUN_LABEL
from lossguard.monitor.promql import PromQLError
from lossguard.monitor.rules.templating import go_quote
from lossguard.monitor.sources import Source, SourceError
from lossguard.monitor.sources.liveness import LAST_STEP_LABEL

log = logging.getLogger("lossguard.monitor.notify")
ACTIONS = {  # counter -> how a notification says it
    ROLLBACKS_TOTAL: ("rolled back {n} time", "rolled back {n} times"),
    SKIPPED_STEPS_TOTAL: ("skipped {n} step", "skipped {n} steps"),
}
FACT_METRICS = frozenset({STEP, *ACTIONS})
Facts = tuple[int | None, tuple[str, ...]]  # the run's step, what was done about it


class RunFacts:
    """Looks up a run's step and actions at a time; nothing when the alert names no run."""

    def __init__(self, source: Source) -> None:
        self.source = source

    def of(self, labels: Mapping[str, str], t: float) -> Facts:
        run_id = labels.get(RUN_LABEL)
        if not run_id:
            return None, ()
        selector = f"{{run_id={go_quote(run_id)}}}"
        step = self.step(run_id, t)
        if step is None and labels.get(LAST_STEP_LABEL, "").isdigit():
            step = int(labels[LAST_STEP_LABEL])
        actions = []
        for metric, (one, many) in ACTIONS.items():
            n = self._max(f"sum by (rank) ({metric}{selector})", t)  # over its labels (reason)
            if n:
                actions.append((one if n == 1 else many).format(n=n))
        return step, tuple(actions)

    def step(self, run_id: str, t: float) -> int | None:
        """The run's last completed step at ``t`` (None: not known)."""
        return self._max(f"{STEP}{{run_id={go_quote(run_id)}}}", t)

    def _max(self, expr: str, t: float) -> int | None:
        """The largest value over the run's ranks, as an integer (None when absent)."""
        try:
            result = self.source.query(expr, t)
        except (PromQLError, SourceError) as exc:
            log.debug("run facts: %s: %s", expr, exc)
            return None
        if not isinstance(result, list):
            return None
        values = [s.value for s in result if math.isfinite(s.value)]
        return int(max(values)) if values else None

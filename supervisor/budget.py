"""How often a run may be restarted: at most N restarts per window, with a backoff that doubles
with each restart in the window."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class RestartBudget:
    max_restarts: int
    window_s: float
    backoff_s: float
    backoff_max_s: float
    _restarts: deque[float] = field(default_factory=deque, init=False)

    def _recent(self, now: float) -> int:
        while self._restarts and self._restarts[0] <= now - self.window_s:
            self._restarts.popleft()
        return len(self._restarts)

    def remaining(self, now: float) -> int:
        return max(0, self.max_restarts - self._recent(now))

    def take(self, now: float) -> float | None:
        """Spend one restart: the delay before it, or None when the budget is spent."""
        recent = self._recent(now)
        if recent >= self.max_restarts:
            return None
        self._restarts.append(now)
        return min(self.backoff_max_s, self.backoff_s * 2**recent)

    def reset(self) -> None:
        """A human restarted the run: the count starts again."""
        self._restarts.clear()

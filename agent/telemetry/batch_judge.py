"""A step's token statistics (``batch_tokens``) judged against the run's own history: the
median and a robust spread (1.4826 x the median absolute deviation) of the other steps in the
ring. Torch-free (the diagnosis runs on the host)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

FIELDS = ("entropy", "distinct")
"""The statistics of a step's token ids, in the order ``batch_tokens`` records them."""
UNLIKE = 6.0
"""A statistic this many robust standard deviations from the run's median, either way, makes
the batch unlike the run's data."""
MIN_HISTORY = 16
"""Other steps in the ring before a batch is judged."""
SPREAD_FLOOR = 0.01
"""The spread is at least this fraction of the median (data so regular that most batches are
alike would otherwise make any difference count)."""
_MAD_TO_STD = 1.4826


@dataclass(frozen=True)
class Judged:
    """One statistic of the step against the history: value, median, robust z-score."""

    name: str
    value: float
    typical: float
    zscore: float

    @property
    def unlike(self) -> bool:
        return abs(self.zscore) >= UNLIKE

    def describe(self) -> str:
        """E.g. ``token entropy 7.62 bits against a typical 4.36``."""
        if self.name == "distinct":
            return (
                f"distinct token ids {100 * self.value:.2g}% of the batch against a typical "
                f"{100 * self.typical:.2g}%"
            )
        return f"token entropy {self.value:.3g} bits against a typical {self.typical:.3g}"


@dataclass(frozen=True)
class BatchJudgement:
    """Every statistic of one step's batch (``rank``'s share of it), judged; ``history``: the
    other steps used."""

    judged: tuple[Judged, ...]
    history: int
    rank: int = 0
    unlike_ranks: tuple[int, ...] = ()  # of all the ranks judged, those whose share is unlike

    @property
    def furthest(self) -> float:
        """The largest distance of a statistic from the run's, in robust standard deviations."""
        return max(abs(j.zscore) for j in self.judged)

    @property
    def unlike(self) -> tuple[Judged, ...]:
        """The statistics far from the run's, the furthest first (empty: an ordinary batch)."""
        far = [j for j in self.judged if j.unlike]
        return tuple(sorted(far, key=lambda j: -abs(j.zscore)))

    def as_dict(self) -> dict[str, Any]:
        """For the diagnosis: each statistic's value, typical value and z-score."""
        fields: dict[str, Any] = {"history": self.history, "unlike": bool(self.unlike)}
        fields.update(rank=self.rank, unlike_ranks=list(self.unlike_ranks))
        for j in self.judged:
            fields[j.name] = j.value
            fields[f"typical_{j.name}"] = j.typical
            fields[f"zscore_{j.name}"] = j.zscore
        return fields


def judge_ranks(
    step: int, histories: Sequence[Mapping[int, Sequence[float]]]
) -> BatchJudgement | None:
    """Each rank's share of ``step``'s batch against that rank's history (``histories``, by
    rank): the share furthest from its run's, with the ranks whose share is unlike theirs
    (None: no rank's could be judged)."""
    judged = [judge(step, history, rank) for rank, history in enumerate(histories)]
    known = [j for j in judged if j is not None]
    if not known:
        return None
    unlike = tuple(j.rank for j in known if j.unlike)
    return replace(max(known, key=lambda j: j.furthest), unlike_ranks=unlike)


def judge(
    step: int, history: Mapping[int, Sequence[float]], rank: int = 0
) -> BatchJudgement | None:
    """``step``'s statistics (``FIELDS``) against the other steps of ``history``; None when
    the step was not recorded or there are fewer than ``MIN_HISTORY`` others."""
    own = history.get(step)
    others = [row for recorded, row in history.items() if recorded != step]
    if own is None or len(others) < MIN_HISTORY:
        return None
    judged = []
    for index, name in enumerate(FIELDS):
        column = [row[index] for row in others]
        typical = statistics.median(column)
        mad = statistics.median(abs(value - typical) for value in column)
        spread = max(_MAD_TO_STD * mad, SPREAD_FLOOR * abs(typical), 1e-12)
        judged.append(Judged(name, own[index], typical, (own[index] - typical) / spread))
    return BatchJudgement(tuple(judged), len(others), rank)

"""Cheap statistics of each step's input token ids, on the device, kept in a small ring that is
read only when a detection is diagnosed (never per step: no host sync on the training path).

Per step, over all the token ids the step was given (every micro-batch):

* ``entropy``: the unigram entropy of the ids, in bits (the mean over tokens of
  ``-log2(count of the token's id / tokens)``);
* ``distinct``: the fraction of the ids that are distinct (distinct ids / tokens).

Both are exact (a sort and two binary searches, static shapes, any vocabulary). Natural text
keeps both steady from batch to batch; a batch of padding or of one repeated token sends both
towards 0, a repeated sequence lowers ``distinct``, uniform random ids raise both.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lossguard.agent.telemetry.batch_judge import FIELDS

RING = 256
"""Steps of history kept (the diagnosis judges a step against the others in it)."""

_F64 = torch.float64


def token_statistics(ids: torch.Tensor) -> torch.Tensor:
    """``(entropy, distinct)`` of ``ids`` (any shape, at least one id) as a float64 device
    tensor."""
    ordered = ids.detach().reshape(-1).sort().values
    counts = torch.searchsorted(ordered, ordered, right=True) - torch.searchsorted(ordered, ordered)
    share = counts.to(_F64) / ordered.numel()
    entropy = -share.log2().mean()
    distinct = share.reciprocal().sum() / ordered.numel() ** 2
    return torch.stack((entropy, distinct))


class BatchTokens:
    """The last ``RING`` steps' token statistics on ``device``: a row per step, ``(step,
    entropy, distinct)``, at row ``step % RING``."""

    def __init__(self, device: torch.device, size: int = RING) -> None:
        self._ring = torch.full((size, 1 + len(FIELDS)), float("nan"), dtype=_F64, device=device)

    def observe(self, step: int, ids: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Record the token ids of ``step`` (the step being taken; micro-batches as a
        sequence). No host sync. Integer ids only; nothing is recorded for an empty step."""
        parts = [ids] if isinstance(ids, torch.Tensor) else list(ids)
        flat = [p.detach().reshape(-1).to(self._ring.device) for p in parts]
        if not flat or any(p.is_floating_point() or p.is_complex() for p in flat):
            raise TypeError("inputs: token ids must be integer tensors")
        tokens = torch.cat(flat) if len(flat) > 1 else flat[0]
        if tokens.numel() == 0:
            return
        row = self._ring[step % self._ring.shape[0]]
        row[0].fill_(float(step))  # a kernel: item assignment would copy from the host
        row[1:].copy_(token_statistics(tokens))

    def read(self, step: int) -> dict[int, tuple[float, ...]]:
        """The statistics of the steps in the ring up to ``step`` (one host read): by step.
        Rows of later steps (a timeline a restore abandoned) are left out."""
        history: dict[int, tuple[float, ...]] = {}
        for row in self._ring.tolist():
            recorded = row[0]
            if recorded == recorded and step - self._ring.shape[0] < recorded <= step:
                history[int(recorded)] = tuple(row[1:])
        return history

"""Cheap statistics of each step's input token ids, on the device, kept in a small ring that is
read only when a detection is diagnosed (never per step: no host sync on the training path).

Per step, over all the token ids the step was given (every micro-batch):

* ``entropy``: the unigram entropy of the ids, in bits (the mean over tokens of
  ``-log2(count of the token's id / tokens)``);
* ``distinct``: the fraction of the ids that are distinct (distinct ids / tokens).

Both come from a histogram of the ids on the device (a scatter-add into a table of
``slots(vocabulary)`` counters and a gather: a few kernels, no sort, static shapes). They are
exact while every id is below the table's size (the model's vocabulary, rounded up to a power of
two); larger ids share a counter with those equal to them modulo the size, which lowers both a
little. Natural text keeps both steady from batch to batch; a batch of padding or of one
repeated token sends both towards 0, a repeated sequence lowers ``distinct``, uniform random ids
raise both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from lossguard.agent.telemetry.batch_judge import FIELDS

RING = 256
"""Steps of history kept (the diagnosis judges a step against the others in it)."""

DEFAULT_VOCABULARY = 1 << 17
"""The table's size when the vocabulary is not known (Llama 3's 128,256 ids fit)."""
MAX_SLOTS = 1 << 20
"""The largest table (4 MiB of counters)."""

_F64 = torch.float64


def slots(vocabulary: int | None) -> int:
    """The histogram's size for ``vocabulary`` ids: the next power of two, at most MAX_SLOTS."""
    wanted = max(vocabulary or DEFAULT_VOCABULARY, 2)
    return min(1 << (wanted - 1).bit_length(), MAX_SLOTS)


def vocabulary_of(model: nn.Module) -> int | None:
    """The vocabulary of ``model``: its largest ``nn.Embedding`` (None without one)."""
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return max(sizes, default=None)


def token_statistics(ids: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """``(entropy, distinct)`` of ``ids`` (integers >= 0, any shape, at least one) as a float64
    tensor on their device. ``counts``: the histogram's table to reuse (int32, a power of two
    long, on that device), overwritten; by default one of ``slots(None)``."""
    flat = ids.detach().reshape(-1)
    if counts is None:
        counts = torch.empty(slots(None), dtype=torch.int32, device=flat.device)
    slot = (flat & (counts.numel() - 1)).long()
    counts.zero_()
    counts.scatter_add_(0, slot, torch.ones_like(slot, dtype=torch.int32))
    tokens = flat.numel()
    # the mean over tokens of -log2(count / tokens), and distinct ids / tokens
    entropy = math.log2(tokens) - counts[slot].to(_F64).log2().mean()
    distinct = torch.count_nonzero(counts).to(_F64) / tokens
    return torch.stack((entropy, distinct))


class BatchTokens:
    """The last ``RING`` steps' token statistics on ``device``: a row per step, ``(step,
    entropy, distinct)``, at row ``step % RING``. ``vocabulary``: the model's, if known (sizes
    the histogram: see ``slots``)."""

    def __init__(
        self, device: torch.device, size: int = RING, *, vocabulary: int | None = None
    ) -> None:
        self._ring = torch.full((size, 1 + len(FIELDS)), float("nan"), dtype=_F64, device=device)
        self._counts = torch.zeros(slots(vocabulary), dtype=torch.int32, device=device)

    def observe(self, step: int, ids: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Record the token ids of ``step`` (the step being taken; micro-batches as a
        sequence). No host sync. Integer ids only; nothing is recorded for an empty step."""
        parts = [ids] if isinstance(ids, torch.Tensor) else list(ids)
        flat = [p.detach().reshape(-1).to(self._ring.device) for p in parts]
        if not flat or any(
            p.is_floating_point() or p.is_complex() or p.dtype == torch.bool for p in flat
        ):
            raise TypeError("inputs: token ids must be integer tensors")
        tokens = torch.cat(flat) if len(flat) > 1 else flat[0]
        if tokens.numel() == 0:
            return
        row = self._ring[step % self._ring.shape[0]]
        row[0].fill_(float(step))  # a kernel: item assignment would copy from the host
        row[1:].copy_(token_statistics(tokens, self._counts))

    def read(self, step: int) -> dict[int, tuple[float, ...]]:
        """The statistics of the steps in the ring up to ``step`` (one host read): by step.
        Rows of later steps (a timeline a restore abandoned) are left out."""
        history: dict[int, tuple[float, ...]] = {}
        for row in self._ring.tolist():
            recorded = row[0]
            if recorded == recorded and step - self._ring.shape[0] < recorded <= step:
                history[int(recorded)] = tuple(row[1:])
        return history

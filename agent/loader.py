"""``SkippableDataLoader``: a standard DataLoader whose place in the data a Guard checkpoints,
restores and skips, so that resume, rollback and ``skip_batches`` work in any training loop.

    loader = SkippableDataLoader(dataset, batch_size=32, shuffle=True, num_workers=4,
                                 generator=torch.Generator().manual_seed(0))
    # or sampler=DistributedSampler(dataset), or any sampler or batch_sampler
    guard = Guard(run_dir, model=model, optimizer=opt, data=loader, ...)
    while guard.step < max_steps and not guard.stop_requested:
        for x, y in loader:  # the rest of the current epoch
            ...

Each epoch's order (its batches of indices) is drawn when the epoch starts, exactly as the plain
DataLoader would draw it, and the generator states it was drawn from are kept: a checkpoint
holds the epoch, the batches taken in it and those states, so a restore draws the same order
again and goes on from the same batch, and skipping passes over indices without loading data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler


def _distinct(generators: Iterable[object]) -> list[torch.Generator]:
    """The torch generators among ``generators``, each once, in order."""
    found: list[torch.Generator] = []
    for generator in generators:
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def _states(generators: Sequence[torch.Generator]) -> list[torch.Tensor]:
    return [generator.get_state() for generator in generators]


def _set_states(generators: Sequence[torch.Generator], states: Sequence[torch.Tensor]) -> None:
    for generator, state in zip(generators, states, strict=True):
        generator.set_state(state)


@contextlib.contextmanager
def _generators_kept(generators: Sequence[torch.Generator]) -> Iterator[None]:
    """Whatever runs inside draws from ``generators`` without moving them on."""
    saved = _states(generators)
    try:
        yield
    finally:
        _set_states(generators, saved)


class _EpochBatches(Sampler[list[int]]):
    """The loader's batch sampler: one epoch's batches of ``batches`` (a standard batch
    sampler), drawn when the epoch starts and served from batch ``start`` on."""

    def __init__(self, batches: Iterable[list[int]]) -> None:
        self.batches = batches
        parts = (batches, getattr(batches, "sampler", None))
        self.epoch_setters: list[Any] = [part for part in parts if hasattr(part, "set_epoch")]
        self.sampler_generators = _distinct(getattr(part, "generator", None) for part in parts)
        self.drawn_with = _distinct([torch.default_generator, *self.sampler_generators])
        """The generators an order may be drawn from: the default one and the sampler's."""
        self.epoch = 0
        self.drawn_from: list[torch.Tensor] | None = None
        """The states of ``drawn_with`` this epoch's order was drawn from (None: not yet)."""
        self.order: list[list[int]] | None = None
        self.start = 0

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[int]]:
        if self.order is None:  # the epoch starts: draw its order as the DataLoader would
            self.drawn_from = _states(self.drawn_with)
            self.order = self._draw()
        yield from self.order[self.start :]

    def _draw(self) -> list[list[int]]:
        for sampler in self.epoch_setters:
            sampler.set_epoch(self.epoch)
        return [list(batch) for batch in self.batches]

    def redraw(self) -> None:
        """This epoch's order again, from the states it was first drawn from; the generators
        are left as they were."""
        assert self.drawn_from is not None
        with _generators_kept(self.drawn_with):
            _set_states(self.drawn_with, self.drawn_from)
            self.order = self._draw()

    def next_epoch(self) -> None:
        self.epoch += 1
        self.drawn_from = self.order = None
        self.start = 0


class SkippableDataLoader(DataLoader[Any]):
    """A ``torch.utils.data.DataLoader`` (the same arguments; those after ``batch_sampler`` by
    keyword) that a Guard can checkpoint, resume and skip batch by batch: pass it as ``data``.

    Iterating yields the rest of the current epoch; the next iteration starts the next one
    (calling ``set_epoch`` on a sampler that has it, such as ``DistributedSampler``).
    ``position`` counts the batches the loop has taken, all epochs; ``epoch`` and ``offset``
    say where it stands. ``state_dict``/``load_state_dict`` carry that place and the
    generator states of the epoch's order, so a resume or rollback goes on with exactly the
    batches an uninterrupted run takes, and leaves the random streams (the global one, the
    sampler's and the loader's ``generator``) as that run has them. ``skip(n)`` passes over n
    batches without loading them. A load or skip during an iteration takes effect at the next
    batch.

    Needs a map-style dataset, batches (``batch_size`` or ``batch_sampler``), and an order
    drawn from torch generators (a sampler's ``generator`` or the default one, as
    ``RandomSampler`` draws it) or fixed by ``set_epoch``. Random work in worker processes
    (augmentation) is seeded as usual but not replayed exactly after a resume mid-epoch.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        *,
        drop_last: bool = False,
        generator: torch.Generator | None = None,
        **loader_args: Any,
    ) -> None:
        if isinstance(dataset, IterableDataset):
            raise ValueError("SkippableDataLoader needs a map-style dataset, not an iterable one")
        # torch's own checks and the batch sampler it would build from these arguments
        batches = DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            drop_last=drop_last,
            generator=generator,
        ).batch_sampler
        if batches is None:
            raise ValueError("SkippableDataLoader needs batches: batch_size or batch_sampler")
        self._epochs = _EpochBatches(batches)
        self._saved = _distinct([*self._epochs.sampler_generators, generator])
        """Generators whose state a checkpoint carries (the global one is Guard's)."""
        self._kept = _distinct([*self._epochs.drawn_with, generator])
        self.offset = 0
        """Batches taken in the current epoch."""
        self.position = 0
        """Batches taken, all epochs: what ``skip_batches`` and diagnoses count."""
        self._moved = 0  # bumped by every load and skip
        super().__init__(dataset, batch_sampler=self._epochs, generator=generator, **loader_args)

    @property
    def epoch(self) -> int:
        return self._epochs.epoch

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        while True:
            moved = self._moved
            for batch in self._from_here():
                self.offset += 1
                self.position += 1
                yield batch
                if self._moved != moved:
                    break  # a load or skip: go on from the new place
            else:
                self._epochs.next_epoch()
                self.offset = 0
                return

    def _from_here(self) -> Iterator[Any]:
        """A DataLoader iterator from batch ``offset`` of the current epoch. Starting an epoch
        is the plain DataLoader's start; going on inside one whose order is drawn already
        moves no generator (as the uninterrupted run, which drew it once)."""
        epochs = self._epochs
        epochs.start = self.offset
        if epochs.drawn_from is None:
            return super().__iter__()
        if epochs.order is None:
            epochs.redraw()
        with _generators_kept(self._kept):
            return super().__iter__()

    def skip(self, n: int) -> None:
        """Pass over the next ``n`` batches without loading them; an epoch passed over whole
        is not drawn (the next epoch drawn gets the order it would have had)."""
        if n < 0:
            raise ValueError(f"cannot skip a negative number of batches ({n})")
        self.offset += n
        self.position += n
        per_epoch = len(self._epochs)
        while per_epoch and self.offset >= per_epoch:
            self.offset -= per_epoch
            self._epochs.next_epoch()
        self._moved += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "position": self.position,
            "drawn_from": self._epochs.drawn_from,
            "generators": _states(self._saved),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        drawn_from, generators = state["drawn_from"], state["generators"]
        if len(generators) != len(self._saved) or (
            drawn_from is not None and len(drawn_from) != len(self._epochs.drawn_with)
        ):
            raise ValueError("the data state was saved from a loader with other generators")
        _set_states(self._saved, generators)
        epochs = self._epochs
        epochs.epoch, epochs.drawn_from, epochs.order = int(state["epoch"]), drawn_from, None
        self.offset = int(state["offset"])
        self.position = int(state["position"])
        self._moved += 1

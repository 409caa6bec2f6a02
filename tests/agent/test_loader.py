"""SkippableDataLoader: the plain DataLoader's batches, resumable and skippable; and in a user's
loop under Guard, an exact resume and rollbacks that skip exactly the batches asked for."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    TensorDataset,
)

from lossguard.agent import Guard, SkippableDataLoader
from lossguard.agent.config import parse_config
from lossguard.common.control.protocol import SkipBatches

pytestmark = pytest.mark.live

DATASET = TensorDataset(torch.arange(30))
EPOCH = 8  # batches of 4 from 30 samples (the last one short)

LOADERS: dict[str, Callable[[], dict[str, Any]]] = {  # DataLoader arguments, made afresh
    "shuffle with a generator": lambda: {
        "batch_size": 4,
        "shuffle": True,
        "generator": torch.Generator().manual_seed(3),
    },
    "shuffle from the default generator": lambda: {"batch_size": 4, "shuffle": True},
    "DistributedSampler": lambda: {
        "batch_size": 2,
        "sampler": DistributedSampler(DATASET, num_replicas=2, rank=1, seed=5),
    },
    "batch_sampler": lambda: {
        "batch_sampler": BatchSampler(
            RandomSampler(DATASET, generator=torch.Generator().manual_seed(4)), 4, drop_last=True
        ),
    },
    "two workers": lambda: {
        "batch_size": 4,
        "shuffle": True,
        "generator": torch.Generator().manual_seed(3),
        "num_workers": 2,
    },
}
KINDS = pytest.mark.parametrize("kind", list(LOADERS))


def skippable(kind: str) -> SkippableDataLoader:
    return SkippableDataLoader(DATASET, **LOADERS[kind]())


def ids(batch: list[torch.Tensor]) -> list[int]:
    return batch[0].tolist()


def plain_epochs(kind: str, epochs: int) -> list[list[int]]:
    """The plain DataLoader's batches over ``epochs`` epochs, from the default seed 0."""
    torch.manual_seed(0)
    loader = DataLoader(DATASET, **LOADERS[kind]())
    batches = []
    for epoch in range(epochs):
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)  # what the user's loop does; the helper does it itself
        batches += [ids(b) for b in loader]
    return batches


def take(loader: SkippableDataLoader, n: int) -> list[list[int]]:
    """The next ``n`` batches, across epochs as a loop over epochs takes them."""
    taken: list[list[int]] = []
    while len(taken) < n:
        for batch in loader:
            taken.append(ids(batch))
            if len(taken) == n:
                break
    return taken


@KINDS
def test_it_yields_the_plain_dataloaders_batches(kind: str) -> None:
    expected = plain_epochs(kind, 3)
    after = torch.rand(3)
    torch.manual_seed(0)
    loader = skippable(kind)
    assert [[ids(b) for b in loader] for _ in range(3)] == [
        expected[i : i + len(loader)] for i in range(0, len(expected), len(loader))
    ]
    assert torch.equal(torch.rand(3), after)  # the default generator moved on the same way
    assert (loader.epoch, loader.offset, loader.position) == (3, 0, len(expected))


@KINDS
def test_a_loaded_state_goes_on_with_the_same_batches(kind: str) -> None:
    """Saved mid-epoch, loaded into a new loader in a process whose generators have moved on:
    the same batches follow, and the default generator goes on as it would have."""
    torch.manual_seed(0)
    loader = skippable(kind)
    first = take(loader, len(loader) + 3)
    state, rng = loader.state_dict(), torch.get_rng_state()
    rest = take(loader, 2 * len(loader))
    after = torch.rand(3)
    assert first + rest == plain_epochs(kind, 4)[: len(first) + len(rest)]

    torch.manual_seed(99)
    again = skippable(kind)
    take(again, 2)  # a different place, to be replaced
    again.load_state_dict(state)
    torch.set_rng_state(rng)  # Guard restores the global RNG with the state
    assert (again.epoch, again.offset, again.position) == (1, 3, len(first))
    assert take(again, len(rest)) == rest
    assert torch.equal(torch.rand(3), after)


@pytest.mark.parametrize("n", [3, EPOCH - 1, EPOCH + 2])
def test_skip_passes_over_exactly_n_batches(n: int) -> None:
    """Within the epoch, up to its end and into the next one."""
    kind = "shuffle with a generator"
    expected = plain_epochs(kind, 3)
    torch.manual_seed(0)
    loader = skippable(kind)
    first = take(loader, 2)
    loader.skip(n)
    assert loader.position == 2 + n
    assert (loader.epoch, loader.offset) == divmod(2 + n, EPOCH)
    assert first + take(loader, 5) == expected[:2] + expected[2 + n : 7 + n]
    with pytest.raises(ValueError, match="negative"):
        loader.skip(-1)


def test_a_load_during_an_iteration_takes_effect_at_the_next_batch() -> None:
    kind = "two workers"
    expected = plain_epochs(kind, 2)
    torch.manual_seed(0)
    loader = skippable(kind)
    taken = []
    state: dict[str, Any] = {}
    for batch in loader:
        taken.append(ids(batch))
        if len(taken) == 2:
            state = loader.state_dict()
        if len(taken) == 5:
            loader.load_state_dict(state)  # as a rollback does, from inside the loop
    assert taken == expected[:5] + expected[2:EPOCH]


def test_what_it_cannot_resume_is_refused() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(ValueError, match="map-style"):
        SkippableDataLoader(Stream(), batch_size=2)
    with pytest.raises(ValueError, match="needs batches"):
        SkippableDataLoader(DATASET, batch_size=None)
    with pytest.raises(ValueError, match="mutually exclusive"):  # torch's own checks
        SkippableDataLoader(DATASET, sampler=RandomSampler(DATASET), shuffle=True)
    saved = skippable("shuffle from the default generator").state_dict()
    with pytest.raises(ValueError, match="other generators"):
        skippable("shuffle with a generator").load_state_dict(saved)


# ---------------------------------------------------------------- in a user's loop under Guard

STEPS = 30
SAMPLES = 40  # 10 batches of 4: the run crosses two epoch boundaries


class UserRun:
    """A user's own loop: a small regression model with dropout (the global RNG matters),
    AdamW, a SkippableDataLoader that shuffles with its own generator, and Guard."""

    def __init__(self, run_dir: Path, **guard_args: Any) -> None:
        torch.manual_seed(0)
        x = torch.randn(SAMPLES, 8)
        dataset = TensorDataset(torch.arange(SAMPLES), x, x.sum(dim=1, keepdim=True))
        self.model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.loader = SkippableDataLoader(
            dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1)
        )
        cfg = parse_config(
            {
                "telemetry": {"host": "127.0.0.1", "port": 0},
                "train": {"log_every": 1},
                "checkpoint": {"every": 5, "keep_last": 50, "save_on_exit": False},
            }
        )
        self.guard = Guard(
            run_dir,
            model=self.model,
            optimizer=self.opt,
            data=self.loader,
            config=cfg,
            max_steps=STEPS,
            progress=False,
            **guard_args,
        )
        self.batches: dict[int, list[int]] = {}  # step -> the sample ids it trained on
        self.losses: dict[int, float] = {}

    def train(self, until: int, at_step: Callable[[Guard], None] = lambda guard: None) -> None:
        """Train to step ``until``; ``at_step`` runs at every step boundary (after ``poll``)."""
        guard = self.guard
        while guard.step < until:
            for index, x, y in self.loader:
                loss = nn.functional.mse_loss(self.model(x), y)
                loss.backward()
                guard.after_backward(loss, tokens=len(index))
                self.opt.step()
                self.opt.zero_grad()
                guard.end_step()
                self.batches[guard.step] = index.tolist()
                self.losses[guard.step] = loss.item()
                guard.poll()
                at_step(guard)
                if guard.step >= until:
                    break


def test_a_user_loop_resumes_exactly(tmp_path: Path) -> None:
    whole = UserRun(tmp_path / "whole")
    whole.train(STEPS)
    whole.guard.close()

    killed = UserRun(tmp_path / "run")
    killed.train(17)
    killed.guard.close(failed=True)  # as a crash leaves it: checkpoints at 5, 10 and 15
    torch.manual_seed(1234)  # the new process's generators stand elsewhere
    resumed = UserRun(tmp_path / "run", resume="latest")
    assert resumed.guard.step == 15 and resumed.loader.position == 15
    resumed.train(STEPS)
    resumed.guard.close()
    for step in range(16, STEPS + 1):
        assert resumed.batches[step] == whole.batches[step], step
        assert resumed.losses[step] == whole.losses[step], step
    final, expected = resumed.model.state_dict(), whole.model.state_dict()
    assert all(torch.equal(final[k], expected[k]) for k in expected)


@pytest.mark.parametrize(("skip", "skipped"), [(3, 3), (7, 7), ("abandoned", 4)])
def test_a_rollback_skips_exactly_the_batches_asked_for(
    tmp_path: Path, skip: SkipBatches, skipped: int
) -> None:
    """Rolled back from step 14 to step 10: the steps after it train on the batches that
    come ``skipped`` batches after step 10's (``abandoned``: after step 14's), across an
    epoch boundary too."""
    whole = UserRun(tmp_path / "whole")
    whole.train(STEPS)
    whole.guard.close()
    stream = [whole.batches[step] for step in range(1, STEPS + 1)]  # stream[p]: position p

    results: list[dict[str, Any]] = []

    def roll_back_once(guard: Guard) -> None:
        if guard.step == 14 and not results:
            results.append(guard.rollback(10, skip_batches=skip, lr_scale=1.0))

    run = UserRun(tmp_path / "run")
    run.train(STEPS - skipped, at_step=roll_back_once)
    run.guard.close()
    assert results[0]["skipped_batches"] == skipped and results[0]["to_step"] == 10
    after = [run.batches[step] for step in range(11, STEPS - skipped + 1)]
    assert after == stream[10 + skipped :]
    assert run.loader.position == STEPS

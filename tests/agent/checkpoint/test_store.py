"""Checkpoint store: atomic saves that survive SIGKILL, verified loads, retention, async saves."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict, namedtuple
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lossguard.agent.checkpoint.snapshot import snapshot
from lossguard.agent.checkpoint.store import CheckpointStore
from lossguard.common.rundir.checkpoints import (
    META_FILE,
    STATE_FILE,
    CheckpointError,
    CheckpointMeta,
    checkpoint_name,
)

pytestmark = pytest.mark.live

LOGGER = "lossguard.agent.checkpoint"
LISTING_LOGGER = "lossguard.common.rundir"  # list_checkpoints: unreadable meta.json
META_FIELDS = {
    "name",
    "step",
    "seq",
    "tokens",
    "healthy",
    "reason",
    "train_loss",
    "val_loss",
    "created_at",
    "files",
    "config_hash",
    "versions",
    "extra",
    "format",
}


def save(store: CheckpointStore, step: int, val_loss: float | None = None, healthy: bool = True):
    payload = {"step": step, "w": torch.full((4,), float(step))}
    return store.save(
        step, payload, tokens=10 * step, healthy=healthy, reason="test", val_loss=val_loss
    )


def names(metas: list[CheckpointMeta]) -> list[str]:
    return [m.name for m in metas]


def steps(metas: list[CheckpointMeta]) -> list[int]:
    return [m.step for m in metas]


def hidden_entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".trash-")))


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)


def assert_same(a: Any, b: Any) -> None:
    """Equal values of the same types, recursively; tensors equal in dtype, shape and content."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


# --- round trip -------------------------------------------------------------------------------


def test_round_trip_restores_payload_and_writes_meta(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    random.seed(5)
    np_state: Any = np.random.RandomState(9).get_state()
    payload = {
        "model": OrderedDict(w=torch.randn(3, 4, generator=gen), b=torch.arange(4)),
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 4, generator=gen)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}],
        },
        "data": {"position": 12, "seed": 3},
        "rng": {
            "python": random.getstate(),
            "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "torch": torch.get_rng_state(),
        },
        "scale": 1.5,
        "flags": [True, None, "text"],
    }
    store = CheckpointStore(
        tmp_path / "ck", keep_last=3, config_hash="abc123", versions={"torch": "2.13", "x": None}
    )
    before = time.time()
    meta = store.save(
        1200,
        payload,
        tokens=4096,
        healthy=True,
        reason="periodic",
        train_loss=2.5,
        val_loss=2.75,
        extra={"note": "first", "lr_scale": 0.5},
    )
    after = time.time()

    loaded_meta, state = store.load("latest")
    assert loaded_meta == meta
    assert_same(state, payload)
    expected_next = random.random()
    random.setstate(state["rng"]["python"])
    assert random.random() == expected_next

    folder = tmp_path / "ck" / "step_00001200"
    assert sorted(p.name for p in folder.iterdir()) == [META_FILE, STATE_FILE]
    on_disk = json.loads((folder / META_FILE).read_text())
    assert set(on_disk) == META_FIELDS
    assert on_disk == meta.to_dict()
    assert (meta.name, meta.step, meta.seq, meta.tokens) == ("step_00001200", 1200, 1, 4096)
    assert (meta.healthy, meta.reason, meta.train_loss, meta.val_loss) == (
        True,
        "periodic",
        2.5,
        2.75,
    )
    assert meta.config_hash == "abc123" and meta.versions == {"torch": "2.13", "x": None}
    assert meta.extra == {"note": "first", "lr_scale": 0.5}
    assert before <= meta.created_at <= after
    digest = hashlib.sha256((folder / STATE_FILE).read_bytes()).hexdigest()
    assert meta.files == {STATE_FILE: digest}
    assert CheckpointMeta.from_dict(on_disk) == meta


def test_checkpoint_name_and_step_range() -> None:
    assert checkpoint_name(1200) == "step_00001200"
    assert checkpoint_name(0) == "step_00000000"
    for bad in (-1, 10**8, True):
        with pytest.raises(ValueError):
            checkpoint_name(bad)


def test_seq_continues_after_reopening(tmp_path: Path) -> None:
    save(CheckpointStore(tmp_path, keep_last=5), 1)
    save(CheckpointStore(tmp_path, keep_last=5), 2)
    store = CheckpointStore(tmp_path, keep_last=5)
    assert [m.seq for m in store.list()] == [1, 2]
    assert save(store, 3).seq == 3


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"step": "12"}, "'step'"),
        ({"healthy": "yes"}, "'healthy'"),
        ({"files": {"../state.pt": "0" * 64}}, "'files'"),
        ({"files": {STATE_FILE: "not-a-digest"}}, "'files'"),
        ({"val_loss": "low"}, "'val_loss'"),
        ({"name": "step_00000099"}, "does not match step"),
        ({"name": "../etc"}, "'name'"),
    ],
)
def test_meta_from_dict_rejects_bad_fields(tmp_path: Path, change: dict, problem: str) -> None:
    good = save(CheckpointStore(tmp_path, keep_last=1), 12).to_dict()
    with pytest.raises(CheckpointError, match=problem):
        CheckpointMeta.from_dict({**good, **change})
    del good["tokens"]
    with pytest.raises(CheckpointError, match=r"checkpoint step_00000012: .*'tokens'"):
        CheckpointMeta.from_dict(good)


# --- crash safety -----------------------------------------------------------------------------

CHILD = """
import sys
from pathlib import Path
import torch
from lossguard.agent.checkpoint.store import CheckpointStore

store = CheckpointStore(Path(sys.argv[1]), keep_last=2)
step = int(sys.argv[2])
while True:
    payload = {"step": step, "weights": torch.full((1 << 20,), float(step))}  # 4 MiB
    store.save(step, payload, tokens=step, healthy=step % 3 != 0, reason="crash test",
               val_loss=float((step * 7919) % 101))
    step += 1
"""


def exited_or_saved(child: subprocess.Popen[bytes], folder: Path) -> Callable[[], bool]:
    return lambda: child.poll() is not None or folder.is_dir()


def sigkill_rounds(root: Path, rounds: int, seed: int = 20240611) -> list[int]:
    """``rounds`` child processes, one after another, each saving 4 MiB checkpoints into
    ``root`` in a loop and SIGKILLed 0-0.3 s after its first save; after each kill the store
    holds nothing hidden and every checkpoint verifies and loads. The steps of the newest
    checkpoint after each round. (The soak: ``python -m benchmarks.bench_checkpoint_kills``.)"""
    script = root.parent / f"{root.name}-child.py"
    script.write_text(CHILD)
    root.mkdir()
    rng = random.Random(seed)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    newest = []
    for round_no in range(rounds):
        first = 1000 * round_no + 1
        child = subprocess.Popen(
            [sys.executable, str(script), str(root), str(first)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            wait_for(
                exited_or_saved(child, root / checkpoint_name(first)),
                timeout=60,
                what=f"the first checkpoint of round {round_no}",
            )
            assert child.poll() is None, child.stderr.read().decode() if child.stderr else ""
            time.sleep(rng.uniform(0.0, 0.3))  # the kill moment, not synchronisation
        finally:
            child.send_signal(signal.SIGKILL)
            child.communicate()

        store = CheckpointStore(root, keep_last=2)
        assert hidden_entries(root) == []
        metas = store.list()
        assert metas and metas[-1].step >= first
        assert all(m.name.startswith("step_") for m in metas)
        for meta in metas:
            store.verify(meta)
        meta, state = store.load("latest")
        assert meta == metas[-1]
        assert state["step"] == meta.step
        assert torch.equal(state["weights"], torch.full((1 << 20,), float(meta.step)))
        newest.append(meta.step)
    return newest


def test_sigkill_at_random_moments_never_leaves_a_broken_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Six rounds (each a kill at a fresh random moment of a fresh process); the soak runs
    more of the same rounds."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    caplog.set_level(logging.WARNING, logger=LISTING_LOGGER)
    assert len(sigkill_rounds(tmp_path / "ck", rounds=6)) == 6
    assert [r for r in caplog.records if r.name in (LOGGER, LISTING_LOGGER)] == []


def test_leftovers_are_invisible_and_removed_on_open(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=5)
    save(store, 1)
    shutil.copytree(tmp_path / "step_00000001", tmp_path / ".tmp-step_00000002-ab12")
    shutil.copytree(tmp_path / "step_00000001", tmp_path / ".trash-step_00000003-cd34")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "step_1").mkdir()
    assert names(store.list()) == ["step_00000001"]
    assert [m.name for m in store.resolve("latest")] == ["step_00000001"]
    CheckpointStore(tmp_path, keep_last=5)
    assert hidden_entries(tmp_path) == []
    assert (tmp_path / "notes.txt").exists()


# --- corruption -------------------------------------------------------------------------------


def test_flipped_byte_falls_back_to_previous_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path, keep_last=5)
    save(store, 1)
    bad = save(store, 2)
    state_path = tmp_path / bad.name / STATE_FILE
    data = bytearray(state_path.read_bytes())
    data[len(data) // 2] ^= 0x01
    state_path.write_bytes(bytes(data))

    with pytest.raises(CheckpointError, match=r"step_00000002: sha256 mismatch in state\.pt"):
        store.verify(bad)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    meta, state = store.load("latest")
    assert meta.step == 1 and state["step"] == 1
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert messages == [
        "checkpoint step_00000002 is unusable (sha256 mismatch in state.pt); trying step_00000001"
    ]


def test_every_candidate_unusable_raises_naming_the_target(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=5)
    for step in (1, 2):
        save(store, step)
        (tmp_path / checkpoint_name(step) / STATE_FILE).unlink()
    with pytest.raises(CheckpointError, match="no usable checkpoint for target 'latest'"):
        store.load("latest")


class Opaque:
    """Picklable, but not loadable with weights_only=True."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque)


def test_state_that_weights_only_refuses_is_unusable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path, keep_last=5)
    save(store, 1)
    store.save(2, {"obj": Opaque()}, tokens=0, healthy=True, reason="test")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    meta, _ = store.load(2)
    assert meta.step == 1
    assert "step_00000002 is unusable (cannot load state.pt" in caplog.text


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda path: path.unlink(), "meta.json is missing"),
        (lambda path: path.write_bytes(path.read_bytes()[:40]), "JSONDecodeError"),
        (lambda path: path.write_text('{"name": "step_00000002"}'), "lacks the field 'step'"),
    ],
)
def test_unreadable_meta_is_skipped_with_a_warning(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    damage: Callable[[Path], object],
    problem: str,
) -> None:
    store = CheckpointStore(tmp_path, keep_last=5)
    save(store, 1)
    save(store, 2)
    damage(tmp_path / "step_00000002" / META_FILE)
    caplog.set_level(logging.WARNING, logger=LISTING_LOGGER)
    assert steps(store.list()) == [1]
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("checkpoint step_00000002: ")
    assert problem in record.getMessage()
    assert store.load("latest")[0].step == 1


def test_meta_of_another_folder_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path, keep_last=5)
    save(store, 1)
    shutil.copytree(tmp_path / "step_00000001", tmp_path / "step_00000007")
    caplog.set_level(logging.WARNING, logger=LISTING_LOGGER)
    assert steps(store.list()) == [1]
    assert "checkpoint step_00000007: meta.json names step_00000001" in caplog.text


# --- retention --------------------------------------------------------------------------------


def on_disk(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_retention_keeps_last_best_last_good_and_pinned(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2)
    for step, val, healthy in [
        (1, 5.0, True),
        (2, 2.0, True),  # best
        (3, 3.0, True),
        (4, None, True),  # last good
        (5, 4.0, False),
        (6, None, False),
    ]:
        save(store, step, val_loss=val, healthy=healthy)
    assert on_disk(tmp_path) == [checkpoint_name(s) for s in (2, 4, 5, 6)]
    assert store.retained(store.list()) == {checkpoint_name(s) for s in (2, 4, 5, 6)}

    store.pin("step_00000005")
    save(store, 7, healthy=True)  # the new last good: 4 goes, 5 is pinned
    assert on_disk(tmp_path) == [checkpoint_name(s) for s in (2, 5, 6, 7)]

    store.unpin("step_00000005")
    save(store, 8, val_loss=1.0, healthy=False)  # the new best: 2 goes, and 5, 6
    assert on_disk(tmp_path) == [checkpoint_name(s) for s in (7, 8)]
    assert store.apply_retention() == []


def test_apply_retention_returns_removed_names(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=5)
    for step in range(1, 5):
        save(store, step)
    store.keep_last = 1
    assert store.apply_retention() == [checkpoint_name(s) for s in (1, 2, 3)]
    assert on_disk(tmp_path) == ["step_00000004"]


def test_pin_needs_an_existing_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2)
    save(store, 1)
    for name in ("step_00000002", "../step_00000001", str(tmp_path / "step_00000001")):
        with pytest.raises(CheckpointError, match="cannot pin"):
            store.pin(name)


# --- resolve ----------------------------------------------------------------------------------


def test_resolve_orders_candidates(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=10)
    save(store, 10, val_loss=3.0, healthy=True)
    save(store, 20, val_loss=1.0, healthy=True)
    save(store, 30, val_loss=1.0, healthy=False)
    save(store, 40, val_loss=None, healthy=False)
    save(store, 50, val_loss=float("nan"), healthy=False)

    assert steps(store.resolve("latest")) == [50, 40, 30, 20, 10]
    assert steps(store.resolve("best")) == [30, 20, 10]  # tie on 1.0: the newer first
    assert steps(store.resolve("last_good")) == [20, 10]
    assert steps(store.resolve(30)) == [30, 20, 10]
    assert steps(store.resolve(10)) == [10]

    replayed = save(store, 20, val_loss=2.0, healthy=True)  # the same step after a rollback
    assert replayed.seq == 6 and hidden_entries(tmp_path) == []
    assert [(m.step, m.seq) for m in store.list()] == [(10, 1), (30, 3), (40, 4), (50, 5), (20, 6)]
    assert steps(store.resolve("latest")) == [20, 50, 40, 30, 10]
    assert steps(store.resolve("best")) == [30, 20, 10]
    assert steps(store.resolve(20)) == [20, 10]  # never 30..50 of the abandoned timeline
    assert steps(store.resolve(30)) == [30, 10]


def test_resolve_rejects_unknown_targets_and_empty_stores(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2)
    for target in ("latest", "best", "last_good", 0):
        with pytest.raises(CheckpointError, match=f"no checkpoint matches target {target!r}"):
            store.resolve(target)
    with pytest.raises(CheckpointError, match="no checkpoint matches"):
        store.load("latest")
    save(store, 1, healthy=False)
    with pytest.raises(CheckpointError, match="no checkpoint matches target 'best'"):
        store.resolve("best")
    with pytest.raises(CheckpointError, match="no checkpoint matches target 1200 in "):
        store.resolve(1200)
    for target in ("../etc", "/tmp/x", str(tmp_path / "step_00000001"), "step_00000001", "1"):
        with pytest.raises(CheckpointError, match="unknown checkpoint target"):
            store.load(target)
    for bad in (True, 1.0, None):
        with pytest.raises(CheckpointError, match="unknown checkpoint target"):
            store.resolve(bad)  # type: ignore[arg-type]


# --- async saves ------------------------------------------------------------------------------


class Gate:
    """Holds a save in flight while it is being pickled, until the test opens the gate."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def __reduce__(self) -> tuple[type, tuple[int]]:
        self.entered.set()
        assert self.opened.wait(30)
        return int, (0,)


def test_save_async_keeps_one_save_in_flight(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=5)
    events: list[tuple[str, int]] = []
    threads: list[threading.Thread] = []

    def on_done(result: CheckpointMeta | BaseException) -> None:
        assert isinstance(result, CheckpointMeta)
        threads.append(threading.current_thread())
        events.append(("done", result.step))

    gate = Gate()
    store.save_async(1, {"gate": gate}, tokens=1, healthy=True, reason="a", on_done=on_done)
    assert gate.entered.wait(30)
    assert store.in_progress
    store.wait(timeout=0.05)
    assert store.in_progress

    def submit_second() -> None:
        payload = snapshot({"w": torch.ones(3)})
        store.save_async(2, payload, tokens=2, healthy=True, reason="b", on_done=on_done)
        events.append(("submitted", 2))

    second = threading.Thread(target=submit_second)
    second.start()
    second.join(timeout=0.3)
    assert second.is_alive(), "a second save_async must wait for the save in flight"
    assert events == []

    gate.opened.set()
    second.join(timeout=30)
    assert not second.is_alive()
    store.wait()
    assert not store.in_progress
    assert events.index(("done", 1)) < events.index(("submitted", 2)) < events.index(("done", 2))
    assert all(t is not threading.main_thread() for t in threads)
    assert steps(store.list()) == [1, 2]
    assert store.load("latest")[1]["w"].tolist() == [1.0, 1.0, 1.0]


def test_failed_async_save_reports_and_leaves_nothing(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=5)
    save(store, 1)
    results: list[CheckpointMeta | BaseException] = []
    store.save_async(
        2, {"f": lambda: 0}, tokens=2, healthy=True, reason="x", on_done=results.append
    )
    store.wait()
    assert not store.in_progress
    [error] = results
    assert isinstance(error, CheckpointError)
    assert str(error).startswith("checkpoint step_00000002: save failed (")
    assert "pickle" in str(error)
    assert "\n" not in str(error)
    assert on_disk(tmp_path) == ["step_00000001"]
    with pytest.raises(CheckpointError, match="save failed"):
        store.save(3, {"f": lambda: 0}, tokens=3, healthy=True, reason="x")
    assert on_disk(tmp_path) == ["step_00000001"]


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_async_save_writes_at_the_lowest_cpu_priority(tmp_path: Path) -> None:
    """The writer thread runs at nice 19; the thread that asked for the save keeps its own."""
    store = CheckpointStore(tmp_path, keep_last=5)
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[int] = []

    def on_done(result: CheckpointMeta | BaseException) -> None:
        assert isinstance(result, CheckpointMeta)
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    store.save_async(
        1, snapshot({"w": torch.ones(3)}), tokens=1, healthy=True, reason="a", on_done=on_done
    )
    store.wait()
    assert seen == [19]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own
    assert steps(store.list()) == [1]


def test_failing_on_done_is_logged_and_the_store_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path, keep_last=5)
    calls: list[str] = []

    def on_done(result: CheckpointMeta | BaseException) -> None:
        calls.append("called")
        store.wait()  # not allowed from the writer thread: raises CheckpointError

    store.save_async(1, {"x": 1}, tokens=1, healthy=True, reason="a", on_done=on_done)
    store.wait()
    assert calls == ["called"]
    assert "checkpoint on_done callback failed" in caplog.text
    assert "from on_done" in caplog.text
    assert steps([save(store, 2)]) == [2]
    assert steps(store.list()) == [1, 2]


# --- snapshot ---------------------------------------------------------------------------------

Pair = namedtuple("Pair", "first second")


def test_snapshot_copies_tensors_and_keeps_structure() -> None:
    model = torch.nn.Linear(3, 2)
    state = model.state_dict()
    wide = torch.arange(12.0).reshape(3, 4)
    original: dict[str, Any] = {
        "model": state,
        "param": model.weight,
        "nested": [wide.t(), (torch.ones(2), 3, "s"), Pair(torch.zeros(1), None)],
        "scalars": {"lr": 0.1, "step": 7, "flag": True, "raw": b"xy"},
    }
    copied = snapshot(original)
    expected: dict[str, Any] = {
        "model": {k: v.detach().clone() for k, v in state.items()},
        "nested": [wide.t().clone(), (torch.ones(2), 3, "s"), Pair(torch.zeros(1), None)],
    }

    with torch.no_grad():
        for tensor in state.values():
            tensor.add_(100.0)
    wide.fill_(-1.0)
    original["nested"][1][0].fill_(9.0)
    original["nested"][2].first.fill_(9.0)

    assert type(copied["model"]) is OrderedDict
    assert copied["model"]._metadata == state._metadata  # type: ignore[attr-defined]
    for key, tensor in copied["model"].items():
        assert torch.equal(tensor, expected["model"][key])
        assert not tensor.requires_grad and tensor.data_ptr() != state[key].data_ptr()
    assert_same(copied["nested"], expected["nested"])
    assert copied["nested"][0].is_contiguous()
    assert not copied["param"].requires_grad
    assert torch.equal(copied["param"], expected["model"]["weight"])
    assert copied["scalars"] == original["scalars"]
    assert copied["scalars"] is not original["scalars"]

    model.load_state_dict(copied["model"])  # still a valid state dict


@pytest.mark.gpu
def test_snapshot_of_cuda_tensors_is_pinned_and_complete() -> None:
    source = torch.randn(1 << 22, device="cuda")
    expected = source.cpu()
    copied = snapshot({"x": source})["x"]
    source.fill_(0.0)
    assert copied.device.type == "cpu" and copied.is_pinned()
    assert torch.equal(copied, expected)

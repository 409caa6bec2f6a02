"""Data: byte-tokenised text, token files, and sampling as a pure function of position."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lossguard.agent.config import DataConfig
from lossguard.agent.train.corpus import (
    BatchSampler,
    DataError,
    TokenData,
    load_data,
    prepare_text_corpus,
    stdlib_source_dir,
    text_files,
)

STREAM = np.arange(5000, dtype=np.uint16) % 251
DATA = TokenData(256, STREAM, STREAM[:900], "test stream")


def sampler(**kw: int) -> BatchSampler:
    args = {"block_size": 16, "batch_size": 4, "grad_accum": 2, "seed": 3, **kw}
    return BatchSampler(DATA, **args)


@settings(max_examples=60, deadline=None)
@given(
    skips=st.lists(st.integers(0, 50), max_size=5),
    steps_before=st.integers(0, 5),
    seed=st.integers(0, 2**31),
)
def test_batch_depends_only_on_position(skips: list[int], steps_before: int, seed: int) -> None:
    walked = sampler(seed=seed)
    for _ in range(steps_before):
        walked.next_step()
    for n in skips:
        walked.skip(n)
    position = walked.position
    assert position == steps_before + sum(skips)
    fresh = sampler(seed=seed)
    fresh.load_state_dict(walked.state_dict())
    got, expected = walked.next_step(), [fresh.batch(position, m) for m in range(2)]
    for (x1, y1), (x2, y2) in zip(got, expected, strict=True):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)


def test_sampling_is_deterministic_and_seeded() -> None:
    a, b, c = sampler(), sampler(), sampler(seed=4)
    np.testing.assert_array_equal(a.batch(7, 1)[0], b.batch(7, 1)[0])
    assert not np.array_equal(a.batch(7, 1)[0], c.batch(7, 1)[0])
    assert not np.array_equal(a.batch(7, 0)[0], a.batch(7, 1)[0])
    assert not np.array_equal(a.batch(7, 0)[0], a.batch(8, 0)[0])


def test_targets_are_inputs_shifted_by_one() -> None:
    x, y = sampler().batch(0)
    assert x.shape == y.shape == (4, 16) and x.dtype == np.int64
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    # STREAM counts up modulo 251, so a contiguous window does too
    np.testing.assert_array_equal((x[:, :-1] + 1) % 251, x[:, 1:])
    assert int(x.max()) < 256


def test_ranks_split_the_same_global_batch() -> None:
    whole = sampler(batch_size=8).batch(5, 1)[0]
    shards = [sampler(batch_size=4, rank=r, world_size=2).batch(5, 1)[0] for r in (0, 1)]
    np.testing.assert_array_equal(np.concatenate(shards), whole)


def test_validation_batches_are_fixed() -> None:
    s = sampler()
    first = [x for x, _ in s.val_batches(3)]
    s.next_step()
    again = [x for x, _ in s.val_batches(3)]
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(first) == 3


def test_too_little_data_names_the_block_size() -> None:
    with pytest.raises(DataError, match=r"val split has 900 tokens, too few for model.block_size"):
        BatchSampler(DATA, block_size=1000, batch_size=1, grad_accum=1, seed=0)


def test_negative_skip_is_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        sampler().skip(-1)


def test_text_folder_is_tokenised_as_bytes_and_cached(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("héllo wörld\n" * 50, encoding="utf-8")
    (corpus / "sub" / "b.txt").write_text("second file\n" * 50, encoding="utf-8")
    (corpus / "blob.txt").write_bytes(b"\xff\xfe\x00binary")
    (corpus / "skip.md").write_text("not included")
    cfg = DataConfig(kind="text", path=corpus, include=["*.txt"], val_fraction=0.1)
    folder = prepare_text_corpus(cfg, tmp_path / "cache")
    data = load_data(cfg, tmp_path / "cache", None)
    assert data.vocab_size == 256 and data.train is not None and data.val is not None
    text = bytes(np.concatenate([data.train, data.val]).astype(np.uint8)).decode("utf-8")
    assert text == "héllo wörld\n" * 50 + "\n" + "second file\n" * 50  # binary file skipped
    assert len(data.val) == len(text.encode()) - int(len(text.encode()) * 0.9)
    mtime = (folder / "train.bin").stat().st_mtime_ns
    assert prepare_text_corpus(cfg, tmp_path / "cache") == folder
    assert (folder / "train.bin").stat().st_mtime_ns == mtime  # reused, not rewritten
    (corpus / "a.txt").write_text("changed\n" * 60, encoding="utf-8")
    assert prepare_text_corpus(cfg, tmp_path / "cache") != folder  # a changed corpus re-caches


def test_max_bytes_caps_the_corpus(tmp_path: Path) -> None:
    (tmp_path / "big.txt").write_text("x" * 10_000)
    cfg = DataConfig(kind="text", path=tmp_path / "big.txt", max_bytes=1000)
    data = load_data(cfg, tmp_path / "cache", None)
    assert data.train is not None and data.val is not None
    assert len(data.train) + len(data.val) == 1000


def test_text_needs_the_byte_vocabulary(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("text " * 100)
    with pytest.raises(DataError, match=r"^model.vocab_size: must be >= 256"):
        load_data(DataConfig(kind="text", path=tmp_path / "a.txt"), tmp_path / "cache", 100)


def test_empty_text_folder_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "corpus").mkdir()
    cfg = DataConfig(kind="text", path=tmp_path / "corpus", include=["*.txt"])
    with pytest.raises(DataError, match=r"^data.path: no files matching"):
        load_data(cfg, tmp_path / "cache", None)


def test_default_corpus_is_the_stdlib_sources() -> None:
    root = stdlib_source_dir()
    files = text_files(root, ["*.py"])
    names = {f.relative_to(root).as_posix() for f in files}
    assert "os.py" in names and "json/__init__.py" in names
    assert not any("site-packages" in n or "__pycache__" in n for n in names)
    assert files == sorted(files, key=lambda f: f.relative_to(root).as_posix())


def test_text_files_match_every_pattern_in_path_order_and_skip_package_folders(
    tmp_path: Path,
) -> None:
    for name in ["b.py", "a/z.txt", "a/b/c.py", "a/notes.md", "site-packages/x.py", ".git/y.py"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    files = text_files(tmp_path, ["*.py", "*.txt"])
    assert [f.relative_to(tmp_path).as_posix() for f in files] == ["a/b/c.py", "a/z.txt", "b.py"]


def test_nanogpt_token_files_are_memory_mapped(tmp_path: Path) -> None:
    tokens = np.random.default_rng(0).integers(0, 50257, size=3000).astype(np.uint16)
    tokens[:2000].tofile(tmp_path / "train.bin")
    tokens[2000:].tofile(tmp_path / "val.bin")
    cfg = DataConfig(kind="tokens", path=tmp_path)
    data = load_data(cfg, tmp_path / "cache", None)
    assert data.vocab_size == 50304 and isinstance(data.train, np.memmap)
    np.testing.assert_array_equal(np.asarray(data.val), tokens[2000:])
    x, _ = BatchSampler(data, block_size=32, batch_size=2, grad_accum=1, seed=1).batch(0)
    assert x.max() < 50257


def test_synthetic_data_has_the_vocabulary() -> None:
    data = load_data(DataConfig(kind="synthetic"), Path("unused"), 1000)
    x, y = BatchSampler(data, block_size=8, batch_size=3, grad_accum=1, seed=1).batch(2)
    assert x.shape == (3, 8) and x.min() >= 0 and x.max() < 1000
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])

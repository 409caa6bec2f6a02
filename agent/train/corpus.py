"""Training data: nanoGPT token files, byte-tokenised text, and a position-addressed sampler.

Torch-free. A batch is a pure function of (seed, step index, micro-step, rank), so the data
position is one integer that a checkpoint can store, and skipping N batches costs nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from lossguard.agent.config import DataConfig
from lossguard.common.config import ConfigError
from lossguard.common.ownership import PRIVATE_DIR, claim_directory

BYTE_VOCAB_SIZE = 256
GPT2_PADDED_VOCAB_SIZE = 50304
TOKEN_DTYPE = np.uint16
SKIPPED_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages", ".git"})
_SPLIT_IDS = {"train": 0, "val": 1}

Batch = tuple[np.ndarray, np.ndarray]


class DataError(ConfigError):
    """The data cannot be used as configured; the message names the key and the reason."""


@dataclass(frozen=True)
class TokenData:
    """Token streams of the train and val splits (None for synthetic data)."""

    vocab_size: int
    train: np.ndarray | None
    val: np.ndarray | None
    description: str


def stdlib_source_dir() -> Path:
    """Folder of the running Python's standard library sources: the demo corpus."""
    return Path(sysconfig.get_paths()["stdlib"])


def text_files(root: Path, include: list[str]) -> list[Path]:
    """The files of a text corpus in a stable order: ``root`` itself, or matches under it
    (``SKIPPED_DIRS`` are not entered)."""
    if root.is_file():
        return [root]
    found: list[tuple[str, Path]] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
        for name in names:
            path = Path(folder, name)
            relative = PurePosixPath(path.relative_to(root).as_posix())
            if any(relative.match(pattern) for pattern in include) and path.is_file():
                found.append((relative.as_posix(), path))
    return [path for _, path in sorted(found)]


def _corpus_key(root: Path, files: list[Path], cfg: DataConfig) -> str:
    listing = [
        (f.relative_to(root).as_posix() if f != root else f.name, f.stat().st_size) for f in files
    ]
    blob = json.dumps(
        [str(root.resolve()), cfg.include, cfg.max_bytes, cfg.val_fraction, listing]
    ).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _read_utf8_corpus(files: list[Path], max_bytes: int | None) -> bytes:
    chunks: list[bytes] = []
    total = 0
    for path in files:
        raw = path.read_bytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        chunks.append(raw)
        total += len(raw) + 1
        if max_bytes is not None and total >= max_bytes:
            break
    corpus = b"\n".join(chunks)
    return corpus[:max_bytes] if max_bytes is not None else corpus


def cache_dir(cfg: DataConfig, runs: Path) -> Path:
    """Where tokenised text is cached: ``data.cache_dir``, else this user's own folder in the
    runs folder, ``<run.dir>/.cache-<uid>`` (in a shared runs folder, another user's files are
    never taken for it)."""
    return cfg.cache_dir if cfg.cache_dir is not None else runs / f".cache-{os.geteuid()}"


def claim_cache(folder: Path) -> None:
    """Make ``folder`` this user's private cache (0700), or check that the existing one is
    (``claim_directory``): anyone who can write in it could plant the tokens a run trains on;
    anyone who can read it, read the data."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        claim_directory(folder, PRIVATE_DIR, instead="set data.cache_dir to a folder of your own")
    except ValueError as exc:
        raise DataError(f"data cache: {exc}") from None


def _write_splits(out_dir: Path, tokens: np.ndarray, val_fraction: float) -> None:
    """Write train.bin/val.bin (0600) into ``out_dir`` (0700), which appears whole or not at
    all."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    cut = int(len(tokens) * (1.0 - val_fraction))
    for name, part in (("train.bin", tokens[:cut]), ("val.bin", tokens[cut:])):
        private = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with open(private, "wb") as fh:
            part.astype(TOKEN_DTYPE).tofile(fh)
            fh.flush()
            os.fsync(fh.fileno())
    try:
        os.rename(tmp, out_dir)
    except OSError:  # another rank or process finished the same cache first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out_dir / "val.bin").is_file():
            raise


def prepare_text_corpus(cfg: DataConfig, cache_dir: Path) -> Path:
    """Tokenise UTF-8 text as bytes into a cached train.bin/val.bin folder of ``cache_dir``
    (``claim_cache``) and return it."""
    root = cfg.path if cfg.path is not None else stdlib_source_dir()
    files = text_files(root, cfg.include)
    if not files:
        raise DataError(f"data.path: no files matching {cfg.include} under {root}")
    claim_cache(cache_dir)
    out_dir = cache_dir / f"text-{_corpus_key(root, files, cfg)}"
    if (out_dir / "val.bin").is_file():
        return out_dir
    corpus = _read_utf8_corpus(files, cfg.max_bytes)
    if not corpus:
        raise DataError(f"data.path: no UTF-8 text in the files under {root}")
    _write_splits(out_dir, np.frombuffer(corpus, dtype=np.uint8), cfg.val_fraction)
    return out_dir


def open_token_dir(path: Path, vocab_size: int, description: str) -> TokenData:
    """Memory-map a nanoGPT-format folder (train.bin and val.bin, uint16 tokens)."""
    splits = [np.memmap(path / f"{s}.bin", dtype=TOKEN_DTYPE, mode="r") for s in _SPLIT_IDS]
    return TokenData(vocab_size, splits[0], splits[1], description)


def load_data(cfg: DataConfig, cache_dir: Path, vocab_size: int | None) -> TokenData:
    """Open the configured data; ``cache_dir`` holds tokenised text."""
    if cfg.kind == "synthetic":
        vocab = vocab_size or GPT2_PADDED_VOCAB_SIZE
        return TokenData(vocab, None, None, f"synthetic uniform tokens, vocab {vocab}")
    if cfg.kind == "tokens":
        assert cfg.path is not None  # guaranteed by DataConfig validation
        return open_token_dir(cfg.path, vocab_size or GPT2_PADDED_VOCAB_SIZE, str(cfg.path))
    if vocab_size is not None and vocab_size < BYTE_VOCAB_SIZE:
        raise DataError(f"model.vocab_size: must be >= {BYTE_VOCAB_SIZE} for byte-tokenised text")
    root = cfg.path if cfg.path is not None else stdlib_source_dir()
    folder = prepare_text_corpus(cfg, cache_dir)
    return open_token_dir(folder, vocab_size or BYTE_VOCAB_SIZE, f"text {root} (bytes)")


class BatchSampler:
    """Draws (input, target) batches at a position: a pure function of its arguments.

    A step's global batch is ``world_size * batch_size`` sequences per micro-step, drawn from
    ``(seed, split, index, micro_step)``; rank r takes the r-th slice, so any number of ranks
    sees the same global batch. ``position`` is the index of the next training step's batch.
    """

    def __init__(
        self,
        data: TokenData,
        *,
        block_size: int,
        batch_size: int,
        grad_accum: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.data = data
        self.block_size = block_size
        self.batch_size = batch_size
        self.grad_accum = grad_accum
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.position = 0
        for name in _SPLIT_IDS:
            tokens = getattr(data, name)
            if tokens is not None and len(tokens) <= block_size + 1:
                raise DataError(
                    f"data: the {name} split has {len(tokens)} tokens, too few for "
                    f"model.block_size {block_size}"
                )

    @property
    def tokens_per_step(self) -> int:
        """Tokens this rank trains on per optimizer step."""
        return self.batch_size * self.grad_accum * self.block_size

    def batch(self, index: int, micro_step: int = 0, split: str = "train") -> Batch:
        """This rank's (x, y) int64 arrays of shape (batch_size, block_size)."""
        rng = np.random.default_rng([self.seed, _SPLIT_IDS[split], index, micro_step])
        global_rows = self.world_size * self.batch_size
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        tokens = getattr(self.data, split)
        if tokens is None:
            rows = rng.integers(0, self.data.vocab_size, size=(global_rows, self.block_size + 1))
            window = rows[mine]
        else:
            starts = rng.integers(0, len(tokens) - self.block_size, size=global_rows)[mine]
            window = tokens[starts[:, None] + np.arange(self.block_size + 1)]
        window = window.astype(np.int64)
        return window[:, :-1], window[:, 1:]

    def next_step(self) -> list[Batch]:
        """The micro-batches of the next optimizer step; advances the position by one."""
        batches = [self.batch(self.position, m) for m in range(self.grad_accum)]
        self.position += 1
        return batches

    def skip(self, n: int) -> None:
        """Pass over ``n`` step batches without reading them."""
        if n < 0:
            raise ValueError("cannot skip a negative number of batches")
        self.position += n

    def val_batches(self, count: int) -> Iterator[Batch]:
        """A fixed set of validation batches, the same at every evaluation."""
        return (self.batch(i, 0, split="val") for i in range(count))

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        self.seed = int(state["seed"])

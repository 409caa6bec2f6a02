"""A step's token statistics on the device, the ring that keeps them, and how a diagnosis judges a
batch against the run's own: a batch of random ids, of padding or of one repeated sequence is
unlike the run's data, an ordinary one is not; precision histories likewise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lossguard.agent.telemetry.batch_judge import MIN_HISTORY, judge
from lossguard.agent.telemetry.batch_tokens import (
    RING,
    BatchTokens,
    slots,
    token_statistics,
    vocabulary_of,
)
from lossguard.agent.telemetry.diagnosis import PrecisionHistory, diagnose
from tests.agent.telemetry.test_diagnosis import context
from tests.support.host_reads import count_host_reads

pytestmark = pytest.mark.live

VOCAB = 256
ROWS, COLUMNS = 8, 64


def test_statistics_are_exact() -> None:
    entropy, distinct = token_statistics(torch.tensor([[3, 1], [1, 2]])).tolist()
    assert entropy == pytest.approx(1.5)  # counts 2, 1, 1 of 4: (1 + 1 + 2 + 2) / 4 bits
    assert distinct == pytest.approx(0.75)
    padding = token_statistics(torch.zeros(ROWS, COLUMNS, dtype=torch.long)).tolist()
    assert padding == [0.0, 1 / (ROWS * COLUMNS)]


def counted(ids: np.ndarray) -> list[float]:
    """The statistics from a count of the ids (numpy's), the definitions written out."""
    _, inverse, counts = np.unique(ids.reshape(-1), return_inverse=True, return_counts=True)
    share = counts[inverse] / ids.size
    return [float(-np.log2(share).mean()), len(counts) / ids.size]


@pytest.mark.parametrize("vocabulary", [256, 50_257, 128_256])
def test_statistics_match_a_count_of_the_ids(vocabulary: int) -> None:
    rng = np.random.default_rng(vocabulary)
    for size in (1, 7, 512, 12_288):
        ids = rng.integers(0, vocabulary, size=size)
        ids[: size // 3] = ids[0]  # some repeats
        table = torch.zeros(slots(vocabulary), dtype=torch.int32)
        for dtype in (torch.int64, torch.int32):
            got = token_statistics(torch.from_numpy(ids).to(dtype), table).tolist()
            assert got == pytest.approx(counted(ids), rel=1e-12, abs=1e-12)


def test_the_table_fits_the_vocabulary_and_larger_ids_share_slots() -> None:
    assert [slots(v) for v in (None, 256, 257, 50_257, 10**9)] == [2**17, 256, 512, 2**16, 2**20]
    model = torch.nn.Sequential(torch.nn.Embedding(50_257, 4), torch.nn.Embedding(64, 4))
    assert vocabulary_of(model) == 50_257 and vocabulary_of(torch.nn.Linear(2, 2)) is None
    wide = np.array([5, 5 + 256, 9, 300])  # 5 and 261 share slot 5 of a 256-slot table
    table = torch.zeros(256, dtype=torch.int32)
    assert token_statistics(torch.from_numpy(wide), table).tolist() == pytest.approx(
        counted(wide % 256)
    )


def zipf_batches(count: int, seed: int = 0) -> list[np.ndarray]:
    """Batches like text: ids drawn with Zipf-like frequencies from a 256-id vocabulary."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, VOCAB + 1)
    order = rng.permutation(VOCAB)
    return [
        order[rng.choice(VOCAB, size=(ROWS, COLUMNS), p=weights / weights.sum())]
        for _ in range(count)
    ]


def ring_with(batches: list[np.ndarray]) -> BatchTokens:
    ring = BatchTokens(torch.device("cpu"))
    for step, batch in enumerate(batches, start=1):
        ring.observe(step, torch.from_numpy(batch))
    return ring


def test_recording_a_step_reads_nothing_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    batches = [torch.from_numpy(batch) for batch in zipf_batches(5)]
    ring = BatchTokens(torch.device("cpu"))
    reads = count_host_reads(monkeypatch)
    for step, batch in enumerate(batches, start=1):
        ring.observe(step, [batch[:4], batch[4:]])
    assert reads == []
    assert len(ring.read(5)) == 5 and reads == ["tolist"]  # the one read, at a diagnosis


@pytest.mark.gpu
def test_recording_never_syncs_on_cuda() -> None:
    batches = [torch.from_numpy(batch) for batch in zipf_batches(20)]
    on_cuda = [batch.cuda() for batch in batches]
    ring = BatchTokens(torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step, batch in enumerate(on_cuda, start=1):
            ring.observe(step, [batch[:4], batch[4:]])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got, expected = ring.read(20), ring_with([b.numpy() for b in batches]).read(20)
    assert got.keys() == expected.keys()
    assert all(got[step] == pytest.approx(expected[step]) for step in got)


def test_the_ring_keeps_the_last_steps_of_this_timeline() -> None:
    ring = ring_with(zipf_batches(RING + 40))
    steps = sorted(ring.read(RING + 40))
    assert steps == list(range(41, RING + 41))  # the oldest were overwritten
    assert sorted(ring.read(100)) == list(range(41, 101))  # a restore to 100: later ones left out
    micro = [torch.tensor([[3, 1]]), torch.tensor([[1, 2]])]
    ring.observe(101, micro)  # micro-batches count as one step's batch
    assert ring.read(101)[101] == pytest.approx((1.5, 0.75))
    with pytest.raises(TypeError, match="token ids must be integer tensors"):
        ring.observe(102, torch.zeros(2, 3))


@pytest.mark.parametrize(
    ("kind", "direction"),
    [("random", 1.0), ("padding", -1.0), ("repeated", -1.0), ("ordinary", 0.0)],
)
def test_a_batch_is_judged_against_the_run(kind: str, direction: float) -> None:
    batches = zipf_batches(120)
    rng = np.random.default_rng(99)
    odd = {
        "random": rng.integers(0, VOCAB, size=(ROWS, COLUMNS)),
        "padding": np.zeros((ROWS, COLUMNS), dtype=np.int64),
        "repeated": np.tile(batches[0][:1], (ROWS, 1)),
        "ordinary": zipf_batches(1, seed=5)[0],
    }[kind]
    judgement = judge(121, ring_with([*batches, odd]).read(121))
    assert judgement is not None and judgement.history == 120
    if direction == 0.0:
        assert judgement.unlike == ()
        assert judgement.as_dict()["unlike"] is False
        return
    furthest = judgement.unlike[0]
    assert furthest.zscore * direction > 6.0, judgement
    assert judgement.as_dict()["unlike"] is True


def test_too_little_history_or_an_unseen_step_is_not_judged() -> None:
    history = ring_with(zipf_batches(MIN_HISTORY)).read(MIN_HISTORY)
    assert judge(MIN_HISTORY, history) is None  # MIN_HISTORY - 1 others
    assert judge(MIN_HISTORY + 5, history) is None
    more = ring_with(zipf_batches(MIN_HISTORY + 1)).read(MIN_HISTORY + 1)
    assert judge(MIN_HISTORY + 1, more) is not None


def test_the_diagnosis_names_a_batch_unlike_the_run_or_says_it_is_ordinary() -> None:
    usual = {step: (4.4 + 0.01 * (step % 5), 0.10) for step in range(20, 110)}
    spike = {"spike_step": 105.0, "spike_value": 9.0, "spike_mean": 2.0, "spike_std": 0.5}
    burst = {"spike_step": 105.0, "spike_value": 40.0, "spike_mean": 1.0}
    seen = {
        "loss": {"nonfinite_step": -1.0, "mean": 2.0, "std": 0.1, **spike},
        "grad_norm": {"nonfinite_step": -1.0, "mean": 1.0, "std": 0.1, **burst},
    }
    known = context(batch_tokens=[usual])
    odd = context(batch_tokens=[{**usual, 105: (7.6, 0.44)}])
    diagnosis = diagnose("loss", nonfinite=False, stats=seen, context=odd)
    assert diagnosis["causes"] == [
        "the batch at data position 504 is unlike the run's data: distinct token ids 44% of "
        "the batch against a typical 10%, token entropy 7.6 bits against a typical 4.42",
        "gradient norm 40x its window mean",
    ]
    tokens = diagnosis["batch_tokens"]
    assert tokens["unlike"] and tokens["entropy"] == 7.6 and tokens["typical_distinct"] == 0.1
    assert tokens["rank"] == 0
    ordinary = diagnose("loss", nonfinite=False, stats=seen, context=known)
    assert ordinary["causes"] == [
        "gradient norm 40x its window mean on the batch at data position 504, with learning "
        "rate on schedule, no precision change and tokens like the run's data"
    ]
    quiet = {**seen, "grad_norm": {"nonfinite_step": -1.0, "mean": 1.0, "spike_step": -1.0}}
    assert diagnose("loss", nonfinite=False, stats=quiet, context=known)["causes"] == [
        "nothing stands out (learning rate on schedule, no gradient-norm or precision change, "
        "tokens like the run's data): the batch at data position 504 is what is left to check"
    ]


def test_precision_history_keeps_the_lowest_scale_and_the_highest_overflow() -> None:
    history = PrecisionHistory()
    for scale in (65536.0, 32768.0, 65536.0):
        history.loss_scale_seen(scale)
    assert (history.loss_scale_before, history.loss_scale_low) == (65536.0, 32768.0)
    for ratio in (0.0, 0.01, 0.002):
        history.fp8_seen(ratio)
    assert history.fp8_high == 0.01  # not the last sample's: the run's highest


def test_under_torchrun_the_share_furthest_from_its_rank_s_run_is_named() -> None:
    usual = {step: (4.4 + 0.01 * (step % 5), 0.10) for step in range(20, 110)}
    seen = {
        "loss": {"nonfinite_step": 105.0, "mean": 2.0, "std": 0.1, "spike_step": -1.0},
        "grad_norm": {"nonfinite_step": -1.0, "mean": 1.0, "spike_step": -1.0},
    }
    padded = {**usual, 105: (0.0, 0.002)}  # a share of step 105 that is all padding
    shares = context(batch_tokens=[usual, usual, padded, {}])  # rank 3: no ids seen
    diagnosis = diagnose("loss", nonfinite=True, stats=seen, context=shares)
    assert diagnosis["batch_tokens"]["rank"] == 2
    assert diagnosis["batch_tokens"]["unlike_ranks"] == [2]
    assert diagnosis["causes"] == [
        "the batch at data position 504 (rank 2's share) is unlike the run's data: token "
        "entropy 0 bits against a typical 4.42, distinct token ids 0.2% of the batch against "
        "a typical 10%"
    ]
    random = {**usual, 105: (7.6, 0.44)}  # further from the run's than the padding
    shares = context(batch_tokens=[usual, padded, random])
    diagnosis = diagnose("loss", nonfinite=True, stats=seen, context=shares)
    assert diagnosis["batch_tokens"]["unlike_ranks"] == [1, 2]
    assert diagnosis["causes"][0].startswith(
        "the batch at data position 504 (the shares of ranks 2, 1) is unlike the run's data: "
        "distinct token ids 44% of the batch"
    )

"""What the diagnosis says about each fault drill, on the built-in trainer: the cause the drill
planted when there is one to see (a learning rate off its schedule, a batch of random tokens,
FP8 overflow), and "nothing stands out" (the data included) where a drill leaves no other trace
(scaled activations, a NaN loss)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from lossguard.agent.config import parse_config
from lossguard.agent.train.trainer import Trainer
from tests.agent.checkpoint.test_sharded import finished, torchrun
from tests.support.runs import events, sliced_settings, write_config

pytestmark = pytest.mark.live

FAULT_STEP = 60
QUIET = "learning rate on schedule"


def diagnoses(
    tmp_path: Path, cache: Path, fault: dict[str, Any], at: int = FAULT_STEP, **sections: Any
) -> list[dict]:
    """Train the tiny model 66 steps (warm-up 30) with ``fault`` at step 60, the spike window
    short enough to forget the warm-up's falling loss; the diagnoses of the detections, the
    first of which must be at step ``at``."""
    settings = sliced_settings(
        tmp_path / "runs",
        cache,
        train={"max_steps": 66, "warmup_steps": 30, "log_every": 3, "eval_every": 1000},
        snapshot={"every": None},
        faults=[{"step": FAULT_STEP, **fault}],
        telemetry={
            "host": "127.0.0.1",
            "port": 0,
            "spikes": {"window": 16, "min_history": 8},
            "fp8": {"every": 1},
        },
        **sections,
    )
    Trainer(parse_config(settings), progress=False).fit()
    lines = (tmp_path / "runs/tiny/events.jsonl").read_text().splitlines()
    found = [json.loads(line) for line in lines]
    detected = [e["diagnosis"] for e in found if e["event"] in ("spike", "nonfinite")]
    assert detected and detected[0]["step"] == at, detected
    return detected


@pytest.mark.parametrize(
    ("duration", "named"), [(1, f"at step {FAULT_STEP} ("), (6, f"from step {FAULT_STEP} on (")]
)
def test_lr_scale_is_named_against_the_schedule(
    tmp_path: Path, corpus_cache: Path, duration: int, named: str
) -> None:
    """One step at 1000x, or every step from the fault to the end (the demo's): named from the
    step where the departure began."""
    fault = {"kind": "lr_scale", "factor": 1000.0, "duration": duration}
    found = diagnoses(tmp_path, corpus_cache, fault, at=FAULT_STEP + 1)  # the step after its update
    assert found[0]["causes"][0].startswith(f"learning rate 1000x its schedule {named}")


def test_a_corrupt_batch_is_named_as_unlike_the_run_s_data(
    tmp_path: Path, corpus_cache: Path
) -> None:
    found = diagnoses(tmp_path, corpus_cache, {"kind": "corrupt_batch"})
    causes = found[0]["causes"]
    batch = f"the batch at data position {FAULT_STEP - 1}"
    assert re.fullmatch(
        rf"{batch} is unlike the run's data: distinct token ids \d+% of the batch against a "
        rf"typical \d+%, token entropy [\d.]+ bits against a typical [\d.]+",
        causes[0],
    ), causes
    tokens = found[0]["batch_tokens"]
    assert tokens["unlike"] and tokens["history"] == FAULT_STEP - 1
    assert tokens["entropy"] > tokens["typical_entropy"] + 2  # uniform bytes: about 7.6 bits


def test_scaled_activations_do_not_blame_the_data(tmp_path: Path, corpus_cache: Path) -> None:
    found = diagnoses(tmp_path, corpus_cache, {"kind": "scale_activations", "factor": 100.0})
    [cause] = found[0]["causes"]
    batch = f"the batch at data position {FAULT_STEP - 1}"
    assert re.fullmatch(
        rf"gradient norm \d+x its window mean on {batch}, with {QUIET}, no precision change "
        rf"and tokens like the run's data"
        rf"|nothing stands out \({QUIET}, no gradient-norm or precision change, tokens like "
        rf"the run's data\): {batch} is what is left to check",
        cause,
    ), cause
    assert found[0]["batch_tokens"]["unlike"] is False


def test_a_nan_with_nothing_else_says_nothing_stands_out(
    tmp_path: Path, corpus_cache: Path
) -> None:
    found = diagnoses(tmp_path, corpus_cache, {"kind": "nonfinite_loss"})
    assert found[0]["nonfinite"] and found[0]["causes"] == [
        f"nothing stands out ({QUIET}, no gradient-norm or precision change, tokens like the "
        f"run's data): the non-finite value arose in the forward or backward pass of the "
        f"batch at data position {FAULT_STEP - 1}"
    ]


def test_an_activation_outlier_under_fp8_shows_as_overflow(
    tmp_path: Path, corpus_cache: Path
) -> None:
    found = diagnoses(
        tmp_path, corpus_cache, {"kind": "activation_outlier"}, precision={"dtype": "fp8"}
    )
    assert any(cause.startswith("FP8 overflow in ") for cause in found[0]["causes"])
    assert not any("learning rate" in cause for cause in found[0]["causes"])


def test_under_torchrun_every_rank_s_share_is_judged(tmp_path: Path, corpus_cache: Path) -> None:
    """DDP on 2 ranks: the ranks' statistics are gathered at the detection; the corrupt batch
    (random tokens on both ranks) is named with both shares."""
    settings = sliced_settings(
        tmp_path / "runs",
        corpus_cache,
        train={"max_steps": 44, "warmup_steps": 10, "log_every": 2, "eval_every": 1000},
        snapshot={"every": None},
        faults=[{"step": 40, "kind": "corrupt_batch"}],
        telemetry={"host": "127.0.0.1", "port": 0, "spikes": {"window": 16, "min_history": 8}},
    )
    finished(torchrun(2, write_config(tmp_path / "c.yaml", settings)))
    found = [e["diagnosis"] for e in events(tmp_path / "runs/tiny") if e["event"] == "spike"]
    assert found and found[0]["step"] == 40, found
    assert found[0]["batch_tokens"]["unlike_ranks"] == [0, 1]
    assert found[0]["causes"][0].startswith(
        "the batch at data position 39 (the shares of ranks 0, 1) is unlike the run's data: "
    )

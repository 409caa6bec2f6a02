"""LossguardCallback under a real Lightning ``Trainer``: a tiny language model trains on CPU while
an operator pauses, scrapes, saves, rolls back and stops it over the control socket."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lossguard.agent.config import parse_config
from lossguard.agent.integrations.lightning import LossguardCallback
from tests.support.integration_checks import (
    NAN_STEP,
    RUN_ID,
    Operator,
    all_finite,
    check_live_metrics,
    check_resumed,
    check_run_directory,
    count_hot_reads,
    settings,
)

MAX_STEPS = 400  # the operator's stop ends the run long before
VOCAB = 64


class TinyLM(pl.LightningModule):
    """A bigram model on token batches; its loss is NaN at optimizer step ``NAN_STEP``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.head = nn.Linear(32, VOCAB)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (batch_ids,) = batch
        logits = self.head(self.embed(batch_ids[:, :-1]))
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch_ids[:, 1:].reshape(-1))
        return loss * float("nan") if self.global_step == NAN_STEP - 1 else loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.training_step(batch, batch_idx))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
        schedule = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, MAX_STEPS)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def trainer(folder: Path, max_steps: int, callback: LossguardCallback) -> pl.Trainer:
    return pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        val_check_interval=8,
        default_root_dir=folder,
        callbacks=[callback],
    )


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch")
def test_lightning_fit_is_watched_controlled_and_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    tokens = torch.randint(
        0, VOCAB, (4 * MAX_STEPS, 17), generator=torch.Generator().manual_seed(0)
    )
    data = torch.utils.data.TensorDataset(tokens)  # batches are [ids]: tokens from the first
    train = torch.utils.data.DataLoader(data, batch_size=4)
    val = torch.utils.data.DataLoader(torch.utils.data.Subset(data, range(8)), batch_size=4)
    runs, run_dir = tmp_path / "runs", tmp_path / "runs" / RUN_ID
    callback = LossguardCallback(run_dir, config=parse_config(settings()))
    hot_reads = count_hot_reads(
        monkeypatch, callback, ("on_before_backward", "on_before_optimizer_step")
    )
    first = trainer(tmp_path / "pl", MAX_STEPS, callback)
    model = TinyLM()
    operator = Operator(runs, model)
    operator.start()
    first.fit(model, train, val)
    operator.join(60)

    seen = operator.seen
    check_live_metrics(seen)
    assert seen["stop"]["step"] >= seen["paused_at"] + 2
    saves = check_run_directory(run_dir, seen)
    stopped_at = first.global_step  # Lightning's, which a rollback does not rewind
    assert saves[-1] == tmp_path / "pl" / "checkpoints" / f"lossguard-step={stopped_at}.ckpt"
    assert torch.load(saves[-1], weights_only=False)["global_step"] == stopped_at
    assert stopped_at < MAX_STEPS
    assert all_finite(model)  # the NaN step's update was skipped (fused AdamW)
    assert len(hot_reads) > 2 * NAN_STEP and sum(hot_reads) == 0
    assert callback.guard is None

    # resumed Lightning's way, from the checkpoint the stop had it write
    trainer(tmp_path / "pl", stopped_at + 3, callback).fit(model, train, val, ckpt_path=saves[-1])
    check_resumed(run_dir, stopped_at, stopped_at + 3)

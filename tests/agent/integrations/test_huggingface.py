"""LossguardCallback under a real ``transformers.Trainer``: a tiny GPT-2 built in code trains on
CPU while an operator pauses, scrapes, saves, rolls back and stops it over the control socket."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from lossguard.agent.config import parse_config
from lossguard.agent.integrations.huggingface import LossguardCallback
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


class TokenData(torch.utils.data.Dataset):
    """Random byte-level sequences, labels = inputs (the model shifts them)."""

    def __init__(self, count: int, length: int = 16) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 256, (count, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def nan_at_step(model: nn.Module) -> None:
    """Make the training loss NaN at optimizer step ``NAN_STEP`` (one micro-batch a step), as
    a diverging run would report it: a forward hook, ahead of the callback's own."""
    forwards = [0]

    def poison(module: nn.Module, args: Any, output: Any) -> Any:
        if module.training:
            forwards[0] += 1
            if forwards[0] == NAN_STEP:
                output["loss"] = output["loss"] * float("nan")
        return output

    model.register_forward_hook(poison)


def trainer(model: nn.Module, folder: Path, max_steps: int, callback: LossguardCallback) -> Trainer:
    args = TrainingArguments(
        output_dir=str(folder),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="no",
        eval_strategy="steps",
        eval_steps=8,
        per_device_eval_batch_size=4,
        logging_steps=10,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    data, evaluation = TokenData(4 * MAX_STEPS), TokenData(8)
    return Trainer(
        model=model,
        args=args,
        train_dataset=data,
        eval_dataset=evaluation,
        callbacks=[callback],
    )


def test_trainer_run_is_watched_controlled_and_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=256,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    nan_at_step(model)
    runs, run_dir = tmp_path / "runs", tmp_path / "runs" / RUN_ID
    callback = LossguardCallback(run_dir, config=parse_config(settings()))
    hot_reads = count_hot_reads(monkeypatch, callback, ("_forward_done", "on_pre_optimizer_step"))
    first = trainer(model, tmp_path / "hf", MAX_STEPS, callback)
    operator = Operator(runs, model)
    operator.start()
    first.train()
    operator.join(60)

    seen = operator.seen
    check_live_metrics(seen)
    saves = check_run_directory(run_dir, seen)
    # the Trainer's own checkpoints, named by its global step (which a rollback does not
    # rewind): the one the stop asked for is its last step
    stopped_at = first.state.global_step
    assert [p.name for p in saves][-1] == f"checkpoint-{stopped_at}"
    assert stopped_at < MAX_STEPS
    assert all_finite(model)  # the NaN step's update was skipped (fused AdamW)
    assert len(hot_reads) > 2 * NAN_STEP and sum(hot_reads) == 0
    assert first.args.max_grad_norm == 1.0  # handed back after the callback clipped for it
    assert callback.guard is None

    # resumed the Trainer's way, from the checkpoint the stop had it write
    second = trainer(model, tmp_path / "hf", stopped_at + 3, callback)
    second.train(resume_from_checkpoint=str(saves[-1]))
    check_resumed(run_dir, stopped_at, stopped_at + 3)

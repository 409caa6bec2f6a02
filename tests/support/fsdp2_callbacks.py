"""One rank of the framework callbacks' FSDP2 runs (``torchrun --nproc_per_node 2 -m
tests.support.fsdp2_callbacks ROOT SCENARIO...``, gloo, CPU): a ``transformers.Trainer`` sharded by
accelerate's FSDP2 (``hf``) and a Lightning ``fit`` under ``ModelParallelStrategy`` with
``fully_shard`` in ``configure_model`` (``lightning``), one after the other in the same
processes, each in ``ROOT/runs/<scenario>`` until an operator stops it. The Lightning run
takes a NaN on rank 1 only when the operator asks (``NAN_FLAG``); with
``$LOSSGUARD_TEST_COLLECTIVES`` set, every rank records its collectives there
(tests/support/rank_drill.py).

accelerate 1.15 turns its FSDP plugin on only on accelerators: on CPU its state stays
``MULTI_CPU`` and the Trainer would run DDP. ``accelerate_fsdp_on_cpu`` takes the branch that
accelerate takes on GPUs (``distributed_type = FSDP`` and the plugin); the sharding itself is
accelerate's own ``fully_shard`` of the model, on CPU with gloo.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from lossguard.agent.config import parse_config
from lossguard.agent.integrations import huggingface, lightning
from tests.support.rank_drill import record_collectives

MAX_STEPS = 400  # the operator's stop ends each run long before
BATCH, LENGTH, VOCAB = 4, 16, 256


class TokenData(torch.utils.data.Dataset):
    """Random byte-level sequences; ``input_ids`` and ``labels`` (the models shift them)."""

    def __init__(self, count: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (count, LENGTH), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def settings() -> dict[str, Any]:
    return {"telemetry": {"host": "127.0.0.1", "port": 0}, "train": {"log_every": 2}}


def gpt2() -> GPT2LMHeadModel:
    """A 2-layer GPT-2 built in code (seeded: the same weights on every rank)."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=VOCAB,
        n_positions=LENGTH,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def accelerate_fsdp_on_cpu() -> None:
    """Have accelerate's state take its accelerator branch for an FSDP plugin on CPU."""
    original = AcceleratorState.__init__

    def init(self: AcceleratorState, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init


def run_trainer(root: Path) -> None:
    accelerate_fsdp_on_cpu()
    args = TrainingArguments(
        output_dir=str(root / "hf"),
        max_steps=MAX_STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        save_strategy="no",
        logging_steps=1000,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        fsdp=True,  # type: ignore[arg-type]  # transformers 5.24's own advice
        fsdp_config={
            "version": 2,
            "transformer_layer_cls_to_wrap": ["GPT2Block"],
            "state_dict_type": "SHARDED_STATE_DICT",  # the Trainer's own checkpoints: DCP
        },
    )
    callback = huggingface.LossguardCallback(root / "runs/hf", config=parse_config(settings()))
    data = TokenData(2 * BATCH * MAX_STEPS)
    trainer = Trainer(model=gpt2(), args=args, train_dataset=data, callbacks=[callback])
    assert trainer.is_fsdp_enabled
    trainer.train()


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyLM(pl.LightningModule):
    """Embedding, two residual MLP blocks and a head; under ``ModelParallelStrategy``,
    ``configure_model`` shards every block and the root over the data-parallel mesh (FSDP2).
    Once ``nan_flag`` exists, rank 1's next loss is NaN (rank 1 only, as one rank's batch)."""

    def __init__(self, width: int = 32, nan_flag: Path | None = None) -> None:
        super().__init__()
        self.nan_flag = nan_flag
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, VOCAB)

    def configure_model(self) -> None:
        if self.device_mesh is None:  # not ModelParallelStrategy: nothing to shard here
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(batch["input_ids"][:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten())
        if self.global_rank == 1 and self.nan_flag is not None and self.nan_flag.exists():
            self.nan_flag.unlink()
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def run_lightning(root: Path) -> None:
    callback = lightning.LossguardCallback(root / "runs/lightning", config=parse_config(settings()))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=MAX_STEPS,
        gradient_clip_val=1.0,
        default_root_dir=root / "lightning",
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[callback],
    )
    loader = torch.utils.data.DataLoader(TokenData(2 * BATCH * MAX_STEPS), batch_size=BATCH)
    trainer.fit(TinyLM(nan_flag=root / NAN_FLAG), loader)


SCENARIOS = {"hf": run_trainer, "lightning": run_lightning}
NAN_FLAG = "nan-on-rank-1"
"""In ROOT: the Lightning run's rank 1 takes a NaN loss at its next step."""

if __name__ == "__main__":
    if "LOSSGUARD_TEST_COLLECTIVES" in os.environ:
        record_collectives(
            Path(os.environ["LOSSGUARD_TEST_COLLECTIVES"]) / f"collectives_{os.environ['RANK']}.txt"
        )
    for name in sys.argv[2:]:
        SCENARIOS[name](Path(sys.argv[1]))

"""The framework callbacks under FSDP2, on 2 CPU processes (``torchrun``, gloo): a
``transformers.Trainer`` sharded by accelerate's FSDP2 and a Lightning ``fit`` under
``ModelParallelStrategy`` (``tests/support/fsdp2_callbacks.py``, one launch for both), each watched,
saved to a ``dcp`` checkpoint, rolled back on every rank and stopped over the control socket;
the Lightning run's rollback comes after a NaN on rank 1 alone, and every rank must have entered
the same collectives. What cannot work is refused at start with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
)
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from transformers import TrainerControl, TrainerState, TrainingArguments

from lossguard.agent.integrations import lightning
from lossguard.agent.integrations.huggingface import LossguardCallback
from lossguard.agent.integrations.lightning import strategy_refusal
from lossguard.agent.recovery import weights_digest
from lossguard.common.control.client import ControlClient
from lossguard.common.rundir.checkpoints import read_meta
from lossguard.common.rundir.names import SOCKET_NAME
from tests.support.drill_runs import same_collectives
from tests.support.fsdp2_callbacks import NAN_FLAG, TinyLM, TokenData, gpt2
from tests.support.integration_checks import scrape
from tests.support.processes import REPO, ctl_cli, free_port, stop_process, wait_for
from tests.support.runs import events

pytestmark = pytest.mark.live

SCENARIOS = ("hf", "lightning")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def operate(run_dir: Path, nan_flag: Path | None) -> dict[str, Any]:
    """Scrape the run while paused, save, go on (``nan_flag``: with a NaN on rank 1 only, in the
    next step), roll back to the save, go on, stop."""
    wait_for((run_dir / "agent.json").exists, 120, f"{run_dir.name}'s agent.json")
    info = json.loads((run_dir / "agent.json").read_text())
    seen: dict[str, Any] = {}
    with ControlClient(socket_path=run_dir / SOCKET_NAME, timeout=60) as ctl:

        def step() -> int:
            return int(ctl.request("status")["step"])

        wait_for(lambda: step() >= 3, 60, "three steps")
        paused = seen["paused"] = ctl.request("pause")["step"]
        seen["scrape"] = wait_for(lambda: paused_scrape(info["metrics_urls"]), 60, "the pause")
        seen["saved"] = ctl.request("save")
        if nan_flag is not None:
            nan_flag.touch()
        ctl.request("resume")
        wait_for(lambda: step() >= paused + 3, 60, "three more steps")
        ctl.request("pause")
        seen["rollback"] = ctl.request("rollback", {"target": paused, "skip_batches": "abandoned"})
        ctl.request("resume")
        wait_for(lambda: step() >= paused + 2, 60, "steps after the rollback")
        seen["stop"] = ctl.request("stop")
    return seen


def paused_scrape(urls: list[str]) -> dict[Any, float] | None:
    """Every rank's metrics, once every rank shows the pause (rank 0 answers the pause request;
    another rank may publish its own pause a moment later); None before."""
    samples = {k: v for url in urls for k, v in scrape(url).items()}
    paused = [v for (name, _), v in samples.items() if name == "lossguard_paused"]
    return samples if len(paused) == len(urls) and all(v == 1 for v in paused) else None


def value(samples: dict[Any, float], run_id: str, name: str, rank: str) -> float:
    return samples[(name, frozenset({"run_id": run_id, "rank": rank}.items()))]


def saved_digest(checkpoint: Path, model: nn.Module, tmp_path: Path) -> str:
    """The weights digest of a ``dcp`` checkpoint's model, loaded whole into ``model``."""
    whole = tmp_path / f"{checkpoint.parent.parent.name}.pt"
    dcp_to_torch_save(checkpoint, whole)
    model.load_state_dict(torch.load(whole, weights_only=False)["model"])
    return weights_digest(model)


def launch(root: Path) -> dict[str, dict[str, Any]]:
    """Both scenarios in one 2-rank launch, each driven by ``operate``; what each operator
    saw."""
    log = root / "ranks.log"  # a file, not a pipe nobody reads while the operators run
    with log.open("w") as output:
        ranks = subprocess.Popen(
            [*TORCHRUN, "-m", "tests.support.fsdp2_callbacks", str(root), *SCENARIOS],
            stdout=output,
            stderr=output,
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1", "LOSSGUARD_TEST_COLLECTIVES": str(root)},
        )
    try:
        seen = {
            name: operate(root / "runs" / name, root / NAN_FLAG if name == "lightning" else None)
            for name in SCENARIOS
        }
        ranks.wait(120)
    except BaseException as failure:
        stop_process(ranks)  # torchrun passes SIGTERM on to the ranks
        raise AssertionError(log.read_text()[-3000:]) from failure
    assert ranks.returncode == 0, log.read_text()[-3000:]
    return seen


def test_a_sharded_framework_run_is_watched_saved_with_dcp_and_rolled_back_on_every_rank(
    tmp_path: Path,
) -> None:
    """One launch for both frameworks (one test, so that pytest-xdist never starts the launch
    twice, once per worker)."""
    seen = launch(tmp_path)
    for scenario in SCENARIOS:
        check_scenario(tmp_path / "runs" / scenario, seen[scenario], scenario, tmp_path)
    # the Lightning run rolled back after a NaN on rank 1 alone, every rank in step
    assert not (tmp_path / NAN_FLAG).exists()
    same_collectives(tmp_path, 2)


def check_scenario(run_dir: Path, seen: dict[str, Any], scenario: str, tmp_path: Path) -> None:
    """What ``operate`` saw of ``scenario``'s run, and what the run left in ``run_dir``."""
    paused, saved, rollback = seen["paused"], seen["saved"], seen["rollback"]
    # Guard's metrics while paused, the gradient norm taken over the DTensor shards
    for rank in ("0", "1"):
        assert value(seen["scrape"], scenario, "lossguard_step", rank) == paused
        assert value(seen["scrape"], scenario, "lossguard_paused", rank) == 1
        assert value(seen["scrape"], scenario, "lossguard_train_loss", rank) > 0
        assert value(seen["scrape"], scenario, "lossguard_tokens_per_second", rank) > 0
    norms = [value(seen["scrape"], scenario, "lossguard_grad_norm", rank) for rank in "01"]
    assert norms[0] > 0 and norms[0] == norms[1]  # the global norm: the same on every rank
    # the save: a dcp checkpoint of both ranks' shards, listed by lossguard-ctl from disk
    assert saved["step"] == paused
    checkpoint = run_dir / "checkpoints" / saved["name"]
    meta = read_meta(checkpoint)
    assert meta.format == "dcp" and meta.extra["world_size"] == 2
    assert {"__0_0.distcp", "__1_0.distcp", "rank_0.pt", "rank_1.pt"} <= set(meta.files)
    listed = ctl_cli("--run-dir", str(run_dir), "--json", "checkpoints")
    assert listed.returncode == 0, listed.stderr
    assert saved["name"] in [c["name"] for c in json.loads(listed.stdout)["checkpoints"]]
    # the rollback: one collective restore, every rank at the save's step with its weights
    assert rollback["to_step"] == paused and rollback["checkpoint"] == saved["name"]
    assert [(r["rank"], r["step"]) for r in rollback["ranks"]] == [(0, paused), (1, paused)]
    model = gpt2() if scenario == "hf" else TinyLM()
    digest = saved_digest(checkpoint, model, tmp_path)
    assert [r["weights"] for r in rollback["ranks"]] == [digest, digest]
    # the stop: the run ended stopped, and the framework wrote its own checkpoints
    assert json.loads((run_dir / "agent.json").read_text())["exit"] == "stopped"
    written = [Path(e["path"]) for e in events(run_dir) if e["event"] == "framework_checkpoint"]
    assert len(written) == 2 and all(path.exists() for path in written)


@pytest.fixture
def group_of_one() -> Iterator[None]:
    """A gloo process group of this process alone (FSDP1 needs one), left afterwards."""
    address = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group("gloo", init_method=address, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`:UserWarning")
def test_the_trainer_with_fsdp1_or_deepspeed_is_refused_at_start(
    tmp_path: Path, group_of_one: None
) -> None:
    """A model wrapped in FSDP1 (as accelerate does for fsdp_config version 1), and DeepSpeed
    (not installed here: its setting alone)."""
    model = FullyShardedDataParallel(nn.Sequential(nn.Linear(4, 4)), device_id=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters())
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none")
    callback = LossguardCallback(tmp_path / "run")
    begin = (args, TrainerState(), TrainerControl())
    with pytest.raises(ValueError) as refused:
        callback.on_train_begin(*begin, model=model, optimizer=optimizer)
    assert str(refused.value) == (
        "LossguardCallback: transformers.Trainer wrapped the model in FSDP1 "
        "(FullyShardedDataParallel), whose flattened shards the callback can neither measure "
        "nor checkpoint; use FSDP2 (fsdp_config={'version': 2})"
    )
    args.deepspeed = "ds_config.json"
    with pytest.raises(ValueError, match=r"^LossguardCallback: DeepSpeed keeps the gradients"):
        callback.on_train_begin(*begin, model=nn.Linear(4, 4), optimizer=optimizer)
    assert not (tmp_path / "run").exists() and callback.guard is None


def test_tensor_parallel_models_are_refused_at_start(tmp_path: Path, group_of_one: None) -> None:
    """Tensor parallelism leaves parameters on another mesh than FSDP2's, or plain ones."""
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    parallelize_module(model[0], mesh["tp"], ColwiseParallel())
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none")
    callback = LossguardCallback(tmp_path / "run")
    begin = (args, TrainerState(), TrainerControl())
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError) as refused:
        callback.on_train_begin(*begin, model=model, optimizer=optimizer)
    assert str(refused.value) == (
        "LossguardCallback: the model's parameters are DTensors on 1 device mesh(es) and 2 plain "
        "tensors; the gradient norm needs them all on one mesh (FSDP2 / HSDP over the whole "
        "model: fsdp_config={'version': 2}) or none sharded, so tensor parallelism is not "
        "supported"
    )
    fully_shard(model, mesh=mesh["dp"])  # tensor parallel and FSDP2: two meshes
    with pytest.raises(ValueError, match=r"DTensors on 2 device mesh\(es\) and 0 plain"):
        callback.on_train_begin(*begin, model=model, optimizer=optimizer)
    assert not (tmp_path / "run").exists()


def test_lightning_strategies_that_cannot_work_are_refused_with_one_line() -> None:
    """FSDPStrategy (FSDP1; CUDA only, so Lightning refuses it on CPU itself) and DeepSpeed
    (not installed here: an instance made without its constructor)."""
    assert strategy_refusal(ModelParallelStrategy()) is None
    assert strategy_refusal(DDPStrategy()) is None
    assert strategy_refusal(FSDPStrategy()) == (
        "FSDPStrategy wraps the model in FSDP1 (FullyShardedDataParallel), whose flattened "
        "shards the callback can neither measure nor checkpoint; use ModelParallelStrategy "
        "with fully_shard (FSDP2) in configure_model"
    )
    deepspeed = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    assert (strategy_refusal(deepspeed) or "").startswith("DeepSpeedStrategy keeps the gradients")


@pytest.mark.gpu
def test_lightning_fsdp_strategy_is_refused_when_fit_starts_on_a_gpu(tmp_path: Path) -> None:
    """Lightning runs FSDPStrategy only on GPUs: there the callback stops ``fit`` at its start."""
    callback = lightning.LossguardCallback(tmp_path / "run")
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=FSDPStrategy(),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    loader = torch.utils.data.DataLoader(TokenData(8), batch_size=4)
    try:
        with pytest.raises(ValueError, match=r"^LossguardCallback: FSDPStrategy wraps the model"):
            trainer.fit(TinyLM(), loader)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert not (tmp_path / "run").exists() and callback.guard is None

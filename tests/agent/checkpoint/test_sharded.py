"""Sharded runs under real ``torchrun --nproc_per_node 2`` (gloo, CPU): FSDP2 and HSDP train,
write ``dcp`` checkpoints, resume bit for bit after a rank is SIGKILLed, reshard 2 -> 1, and
never show a torn save; rollbacks restore every rank's shards from disk or from memory alike.
Bad combinations are one line and exit 2."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lossguard.agent.checkpoint.dcp_format import owner
from lossguard.agent.config import parse_config
from lossguard.agent.train.corpus import prepare_text_corpus
from lossguard.common.config import ConfigError
from lossguard.common.rundir.checkpoints import CheckpointError, read_meta
from lossguard.common.rundir.files import sha256_file
from tests.monitor.actions.test_live import actions_in, shipped_rule
from tests.support.processes import REPO, ctl_cli, run_cli, start_monitor, stop_process, wait_for
from tests.support.runs import (
    events,
    json_lines,
    sliced_settings,
    step_records,
    throttle,
    write_config,
    write_monitor_config,
)

pytestmark = pytest.mark.live

STEPS = 12
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
AGENT = ["-m", "lossguard.agent.cli", "run"]


def sharded_settings(runs: Path, cache: Path, **distributed: Any) -> dict[str, Any]:
    """Dropout (the RNG states matter), gradient accumulation, a dcp checkpoint every 4 steps."""
    return sliced_settings(
        runs,
        cache,
        model={"dropout": 0.1},
        train={"max_steps": STEPS, "grad_accum": 2, "log_every": 1, "eval_every": 1000},
        checkpoint={"every": 4, "keep_last": 100},
        telemetry={"grad_diagnostics": {"enabled": True, "every": 3}},
        distributed={"strategy": "fsdp2", **distributed},
    )


def torchrun(
    nproc: int, config: Path, *args: str, agent: list[str] = AGENT, **env: str
) -> subprocess.Popen[str]:
    """``agent`` (``lossguard-agent run`` by default) on ``nproc`` ranks, with ``env`` added."""
    return subprocess.Popen(
        [*TORCHRUN, f"--nproc_per_node={nproc}", *agent, str(config), "--no-progress", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )


def finished(process: subprocess.Popen[str], timeout: float = 120) -> str:
    _, stderr = process.communicate(timeout=timeout)
    assert process.returncode == 0, stderr[-3000:]
    return stderr


def full_state(checkpoint: Path, tmp_path: Path) -> dict[str, Any]:
    """A dcp checkpoint's model and optimizer as one torch state dict (unsharded)."""
    out = tmp_path / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)


def assert_same_tensors(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_tensors(a[key], b[key])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def past(run_dir: Path, step: int) -> bool:
    return any(r["step"] >= step for r in json_lines(run_dir / "metrics.jsonl"))


def kill_a_rank(agent: subprocess.Popen[str], run_dir: Path, at_step: int) -> None:
    """SIGKILL one of torchrun's workers once training passed ``at_step`` and the first
    checkpoint is visible; torchrun then ends the group."""
    first = run_dir / "checkpoints/step_00000004"
    wait_for(lambda: past(run_dir, at_step) and first.exists(), 120, f"step {at_step}")
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
    os.kill(int(random.choice(children)), signal.SIGKILL)
    agent.communicate(timeout=120)
    assert agent.returncode != 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus_cache: Path) -> Path:
    """An uninterrupted FSDP2 run of STEPS steps on 2 ranks; its run directory."""
    root = tmp_path_factory.mktemp("reference")
    config = write_config(root / "c.yaml", sharded_settings(root / "runs", corpus_cache))
    finished(torchrun(2, config))
    return root / "runs/tiny"


def test_fsdp2_trains_and_writes_dcp_checkpoints_that_readers_list_unchanged(
    reference: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    losses = step_records(reference)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1]
    # per-layer gradient norms reduced over the shards add up to the global grad norm
    records = json_lines(reference / "metrics.jsonl")
    norms = {r["step"]: r["grad_norm"] for r in records if r["kind"] == "train"}
    sampled = [r for r in records if r["kind"] == "grad_diagnostics"]
    assert [r["step"] for r in sampled] == [3, 6, 9, 12]
    for record in sampled:
        total = math.sqrt(sum(layer["l2"] ** 2 for layer in record["layers"].values()))
        assert total == pytest.approx(norms[record["step"]], rel=1e-4)
    meta = read_meta(reference / f"checkpoints/step_{STEPS:08d}")
    assert meta.format == "dcp" and meta.extra["world_size"] == 2
    assert set(meta.files) == {
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "rank_0.pt",
        "rank_1.pt",
    }
    # each rank hashed the files it wrote; rank 0 published them all
    folder = reference / f"checkpoints/step_{STEPS:08d}"
    assert meta.files == {name: sha256_file(folder / name) for name in meta.files}
    # the torch-free reader: lossguard-ctl from disk, no agent answering
    listed = ctl_cli("--run-dir", str(reference), "--json", "checkpoints")
    assert listed.returncode == 0, listed.stderr
    names = [c["name"] for c in json.loads(listed.stdout)["checkpoints"]]
    assert names == [f"step_{s:08d}" for s in (4, 8, 12)]


@pytest.mark.parametrize(
    "distributed", [{}, {"strategy": "hsdp", "replicate": 1}], ids=["fsdp2", "hsdp-1x2"]
)
def test_a_killed_rank_resumes_to_the_same_losses_and_weights(
    tmp_path: Path, corpus_cache: Path, reference: Path, distributed: dict[str, Any]
) -> None:
    settings = sharded_settings(tmp_path / "runs", corpus_cache, **distributed)
    if distributed:  # and without snapshots: they do not change a run's losses either
        settings["snapshot"] = {"every": None}
    config = write_config(tmp_path / "c.yaml", settings)
    run_dir = tmp_path / "runs/tiny"
    kill_a_rank(torchrun(2, config), run_dir, at_step=random.randint(5, STEPS - 1))
    stderr = finished(torchrun(2, config, "--resume", "latest"))
    assert "resumed from step_0000000" in stderr
    assert step_records(run_dir) == step_records(reference)
    final = f"checkpoints/step_{STEPS:08d}"
    assert_same_tensors(
        full_state(run_dir / final, tmp_path), full_state(reference / final, tmp_path)
    )


def test_a_checkpoint_of_two_ranks_resumes_on_one_and_trains_on(
    tmp_path: Path, corpus_cache: Path, reference: Path
) -> None:
    runs = tmp_path / "runs"
    shutil.copytree(reference, runs / "tiny")
    settings = sharded_settings(runs, corpus_cache)
    settings["train"]["max_steps"] = STEPS + 4
    config = write_config(tmp_path / "c.yaml", settings)
    stderr = finished(torchrun(1, config, "--resume", f"step_{STEPS:08d}"))
    assert "was written by 2 ranks and loads on 1" in stderr
    assert [e["checkpoint"] for e in events(runs / "tiny") if e["event"] == "resharded"] == [
        f"step_{STEPS:08d}"
    ]
    meta = read_meta(runs / f"tiny/checkpoints/step_{STEPS + 4:08d}")
    assert meta.extra["world_size"] == 1 and set(meta.files) >= {"__0_0.distcp", "rank_0.pt"}
    losses = step_records(runs / "tiny")
    assert all(math.isfinite(losses[s]) for s in range(STEPS + 1, STEPS + 5))


def test_spam_trains_sharded_and_its_state_is_in_the_dcp_checkpoint(
    tmp_path: Path, corpus_cache: Path
) -> None:
    """SPAM under FSDP2 updates each rank's shards in place; its moments and step count are in
    the dcp checkpoint (which resumes as the other tests here show for AdamW's)."""
    runs = tmp_path / "runs"
    settings = sharded_settings(runs, corpus_cache)
    settings["train"]["max_steps"] = 8
    spam = {"name": "spam", "reset_every": 3, "reset_warmup": 1, "clip_after": 1, "threshold": 4}
    settings["optim"] = spam
    finished(torchrun(2, write_config(tmp_path / "c.yaml", settings)))
    losses = step_records(runs / "tiny")
    assert sorted(losses) == list(range(1, 9)) and losses[8] < losses[1] - 0.3  # it learns
    full = full_state(runs / "tiny/checkpoints/step_00000004", tmp_path)
    state, weights = full["optimizer"]["state"], full["model"]
    assert state.keys() == weights.keys() - {"lm_head.weight"}  # every parameter (tied: wte)
    for name, values in state.items():
        assert set(values) == {"exp_avg", "exp_avg_sq", "step"} and values["step"] == 4
        assert values["exp_avg"].shape == weights[name].shape  # whole, from both ranks' shards
        assert values["exp_avg_sq"].abs().sum() > 0
    last = [r for r in json_lines(runs / "tiny/metrics.jsonl") if r["kind"] == "train"][-1]
    assert last["optimizer_momentum_resets"] == 2 and last["optimizer_clipped_entries"] > 0


def test_each_file_is_hashed_by_the_rank_that_wrote_it_and_any_other_by_rank_0() -> None:
    written = {"rank_1.pt": 1, "__1_0.distcp": 1, "__3_2.distcp": 3, "rank_0.pt": 0}
    others = {".metadata": 0, "rank_9.pt": 0, "__12_0.distcp": 0, "rank_x.pt": 0, "notes": 0}
    expected = {**written, **others}
    assert {name: owner(name, world_size=4) for name in expected} == expected


def test_bad_combinations_are_one_line_and_exit_2(tmp_path: Path, corpus_cache: Path) -> None:
    base = sharded_settings(tmp_path / "runs", corpus_cache)
    for section, values, field in (
        ("distributed", {"strategy": "hsdp"}, "distributed.replicate"),
        ("distributed", {"strategy": "fsdp2", "replicate": 2}, "distributed.replicate"),
        ("precision", {"dtype": "fp16"}, "precision.dtype"),
    ):
        with pytest.raises(ConfigError, match=field):
            parse_config({**base, section: {**base.get(section, {}), **values}})
    config = write_config(tmp_path / "c.yaml", base)
    out = run_cli(
        "run", str(config), "--set", "distributed.strategy=hsdp", "--set", "distributed.replicate=2"
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "lossguard-agent: error: distributed.replicate: 1 ranks do not divide into 2 replica groups"
    )


def test_meta_without_a_format_is_torch_and_an_unknown_one_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "step_00000001"
    folder.mkdir()
    meta = {
        "name": folder.name,
        "step": 1,
        "seq": 1,
        "tokens": 0,
        "healthy": True,
        "reason": "periodic",
        "train_loss": None,
        "val_loss": None,
        "created_at": 0.0,
        "files": {},
        "config_hash": None,
        "versions": {},
        "extra": {},
    }
    (folder / "meta.json").write_text(json.dumps(meta))
    assert read_meta(folder).format == "torch"
    (folder / "meta.json").write_text(json.dumps({**meta, "format": "zip"}))
    with pytest.raises(CheckpointError, match="unknown format"):
        read_meta(folder)


def test_a_save_torn_by_a_kill_never_becomes_visible_and_the_previous_one_is_used(
    tmp_path: Path, corpus_cache: Path
) -> None:
    """The save of step 8 is slow to publish (``slow_save``): every rank has written its
    shards into the hidden folder when a rank is SIGKILLed, before the folder is published.
    The hidden folder stays (rank 0 killed) or is dropped by rank 0's failing save; either
    way no reader sees it, and the next start removes what is left."""
    settings = sharded_settings(tmp_path / "runs", corpus_cache)
    settings["faults"] = [{"kind": "slow_save", "step": 8, "seconds": 120}]
    config = write_config(tmp_path / "c.yaml", settings)
    checkpoints = tmp_path / "runs/tiny/checkpoints"
    agent = torchrun(2, config)
    hidden = wait_for(
        lambda: [d for d in checkpoints.glob(".tmp-step_00000008-*") if (d / ".metadata").exists()],
        120,
        "the shards of step 8 written",
    )[0]
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
    os.kill(int(random.choice(children)), signal.SIGKILL)
    agent.communicate(timeout=120)
    assert [p.name for p in checkpoints.iterdir() if not p.name.startswith(".")] == [
        "step_00000004"
    ]

    settings["faults"] = []
    stderr = finished(torchrun(2, write_config(config, settings), "--resume", "latest"))
    assert "resumed from step_00000004 at step 4" in stderr
    assert not hidden.exists() and not list(checkpoints.glob(".*"))
    assert read_meta(checkpoints / f"step_{STEPS:08d}").format == "dcp"


def test_a_rank_whose_writes_fail_fails_each_save_and_training_goes_on(
    tmp_path: Path, corpus_cache: Path
) -> None:
    """Rank 1 can write no file past 64 KiB (its shards of every checkpoint fail with EFBIG,
    as on a full disk): each save is reported failed with rank 1's error, none becomes
    visible or is left hidden, and the run trains to its last step and exits 0."""
    settings = sharded_settings(tmp_path / "runs", corpus_cache)
    prepare_text_corpus(parse_config(settings).data, corpus_cache)  # rank 1 could not write it
    config = write_config(tmp_path / "c.yaml", settings)
    limited = ["-m", "tests.support.fsize_limited_agent"]
    finished(torchrun(2, config, agent=limited, LOSSGUARD_TEST_FSIZE=str(64 * 1024)))
    run_dir = tmp_path / "runs/tiny"
    assert sorted(step_records(run_dir)) == list(range(1, STEPS + 1))
    failed = [e for e in events(run_dir) if e["event"] == "checkpoint_failed"]
    assert [e["reason"] for e in failed] == ["periodic"] * 3  # steps 4, 8 and 12 (the last)
    assert all("rank 1: OSError: [Errno 27] File too large" in e["error"] for e in failed), failed
    assert not any(e["event"] == "checkpoint" for e in events(run_dir))
    assert list((run_dir / "checkpoints").iterdir()) == []


def test_rollbacks_from_memory_and_from_disk_replay_the_same_losses_on_every_rank(
    tmp_path: Path,
) -> None:
    """tests/support/sharded_rollbacks.py: an FSDP2 Guard loop rolled back to step 10 from its
    snapshots, then from its dcp checkpoint; then rank 1 (a host with less memory) runs out of
    snapshot budget."""
    launch = subprocess.run(
        [*TORCHRUN, "--nproc_per_node=2", "-m", "tests.support.sharded_rollbacks", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=180,
        check=False,
    )
    assert launch.returncode == 0, launch.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["first"] != ranks[1]["first"]  # each rank its own batches and dropout
    for result in ranks:
        memory, disk = result["from_memory"], result["from_disk"]
        assert (memory["checkpoint"], disk["checkpoint"]) == (
            "memory/step_00000010",
            "step_00000010",
        )
        assert result["after_memory"] == result["first"][10:] == result["after_disk"]
        for answer in (memory, disk):
            assert [(r["rank"], r["step"]) for r in answer["ranks"]] == [(0, 10), (1, 10)]
            assert answer["ranks"][0]["weights"] == answer["ranks"][1]["weights"]
        assert result["snapshots_after_budget"] == {"enabled": False, "metric": 0, "kept": []}
    off = [e for e in events(tmp_path / "run") if e["event"] == "snapshots_off"]
    assert len(off) == 1 and off[0]["reason"].startswith("rank 1: 3 snapshots of ")
    assert launch.stderr.count("in-memory snapshots are off: rank 1:") == 1


def test_a_nan_on_an_fsdp2_run_is_rolled_back_from_memory_by_the_shipped_monitor(
    tmp_path: Path, corpus_cache: Path
) -> None:
    """Snapshots every 4 steps: the monitor's rollback restores the snapshot of step 8, the
    newest healthy one, on every rank (beside the dcp checkpoint of the same step), and
    training goes on."""
    runs = tmp_path / "runs"
    run_dir = runs / "tiny"
    config, _ = write_monitor_config(
        tmp_path / "monitor.yml",
        [shipped_rule(tmp_path, "LossNonFinite")],
        scrape={"runs_root": str(runs)},
        actions={"rollback": {"max_attempts": 2, "cooldown": "0s"}},
    )
    monitor = start_monitor(config)
    settings = sharded_settings(runs, corpus_cache)
    # half the work a step (the reference run covers accumulation and the diagnostics): this
    # run trains for as long as the monitor takes to act, then replays 50 steps
    settings["train"].update(max_steps=10**6, log_every=2, grad_accum=1)
    settings["telemetry"]["grad_diagnostics"] = {"enabled": False}
    settings["snapshot"] = {"every": 4}
    settings["faults"] = [
        # 45 NaNs in a row (gone on the replay): LossNonFinite 40 steps into them
        {"kind": "nonfinite_loss", "step": 10, "duration": 45, "once": True},
        throttle(0.1),
    ]
    agent = torchrun(2, write_config(tmp_path / "c.yaml", settings))
    try:
        rollback = wait_for(
            lambda: next((e for e in events(run_dir) if e["event"] == "rollback"), None),
            150,
            "the monitor's rollback",
        )
        wait_for(lambda: past(run_dir, rollback["from_step"] + 2), 60, "training on")
        listed = ctl_cli("--run-dir", str(run_dir), "--json", "checkpoints")
    finally:
        assert stop_process(monitor) == 0
        stop_process(agent)
    assert rollback["checkpoint"] == "memory/step_00000008" and rollback["from_step"] >= 49
    ranks = rollback["ranks"]
    assert [(r["rank"], r["step"]) for r in ranks] == [(0, 8), (1, 8)]
    assert ranks[0]["weights"] == ranks[1]["weights"]
    action = next(a for a in actions_in(tmp_path / "state.db") if a["kind"] == "rollback")
    assert action["result"]["checkpoint"] == "memory/step_00000008"
    assert listed.returncode == 0, listed.stderr
    states = {c["name"]: c["in_memory"] for c in json.loads(listed.stdout)["checkpoints"]}
    assert {name.startswith("memory/") for name in states} == {True, False}
    assert all(in_memory == name.startswith("memory/") for name, in_memory in states.items())
    replayed = [
        loss for step, loss in step_records(run_dir).items() if 8 < step <= rollback["from_step"]
    ]
    assert replayed and all(math.isfinite(loss) for loss in replayed)


def test_fsdp2_with_each_block_compiled_trains_like_eager(sliced_config) -> None:
    """model.compile under FSDP2 compiles each block's forward before it is sharded (FP8
    layers inside); aot_eager traces as inductor does, without generating kernels."""
    from torch._dynamo.utils import counters

    from tests.agent.train.test_trainer import fit, records

    losses = {}
    for compiled in (False, True):
        graphs = counters["stats"]["unique_graphs"]
        cfg = sliced_config(
            run={"id": f"compiled-{compiled}"},
            model={"n_layer": 2, "compile": compiled, "compile_backend": "aot_eager"},
            precision={"dtype": "fp8"},
            train={"max_steps": 6, "log_every": 2, "eval_every": 6},
            distributed={"strategy": "fsdp2"},
        )
        result, trainer = fit(cfg)
        assert trainer.model is trainer.raw_model  # not wrapped: the blocks are compiled
        names = [name for name, _ in trainer.raw_model.named_parameters()]
        assert "blocks.1.attn.c_attn.weight" in names  # the names of an eager model
        # one graph for the blocks' forward (shared), none when eager
        assert (counters["stats"]["unique_graphs"] > graphs) == compiled
        losses[compiled] = [r["train_loss"] for r in records(result.run_dir, "train")]
    assert losses[True] == pytest.approx(losses[False], rel=1e-3)

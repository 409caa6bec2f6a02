"""Guard in a user's own training loop: accounting, gradient norm, metrics log, no per-step sync;
starting, resuming and overwriting a run directory."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lossguard.agent import Guard
from lossguard.agent.checkpoint.formats import RestoreError
from lossguard.agent.checkpoint.store import CheckpointStore
from lossguard.agent.config import Config, parse_config
from lossguard.agent.recovery import weights_digest
from lossguard.agent.resume_plan import CheckpointsExist
from lossguard.common.rundir.checkpoints import list_checkpoints
from lossguard.common.rundir.supervisor_file import RESUME_ENV
from lossguard.common.rundir.targets import is_superseded
from tests.support.host_reads import count_host_reads


def guard_config(**sections: dict) -> Config:
    """A config for a user's loop, its exporter on any free local port."""
    return parse_config({"telemetry": {"host": "127.0.0.1", "port": 0}, **sections})


def linear_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A seeded one-layer model and its optimizer, for loops that only need some training."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def grad_norm(model: nn.Module) -> torch.Tensor:
    """The global L2 norm of the gradients, computed independently of Guard."""
    squares = [g.pow(2).sum() for p in model.parameters() if (g := p.grad) is not None]
    return torch.stack(squares).sum().sqrt()


def user_loop(run_dir: Path, steps: int, **train: object) -> tuple[Guard, list[float]]:
    """A plain regression loop instrumented the way docs/design.md shows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = guard_config(train=train)
    guard = Guard(run_dir, model=model, optimizer=opt, config=cfg, max_steps=steps, progress=False)
    norms: list[float] = []
    x = torch.randn(64, 8)
    y = x.sum(dim=1, keepdim=True)
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        expected = grad_norm(model)
        norm = guard.after_backward(loss, tokens=64)
        norms.append(float(norm))
        torch.testing.assert_close(norm, expected)
        opt.step()
        opt.zero_grad()
        guard.end_step()
    guard.close()
    return guard, norms


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def step_target(guard: Guard) -> float | None:
    """The exported ``lossguard_step_target`` gauge."""
    assert guard.telemetry is not None
    labels = {"run_id": guard.run_id, "rank": "0"}
    return guard.telemetry.metrics.registry.get_sample_value("lossguard_step_target", labels)


def test_user_loop_gets_accounting_and_a_metrics_log(tmp_path: Path) -> None:
    guard, _ = user_loop(tmp_path / "run", steps=23, log_every=5)
    assert guard.status()["max_steps"] == 23 and step_target(guard) == 23
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [5, 10, 15, 20, 23]
    assert [r["tokens"] for r in records] == [320, 640, 960, 1280, 1472]
    assert guard.step == 23 and guard.tokens_total == 1472
    assert all(r["kind"] == "train" and r["tokens_per_second"] > 0 for r in records)
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    assert records[0]["lr"] == pytest.approx(0.05)
    assert (tmp_path / "run" / "config.yaml").is_file()
    env = json.loads((tmp_path / "run" / "env.json").read_text())
    assert env["packages"]["torch"] == metadata.version("torch")
    assert env["device"]["type"] == "cpu" and env["world_size"] == 1


def test_gradient_norm_is_taken_before_clipping(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    guard = Guard(tmp_path, model=model, config=guard_config(), grad_clip=0.01, progress=False)
    (model(torch.randn(16, 4)) * 100).sum().backward()
    before = grad_norm(model)
    norm = guard.after_backward(torch.tensor(1.0), tokens=16)
    after = grad_norm(model)
    torch.testing.assert_close(norm, before)
    assert after.item() == pytest.approx(0.01, rel=1e-3)
    guard.close()


def test_gradients_are_clipped_only_when_asked(tmp_path: Path) -> None:
    """A config's ``train.grad_clip`` (1.0 by default) is the built-in trainer's: a user's
    loop keeps its gradients, and an open-ended run exports no step target."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    cfg = guard_config(train={"grad_clip": 1.0})
    guard = Guard(tmp_path, model=model, config=cfg, progress=False)
    (model(torch.randn(16, 4)) * 100).sum().backward()
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    norm = guard.after_backward(torch.tensor(1.0), tokens=16)
    after = [p.grad for p in model.parameters() if p.grad is not None]
    assert norm.item() > 100
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert guard.status()["max_steps"] is None and step_target(guard) is None
    guard.close()


def test_host_reads_happen_once_per_log_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hot path leaves values on the device: only the log interval reads them."""
    reads = count_host_reads(monkeypatch)
    model, opt = linear_model()
    cfg = guard_config(train={"max_steps": 30, "log_every": 10})
    guard = Guard(tmp_path, model=model, optimizer=opt, config=cfg, progress=False)
    x = torch.randn(8, 4)
    ids = torch.randint(0, 100, (8, 16))  # the step's input ids: their statistics stay put too
    for _ in range(30):
        model(x).pow(2).mean().backward()
        guard.after_backward(model(x).pow(2).mean(), tokens=8, inputs=ids)
        opt.step()
        opt.zero_grad()
        guard.end_step()
    assert reads == ["tolist"] * 3


def test_first_nonfinite_loss_leaves_one_unhealthy_checkpoint(tmp_path: Path) -> None:
    model, opt = linear_model()
    cfg = guard_config(
        train={"max_steps": 30, "log_every": 5},
        checkpoint={"every": 4, "keep_last": 50},
        telemetry={"host": "127.0.0.1", "port": 0, "spikes": {"recover_steps": 3}},
    )
    x = torch.randn(8, 4)
    with Guard(tmp_path, model=model, optimizer=opt, config=cfg, progress=False) as guard:
        for step in range(1, 31):
            loss = model(x).pow(2).mean()
            loss.backward()
            bad = step in (7, 13)  # as a diverging run would report
            guard.after_backward(loss * float("nan") if bad else loss, tokens=8)
            opt.step()
            opt.zero_grad()
            guard.end_step()
            guard.poll()
    metas = {
        int(p.parent.name.split("_")[1]): json.loads(p.read_text())
        for p in tmp_path.glob("checkpoints/step_*/meta.json")
    }
    nonfinite = [step for step, m in metas.items() if m["reason"] == "nonfinite"]
    assert nonfinite == [10]  # logged at the interval that saw step 7; once only
    assert metas[10]["healthy"] is False
    assert metas[8]["healthy"] is False  # step 8's save came inside that interval
    assert metas[16]["healthy"] is False  # the episode from step 13 has not recovered yet
    assert metas[4]["healthy"] is True and metas[20]["healthy"] is True
    assert metas[30]["reason"] == "final" and metas[30]["healthy"] is True


def test_after_a_rollback_latest_leaves_the_abandoned_timeline(tmp_path: Path) -> None:
    model, opt = linear_model()
    cfg = guard_config(
        train={"max_steps": 20, "log_every": 5},
        checkpoint={"every": 5, "keep_last": 50, "save_on_exit": False},
    )
    guard = Guard(tmp_path, model=model, optimizer=opt, config=cfg, progress=False)
    short_loop(guard, model, opt, 20)
    assert guard.restore(10) == {"checkpoint": "step_00000010", "step": 10}
    guard.close()  # and the process dies before its next checkpoint

    store = CheckpointStore(tmp_path / "checkpoints", keep_last=50)
    assert [m.step for m in store.resolve("latest")] == [10, 5]
    assert [m.step for m in store.resolve("last_good")] == [10, 5]
    assert sorted(m.step for m in store.list() if is_superseded(m)) == [15, 20]
    assert store.resolve(20)[0].step == 20  # an explicit step still reaches it
    superseded = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "superseded"]
    assert superseded[0]["checkpoints"] == ["step_00000015", "step_00000020"]


class Exploding:
    """Registered state whose restore fails: a rollback must not leave a mixed state saved."""

    def state_dict(self) -> dict:
        return {"ok": 1}

    def load_state_dict(self, state: dict) -> None:
        raise RuntimeError("cannot load")


def short_loop(guard: Guard, model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    x = torch.randn(8, 4)
    for _ in range(steps):
        model(x).pow(2).mean().backward()
        guard.after_backward(torch.tensor(1.0), tokens=8)
        opt.step()
        opt.zero_grad()
        guard.end_step()
        guard.poll()


def test_a_restore_that_fails_halfway_stops_and_never_saves(tmp_path: Path) -> None:
    model, opt = linear_model()
    cfg = guard_config(train={"max_steps": 20}, checkpoint={"every": 5})
    guard = Guard(tmp_path, model=model, optimizer=opt, config=cfg, progress=False)
    guard.register("zz_exploding", Exploding())
    short_loop(guard, model, opt, 8)
    with pytest.raises(RestoreError, match=r"step_00000005 failed halfway .*cannot load"):
        guard.restore(5)
    assert guard.stop_requested
    guard.finish()  # would save a mix of step 5 and step 8 state
    guard.close()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_00000005"]


def test_detector_state_is_optional_on_restore(tmp_path: Path) -> None:
    model, opt = linear_model()
    off = guard_config(
        train={"max_steps": 10}, checkpoint={"every": 5}, telemetry={"enabled": False}
    )
    guard = Guard(tmp_path, model=model, optimizer=opt, config=off, progress=False)
    short_loop(guard, model, opt, 5)
    guard.close()
    on = guard_config(train={"max_steps": 10}, checkpoint={"every": 5})
    guard = Guard(tmp_path, model=model, optimizer=opt, config=on, resume=5, progress=False)
    assert guard.step == 5  # saved without detectors: they start afresh
    guard.close()


def test_weights_digest_covers_zero_dim_buffers() -> None:
    model = nn.BatchNorm1d(3)  # num_batches_tracked: a 0-dim int64 buffer
    first = weights_digest(model)
    tracked = model.num_batches_tracked
    assert tracked is not None and tracked.dim() == 0
    tracked.add_(1)
    assert weights_digest(model) != first


def saved_after_three_steps(run_dir: Path) -> tuple[Guard, Path]:
    """A Guard three steps in, lr scale 0.5, checkpointed at step 3; and that checkpoint."""
    model, opt = linear_model()
    cfg = guard_config(train={"max_steps": 10, "log_every": 1})
    guard = Guard(run_dir, model=model, optimizer=opt, config=cfg, progress=False)
    x = torch.randn(8, 4)
    for _ in range(3):
        loss = model(x).pow(2).mean()
        loss.backward()
        guard.after_backward(loss, tokens=8)
        opt.step()
        opt.zero_grad()
        guard.end_step()
    guard.set_lr_scale(0.5)
    guard.save(wait=True)
    return guard, run_dir / "checkpoints" / "step_00000003"


def rewrite_state(folder: Path, change: Callable[[dict], dict]) -> None:
    """Replace the checkpoint's state.pt by ``change`` applied to it, hashes kept valid."""
    state = torch.load(folder / "state.pt", weights_only=True)
    torch.save(change(state), folder / "state.pt")
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"]["state.pt"] = hashlib.sha256((folder / "state.pt").read_bytes()).hexdigest()
    (folder / "meta.json").write_text(json.dumps(meta))


def test_a_format_1_checkpoint_still_restores(tmp_path: Path) -> None:
    """Checkpoints from before the ``progress`` state kept step, tokens and lr scale beside
    the state; they restore all three."""
    guard, folder = saved_after_three_steps(tmp_path / "run")

    def format_1(state: dict) -> dict:
        progress = state["state"].pop("progress")
        return {**state, "format": 1, **progress}

    rewrite_state(folder, format_1)
    guard.set_lr_scale(1.0)
    guard.progress.step, guard.progress.tokens = 7, 56
    assert guard.restore(3) == {"checkpoint": "step_00000003", "step": 3}
    assert (guard.step, guard.tokens_total, guard.lr_scale) == (3, 24, 0.5)
    guard.close()


def test_a_checkpoint_of_a_newer_format_is_refused(tmp_path: Path) -> None:
    guard, folder = saved_after_three_steps(tmp_path / "run")
    rewrite_state(folder, lambda state: {**state, "format": 99})
    newer = "step_00000003: checkpoint format 99 is newer than this lossguard"
    with pytest.raises(RestoreError, match=newer) as refused:
        guard.restore(3)
    assert not refused.value.not_found  # a rollback answers "failed", not "not_found"
    assert guard.step == 3 and not guard.stop_requested
    guard.close()


class Counter:
    """Registered user state: how many steps it has seen."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = int(state["count"])


def checkpointing_guard(run_dir: Path, **guard_args: Any) -> tuple[Guard, nn.Module]:
    """A Guard over a fresh seeded model that checkpoints every 5 steps (none at exit)."""
    model, opt = linear_model()
    cfg = guard_config(checkpoint={"every": 5, "keep_last": 50, "save_on_exit": False})
    guard = Guard(run_dir, model=model, optimizer=opt, config=cfg, progress=False, **guard_args)
    return guard, model


def ten_steps_run(run_dir: Path) -> None:
    """A run that took checkpoints at steps 5 and 10 (a Counter registered as ``seen``)."""
    guard, model = checkpointing_guard(run_dir)
    seen = Counter()
    guard.register("seen", seen)
    x = torch.randn(8, 4)
    for _ in range(10):
        model(x).pow(2).mean().backward()
        guard.after_backward(torch.tensor(1.0), tokens=8)
        guard.optimizer.step()  # type: ignore[union-attr]
        guard.optimizer.zero_grad()  # type: ignore[union-attr]
        seen.count += 1
        guard.end_step()
        guard.poll()
    guard.close()


def saved_weights(run_dir: Path, name: str) -> dict[str, torch.Tensor]:
    state = torch.load(run_dir / "checkpoints" / name / "state.pt", weights_only=True)
    return state["state"]["model"]


def test_a_run_dir_with_checkpoints_is_not_started_over(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ten_steps_run(run_dir)
    records = {name: (run_dir / name).read_bytes() for name in ("events.jsonl", "agent.json")}
    with pytest.raises(CheckpointsExist) as refused:
        checkpointing_guard(run_dir)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{run_dir} already has checkpoints")
    assert "(newest: step_00000010)" in message
    assert "resume='latest'" in message and "overwrite=True" in message
    assert records == {name: (run_dir / name).read_bytes() for name in records}  # untouched
    assert not (run_dir / "control.sock").exists()


def test_a_run_that_crashed_before_its_first_checkpoint_starts_again(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    guard, _ = checkpointing_guard(run_dir)
    short_loop(guard, guard.model, guard.optimizer, 3)  # type: ignore[arg-type]
    guard.close(failed=True)
    assert (run_dir / "config.yaml").exists() and list_checkpoints(run_dir / "checkpoints") == []
    again, _ = checkpointing_guard(run_dir)
    assert again.step == 0
    again.close()
    assert [e["event"] for e in read_jsonl(run_dir / "events.jsonl")].count("start") == 2


def test_resume_restores_before_the_first_step(tmp_path: Path) -> None:
    """``resume`` takes a checkpoint name too; state registered right after the resume gets
    its saved state, state registered once training went on does not."""
    run_dir = tmp_path / "run"
    ten_steps_run(run_dir)
    guard, model = checkpointing_guard(run_dir, resume="step_00000005")
    assert guard.step == 5
    weights = saved_weights(run_dir, "step_00000005")
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    seen = Counter()
    guard.register("seen", seen)
    assert seen.count == 5
    resumed = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "resumed"]
    assert len(resumed) == 1
    assert {k: resumed[0][k] for k in ("target", "source", "checkpoint", "step")} == {
        "target": 5,
        "source": "argument",
        "checkpoint": "step_00000005",
        "step": 5,
    }
    short_loop(guard, model, guard.optimizer, 1)  # type: ignore[arg-type]
    late = Counter()
    guard.register("late", late)
    assert late.count == 0
    guard.close()


def test_the_supervisors_resume_wins_over_the_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    ten_steps_run(run_dir)
    monkeypatch.setenv(RESUME_ENV, "step_00000005")
    guard, _ = checkpointing_guard(run_dir, resume="latest", skip_batches=3)
    assert guard.step == 5
    guard.close()
    guard, _ = checkpointing_guard(run_dir, overwrite=True)  # not honoured on a restart
    assert guard.step == 5 and list_checkpoints(run_dir / "checkpoints")
    guard.close()
    resumed = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "resumed"]
    assert [(e["source"], e["skipped_batches"]) for e in resumed] == [(RESUME_ENV, 0)] * 2
    monkeypatch.setenv(RESUME_ENV, "")  # empty: not set
    guard, _ = checkpointing_guard(run_dir, resume=10)  # superseded by the resume at 5
    assert guard.step == 10
    guard.close()
    monkeypatch.setenv(RESUME_ENV, "../step_00000005")
    with pytest.raises(ValueError, match=f"^{RESUME_ENV}: .*never a path"):
        checkpointing_guard(run_dir)


def test_overwrite_moves_the_previous_run_aside(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ten_steps_run(run_dir)
    old_events = (run_dir / "events.jsonl").read_text()
    guard, model = checkpointing_guard(run_dir, overwrite=True)
    assert guard.step == 0 and list_checkpoints(run_dir / "checkpoints") == []
    short_loop(guard, model, guard.optimizer, 5)  # type: ignore[arg-type]
    guard.close()
    (aside,) = run_dir.glob("overwritten-*")
    assert [m.name for m in list_checkpoints(aside / "checkpoints")] == [
        "step_00000005",
        "step_00000010",
    ]
    assert (aside / "events.jsonl").read_text() == old_events
    assert (aside / "metrics.jsonl").exists() and (aside / "config.yaml").exists()
    assert [m.name for m in list_checkpoints(run_dir / "checkpoints")] == ["step_00000005"]
    overwritten = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "overwritten"]
    assert overwritten[0]["moved_to"] == str(aside)
    assert overwritten[0]["checkpoints"] == ["step_00000005", "step_00000010"]


def test_a_resume_that_fails_closes_the_guard(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ten_steps_run(run_dir)
    with pytest.raises(RestoreError, match="no checkpoint matches target 7"):
        checkpointing_guard(run_dir, resume=7)
    assert not (run_dir / "control.sock").exists()
    assert json.loads((run_dir / "agent.json").read_text())["exit"] == "failed"
    guard, _ = checkpointing_guard(run_dir, resume="latest")  # nothing was left held
    assert guard.step == 10
    guard.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"resume": "latest", "overwrite": True}, "exclude each other"),
        ({"skip_batches": 3}, "only with resume"),
        ({"resume": "latest", "skip_batches": -1}, "must be >= 0"),
        ({"resume": "/tmp/step_00000005"}, "^resume: .*never a path"),
        ({"grad_clip": 0.0}, "grad_clip: must be a number > 0"),
        ({"max_steps": 0}, "max_steps: must be >= 1"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(
    tmp_path: Path, args: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        checkpointing_guard(tmp_path / "run", **args)
    assert not (tmp_path / "run").exists()

"""Configuration: validation errors name the key path and reason; --set; the CLI exits 2; what
reads the host (data files, the control token) is checked at start, not by validation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from lossguard.agent.config import Config, GuardConfig, check_host, load_config, parse_config
from lossguard.common.config import ConfigError, validate
from tests.support.processes import REPO, run_cli

pytestmark = pytest.mark.live


def test_shipped_configs_are_valid() -> None:
    demo = load_config(REPO / "configs/demo.yaml")
    assert demo.precision.dtype == "fp32" and demo.data.kind == "text"
    gpt2 = load_config(REPO / "configs/gpt2-124m.yaml", ["data.kind=synthetic", "data.path=null"])
    assert (gpt2.model.n_layer, gpt2.model.n_embd, gpt2.model.block_size) == (12, 768, 1024)


def test_shipped_gpt2_config_names_its_missing_data() -> None:
    config = load_config(REPO / "configs/gpt2-124m.yaml")  # valid: the files are read at start
    with pytest.raises(
        ConfigError, match=r"^data\.path: no such file: data/openwebtext/train\.bin"
    ):
        check_host(config)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"data": {"path": "/no/such/corpus"}},
            "data.path: no such file or directory: /no/such/corpus",
        ),
        (
            {"control": {"tcp": "127.0.0.1:7070", "token_env": "LOSSGUARD_TEST_UNSET_TOKEN"}},
            "control.tcp: needs a token in the environment variable LOSSGUARD_TEST_UNSET_TOKEN, "
            "which is not set",
        ),
    ],
)
def test_host_checks_wait_for_the_start(data: dict, message: str) -> None:
    config = parse_config(data)  # a config is valid wherever it is read
    with pytest.raises(ConfigError) as info:
        check_host(config)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"train": {"lr": 0}}, "train.lr: must be > 0"),
        ({"train": {"lr": -1e-3}}, "train.lr: must be > 0"),
        ({"train": {"lrr": 1.0}}, "train.lrr: unknown key"),
        ({"bogus": {}}, "bogus: unknown key"),
        ({"train": {"max_steps": "many"}}, "train.max_steps: must be an integer"),
        ({"train": {"batch_size": 0}}, "train.batch_size: must be >= 1"),
        ({"train": {"schedule": "step"}}, "train.schedule: must be one of 'cosine', 'linear'"),
        ({"precision": {"dtype": "fp4"}}, "precision.dtype: must be one of 'fp32'"),
        ({"model": {"n_embd": 100, "n_head": 3}}, "model.n_embd: must be divisible by n_head"),
        ({"model": {"dropout": 1.5}}, "model.dropout: must be < 1"),
        ({"data": {"kind": "tokens"}}, "data.path: required when kind is 'tokens'"),
        ({"run": {"id": "../escape"}}, "run.id: may hold only letters"),
        ({"train": {"early_stopping": {}}}, "train.early_stopping.patience: required key"),
        ({"train": 3}, "train: must be a mapping of keys"),
        ({"train": {"lr": float("inf")}}, "train.lr: must be a finite number"),
        ({"control": {"tcp": "nohost"}}, "control.tcp: must be HOST:PORT"),
        ({"distributed": {"timeout": "5s"}}, "distributed.timeout: must be at least 10s, not '5s'"),
        ({"distributed": {"timeout": "soon"}}, "distributed.timeout: not a valid duration: 'soon'"),
        ({"distributed": {"stop_grace": "1s"}}, "distributed.stop_grace: must be at least 5s"),
        (
            {"faults": [{"kind": "crash", "step": 1, "ranks": [1, 1]}]},
            "faults.0.ranks: must be distinct ranks >= 0",
        ),
        (
            {"faults": [{"kind": "crash", "step": 1, "ranks": [-1]}]},
            "faults.0.ranks: must be distinct ranks >= 0",
        ),
        (
            {"faults": [{"kind": "crash", "step": 1, "ranks": []}]},
            "faults.0.ranks: must list at least one rank",
        ),
        (
            {"telemetry": {"spikes": {"recover_steps": 30, "level_shift_after": 30}}},
            "telemetry.spikes.level_shift_after: must be > recover_steps (30)",
        ),
    ],
)
def test_bad_values_name_key_and_reason(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_overrides_set_nested_keys_as_yaml_scalars() -> None:
    cfg = parse_config(
        {"train": {"lr": 1.0}},
        ["train.lr=3e-4", "model.compile=true", "train.early_stopping.patience=3", "run.id=x"],
    )
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.model.compile is True
    assert cfg.train.early_stopping is not None and cfg.train.early_stopping.patience == 3
    assert cfg.run.id == "x"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lr", "--set train.lr: expected KEY=VALUE"),
        ("train.lr.x=1", "--set train.lr.x=1: train.lr is not a section"),
        ("train.nope=1", "train.nope: unknown key"),
        ("train.lr=[1", "--set train.lr=[1: value is not valid YAML"),
        ("train.lr=.inf", "train.lr: must be a finite number"),
    ],
)
def test_bad_overrides(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"train": {"lr": 1.0}}, [override])
    assert str(info.value).startswith(message)


def test_resolved_config_round_trips() -> None:
    cfg = parse_config({"train": {"max_steps": 7}, "run": {"id": "r"}})
    again = Config.model_validate(yaml.safe_load(yaml.safe_dump(cfg.resolved())))
    assert again == cfg and again.digest() == cfg.digest()


def test_durations_and_sizes_are_parsed_once_and_written_as_given() -> None:
    cfg = parse_config({"distributed": {"timeout": "1h30m"}, "snapshot": {"budget": "2GiB"}})
    assert cfg.distributed.timeout.seconds == 5400.0 and cfg.distributed.stop_grace.seconds == 20
    assert cfg.snapshot.budget.amount == 2 * 2**30
    resolved = cfg.resolved()
    assert (
        resolved["distributed"]["timeout"] == "1h30m" and resolved["snapshot"]["budget"] == "2GiB"
    )
    assert yaml.safe_load(yaml.safe_dump(cfg.distributed.model_dump()))["stop_grace"] == "20s"


def test_a_guard_config_holds_only_what_a_guard_reads() -> None:
    guard = GuardConfig.model_validate(
        {
            "train": {"log_every": 5},
            "distributed": {"timeout": "1m"},
            "precision": {"dtype": "bf16"},
        }
    )
    assert guard.train.log_every == 5 and guard.distributed.timeout.seconds == 60
    assert set(Config.model_fields) - set(GuardConfig.model_fields) == {
        "model",
        "data",
        "optim",
        "faults",
    }
    trainer_only: list[dict[str, Any]] = [
        {"model": {}},
        {"train": {"lr": 0.1}},
        {"distributed": {"strategy": "ddp"}},
    ]
    for data in trainer_only:
        with pytest.raises(ConfigError, match="unknown key"):
            validate(GuardConfig, data)
    assert isinstance(parse_config({}), GuardConfig)


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        ("train:\n  lr: 0\n", [], "train.lr: must be > 0"),
        ("train:\n  lr: 0.1\n  typo: 1\n", [], "train.typo: unknown key"),
        ("train:\n  max_steps: [1]\n", [], "train.max_steps: must be an integer"),
        ("train: {lr: 0.1\n", [], "invalid YAML"),
        ("- a\n- b\n", [], "the top level must be a mapping"),
        ("data:\n  path: /missing/corpus\n", [], "data.path: no such file or directory"),
        ("{}\n", ["--set", "precision.dtype=int3"], "precision.dtype: must be one of"),
        ("snapshot:\n  budget: lots\n", [], "snapshot.budget: must be a size such as 8GiB"),
        ("snapshot:\n  budget: 150%\n", [], "snapshot.budget: a percentage must be in"),
        ("snapshot:\n  every: -5\n", [], "snapshot.every: must be >= 1"),
        ("checkpoint:\n  every_seconds: -1\n", [], "checkpoint.every_seconds: must be > 0"),
        ("optim:\n  name: lion\n", [], "optim.name: must be one of 'adamw' or 'spam'"),
        ("optim:\n  reset_every: -500\n", [], "optim.reset_every: must be >= 1"),
        ("optim:\n  threshold: 0\n", [], "optim.threshold: must be > 0"),
        ("{}\n", ["--set", "optim.threshold=-5"], "optim.threshold: must be > 0"),
        ("optim:\n  clip_after: 500\n", [], "optim.clip_after: must be < reset_every (500)"),
        (None, [], "no such config file"),
    ],
)
def test_cli_bad_config_is_one_line_and_exit_2(
    tmp_path: Path, content: str | None, args: list[str], message: str
) -> None:
    path = tmp_path / "cfg.yaml"
    if content is not None:
        path.write_text(content)
    result = run_cli("run", str(path), *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("lossguard-agent: error: ") and message in lines[0]
    assert "Traceback" not in result.stderr


def test_check_prints_the_config_resolved(tmp_path: Path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text("train: {lr: 0.01}\n")
    result = run_cli("check", str(path), "--set", "train.max_steps=7")
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert set(resolved) == set(Config().resolved())
    assert (resolved["train"]["lr"], resolved["train"]["max_steps"]) == (0.01, 7)
    bad = run_cli("check", str(path), "--set", "train.lr=-1")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("lossguard-agent: error: train.lr")


def test_torch_free_modules_do_not_import_torch() -> None:
    code = (
        "import sys, lossguard.agent, lossguard.agent.config, lossguard.agent.train.corpus, "
        "lossguard.agent.cli, lossguard.monitor\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

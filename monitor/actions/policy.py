"""The ``actions`` section of ``monitor.yml``: what the monitor does when an alert carrying an
``action`` label fires, how often, and what happens when its rollbacks are spent.

Defaults follow practice: restart from the last good checkpoint and skip the batches the
abandoned steps trained on (PaLM restarted ~100 steps before a spike and skipped 200-500
batches); lower the learning rate when a divergence comes back (OPT)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from lossguard.common.config import Duration, LooseDuration, PositiveDuration, Section
from lossguard.common.control.address import split_address
from lossguard.common.control.bearer import DEFAULT_TOKEN_ENV
from lossguard.common.control.protocol import parse_target

ACTION_LABEL = "action"
ACTIONS = ("rollback", "pause", "stop", "checkpoint", "restart")
COMMAND_OF = {
    "rollback": "rollback",
    "pause": "pause",
    "stop": "stop",
    "checkpoint": "save",
    "restart": "restart",
}
"""The control command each action sends (``restart`` goes to the run's supervisor)."""
SUPERVISOR_ACTIONS = ("restart",)
Trigger = Literal["rules", "alertmanager"]
TRIGGERS: tuple[Trigger, ...] = ("rules", "alertmanager")


class RollbackPolicy(Section):
    target: str | int = Field(
        default="last_good", description="last_good, best, latest or a step number."
    )
    skip_batches: Literal["abandoned"] | int = Field(
        default="abandoned",
        description="Batches to pass over after restoring: a number, or 'abandoned' for as "
        "many as the steps rolled back (the abandoned timeline's data does not recur).",
    )
    lr_scale: list[float] = Field(
        default_factory=lambda: [1.0, 0.5],
        min_length=1,
        description="Factor applied to the run's learning rate at each attempt (attempt i "
        "uses the i-th, the last repeats): by default the second and later halve it again.",
    )
    max_attempts: int = Field(
        default=3,
        ge=1,
        description="Rollbacks of a run whose bad steps lie within within_steps of each other.",
    )
    within_steps: int = Field(
        default=2000,
        ge=1,
        strict=True,
        description="Steps of training: an earlier rollback counts as an attempt while the "
        "step it rolled back from lies within this many steps of the run's step now.",
    )
    cooldown: LooseDuration = Field(
        default=Duration("30s"), description="Least time between two rollbacks of one run."
    )
    on_exhausted: Literal["pause", "stop", "none"] = Field(
        default="pause",
        description="What to do when the attempts are spent (besides the RollbacksExhausted "
        "page): pause keeps the process and its state for a human.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_window(cls, data: Any) -> Any:
        if isinstance(data, dict) and "window" in data:
            raise ValueError(
                "window: attempts are counted in steps of training now, not in time; "
                "use within_steps (a number of steps) instead"
            )
        return data

    @field_validator("target", mode="before")
    @classmethod
    def _target(cls, value: Any) -> str | int:
        return parse_target(value)

    @field_validator("skip_batches")
    @classmethod
    def _skip(cls, value: str | int) -> str | int:
        if isinstance(value, int) and value < 0:
            raise ValueError("must be >= 0 or 'abandoned'")
        return value

    @field_validator("lr_scale")
    @classmethod
    def _scales(cls, value: list[float]) -> list[float]:
        if any(not 0 < s <= 1 for s in value):
            raise ValueError("each factor must be in (0, 1]")
        return value

    def scale_for(self, attempt: int) -> float:
        """The learning-rate factor of rollback ``attempt`` (1-based)."""
        return self.lr_scale[min(attempt, len(self.lr_scale)) - 1]


class ActionsConfig(Section):
    enabled: bool = Field(default=True, description="Act on alerts with an action label.")
    dry_run: bool = Field(
        default=False, description="Announce and record what would be done; send nothing."
    )
    triggers: list[Trigger] = Field(
        default_factory=lambda: list(TRIGGERS),
        min_length=1,
        description="Whose alerts start actions: the monitor's own rules, Alertmanager's "
        "webhook, or both. Where Prometheus and the monitor evaluate the same rules, keep one, "
        "so that one divergence is one action.",
    )
    timeout: PositiveDuration = Field(
        default=Duration("2m"), description="Wait this long for the agent to apply a command."
    )
    retry_for: PositiveDuration = Field(
        default=Duration("10m"),
        description="Keep retrying an unreachable agent this long, then fail.",
    )
    rollback: RollbackPolicy = Field(default_factory=RollbackPolicy)
    agents: dict[str, str] = Field(
        default_factory=dict,
        description="run_id: HOST:PORT of a run's control TCP listener: an override of the "
        "address the run announces (lossguard_agent_info) and of its socket under "
        "scrape.runs_root.",
    )
    token_env: str = Field(
        default=DEFAULT_TOKEN_ENV,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Environment variable holding the agents' TCP control token.",
    )

    @field_validator("agents")
    @classmethod
    def _addresses(cls, agents: dict[str, str]) -> dict[str, str]:
        for run_id, address in agents.items():
            try:
                split_address(address)
            except ValueError:
                raise ValueError(f"{run_id}: expected HOST:PORT, got {address!r}") from None
        return agents

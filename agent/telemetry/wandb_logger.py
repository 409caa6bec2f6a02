"""Mirror lossguard's metrics records to Weights & Biases (optional extra ``lossguard[wandb]``).

The W&B run id is the lossguard run id, so a resumed run continues the same W&B run. Charts use
the record's ``step`` field as their x-axis; W&B's own step only orders the rows and never goes
back, so records replayed after a rollback get rows of their own instead of being dropped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lossguard.agent.config import WandbConfig
from lossguard.common.config import ConfigError

if TYPE_CHECKING:
    from wandb import Run

log = logging.getLogger(__name__)

# Summary aggregate per metric; every other metric's summary is its last value.
SUMMARIES = {
    "train_loss": "min",
    "val_loss": "min",
    "tokens_per_second": "mean",
    "mfu": "mean",
    "grad_norm": "max",
}


def resolve_mode(mode: str) -> Literal["online", "offline"]:
    """``auto`` is offline unless ``WANDB_API_KEY`` is set (only its presence is looked at)."""
    if mode == "auto":
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return "online" if mode == "online" else "offline"


def numeric_fields(record: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """The int/float (not bool) values of ``record``, nested mappings flattened as ``a/b``."""
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from numeric_fields(value, f"{name}/")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            yield name, value


class WandbLogger:
    """Mirrors lossguard's metrics records to Weights & Biases."""

    def __init__(
        self,
        cfg: WandbConfig,
        *,
        run_id: str,
        run_dir: Path,
        config: dict[str, Any],
        resume: bool,
    ) -> None:
        try:
            import wandb
        except ModuleNotFoundError as exc:
            if exc.name != "wandb":
                raise
            raise ConfigError(
                "wandb.enabled: the wandb package is not installed (pip install 'lossguard[wandb]')"
            ) from None
        self.mode = resolve_mode(cfg.mode)
        directory = cfg.dir if cfg.dir is not None else run_dir
        directory.mkdir(parents=True, exist_ok=True)
        self.run: Run = wandb.init(
            id=run_id,
            name=run_id,
            resume="allow",
            mode=self.mode,
            dir=directory,
            project=cfg.project,
            entity=cfg.entity,
            tags=list(cfg.tags),
            config=config,
            settings=wandb.Settings(console="off"),  # lossguard's own terminal output stays out
        )
        if self.run.resumed and not resume:
            log.warning("wandb: run %s already exists; appending to it", run_id)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        for name, summary in SUMMARIES.items():
            self.run.define_metric(name, summary=summary)
        # W&B's step of the row being filled and the record step in it. A resumed online run
        # starts after the steps the server holds; rows below that would be dropped.
        start = self.run.starting_step
        self._row: int | None = start - 1 if start > 0 else None
        self._row_record_step: int | None = None
        self._warned = False
        self._finished = False

    def log(self, record: Mapping[str, Any]) -> None:
        """Log a record's numbers at its step; records of one step share a W&B row."""
        step = int(record["step"])
        data = {name: value for name, value in numeric_fields(record) if name != "step"}
        data["step"] = step
        if self._row is None or step > self._row:
            self._row = step
        elif step != self._row_record_step:
            # W&B drops rows whose step is not above the last one: after a rollback (or a
            # resume behind the W&B run) give the record a new row; "step" keeps its x position.
            if not self._warned:
                self._warned = True
                log.warning(
                    "wandb: step %d is behind W&B step %d (rollback?); logging it in later rows",
                    step,
                    self._row,
                )
            self._row += 1
        self._row_record_step = step
        self.run.log(data, step=self._row)

    def finish(self) -> None:
        """Flush and close the W&B run (idempotent)."""
        if not self._finished:
            self._finished = True
            self.run.finish()

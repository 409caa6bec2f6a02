"""Terminal output: a live display on a TTY, key=value lines elsewhere."""

from __future__ import annotations

import io

from rich.console import Console

from lossguard.agent.telemetry.progress import LineProgress, LiveProgress, logfmt
from lossguard.common.console import format_duration

TRAIN = {
    "kind": "train",
    "step": 50,
    "train_loss": 2.34567,
    "lr": 3e-4,
    "grad_norm": 0.5,
    "tokens_per_second": 12345.6,
    "mfu": 0.4123,
    "step_time_seconds": 0.2,
}
EVAL = {"kind": "eval", "step": 50, "val_loss": 2.5, "val_perplexity": 12.18}


def test_lines_carry_step_loss_throughput_and_eta() -> None:
    line = logfmt(TRAIN, total_steps=200)
    assert line == (
        "kind=train step=50/200 loss=2.3457 lr=3.000e-04 grad_norm=0.500 tok/s=12346 "
        "mfu=0.412 step_s=0.2000 eta=0:00:30"
    )
    assert logfmt(EVAL, total_steps=None) == "kind=eval step=50 val_loss=2.5000 val_ppl=12.18"
    out = io.StringIO()
    LineProgress(200, stream=out).update(TRAIN)
    assert out.getvalue() == line + "\n"


def test_durations_read_as_hours_minutes_seconds() -> None:
    assert format_duration(0) == "0:00:00"
    assert format_duration(3725.4) == "1:02:05"
    assert format_duration(-3) == "0:00:00"


def test_tty_display_shows_step_loss_tokens_per_second_and_eta() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=150, color_system=None)
    display = LiveProgress(total_steps=200, start_step=0, console=console)
    display.update(TRAIN)
    display.update(EVAL)
    display.close()
    screen = out.getvalue()
    assert "50/200" in screen and "loss 2.3457" in screen and "12,346 tok/s" in screen
    assert "ETA" in screen and "val_loss 2.5000" in screen

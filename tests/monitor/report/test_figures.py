"""The report's figures as a reader sees them: matplotlib's own math in tick labels, text from
the run as written, alert names that do not overlap, and a step axis where the timeline that
went on is not squeezed by the steps an abandoned one reached."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from lossguard.monitor.report import marks
from lossguard.monitor.report.data import Point, RunRecord
from lossguard.monitor.report.figures import PANELS, TAIL_SHARE, overview_figure, panel_figure
from lossguard.monitor.report.history import AlertSpan

ODD = r"$\nomacro{x}$"
"""Math that matplotlib cannot parse: drawn as math, it raises."""


def rolled_back_run(tmp_path: Path, alerts: tuple[AlertSpan, ...] = ()) -> RunRecord:
    """A run that diverged on to step 1000, was rolled back to step 100 at second 1000 and
    went on to step 200: a step a second, grad norms from 1 to 10^6 (a log axis)."""
    kept = [
        Point(s, float(s), {"train_loss": 3.0, "grad_norm": 10.0 ** (s % 7)}) for s in range(101)
    ]
    diverged = [
        Point(s, float(s), {"train_loss": 9.0, "grad_norm": 1.0}, abandoned=True)
        for s in range(101, 1001)
    ]
    recovered = [Point(s, 900.0 + s, {"train_loss": 2.0}) for s in range(101, 201)]
    restore = marks.Restore("rollback", 1000, 100, f"step_100{ODD}", 1000.5)
    return RunRecord(
        tmp_path, f"run{ODD}", "stopped", None, (*kept, *diverged, *recovered), (), (), (),
        (restore,), (), (), (), alerts=alerts,
    )  # fmt: skip


def axes_titled(fig: Figure, title: str) -> Axes:
    return next(ax for ax in fig.axes if ax.get_title(loc="left") == title)


def test_log_ticks_are_math_and_the_run_s_text_is_not(tmp_path: Path) -> None:
    """A log axis's ``$\\mathdefault{10^{5}}$`` is drawn as 10 to the 5th, not as its
    source; the run's id, alert names and checkpoint names keep their ``$``."""
    alerts = (AlertSpan(f"Cost{ODD}", f"sev{ODD}", "", 50.0, 60.0),)
    run = rolled_back_run(tmp_path, alerts)
    overview, panel = overview_figure(run), panel_figure(PANELS[1], run)  # PNG's, page's
    for fig, ax in ((overview, axes_titled(overview, PANELS[1].title)), (panel, panel.axes[0])):
        fig.draw_without_rendering()  # raises where text from the run is parsed as math
        assert ax.get_yscale() == "log"
        widths = [t.get_window_extent().width for t in ax.get_yticklabels() if t.get_text()]
        assert widths and max(widths) < 40, widths  # the source would be 100 pixels or more


def test_alert_names_that_fire_together_do_not_overlap(tmp_path: Path) -> None:
    together = [AlertSpan(name, "critical", "", 20.0, 40.0) for name in ("LossSpike", "A", "B")]
    near = AlertSpan("GradNormSpikeAndMore", "warning", "", 21.0, None)
    late = AlertSpan("TrainingStalled", "info", "", 995.0, None)  # at the panel's right edge
    run = rolled_back_run(tmp_path, (*together, near, late))
    fig = overview_figure(run)
    fig.draw_without_rendering()
    loss = axes_titled(fig, "Loss")
    names = [t for t in loss.texts if re.fullmatch(r"mark-alert-\d+-label", t.get_gid() or "")]
    boxes = [name.get_window_extent() for name in names]
    assert len(boxes) == 5
    for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b), (a, b)
    assert all(loss.bbox.x0 <= box.x0 and box.x1 <= loss.bbox.x1 for box in boxes)


def test_the_steps_only_an_abandoned_timeline_reached_are_drawn_narrow(tmp_path: Path) -> None:
    """The recovered run (to step 200) takes the width but TAIL_SHARE; steps 200 to 1000 are
    still drawn (the divergence, the rollback's mark), shaded and named on the axis."""
    run = rolled_back_run(tmp_path)
    assert run.current_last_step == 200 and run.last_step == 1000
    fig = overview_figure(run)
    fig.draw_without_rendering()
    for ax in (a for a in fig.axes if a.get_xlabel()):
        left, right = ax.bbox.x0, ax.bbox.x1
        at_200 = (ax.transData.transform((200, 1))[0] - left) / (right - left)
        # linear, step 200 of 1000 would sit at a fifth of the width; narrowed, the recovered
        # run's 200 steps fill all but the abandoned tail's share
        assert at_200 == pytest.approx(1 - TAIL_SHARE, abs=0.02), at_200
        assert ax.get_xlim()[1] >= 1000
        assert "abandoned-tail" in {p.get_gid() for p in ax.patches}
        assert "steps 200 to 1000, reached only by the abandoned timeline" in ax.get_xlabel()
        assert max(float(t) for t in ax.get_xticks()) == 1000


def test_a_run_without_an_abandoned_tail_keeps_a_linear_step_axis(tmp_path: Path) -> None:
    points = tuple(Point(s, float(s), {"train_loss": 3.0}) for s in range(1, 101))
    run = RunRecord(tmp_path, "r", "completed", None, points, (), (), (), (), (), (), ())
    ax = panel_figure(PANELS[0], run).axes[0]
    assert ax.get_xscale() == "linear" and ax.get_xlabel() == "step"
    assert ax.get_xlim() == (0, 102)

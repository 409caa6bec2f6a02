"""The report's plots, drawn with matplotlib (no pyplot state: one ``Figure`` per drawing):
loss with the run's marks, gradient norm with the spike statistic, throughput with MFU, device
memory. Each panel is a function of one Axes; the page draws them one figure each (SVG), the
overview stacks them in one PNG.

Marks carry SVG ids (``mark-rollback-0``, ``mark-spike-0``, ``mark-checkpoints``,
``mark-alert-0``, ...), series ``series-<field>``, an empty panel ``no-data-<panel>``, a
remark on what a panel lacks ``note-<key>`` (``note-no-mfu``), the steps only an abandoned
timeline reached, drawn narrower, ``abandoned-tail``.

Text from the run (its id, alert names, request ids, checkpoint names) goes through
:func:`_plain`, so a ``$`` in it is a dollar sign; matplotlib's own labels (a log axis's
``10^5``) keep their math.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import matplotlib
import numpy as np
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator
from matplotlib.typing import LineStyleType

from lossguard.monitor.report.data import Point, RunRecord

PANEL_SIZE = (11.0, 3.4)  # inches, one panel
PNG_DPI = 100
GIB = 2.0**30
WIDE = 50.0  # a positive series spanning more than this factor gets a log axis
ALERT_NAME = re.compile(r"mark-alert-\d+-label")
ALERT_NAME_TOP = 0.99  # axes fraction: the first row of alert names
TAIL_SHARE = 0.25
"""The most of a panel's width taken by the steps that only an abandoned timeline reached (a
run rolled back from step 1000 to 100 and stopped at 200: steps 200 to 1000)."""

COLOURS = {
    "train_loss": "#1f77b4",
    "val_loss": "#ff7f0e",
    "grad_norm": "#2ca02c",
    "loss_zscore": "#9467bd",
    "grad_norm_zscore": "#8c564b",
    "tokens_per_second": "#17becf",
    "mfu": "#e377c2",
    "memory.allocated": "#393b79",
    "memory.reserved": "#bd9e39",
    "memory.peak_allocated": "#ad494a",
    "spike": "#d62728",
    "rollback": "#0b6e4f",
    "resume": "#6a51a3",
    "checkpoint": "#4f6d7a",
    "checkpoint_unhealthy": "#e6550d",
    "last_good": "#c7a500",
    "command": "#7b2cbf",
    "crash": "#a50f15",
    "critical": "#fcc5c0",
    "warning": "#fee6a8",
    "info": "#c6dbef",
    "abandoned_tail": "#f0f0f0",
}
"""Every colour the report draws with, by series or mark (alert spans by severity)."""
_NO_METADATA: dict[str, str | None] = {"Date": None, "Creator": None, "Format": None, "Type": None}
"""No date or creator in the SVG (nothing that is not the run)."""


@dataclass(frozen=True)
class Panel:
    key: str
    title: str
    draw: Callable[[Axes, RunRecord], None]


def draw_loss(ax: Axes, run: RunRecord) -> None:
    """Train and validation loss, and every mark: alerts, spikes, rollbacks and resumes,
    checkpoints, control commands, crashes."""
    plotted = _plot(ax, run.train, "train_loss", "train loss")
    plotted |= _plot(ax, run.evals, "val_loss", "val loss", marker="o")
    if not plotted:
        _no_data(ax, "loss", "No loss logged: metrics.jsonl holds no train or eval record.")
        return
    _log_scale_if_wide(ax, [p.values.get("train_loss") for p in run.train if not p.abandoned])
    _fit_to_current(ax, [*run.train, *run.evals], ("train_loss", "val_loss"))
    ax.set_ylabel("loss")
    _mark_alerts(ax, run)
    _mark_spikes(ax, run)
    _mark_restores(ax, run)
    _mark_checkpoints(ax, run)
    _mark_commands(ax, run)
    _mark_crashes(ax, run)
    ax.legend(handles=_legend(ax, run), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)


def draw_grad_norm(ax: Axes, run: RunRecord) -> None:
    """Gradient norm (before clipping) and the spike detectors' z-scores."""
    if not _plot(ax, run.train, "grad_norm", "grad norm"):
        _no_data(ax, "grad-norm", "No gradient norm logged.")
        return
    _log_scale_if_wide(ax, [p.values.get("grad_norm") for p in run.train])
    ax.set_ylabel("grad norm")
    twin = ax.twinx()
    plotted = _plot(twin, run.train, "grad_norm_zscore", "grad norm z-score", linestyle="--")
    plotted |= _plot(twin, run.train, "loss_zscore", "loss z-score", linestyle="--")
    threshold: list[Artist] = []
    if plotted:
        twin.set_ylabel("z-score")
        if run.spike_zscore is not None:
            for level in (run.spike_zscore, -run.spike_zscore):
                twin.axhline(level, color=COLOURS["spike"], linewidth=0.8, linestyle=":")
            threshold.append(
                Line2D([], [], color=COLOURS["spike"], linestyle=":", label="spike threshold")
            )
    missing = ("no-zscore", "no spike statistic logged (telemetry off)")
    _finish_twin(ax, twin, plotted, missing, threshold)


def draw_throughput(ax: Axes, run: RunRecord) -> None:
    """Tokens per second and MFU, over each log interval."""
    if not _plot(ax, run.train, "tokens_per_second", "tokens/s"):
        _no_data(ax, "throughput", "No throughput logged.")
        return
    ax.set_ylabel("tokens/s")
    _from_zero(ax)
    twin = ax.twinx()
    plotted = _plot(twin, run.train, "mfu", "MFU", scale=100.0, linestyle="--")
    if plotted:
        twin.set_ylabel("MFU (%)")
        _from_zero(twin)
    _finish_twin(ax, twin, plotted, ("no-mfu", "MFU not logged by this run"))


def draw_memory(ax: Axes, run: RunRecord) -> None:
    """Device memory: allocated, reserved and peak allocated; the limit where it is on scale."""
    plotted = False
    styles: tuple[tuple[str, LineStyleType], ...] = (  # allocated on top: it moves most
        ("peak_allocated", "--"),
        ("reserved", "-"),
        ("allocated", "-"),
    )
    for kind, style in styles:
        key = f"memory.{kind}"
        label = kind.replace("_", " ")
        plotted |= _plot(ax, run.train, key, label, scale=1 / GIB, linestyle=style)
    if not plotted:
        _no_data(ax, "memory", "No device memory logged.")
        return
    ax.set_ylabel("GiB")
    _from_zero(ax)
    limits = [v for p in run.train if (v := p.values.get("memory.limit")) is not None]
    if limits:
        limit, top = max(limits) / GIB, ax.get_ylim()[1]
        if limit <= 4 * top:
            ax.axhline(limit, color="#333333", linestyle="--", linewidth=0.8, label="limit")
        else:
            _note(ax, "memory-limit", f"limit {limit:.1f} GiB (off scale)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)


PANELS = (
    Panel("loss", "Loss", draw_loss),
    Panel("grad-norm", "Gradient norm and spike statistic", draw_grad_norm),
    Panel("throughput", "Throughput and MFU", draw_throughput),
    Panel("memory", "Device memory", draw_memory),
)


def panel_svg(panel: Panel, run: RunRecord) -> str:
    """One panel as an SVG element to inline in HTML (no XML prolog, ids unique to it)."""
    buffer = io.StringIO()
    fig = panel_figure(panel, run)
    with matplotlib.rc_context({"svg.hashsalt": f"lossguard-{panel.key}"}):
        fig.savefig(buffer, format="svg", metadata=_NO_METADATA)
    text = buffer.getvalue()
    return text[text.index("<svg") :]


def panel_figure(panel: Panel, run: RunRecord) -> Figure:
    """One panel, drawn and laid out."""
    fig = Figure(figsize=PANEL_SIZE, layout="constrained")
    _draw(panel, fig.add_subplot(), run)
    _stagger_alert_names(fig)
    return fig


def overview_png(run: RunRecord) -> bytes:
    """Every panel stacked in one PNG, titled with the run and how it ended."""
    buffer = io.BytesIO()
    overview_figure(run).savefig(buffer, format="png", dpi=PNG_DPI, metadata={"Software": None})
    return buffer.getvalue()


def overview_figure(run: RunRecord) -> Figure:
    """Every panel stacked, drawn and laid out, as :func:`overview_png` saves it."""
    width, height = PANEL_SIZE
    fig = Figure(figsize=(width, height * len(PANELS) + 0.4), layout="constrained", dpi=PNG_DPI)
    fig.suptitle(_plain(f"lossguard run {run.run_id}: {run.outcome}"), fontsize=12)
    for panel, ax in zip(PANELS, fig.subplots(len(PANELS), 1), strict=True):
        ax.set_title(panel.title, fontsize=10, loc="left")
        _draw(panel, ax, run)
    _stagger_alert_names(fig)
    return fig


def _draw(panel: Panel, ax: Axes, run: RunRecord) -> None:
    panel.draw(ax, run)
    if ax.axison:
        _step_axis(ax, run)
        ax.grid(True, linewidth=0.3, alpha=0.5)


def _plain(text: str) -> str:
    """``text`` from the run as written: each ``$`` escaped, so matplotlib draws no math."""
    return text.replace("$", r"\$")


def _step_axis(ax: Axes, run: RunRecord) -> None:
    """Steps from 0 to the run's last. Where an abandoned timeline reached steps far past the
    current timeline's last, those take :data:`TAIL_SHARE` of the width, shaded, and the axis
    label says so: the run that went on is what the panel shows at full width."""
    last = run.last_step or 1
    current = run.current_last_step or 0
    ax.set_xlim(0, last * 1.02)
    ax.set_xlabel("step")
    if current <= 0 or (last - current) * (1 - TAIL_SHARE) <= current * TAIL_SHARE:
        return  # no abandoned tail, or one that takes no more than its share anyway
    squeeze = current * TAIL_SHARE / ((last - current) * (1 - TAIL_SHARE))

    def forward(steps: np.ndarray) -> np.ndarray:
        return np.where(steps <= current, steps, current + (steps - current) * squeeze)

    def inverse(places: np.ndarray) -> np.ndarray:
        return np.where(places <= current, places, current + (places - current) / squeeze)

    ax.set_xscale("function", functions=(forward, inverse))
    ticks = [t for t in MaxNLocator(nbins=8, integer=True).tick_values(0, current) if t <= current]
    ax.set_xticks([*ticks, last])
    tail = ax.axvspan(current, last, color=COLOURS["abandoned_tail"], zorder=-1, linewidth=0)
    tail.set_gid("abandoned-tail")
    ax.set_xlabel(
        f"step (shaded: steps {current} to {last}, reached only by the abandoned timeline, "
        f"drawn {1 / squeeze:.1f}x narrower)"
    )


# ------------------------------------------------------------------ series


def _segments(points: Sequence[Point], key: str) -> Iterator[tuple[bool, list[int], list[float]]]:
    """``(abandoned, steps, values)`` runs of the points that have ``key``: a new run where
    the timeline changes (abandoned or not) or steps go back (a rollback or resume)."""
    steps: list[int] = []
    values: list[float] = []
    abandoned = False
    for point in points:
        value = point.values.get(key)
        if value is None:
            continue
        if steps and (point.abandoned != abandoned or point.step <= steps[-1]):
            yield abandoned, steps, values
            steps, values = [], []
        abandoned = point.abandoned
        steps.append(point.step)
        values.append(value if math.isfinite(value) else math.nan)
    if steps:
        yield abandoned, steps, values


def _plot(
    ax: Axes,
    points: Sequence[Point],
    key: str,
    label: str,
    *,
    scale: float = 1.0,
    linestyle: LineStyleType = "-",
    marker: str | None = None,
) -> bool:
    """Plot ``key`` of ``points``; the abandoned timelines dotted and faint, each value a dot
    (short, and broken by NaNs, they may have no two values in a row). False: no point has
    it."""
    colour = COLOURS[key]
    plotted = labelled = False
    for abandoned, steps, values in _segments(points, key):
        scaled = [v * scale for v in values]
        style = ":" if abandoned else linestyle
        (line,) = ax.plot(
            steps,
            scaled,
            color=colour,
            linestyle=style,
            linewidth=1.0 if abandoned else 1.6,
            alpha=0.45 if abandoned else 1.0,
            marker="." if abandoned and marker is None else marker,
            markersize=3,
            label=None if abandoned or labelled else label,
        )
        line.set_gid(f"series-{key}{'-abandoned' if abandoned else ''}")
        labelled |= not abandoned
        plotted = True
    return plotted


def _fit_to_current(ax: Axes, points: Sequence[Point], keys: Sequence[str]) -> None:
    """The y range of the timeline training went on with: an abandoned one (a divergence, a
    loss of thousands) runs off the top as a faint branch instead of flattening the run."""
    values = [
        value
        for point in points
        if not point.abandoned
        for key in keys
        if (value := point.values.get(key)) is not None and math.isfinite(value)
    ]
    if not values or not any(p.abandoned for p in points):
        return
    low, high = min(values), max(values)
    if ax.get_yscale() == "log":
        ax.set_ylim(low / 1.5, high * 1.5)
    else:
        margin = 0.1 * (high - low) or 0.1 * abs(high) or 1.0
        ax.set_ylim(low - margin, high + margin)


def _log_scale_if_wide(ax: Axes, values: Sequence[float | None]) -> None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if finite and min(finite) > 0 and max(finite) / min(finite) > WIDE:
        ax.set_yscale("log")


def _finish_twin(
    ax: Axes,
    twin: Axes,
    plotted: bool,
    missing: tuple[str, str],
    extra: Sequence[Artist] = (),
) -> None:
    """One legend for a panel's two y axes; a twin with nothing on it is hidden, and the
    panel says what is missing (``missing``: the note's key and words)."""
    if not plotted:
        twin.set_axis_off()
        _note(ax, *missing)
    handles = [*ax.get_legend_handles_labels()[0], *extra, *twin.get_legend_handles_labels()[0]]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.06, 1.0), fontsize=7)


def _from_zero(ax: Axes) -> None:
    """A y axis from 0 with room above the highest value (a flat series shows mid-panel)."""
    top = ax.get_ylim()[1]
    ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)


def _no_data(ax: Axes, panel: str, message: str) -> None:
    ax.set_axis_off()
    text = ax.text(0.5, 0.5, message, ha="center", va="center", fontsize=12, color="#555555")
    text.set_gid(f"no-data-{panel}")


def _note(ax: Axes, key: str, message: str) -> None:
    """A remark in the panel's corner (what is missing from it), id ``note-<key>``."""
    note = ax.text(
        0.99,
        0.97,
        message,
        transform=ax.transAxes,
        ha="right",
        va="top",
        fontsize=8,
        color="#555555",
    )
    note.set_gid(f"note-{key}")


# ------------------------------------------------------------------ marks


def _mark_alerts(ax: Axes, run: RunRecord) -> None:
    """Each alert of the run, firing to resolved (or to the end), shaded by severity, named
    at its start along the top (in rows, :func:`_stagger_alert_names`)."""
    last = run.last_step or 0
    for i, alert in enumerate(run.alerts):
        start = run.step_at(alert.fired_at)
        end = last if alert.resolved_at is None else run.step_at(alert.resolved_at)
        colour = COLOURS.get(alert.severity, COLOURS["info"])
        span = ax.axvspan(start, max(end, start + 0.5), color=colour, zorder=0, linewidth=0)
        span.set_gid(f"mark-alert-{i}")
        label = ax.text(
            start,
            ALERT_NAME_TOP,
            _plain(f" {alert.name} "),
            transform=ax.get_xaxis_transform(),
            ha="left",
            va="top",
            fontsize=7,
            color="#7a0000",
            clip_on=True,
            bbox={"facecolor": "white", "alpha": 0.75, "linewidth": 0, "pad": 0.5},
        )
        label.set_gid(f"mark-alert-{i}-label")


def _stagger_alert_names(fig: Figure) -> None:
    """Lay the figure out, then give each alert name the top-most row where it overlaps no
    name before it (by start), one text height per row: names of alerts that fire together
    stand one under another. A name that would run past the panel's right edge ends at its
    alert's start instead."""
    named = [
        (ax, names)
        for ax in fig.axes
        if (names := [t for t in ax.texts if ALERT_NAME.fullmatch(t.get_gid() or "")])
    ]
    if named:
        fig.draw_without_rendering()  # the names' extents, where the figure puts them
    for ax, names in named:
        rows: list[list[tuple[float, float]]] = []  # each row's names, as (left, right) pixels
        for name in sorted(names, key=lambda t: t.get_window_extent().x0):
            if name.get_window_extent().x1 > ax.bbox.x1:
                name.set_horizontalalignment("right")
            box = name.get_window_extent()
            free = (
                r for r, row in enumerate(rows) if all(box.x1 <= a or b <= box.x0 for a, b in row)
            )
            row = next(free, len(rows))
            if row == len(rows):
                rows.append([])
            rows[row].append((box.x0, box.x1))
            name.set_y(ALERT_NAME_TOP - row * 1.2 * box.height / ax.bbox.height)


def _mark_spikes(ax: Axes, run: RunRecord) -> None:
    """Spikes (triangles) and non-finite values (crosses), along the top."""
    for i, spike in enumerate(run.spikes):
        (mark,) = ax.plot(
            [spike.step],
            [0.94],
            transform=ax.get_xaxis_transform(),
            marker="X" if spike.nonfinite else "v",
            markersize=9,
            color=COLOURS["spike"],
            linestyle="none",
            clip_on=False,
        )
        mark.set_gid(f"mark-{'nonfinite' if spike.nonfinite else 'spike'}-{i}")


def _mark_restores(ax: Axes, run: RunRecord) -> None:
    """A rollback or resume: a line at the step left and an arrow back to the step restored."""
    transform = ax.get_xaxis_transform()
    for i, restore in enumerate(run.restores):
        colour = COLOURS[restore.kind]
        gid = f"mark-{restore.kind}-{i}"
        left = restore.from_step if restore.from_step is not None else restore.to_step
        line = ax.axvline(left, color=colour, linestyle="--", linewidth=1.2)
        line.set_gid(gid)
        if left != restore.to_step:
            arrow = ax.annotate(
                "",
                xy=(restore.to_step, 0.8),
                xytext=(left, 0.8),
                xycoords=transform,
                textcoords=transform,
                arrowprops={"arrowstyle": "->", "color": colour, "linewidth": 1.6},
            )
            arrow.set_gid(f"{gid}-arrow")
            arrow.arrow_patch.set_gid(f"{gid}-arrow-patch")  # type: ignore[union-attr]
        label = ax.text(  # at the step restored: the step left may be the panel's right edge
            restore.to_step,
            0.84,
            _plain(
                f" {restore.kind} to step {restore.to_step}"
                + (f" ({restore.checkpoint})" if restore.checkpoint else "")
            ),
            transform=transform,
            fontsize=7,
            color=colour,
            ha="left",
            va="bottom",
        )
        label.set_gid(f"{gid}-label")


def _mark_checkpoints(ax: Axes, run: RunRecord) -> None:
    """Ticks along the bottom at each save (unhealthy ones orange), a star on ``last_good``."""
    transform = ax.get_xaxis_transform()
    for healthy, key, gid in (
        (True, "checkpoint", "mark-checkpoints"),
        (False, "checkpoint_unhealthy", "mark-checkpoints-unhealthy"),
    ):
        steps = [c.step for c in run.checkpoints if c.healthy == healthy]
        if steps:
            (ticks,) = ax.plot(
                steps,
                [0.03] * len(steps),
                transform=transform,
                marker="|",
                markersize=10,
                markeredgewidth=1.5,
                linestyle="none",
                color=COLOURS[key],
            )
            ticks.set_gid(gid)
    for checkpoint in run.checkpoints:
        if checkpoint.last_good:
            (star,) = ax.plot(
                [checkpoint.step],
                [0.07],
                transform=transform,
                marker="*",
                markersize=13,
                linestyle="none",
                color=COLOURS["last_good"],
                markeredgecolor="#5c4d00",
            )
            star.set_gid("mark-last-good")


def _mark_commands(ax: Axes, run: RunRecord) -> None:
    """Control commands that changed something (a monitor's actions among them)."""
    for i, command in enumerate(run.commands):
        # where it arrived: a rollback's own event is logged at the step it went back to
        step = run.step_at(command.time) if command.time is not None else command.step
        if step is None:
            continue
        line = ax.axvline(step, color=COLOURS["command"], linestyle="-.", linewidth=1.4)
        line.set_gid(f"mark-command-{i}")
        outcome = "" if command.ok else " (refused)"
        label = ax.text(
            step,
            0.5,
            _plain(f" {command.cmd}{outcome} {command.request_id}"),
            transform=ax.get_xaxis_transform(),
            rotation=90,
            fontsize=6,
            color=COLOURS["command"],
            ha="left",
            va="center",
        )
        label.set_gid(f"mark-command-{i}-label")


def _mark_crashes(ax: Axes, run: RunRecord) -> None:
    for i, crash in enumerate(run.crashes):
        if crash.step is not None:
            line = ax.axvline(crash.step, color=COLOURS["crash"], linewidth=1.6)
            line.set_gid(f"mark-crash-{i}")


def _legend(ax: Axes, run: RunRecord) -> list[Artist]:
    """The series' entries and one per kind of mark the panel shows."""
    handles: list[Artist] = list(ax.get_legend_handles_labels()[0])

    def marker(label: str, colour: str, symbol: str, style: LineStyleType = "none") -> None:
        handles.append(Line2D([], [], color=colour, marker=symbol, linestyle=style, label=label))

    if any(p.abandoned for p in run.train):
        marker("abandoned steps", "#888888", ".", ":")
    if any(not s.nonfinite for s in run.spikes):
        marker("spike", COLOURS["spike"], "v")
    if any(s.nonfinite for s in run.spikes):
        marker("non-finite", COLOURS["spike"], "X")
    for kind in ("rollback", "resume"):
        if any(r.kind == kind for r in run.restores):
            marker(kind, COLOURS[kind], "", "--")
    if any(c.healthy for c in run.checkpoints):
        marker("checkpoint", COLOURS["checkpoint"], "|")
    if any(not c.healthy for c in run.checkpoints):
        marker("unhealthy checkpoint", COLOURS["checkpoint_unhealthy"], "|")
    if any(c.last_good for c in run.checkpoints):
        marker("last good", COLOURS["last_good"], "*")
    if run.commands:
        marker("command", COLOURS["command"], "", "-.")
    if run.crashes:
        marker("crash", COLOURS["crash"], "", "-")
    for severity in sorted({a.severity for a in run.alerts}):
        colour = COLOURS.get(severity, COLOURS["info"])
        handles.append(Patch(color=colour, label=_plain(f"alert ({severity or 'no severity'})")))
    return handles

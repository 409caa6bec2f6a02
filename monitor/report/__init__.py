"""``lossguard-monitor report RUN_DIR``: a run's loss, gradients, throughput, memory and audit
trail, with its spikes, rollbacks, checkpoints and alerts marked, as one self-contained HTML
page and one PNG overview. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lossguard.common.ownership import shared_file_mode
from lossguard.common.rundir.files import write_atomically
from lossguard.monitor.report.data import ReportError, read_run

HTML_NAME = "report.html"
PNG_NAME = "report.png"

__all__ = ["HTML_NAME", "PNG_NAME", "ReportError", "ReportFiles", "write_report"]


@dataclass(frozen=True)
class ReportFiles:
    html: Path
    png: Path


def write_report(
    run_dir: Path, out_dir: Path | None = None, *, state_db: Path | None = None
) -> ReportFiles:
    """Write ``report.html`` and ``report.png`` of the run in ``run_dir`` into ``out_dir``
    (default: ``run_dir``), as private as the run (``shared_file_mode``);
    ``state_db``: the monitor's state database, for the run's alerts and actions. Raises
    ReportError naming the problem."""
    from lossguard.monitor.report.figures import overview_png
    from lossguard.monitor.report.html import render

    run = read_run(Path(run_dir), state_db)
    out = Path(out_dir) if out_dir is not None else run.run_dir
    files = ReportFiles(out / HTML_NAME, out / PNG_NAME)
    mode = shared_file_mode(run.run_dir)  # a report of a 0700 run is 0600, of a 0750 one 0640
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_atomically(files.html, render(run), mode=mode)
        write_atomically(files.png, overview_png(run), mode=mode)
    except OSError as exc:
        raise ReportError(f"cannot write the report into {out}: {exc.strerror or exc}") from None
    return files

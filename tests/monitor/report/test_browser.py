"""The report in a real browser: a tiny GPT trains with a NaN, a rollback through the control
socket and a gradient spike; the monitor's state database holds the alert; the report is
opened by headless Chromium (network blocked), and its screenshot must show every plot and
mark, where the page puts them."""

from __future__ import annotations

import itertools
import shutil
import subprocess
import threading
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from lossguard.agent.config import parse_config
from lossguard.agent.train.trainer import Trainer
from lossguard.common.control.client import ControlClient
from lossguard.monitor.report import ReportFiles, write_report
from lossguard.monitor.report.figures import COLOURS
from tests.monitor.report.test_data import record_action, record_alert, svg_ids
from tests.support.processes import wait_for
from tests.support.runs import events, tiny_settings

pytestmark = pytest.mark.live

ROLLBACK_ID = "lg-0123456789abcdef-1"
PANEL_SERIES = ("train_loss", "grad_norm", "tokens_per_second", "memory.allocated")
"""The series that shows each panel (in page order) in the screenshot: colours unique to it."""


def train_with_trouble(runs: Path, cache: Path) -> Path:
    """40 steps: a NaN at step 13, rolled back at step 16 through the control socket (a
    monitor-style request id) to the last good checkpoint; a learning-rate blow-up at step
    25 that the grad norm detector flags as a spike."""
    settings = tiny_settings(
        runs,
        cache,
        train={"max_steps": 40, "log_every": 2, "eval_every": 10},
        checkpoint={"every": 5, "async": False},
        telemetry={"spikes": {"min_history": 8, "zscore": 4.0}},
        faults=[
            {"kind": "nonfinite_loss", "step": 13, "duration": 1, "once": True},
            {"kind": "lr_scale", "step": 25, "duration": 2, "factor": 30.0},
        ],
    )
    trainer = Trainer(parse_config(settings), progress=False)
    guard = trainer.guard
    try:
        while guard.step < 16:
            trainer.train_step()
            guard.poll()
        reply: dict[str, Any] = {}

        def send() -> None:
            with ControlClient(socket_path=trainer.run_path / "control.sock") as client:
                args = {"target": "last_good", "skip_batches": "abandoned", "lr_scale": 0.5}
                reply.update(client.request("rollback", args, request_id=ROLLBACK_ID))

        def applied() -> bool:
            guard.poll()  # applies the command once it is queued
            return not sender.is_alive()

        sender = threading.Thread(target=send)
        sender.start()
        wait_for(applied, 60, "the rollback to be applied")
        sender.join()
        assert reply["to_step"] == 10, reply
        trainer.fit()
    finally:
        trainer.close()
    return trainer.run_path


def troubled_report(work: Path, cache: Path) -> ReportFiles:
    """The report of ``train_with_trouble``, with the monitor's state database holding the
    LossNonFinite alert (firing at the NaN, resolved by the rollback) and its action."""
    run_dir = train_with_trouble(work / "runs", cache)
    trail = events(run_dir)
    nan = next(e for e in trail if e["event"] == "nonfinite")
    rollback = next(e for e in trail if e["event"] == "rollback")
    db = work / "state.db"
    labels = {"alertname": "LossNonFinite", "run_id": "tiny", "severity": "critical"}
    record_alert(db, labels, fired=nan["time"], resolved=rollback["time"] + 0.01)
    record_action(db, "tiny", ROLLBACK_ID, at=nan["time"])
    return write_report(run_dir, state_db=db)


class Resources(HTMLParser):
    """Every tag name, and every attribute or CSS text that could load something."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.references: list[str] = []
        self.css: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self._in_style = tag == "style"
        for name, value in attrs:
            if name in ("src", "href", "xlink:href", "srcset", "action", "poster", "data"):
                self.references.append(value or "")
            if name == "style":
                self.css.append(value or "")

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self.css.append(data)

    def handle_endtag(self, tag: str) -> None:
        self._in_style = False


def check_self_contained(html: Path) -> None:
    """No script, no element that loads anything, no reference but to the page itself."""
    page = Resources()
    page.feed(html.read_text(encoding="utf-8"))
    assert page.tags.isdisjoint({"script", "link", "img", "iframe", "object", "embed", "video"})
    assert page.references and all(ref.startswith("#") for ref in page.references)
    assert not any(("url(" in c and "url(#" not in c) or "@import" in c for c in page.css)


def check_marks_are_named(html: Path) -> None:
    ids = svg_ids(html)
    for series in PANEL_SERIES:
        assert f"series-{series}" in ids
    assert "series-train_loss-abandoned" in ids  # the steps the rollback left
    assert {"mark-nonfinite-0", "mark-nonfinite-1"} <= ids  # loss and grad norm at step 13
    assert any(i.startswith("mark-spike-") for i in ids)
    assert {"mark-rollback-0", "mark-rollback-0-arrow-patch", "mark-command-0"} <= ids
    assert {"mark-checkpoints", "mark-checkpoints-unhealthy", "mark-last-good"} <= ids
    assert "mark-alert-0" in ids and "mark-alert-1" not in ids
    text = html.read_text(encoding="utf-8")
    assert ROLLBACK_ID in text and "LossNonFinite" in text


def screenshot(html: Path, out: Path, profile: Path) -> np.ndarray:
    """Chromium's screenshot of ``html`` (1400 px wide), as RGB rows; no host resolves."""
    chromium = shutil.which("chromium")
    assert chromium, "chromium is missing: scripts/test.sh installs it"
    done = subprocess.run(
        [
            chromium,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--screenshot={out}",
            "--window-size=1400,4000",
            html.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.is_file(), done.stderr[-2000:]
    return np.asarray(Image.open(out).convert("RGB"), dtype=np.int16)


def rows_with(image: np.ndarray, colour: str) -> np.ndarray:
    """The row of each pixel of ``colour`` (within antialiasing), top to bottom."""
    rgb = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)], dtype=np.int16)
    return np.nonzero(np.abs(image - rgb).max(axis=2) <= 12)[0]


def not_blank(image: np.ndarray) -> tuple[float, int]:
    """The share of pixels that are not white, and how many colours there are."""
    inked = float((image.min(axis=2) < 240).mean())
    packed = (image[..., 0].astype(np.int32) << 16) | (image[..., 1] << 8) | image[..., 2]
    return inked, len(np.unique(packed))


def check_panels(image: np.ndarray) -> list[np.ndarray]:
    """Not blank; each panel's series shows, the panels one below the other in page order.
    Returns each panel's rows."""
    inked, colours = not_blank(image)
    assert inked > 0.03 and colours > 200, (inked, colours)
    bands = [rows_with(image, COLOURS[series]) for series in PANEL_SERIES]
    assert all(len(band) > 200 for band in bands), [len(b) for b in bands]
    for above, below in itertools.pairwise(bands):
        assert above.max() < below.min()
    return bands


def test_a_troubled_run_s_report_renders_in_chromium(tmp_path: Path, corpus_cache: Path) -> None:
    report = troubled_report(tmp_path, corpus_cache)
    check_self_contained(report.html)
    check_marks_are_named(report.html)

    image = screenshot(report.html, tmp_path / "page.png", tmp_path / "profile")
    bands = check_panels(image)
    # the loss panel (from its top down to the gradient one) carries the marks, in pixels
    loss = image[bands[0].min() - 10 : bands[1].min()]
    marks = ("spike", "rollback", "command", "checkpoint", "checkpoint_unhealthy", "last_good")
    for mark in marks:
        assert len(rows_with(loss, COLOURS[mark])) > 20, mark
    assert len(rows_with(loss, COLOURS["critical"])) > 2000  # the alert's span

    with Image.open(report.png) as png:  # the overview: the same panels, stacked
        assert png.format == "PNG" and png.size[0] == 1100 and png.size[1] > 1300
        check_panels(np.asarray(png.convert("RGB"), dtype=np.int16))

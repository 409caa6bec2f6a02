"""What every receiver shows of an alert besides its labels: links to the run's dashboard, the
alert's runbook and the monitor, and short texts (the alert's subject, its value, a time,
clipped text)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from urllib.parse import quote, urljoin, urlsplit

from lossguard.monitor.notify.config import NotificationsConfig
from lossguard.monitor.notify.model import RUN_LABEL, AlertInfo

PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
RUNBOOK_ANNOTATION = "runbook_url"
ELLIPSIS = "…"
WHERE = (("run", RUN_LABEL), ("rank", "rank"))  # (shown as, label) in an alert's subject


@dataclass(frozen=True)
class Links:
    """Links from the ``notifications`` section and the monitor's own URL."""

    dashboard_url: str = ""
    runbook_base_url: str = ""
    monitor_url: str = ""  # the monitor's external URL

    @classmethod
    def from_config(cls, config: NotificationsConfig, monitor_url: str = "") -> Links:
        return cls(config.dashboard_url, config.runbook_base_url, monitor_url)

    def dashboard(self, labels: Mapping[str, str]) -> str | None:
        """The dashboard URL with each ``{label_name}`` filled in (URL-quoted; a label the
        alert lacks is empty); None when no dashboard is configured."""
        if not self.dashboard_url:
            return None
        return PLACEHOLDER.sub(lambda m: quote(labels.get(m[1], ""), safe=""), self.dashboard_url)

    def runbook(self, annotations: Mapping[str, str]) -> str | None:
        """The ``runbook_url`` annotation resolved against ``runbook_base_url`` as a browser
        resolves a link (``urljoin``: absolute URLs unchanged; a base that is a folder ends
        with ``/``); None without the annotation."""
        url = annotations.get(RUNBOOK_ANNOTATION, "").strip()
        if not url:
            return None
        return urljoin(self.runbook_base_url, url) if self.runbook_base_url else url


def is_web_url(url: str | None) -> bool:
    """Whether ``url`` is an absolute http(s) URL (one a chat client or PagerDuty can open)."""
    if not url:
        return False
    parts = urlsplit(url)
    return parts.scheme in ("http", "https") and bool(parts.netloc)


def subject(alert: AlertInfo) -> str:
    """``LossSpike run=abc rank=0``: the alert's name and where it is (labels it has)."""
    where = [f"{key}={alert.labels[label]}" for key, label in WHERE if label in alert.labels]
    return " ".join([alert.name or "(unnamed alert)", *where])


def value_display(value: float) -> str:
    """An alert's value for people: six significant digits (``nan``, ``inf`` as such)."""
    return f"{value:.6g}"


def iso_time(seconds: float) -> str:
    """Unix seconds as ISO 8601 in UTC, to the millisecond: ``2024-05-01T12:00:00.000+00:00``."""
    return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat(timespec="milliseconds")


def single_spaced(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) made one space."""
    return " ".join(text.split())


def clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, ending with an ellipsis when cut."""
    return text if len(text) <= limit else text[: limit - len(ELLIPSIS)] + ELLIPSIS

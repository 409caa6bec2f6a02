"""Value checks shared by the monitor's config sections."""

from __future__ import annotations

from lossguard.monitor.promql.literals import parse_duration
from lossguard.monitor.sources.discovery import instance_of


def seconds(text: str) -> float:
    """A Prometheus duration in seconds (raises ValueError with the reason)."""
    try:
        return parse_duration(text) / 1000
    except ValueError:
        raise ValueError(f"not a valid duration: {text!r} (e.g. 1s, 30s, 5m, 1h30m)") from None


def http_url(url: str) -> str:
    """``url`` if it is an http(s) URL with a host and a valid port (raises ValueError)."""
    instance_of(url)
    return url

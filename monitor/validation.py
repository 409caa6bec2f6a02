"""URL checks shared by the monitor's config sections (durations: ``common/config.py``)."""

from __future__ import annotations

from lossguard.monitor.sources.discovery import instance_of


def http_url(url: str) -> str:
    """``url`` if it is an http(s) URL with a host and a valid port (raises ValueError)."""
    instance_of(url)
    return url

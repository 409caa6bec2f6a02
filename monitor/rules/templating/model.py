"""The vocabulary every part of the template engine shares: the prefix Prometheus puts before
every alert template, the data a template sees, Go's value types and the errors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

PREFIX = (
    "{{$labels := .Labels}}{{$externalLabels := .ExternalLabels}}"
    "{{$externalURL := .ExternalURL}}{{$value := .Value}}"
)


class TemplateError(ValueError):
    """A template that cannot be parsed/checked; str() is one line."""


class ExecError(Exception):
    """An error while executing a parsed template (Prometheus renders it into the text)."""


class QueryError(Exception):
    """A template's ``query`` that the rules' source could not answer (one line)."""


@dataclass(frozen=True)
class TemplateData:
    """The dot of an alert template: Prometheus's ``AlertTemplateData``."""

    Labels: dict[str, str]
    ExternalLabels: dict[str, str]
    ExternalURL: str
    Value: float


@dataclass
class QuerySample:
    """One sample of a ``query`` result: Prometheus's template ``sample`` (``*sample`` in Go),
    its labels (the metric name included) and value."""

    Labels: dict[str, str]
    Value: float


GoValue = (
    str | int | float | bool | dict[str, str] | TemplateData | QuerySample | list[QuerySample]
) | None

TemplateQuery = Callable[[str], list[QuerySample]]
"""Runs a template's ``query`` at the evaluation's time (raises :class:`QueryError`)."""

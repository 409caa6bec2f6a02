"""Prometheus alert templates: the subset of Go's text/template that rules files use.

Annotations and alert labels expand as Prometheus's rules/alerting.go expands them: the text
gets the prefix defining ``$labels``, ``$externalLabels``, ``$externalURL`` and ``$value``,
runs with Prometheus's function map (template/template.go) and ``missingkey=zero``, and an
expansion error yields ``<error expanding template: ...>`` instead of an exception. Values
print as Go's ``fmt`` prints them. ``query`` runs its PromQL on the rules' source at the
evaluation's time (``expand``'s ``query``), and ``first``, ``label``, ``value``, ``strvalue`` and
``sortByLabel`` read its samples; functions that need other templates or Prometheus's web UI
(``template``, ``define``, ``graphLink``...) are refused by :func:`check_template`.
:func:`template_queries` tells what a template will query, where that is known before it runs.

The package reads in order: ``model`` (shared types), ``lexer``, ``nodes``, ``parser``,
``gofmt`` (Go's value printing), ``functions`` (the function map), ``executor`` and
``queries``.
"""

from lossguard.monitor.rules.templating.executor import expand
from lossguard.monitor.rules.templating.gofmt import format_float_g, go_quote, sprintf
from lossguard.monitor.rules.templating.model import (
    QueryError,
    QuerySample,
    TemplateError,
    TemplateQuery,
)
from lossguard.monitor.rules.templating.parser import check_template
from lossguard.monitor.rules.templating.queries import QueryText, template_queries

__all__ = [
    "QueryError",
    "QuerySample",
    "QueryText",
    "TemplateError",
    "TemplateQuery",
    "check_template",
    "expand",
    "format_float_g",
    "go_quote",
    "sprintf",
    "template_queries",
]

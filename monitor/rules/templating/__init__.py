"""Prometheus alert templates: the subset of Go's text/template that rules files use.

Annotations and alert labels expand as Prometheus's rules/alerting.go expands them: the text
gets the prefix defining ``$labels``, ``$externalLabels``, ``$externalURL`` and ``$value``,
runs with Prometheus's function map (template/template.go) and ``missingkey=zero``, and an
expansion error yields ``<error expanding template: ...>`` instead of an exception. Values
print as Go's ``fmt`` prints them. Functions that need the query engine or other templates
(``query``, ``template``, ``define``...) are refused by :func:`check_template`.

The package reads in order: ``model`` (shared types), ``lexer``, ``nodes``, ``parser``,
``gofmt`` (Go's value printing), ``functions`` (the function map) and ``executor``.
"""

from lossguard.monitor.rules.templating.executor import expand
from lossguard.monitor.rules.templating.gofmt import format_float_g, go_quote, sprintf
from lossguard.monitor.rules.templating.model import TemplateError
from lossguard.monitor.rules.templating.parser import check_template

__all__ = ["TemplateError", "check_template", "expand", "format_float_g", "go_quote", "sprintf"]

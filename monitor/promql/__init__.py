"""The monitor's embedded PromQL evaluator: a documented subset with Prometheus 2.42 semantics.

Supported: number literals; instant selectors with ``=``, ``!=``, ``=~``, ``!~`` matchers and
``offset`` (5-minute lookback, staleness markers end a series); range selectors as arguments of
rate, increase, delta, changes, resets, max_over_time, min_over_time, avg_over_time and
absent_over_time; absent, time, vector, scalar; + - * / % ^ and == != > < >= <= (with ``bool``)
between scalars and vectors, one-to-one ``on``/``ignoring`` matching; and, or, unless; sum, min,
max, avg, count with ``by``/``without``. Anything else is refused at parse time with an
:class:`UnsupportedError` naming it.
"""

from lossguard.monitor.promql.engine import LOOKBACK_MS, Value, evaluate
from lossguard.monitor.promql.errors import (
    EvaluationError,
    ParseError,
    PromQLError,
    UnsupportedError,
)
from lossguard.monitor.promql.matchers import Matcher
from lossguard.monitor.promql.model import METRIC_NAME, Labels, Sample, format_labels, make_labels
from lossguard.monitor.promql.nodes import Expr
from lossguard.monitor.promql.parser import check, parse
from lossguard.monitor.promql.series import expand_values, parse_series
from lossguard.monitor.promql.storage import STALE_NAN, MemoryStorage, Storage, is_stale

__all__ = [
    "LOOKBACK_MS",
    "METRIC_NAME",
    "STALE_NAN",
    "EvaluationError",
    "Expr",
    "Labels",
    "Matcher",
    "MemoryStorage",
    "ParseError",
    "PromQLError",
    "Sample",
    "Storage",
    "UnsupportedError",
    "Value",
    "check",
    "evaluate",
    "expand_values",
    "format_labels",
    "is_stale",
    "make_labels",
    "parse",
    "parse_series",
]

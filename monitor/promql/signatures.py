"""What the subset supports: functions with their argument types, aggregations, and the
rest of PromQL 2.42 that is refused by name."""

from __future__ import annotations

from lossguard.monitor.promql.nodes import ValueType

_M, _V, _S = ValueType.MATRIX, ValueType.VECTOR, ValueType.SCALAR

_RANGE = (
    "rate",
    "increase",
    "delta",
    "changes",
    "resets",
    "max_over_time",
    "min_over_time",
    "avg_over_time",
    "absent_over_time",
)

FUNCTIONS: dict[str, tuple[tuple[ValueType, ...], ValueType]] = {
    **{name: ((_M,), _V) for name in _RANGE},
    "absent": ((_V,), _V),
    "time": ((), _S),
    "vector": ((_S,), _V),
    "scalar": ((_V,), _S),
}
"""Supported function -> (argument types, result type)."""

AGGREGATIONS = ("sum", "min", "max", "avg", "count", "topk", "bottomk")
PARAMETER_AGGREGATIONS = frozenset(("topk", "bottomk"))
"""Aggregations whose first argument is a scalar parameter (k)."""

UNSUPPORTED_FUNCTIONS = frozenset(
    (
        *("abs", "ceil", "floor", "round", "sgn", "sqrt", "exp", "ln", "log2", "log10"),
        *("clamp", "clamp_max", "clamp_min", "deg", "rad", "pi", "sin", "cos", "tan"),
        *("asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh"),
        *("year", "month", "day_of_month", "day_of_week", "day_of_year", "days_in_month"),
        *("hour", "minute", "timestamp", "sort", "sort_desc", "label_join", "label_replace"),
        *("irate", "idelta", "deriv", "predict_linear", "holt_winters", "count_over_time"),
        *("sum_over_time", "last_over_time", "present_over_time", "quantile_over_time"),
        *("stddev_over_time", "stdvar_over_time", "histogram_quantile", "histogram_count"),
        *("histogram_sum", "histogram_fraction"),
    )
)
UNSUPPORTED_AGGREGATIONS = frozenset(("count_values", "group", "quantile", "stddev", "stdvar"))

SUPPORTS_FUNCTIONS = "the functions " + ", ".join(FUNCTIONS)
SUPPORTS_AGGREGATIONS = "the aggregations " + ", ".join(AGGREGATIONS)
SUPPORTS_OPERATORS = "the operators + - * / % ^ == != > < >= <= and or unless"
SUPPORTS_MATCHING = "one-to-one vector matching with on(...) or ignoring(...)"
SUPPORTS_RANGES = "range selectors such as metric[5m] as arguments of range functions"
SUPPORTS_RESULTS = "expressions whose result is a scalar or an instant vector"
SUPPORTS_OFFSET = "the offset modifier"


def refusal(what: str, supported: str) -> str:
    """The one-line message for valid PromQL outside the subset."""
    return (
        f"unsupported PromQL: {what} (the embedded evaluator supports {supported}; "
        "use source: prometheus to evaluate it)"
    )

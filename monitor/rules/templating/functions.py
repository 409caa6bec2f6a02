"""Prometheus's template function map (template/template.go), each function registered under its
template name: printf, humanize*, title, match, reReplaceAll, first, label, value, strvalue,
sortByLabel, index, len, comparisons, not. ``query`` needs the rules' source: the executor
runs it (:data:`QUERY`)."""

from __future__ import annotations

import datetime
import functools
import math
import re
from collections.abc import Callable, Sequence
from typing import TypeVar

from lossguard.monitor.promql.re2 import compile_re2
from lossguard.monitor.rules.templating.gofmt import format_float_g, go_type, special_float, sprintf
from lossguard.monitor.rules.templating.model import ExecError, GoValue, QuerySample

_Function = Callable[..., GoValue]
_RegisteredFunction = TypeVar("_RegisteredFunction", bound=_Function)

FUNCTIONS: dict[str, tuple[_Function, int, bool]] = {}
"""Template function name -> (function, number of parameters, variadic)."""

QUERY = "query"
"""``query "expr"``: the instant query's samples at the evaluation's time (run by the executor,
which has the rules' source)."""


def _template_function(
    name: str, count: int, variadic: bool = False
) -> Callable[[_RegisteredFunction], _RegisteredFunction]:
    """Register the decorated function in :data:`FUNCTIONS` as ``name``."""

    def register(function: _RegisteredFunction) -> _RegisteredFunction:
        FUNCTIONS[name] = (function, count, variadic)
        return function

    return register


def _to_float(value: GoValue) -> float:
    """Prometheus's ``convertToFloat``: floats, ints and numeric strings."""
    if isinstance(value, float):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            if value != value.strip() or "_" in value:
                raise ValueError(value)
            return float(value)
        except ValueError:
            raise ExecError(f'strconv.ParseFloat: parsing "{value}": invalid syntax') from None
    raise ExecError(f"can't convert {go_type(value)} to float")


def _want_str(value: GoValue) -> str:
    if not isinstance(value, str):
        raise ExecError(f"wrong type for value; expected string; got {go_type(value)}")
    return value


def _want_sample(value: GoValue) -> QuerySample:
    if value is None:
        raise ExecError("runtime error: invalid memory address or nil pointer dereference")
    if not isinstance(value, QuerySample):
        raise ExecError(f"wrong type for value; expected *template.sample; got {go_type(value)}")
    return value


def _want_result(value: GoValue) -> list[QuerySample]:
    if not isinstance(value, list):
        got = go_type(value)
        raise ExecError(f"wrong type for value; expected template.queryResult; got {got}")
    return value


@_template_function("first", 1)
def _first(result: GoValue) -> QuerySample:
    samples = _want_result(result)
    if not samples:
        raise ExecError("error calling first: first() called on vector with no elements")
    return samples[0]


@_template_function("label", 2)
def _label(name: GoValue, sample: GoValue) -> str:
    label = _want_str(name)
    return _want_sample(sample).Labels.get(label, "")


@_template_function("value", 1)
def _value(sample: GoValue) -> float:
    return _want_sample(sample).Value


@_template_function("strvalue", 1)
def _strvalue(sample: GoValue) -> str:
    return _want_sample(sample).Labels.get("__value__", "")


@_template_function("sortByLabel", 2)
def _sort_by_label(name: GoValue, result: GoValue) -> list[QuerySample]:
    """Go's stable sort by the label's value, in place: the result shares the samples' order."""
    label, samples = _want_str(name), _want_result(result)
    samples.sort(key=lambda sample: sample.Labels.get(label, "").encode())
    return samples


@_template_function("printf", 1, variadic=True)
def _printf(fmt: GoValue, *args: GoValue) -> str:
    return sprintf(_want_str(fmt), args)


def _g4(value: float, suffix: str = "") -> str:
    special = special_float(value)
    return (special if special is not None else f"{value:.4g}") + suffix


def _scaled(value: float, step: float, prefixes: str | Sequence[str]) -> tuple[float, str]:
    prefix = ""
    for candidate in prefixes:
        if abs(value) < step:
            break
        prefix = candidate
        value /= step
    return value, prefix


def _scaled_down(value: float) -> tuple[float, str]:
    prefix = ""
    for candidate in "munpfazy":
        if abs(value) >= 1:
            break
        prefix = candidate
        value *= 1000
    return value, prefix


@_template_function("humanize", 1)
def _humanize(arg: GoValue) -> str:
    value = _to_float(arg)
    if value == 0 or not math.isfinite(value):
        return _g4(value)
    if abs(value) >= 1:
        return _g4(*_scaled(value, 1000, "kMGTPEZY"))
    return _g4(*_scaled_down(value))


@_template_function("humanize1024", 1)
def _humanize1024(arg: GoValue) -> str:
    value = _to_float(arg)
    if abs(value) <= 1 or not math.isfinite(value):
        return _g4(value)
    return _g4(*_scaled(value, 1024, ("ki", "Mi", "Gi", "Ti", "Pi", "Ei", "Zi", "Yi")))


@_template_function("humanizeDuration", 1)
def _humanize_duration(arg: GoValue) -> str:
    value = _to_float(arg)
    if not math.isfinite(value):
        return _g4(value)
    if value == 0:
        return _g4(value, "s")
    if abs(value) < 1:
        scaled, prefix = _scaled_down(value)
        return _g4(scaled, prefix + "s")
    sign = "-" if value < 0 else ""
    value = abs(value)
    whole = int(value) if value < 2**63 else -(2**63)  # Go's int64() of an overflowing float
    days, hours = _go_div(whole, 86400), _go_rem(_go_div(whole, 3600), 24)
    minutes, seconds = _go_rem(_go_div(whole, 60), 60), _go_rem(whole, 60)
    if days:
        return f"{sign}{days}d {hours}h {minutes}m {seconds}s"
    if hours:
        return f"{sign}{hours}h {minutes}m {seconds}s"
    if minutes:
        return f"{sign}{minutes}m {seconds}s"
    return f"{sign}{_g4(value)}s"


def _go_div(a: int, b: int) -> int:
    """Go's integer division, truncating toward zero (``b > 0``)."""
    return -(-a // b) if a < 0 else a // b


def _go_rem(a: int, b: int) -> int:
    return a - b * _go_div(a, b)


@_template_function("humanizePercentage", 1)
def _humanize_percentage(arg: GoValue) -> str:
    return _g4(_to_float(arg) * 100, "%")


@_template_function("humanizeTimestamp", 1)
def _humanize_timestamp(arg: GoValue) -> str:
    value = _to_float(arg)
    if not math.isfinite(value):
        return _g4(value)
    if abs(value * 1e9) >= 2**63:
        raise ExecError(
            f"{format_float_g(value)} cannot be represented as a nanoseconds timestamp"
            " since it overflows int64"
        )
    millis = int(int(value * 1e9) / 1_000_000)
    try:
        moment = datetime.datetime(1970, 1, 1) + datetime.timedelta(milliseconds=millis)
    except OverflowError:
        raise ExecError(f"timestamp {format_float_g(value)} is out of range") from None
    fraction = f".{millis % 1000:03d}".rstrip("0").rstrip(".")
    return moment.strftime("%Y-%m-%d %H:%M:%S") + fraction + " +0000 UTC"


@_template_function("toUpper", 1)
def _to_upper(arg: GoValue) -> str:
    return _want_str(arg).upper()


@_template_function("toLower", 1)
def _to_lower(arg: GoValue) -> str:
    return _want_str(arg).lower()


@_template_function("title", 1)
def _title(arg: GoValue) -> str:
    """Go's ``strings.Title``: upper-case the first letter of each word."""
    out: list[str] = []
    previous = " "
    for char in _want_str(arg):
        separator = not (previous.isalnum() or previous == "_")
        out.append(char.upper() if separator else char)
        previous = char
    return "".join(out)


def _regex(pattern: GoValue) -> re.Pattern[str]:
    try:
        return compile_re2(_want_str(pattern))
    except ValueError as exc:
        raise ExecError(f"error parsing regexp: {exc}: `{pattern}`") from None


@_template_function("match", 2)
def _match(pattern: GoValue, text: GoValue) -> bool:
    return _regex(pattern).search(_want_str(text)) is not None


_TEMPLATE_REF = re.compile(r"\$(\$|\{(\w+)\}|(\w+))")


@_template_function("reReplaceAll", 3)
def _re_replace_all(pattern: GoValue, replacement: GoValue, text: GoValue) -> str:
    """Go's ``Regexp.ReplaceAllString``: ``$1``/``${name}`` expansion, Go's empty-match rule."""
    regex, template, source = _regex(pattern), _want_str(replacement), _want_str(text)
    out: list[str] = []
    last_end = 0
    pos = 0
    while pos <= len(source):
        match = regex.search(source, pos)
        if match is None:
            break
        out.append(source[last_end : match.start()])
        if match.end() > last_end or match.start() == 0:
            out.append(_TEMPLATE_REF.sub(functools.partial(_group, match), template))
        last_end = match.end()
        pos = max(pos + 1, match.end())
    out.append(source[last_end:])
    return "".join(out)


def _group(match: re.Match[str], ref: re.Match[str]) -> str:
    if ref.group(1) == "$":
        return "$"
    name = ref.group(2) or ref.group(3)
    key: int | str = int(name) if name.isdigit() and (name == "0" or name[0] != "0") else name
    try:
        return match.group(key) or ""
    except IndexError:
        return ""


@_template_function("stripPort", 1)
def _strip_port(arg: GoValue) -> str:
    """Go's ``net.SplitHostPort`` host, or the input when it has no port."""
    text = _want_str(arg)
    if text.startswith("["):
        end = text.find("]")
        return text[1:end] if end > 0 and text[end + 1 : end + 2] == ":" else text
    host, colon, _ = text.rpartition(":")
    return host if colon and ":" not in host else text


@_template_function("index", 1, variadic=True)
def _index(item: GoValue, *keys: GoValue) -> GoValue:
    for key in keys:
        if isinstance(item, dict) and isinstance(key, str):
            item = item.get(key, "")
        elif isinstance(item, list) and isinstance(key, int) and not isinstance(key, bool):
            if not 0 <= key < len(item):
                raise ExecError(f"error calling index: index out of range: {key}")
            item = item[key]
        elif isinstance(item, str) and isinstance(key, int) and not isinstance(key, bool):
            data = item.encode()
            if not 0 <= key < len(data):
                raise ExecError(f"error calling index: index out of range: {key}")
            item = data[key]
        else:
            raise ExecError(
                f"error calling index: cannot index {go_type(item)} with {go_type(key)}"
            )
    return item


@_template_function("len", 1)
def _len(item: GoValue) -> int:
    if isinstance(item, str):
        return len(item.encode())
    if isinstance(item, dict | list):
        return len(item)
    raise ExecError(f"error calling len: len of type {go_type(item)}")


_BASIC_TYPES = ("bool", "int", "float64", "string")  # the types eq and lt compare


def _comparable(name: str, a: GoValue, b: GoValue, ordered: bool) -> None:
    type_a, type_b = go_type(a), go_type(b)
    if type_a not in _BASIC_TYPES or type_b not in _BASIC_TYPES or (ordered and type_a == "bool"):
        raise ExecError(f"error calling {name}: invalid type for comparison")
    if type_a != type_b:
        raise ExecError(f"error calling {name}: incompatible types for comparison")


@_template_function("eq", 1, variadic=True)
def _eq(first: GoValue, *others: GoValue) -> bool:
    if not others:
        raise ExecError("error calling eq: missing argument for comparison")
    for other in others:
        _comparable("eq", first, other, ordered=False)
        if first == other:
            return True
    return False


@_template_function("ne", 2)
def _ne(a: GoValue, b: GoValue) -> bool:
    return not _eq(a, b)


def _less(name: str, a: GoValue, b: GoValue) -> bool:
    _comparable(name, a, b, ordered=True)
    return a < b  # type: ignore[operator]


def _less_or_equal(name: str, a: GoValue, b: GoValue) -> bool:
    return _less(name, a, b) or a == b


@_template_function("lt", 2)
def _lt(a: GoValue, b: GoValue) -> bool:
    return _less("lt", a, b)


@_template_function("le", 2)
def _le(a: GoValue, b: GoValue) -> bool:
    return _less_or_equal("le", a, b)


@_template_function("gt", 2)
def _gt(a: GoValue, b: GoValue) -> bool:
    """Go's ``gt`` is ``not le``: true for NaN operands."""
    return not _less_or_equal("gt", a, b)


@_template_function("ge", 2)
def _ge(a: GoValue, b: GoValue) -> bool:
    return not _less("ge", a, b)


def truth(value: GoValue) -> bool:
    """Whether ``if``, ``with``, ``and``, ``or`` and ``not`` take ``value`` as true."""
    if isinstance(value, (str, dict, list)):
        return len(value) > 0
    if isinstance(value, float) and math.isnan(value):
        return True
    return bool(value) if value is not None else False


@_template_function("not", 1)
def _not(value: GoValue) -> bool:
    return not truth(value)

"""Printing values as Go's ``fmt`` does: ``%v``, ``%g``-style floats, ``printf`` verbs, quoting."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from decimal import Decimal

from lossguard.monitor.rules.templating.model import GoValue, QuerySample, TemplateData


def go_type(value: GoValue) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float64"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "map[string]string"
    if isinstance(value, QuerySample):
        return "*template.sample"
    if isinstance(value, list):
        return "template.queryResult"
    return "<nil>" if value is None else "template.alertData"


def special_float(value: float) -> str | None:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return None


def format_float_g(value: float) -> str:
    """Go's ``%v`` of a float64: the shortest digits, exponent form below 1e-4 or from 1e6."""
    special = special_float(value)
    if special is not None:
        return special
    sign, digits, exponent = Decimal(repr(value)).normalize().as_tuple()
    assert isinstance(exponent, int)
    text = "".join(map(str, digits))
    dp = len(text) + exponent
    prefix = "-" if sign else ""
    if value == 0:
        return prefix + "0"
    if dp - 1 < -4 or dp - 1 >= 6:
        mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
        return f"{prefix}{mantissa}e{dp - 1:+03d}"
    if dp <= 0:
        return f"{prefix}0.{'0' * -dp}{text}"
    if dp >= len(text):
        return prefix + text + "0" * (dp - len(text))
    return f"{prefix}{text[:dp]}.{text[dp:]}"


def go_print(value: GoValue) -> str:
    """A value as ``{{ value }}`` prints it (Go's ``fmt.Sprint``)."""
    if value is None:
        return "<no value>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return format_float_g(value)
    if isinstance(value, dict):
        return "map[" + " ".join(f"{k}:{v}" for k, v in sorted(value.items())) + "]"
    if isinstance(value, TemplateData):
        fields = (value.Labels, value.ExternalLabels, value.ExternalURL, value.Value)
        return "{" + " ".join(go_print(field) for field in fields) + "}"
    if isinstance(value, QuerySample):
        return f"&{{{go_print(value.Labels)} {go_print(value.Value)}}}"
    if isinstance(value, list):  # Go prints the pointers' addresses; the monitor, the samples
        return "[" + " ".join(go_print(sample) for sample in value) + "]"
    return str(value)


_VERB = re.compile(r"%([-+# 0]*)(\d*)(?:\.(\d*))?(.?)", re.DOTALL)


def sprintf(fmt: str, args: Sequence[GoValue]) -> str:
    """Go's ``fmt.Sprintf`` for the verbs templates use."""
    out: list[str] = []
    used = 0
    i = 0
    while i < len(fmt):
        pct = fmt.find("%", i)
        if pct < 0:
            out.append(fmt[i:])
            break
        out.append(fmt[i:pct])
        match = _VERB.match(fmt, pct)
        assert match is not None
        flags, width, precision, verb = match.groups()
        i = match.end()
        if verb == "%":
            out.append("%")
        elif not verb:
            out.append("%!(NOVERB)")
        elif used >= len(args):
            out.append(f"%!{verb}(MISSING)")
        else:
            out.append(_format_one(flags, width, precision, verb, args[used]))
            used += 1
    if used < len(args):
        extra = ", ".join(f"{go_type(a)}={go_print(a)}" for a in args[used:])
        out.append(f"%!(EXTRA {extra})")
    return "".join(out)


def _format_one(flags: str, width: str, precision: str | None, verb: str, arg: GoValue) -> str:
    spec = "%" + flags + width + ("" if precision is None else "." + (precision or "0"))
    if isinstance(arg, bool):
        if verb in "vt":
            return _pad(flags, width, "true" if arg else "false")
    elif isinstance(arg, int):
        if verb in "vdxXob":
            if verb == "b":
                return _pad(flags, width, format(arg, "b"))
            return (spec + ("d" if verb == "v" else verb)) % arg
        if verb == "c":
            return _pad(flags, width, chr(arg))
        if verb == "q":
            return _pad(flags, width, "'" + go_quote(chr(arg))[1:-1] + "'")
    elif isinstance(arg, float):
        if verb in "vfFeEgG":
            special = special_float(arg)
            if special is not None:
                if special == "NaN" and ("+" in flags or " " in flags):
                    special = ("+" if "+" in flags else " ") + special
                return _pad(flags.replace("0", ""), width, special)
            if verb in "vgG" and precision is None:
                text = format_float_g(arg)
                if "+" in flags and arg >= 0:
                    text = "+" + text
                return _pad(flags, width, text, numeric=True)
            return (spec + ("g" if verb == "v" else verb)) % arg
    elif isinstance(arg, str):
        if verb in "vs":
            return _pad(flags, width, arg if precision is None else arg[: int(precision or 0)])
        if verb == "q":
            return _pad(flags, width, go_quote(arg))
        if verb in "xX":
            text = arg.encode().hex()
            return _pad(flags, width, text.upper() if verb == "X" else text)
    elif isinstance(arg, dict | TemplateData | QuerySample | list) and verb in "vs":
        return _pad(flags, width, go_print(arg))
    if arg is None:
        return f"%!{verb}(<nil>)"
    return f"%!{verb}({go_type(arg)}={_format_one(flags, width, precision, 'v', arg)})"


def _pad(flags: str, width: str, text: str, numeric: bool = False) -> str:
    size = int(width or 0)
    if len(text) >= size:
        return text
    if "-" in flags:
        return text.ljust(size)
    if "0" in flags:
        sign = text[0] if numeric and text[:1] in "+-" else ""
        return sign + text[len(sign) :].rjust(size - len(sign), "0")
    return text.rjust(size)


def go_quote(text: str) -> str:
    """Go's ``strconv.Quote``."""
    out = ['"']
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif char in "\a\b\f\n\r\t\v":
            out.append("\\" + "abfnrtv"["\a\b\f\n\r\t\v".index(char)])
        elif char.isprintable():
            out.append(char)
        elif ord(char) < 0x80:
            out.append(f"\\x{ord(char):02x}")
        elif ord(char) < 0x10000:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(f"\\U{ord(char):08x}")
    return "".join(out) + '"'

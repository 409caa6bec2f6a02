"""Config plumbing shared by the agent and the monitor (torch-free): pydantic sections that
reject unknown keys, one-line errors that name the key path, ``--set`` overrides, YAML files,
durations (Prometheus syntax: ``30s``, ``1h30m``), parsed once into :class:`Duration`.

Every error names the full key path and the reason on one line, e.g. ``train.lr: must be > 0``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    GetCoreSchemaHandler,
    ValidationError,
)
from pydantic_core import PydanticCustomError, core_schema

_DURATION = re.compile(
    r"(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?"
)
_DAY_MS = 24 * 3600 * 1000
_UNIT_MS = (365 * _DAY_MS, 7 * _DAY_MS, _DAY_MS, 3600 * 1000, 60 * 1000, 1000, 1)


class ConfigError(ValueError):
    """A configuration problem, phrased as one line that names the key and the reason."""


def field_error(field: str, reason: str) -> PydanticCustomError:
    """An error from a section-level check that names the field it is about."""
    return PydanticCustomError("field_error", "{reason}", {"field": field, "reason": reason})


class Section(BaseModel):
    """A config section: unknown keys and non-finite numbers are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


_REASONS: dict[str, str] = {
    "extra_forbidden": "unknown key",
    "missing": "required key is missing",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "path_type": "must be a path",
    "list_type": "must be a list",
    "model_type": "must be a mapping of keys",
    "model_attributes_type": "must be a mapping of keys",
    "finite_number": "must be a finite number",
}

_PATTERN_REASONS: dict[str, str] = {
    "id": "may hold only letters, digits, '.', '_' and '-', and start with a letter or digit",
    "tcp": "must be HOST:PORT, e.g. 127.0.0.1:9420",
    "advertise": "must be HOST:PORT, e.g. 10.0.0.5:9420",
    "token_env": "must be an environment variable name",
}

_BOUNDS: dict[str, str] = {
    "greater_than": "gt",
    "greater_than_equal": "ge",
    "less_than": "lt",
    "less_than_equal": "le",
}
_BOUND_SYMBOLS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def _reason(error: Mapping[str, Any]) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    if kind in _BOUNDS:
        bound = _BOUNDS[kind]
        limit = ctx[bound]
        shown = f"{limit:g}" if isinstance(limit, float) else str(limit)
        return f"must be {_BOUND_SYMBOLS[bound]} {shown}"
    if kind == "literal_error":
        return f"must be one of {ctx['expected']}"
    if kind == "string_pattern_mismatch":
        return _PATTERN_REASONS.get(str(error["loc"][-1]), f"must match {ctx.get('pattern')}")
    if kind in ("value_error", "field_error"):
        return str(ctx.get("reason") or ctx.get("error") or error["msg"])
    return _REASONS.get(kind, str(error["msg"]).lower())


def describe_validation_error(exc: ValidationError) -> str:
    """One line naming every failing key path and why."""
    parts = []
    for error in exc.errors():
        loc = [str(p) for p in error["loc"]]
        if error["type"] == "field_error":
            loc.append(str(error["ctx"]["field"]))
        path = ".".join(loc)
        reason = _reason(error)
        parts.append(f"{path}: {reason}" if path else reason)
    return "; ".join(parts)


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` overrides; the value is read as a YAML scalar (``1e-3``, ``true``)."""
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {override}: expected KEY=VALUE, e.g. train.lr=3e-4")
        parts = key.strip().split(".")
        node = data
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                prefix = ".".join(parts[: depth + 1])
                raise ConfigError(f"--set {override}: {prefix} is not a section")
            node = child
        try:
            node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or "invalid YAML"
            raise ConfigError(f"--set {override}: value is not valid YAML ({problem})") from None
    return data


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML config file (empty for an empty file), or ConfigError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


SectionT = TypeVar("SectionT", bound=BaseModel)


def validate(
    model: type[SectionT], data: Mapping[str, Any], overrides: Sequence[str] = ()
) -> SectionT:
    """Validate ``data`` (plus ``--set`` overrides, applied to it in place) into ``model``, or
    raise ConfigError."""
    merged = apply_overrides(dict(data), overrides)
    try:
        return model.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None


def parse_duration(text: str) -> int:
    """Milliseconds in a duration like ``5m`` or ``1h30m`` (units y w d h m s ms, in order)."""
    if text == "0":
        return 0
    match = _DURATION.fullmatch(text)
    if not text or match is None:
        raise ValueError(f"not a valid duration string: {text!r}")
    return sum(int(n) * unit for n, unit in zip(match.groups(), _UNIT_MS, strict=True) if n)


def seconds(text: str) -> float:
    """A Prometheus duration in seconds (raises ValueError with the reason)."""
    try:
        return parse_duration(text) / 1000
    except ValueError:
        raise ValueError(f"not a valid duration: {text!r} (e.g. 1s, 30s, 5m, 1h30m)") from None


_AS_PLAIN_TEXT = core_schema.plain_serializer_function_ser_schema(
    str, return_schema=core_schema.str_schema()
)


class ParsedText(str):
    """A config value kept as the text it was written as (what ``resolved()`` writes back, what
    ``==`` compares) and parsed once, on validation: a subclass's ``__new__`` parses it into an
    attribute, raising ValueError with the reason (the key's one-line error)."""

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(
            cls, core_schema.str_schema(), serialization=_AS_PLAIN_TEXT
        )


class Duration(ParsedText):
    """A Prometheus duration as written (``"10m"``) and its length in ``seconds`` (600.0)."""

    seconds: float

    def __new__(cls, text: str) -> Duration:
        value = super().__new__(cls, text)
        value.seconds = seconds(text)
        return value


def _positive(value: Duration) -> Duration:
    if value.seconds <= 0:
        raise ValueError("must be a positive duration")
    return value


LooseDuration = Annotated[Duration, BeforeValidator(str)]
"""A Duration that YAML may have read as a number (``0``): taken as its text (monitor.yml)."""
PositiveDuration = Annotated[LooseDuration, AfterValidator(_positive)]
"""A LooseDuration longer than zero."""

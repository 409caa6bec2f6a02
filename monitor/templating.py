"""Prometheus alert templates: the subset of Go's text/template that rules files use.

Annotations and alert labels expand as Prometheus's rules/alerting.go expands them: the text
gets the prefix defining ``$labels``, ``$externalLabels``, ``$externalURL`` and ``$value``,
runs with Prometheus's function map (template/template.go) and ``missingkey=zero``, and an
expansion error yields ``<error expanding template: ...>`` instead of an exception. Values
print as Go's ``fmt`` prints them. Functions that need the query engine or other templates
(``query``, ``template``, ``define``...) are refused by :func:`check_template`.
"""

from __future__ import annotations

import datetime
import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal

from lossguard.monitor.promql.re2 import compile_re2

PREFIX = (
    "{{$labels := .Labels}}{{$externalLabels := .ExternalLabels}}"
    "{{$externalURL := .ExternalURL}}{{$value := .Value}}"
)


class TemplateError(ValueError):
    """A template that cannot be parsed/checked; str() is one line."""


class _ExecError(Exception):
    """An error while executing a parsed template (Prometheus renders it into the text)."""


@dataclass(frozen=True)
class _Data:
    """The dot of an alert template: Prometheus's ``AlertTemplateData``."""

    Labels: dict[str, str]
    ExternalLabels: dict[str, str]
    ExternalURL: str
    Value: float


GoValue = str | int | float | bool | dict[str, str] | _Data | None

# ---------------------------------------------------------------- lexer


@dataclass(frozen=True)
class _Token:
    kind: str  # ident field var dot const lparen rparen pipe declare assign comma space
    text: str
    pos: int
    value: GoValue = None


@dataclass(frozen=True)
class _ActionItem:
    tokens: tuple[_Token, ...]
    pos: int


_Item = str | _ActionItem

_SPACE = " \t\r\n"
_NUMBER = re.compile(r"[+-]?(0[xX][0-9a-fA-F_]+|(\d[\d_]*\.?[\d_]*|\.\d[\d_]*)([eE][+-]?\d+)?)")
_IDENT = re.compile(r"\w+")
_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}
_ESCAPES.update({"\\": "\\", '"': '"', "'": "'"})
_STRING_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[0-7]{3}|.)")


def _fail(text: str, pos: int, message: str) -> TemplateError:
    user = max(pos - len(PREFIX), 0)
    body = text[len(PREFIX) :]
    line = body.count("\n", 0, user) + 1
    col = user - (body.rfind("\n", 0, user) + 1) + 1
    return TemplateError(f"{line}:{col}: {message}")


def _lex(text: str) -> list[_Item]:
    """Split a template into text and actions (lists of tokens), applying trim markers."""
    items: list[_Item] = []
    i = 0
    trim_left = False  # the previous action ended with " -}}"
    while True:
        start = text.find("{{", i)
        chunk = text[i:] if start < 0 else text[i:start]
        chunk = chunk.lstrip(_SPACE) if trim_left else chunk
        if start < 0:
            items.append(chunk)
            return items
        inner = start + 2
        if text.startswith("-", inner) and text[inner + 1 : inner + 2] in tuple(_SPACE):
            chunk = chunk.rstrip(_SPACE)
            inner += 2
        items.append(chunk)
        if text.startswith("/*", inner):
            i, trim_left = _lex_comment(text, inner, start)
        else:
            tokens, i, trim_left = _lex_action(text, inner, start)
            items.append(_ActionItem(tuple(tokens), start))


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return i


def _lex_comment(text: str, i: int, start: int) -> tuple[int, bool]:
    """The end of the comment opening at ``i``, and whether it ends with a trim marker."""
    close = text.find("*/", i + 2)
    if close < 0:
        raise _fail(text, start, "unclosed comment")
    after = close + 2
    if text.startswith("}}", after):
        return after + 2, False
    if text[after : after + 1] in tuple(_SPACE) and text.startswith("-}}", after + 1):
        return after + 4, True
    raise _fail(text, start, "comment ends before closing delimiter")


def _lex_action(text: str, i: int, start: int) -> tuple[list[_Token], int, bool]:
    """The tokens up to the closing ``}}``, its end, and whether it has a trim marker."""
    tokens: list[_Token] = []
    depth = 0
    while True:
        if i >= len(text):
            raise _fail(text, start, "unclosed action")
        char = text[i]
        if text.startswith("}}", i):
            _check_closed(text, i, depth)
            return _strip_spaces(tokens), i + 2, False
        if char in _SPACE:
            end = _skip_space(text, i)
            if text.startswith("-}}", end):
                _check_closed(text, end, depth)
                return _strip_spaces(tokens), end + 3, True
            if end >= len(text) or not text.startswith("}}", end):
                tokens.append(_Token("space", " ", i))
            i = end
        elif char in "\"`'":
            token, i = _lex_quoted(text, i)
            tokens.append(token)
        elif char == "$":
            match = _IDENT.match(text, i + 1)
            end = match.end() if match else i + 1
            tokens.append(_Token("var", text[i:end], i))
            i = end
        elif char == "." and not text[i + 1 : i + 2].isdigit():
            match = _IDENT.match(text, i + 1)
            if match:
                tokens.append(_Token("field", match.group(), i))
                i = match.end()
            else:
                tokens.append(_Token("dot", ".", i))
                i += 1
        elif (number := _NUMBER.match(text, i)) and (char not in "+-" or number.end() > i + 1):
            end = number.end()
            if end < len(text) and (text[end].isalnum() or text[end] == "_"):
                raise _fail(text, i, f"bad number syntax: {text[i : end + 1]!r}")
            tokens.append(_Token("const", text[i:end], i, _number(text[i:end])))
            i = end
        elif char.isalpha() or char == "_":
            match = _IDENT.match(text, i)
            assert match is not None
            word = match.group()
            if word in ("true", "false"):
                tokens.append(_Token("const", word, i, word == "true"))
            else:
                tokens.append(_Token("ident", word, i))
            i = match.end()
        elif text.startswith(":=", i):
            tokens.append(_Token("declare", ":=", i))
            i += 2
        elif char in "()|=,":
            kinds = {"(": "lparen", ")": "rparen", "|": "pipe", "=": "assign", ",": "comma"}
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth < 0:
                raise _fail(text, i, "unexpected right paren")
            tokens.append(_Token(kinds[char], char, i))
            i += 1
        else:
            raise _fail(text, i, f"unexpected {char!r} in command")


def _check_closed(text: str, i: int, depth: int) -> None:
    """Refuse an action that ends inside parentheses."""
    if depth > 0:
        raise _fail(text, i, "unclosed left paren")


def _strip_spaces(tokens: list[_Token]) -> list[_Token]:
    while tokens and tokens[0].kind == "space":
        tokens.pop(0)
    while tokens and tokens[-1].kind == "space":
        tokens.pop()
    return tokens


def _number(text: str) -> int | float:
    """A Go number constant: an int unless it is written as a float."""
    try:
        return int(text, 0)
    except ValueError:
        return float(text.replace("_", ""))


def _lex_quoted(text: str, i: int) -> tuple[_Token, int]:
    quote = text[i]
    end = i + 1
    while end < len(text) and text[end] != quote:
        if quote != "`" and text[end] == "\n":
            break
        end += 2 if quote != "`" and text[end] == "\\" else 1
    if end >= len(text) or text[end] != quote:
        raise _fail(
            text,
            i,
            "unterminated quoted string" if quote != "'" else "unterminated character constant",
        )
    body = text[i + 1 : end]
    if quote == "`":
        return _Token("const", text[i : end + 1], i, body.replace("\r", "")), end + 1
    try:
        value = _STRING_ESCAPE.sub(lambda m: _unescape(m.group(1), quote), body)
    except ValueError as exc:
        raise _fail(text, i, f"{exc} in {text[i : end + 1]}") from None
    if quote == "'":
        if len(value) != 1:
            raise _fail(text, i, f"malformed character constant: {text[i : end + 1]}")
        return _Token("const", text[i : end + 1], i, ord(value)), end + 1
    return _Token("const", text[i : end + 1], i, value), end + 1


def _unescape(escape: str, quote: str) -> str:
    if escape[0] in "xuU01234567" and len(escape) > 1:
        code = int(escape[1:], 16) if escape[0] in "xuU" else int(escape, 8)
        return chr(code)
    if escape in _ESCAPES and (escape not in "'\"" or escape == quote):
        return _ESCAPES[escape]
    raise ValueError("invalid syntax")


# ---------------------------------------------------------------- nodes


@dataclass(frozen=True)
class _Const:
    value: GoValue


@dataclass(frozen=True)
class _Func:
    name: str


@dataclass(frozen=True)
class _Chain:
    """A variable (``$x``), the dot (``.``) or a parenthesised pipeline, then fields."""

    base: _Var | _Dot | _Pipe
    fields: tuple[str, ...]


@dataclass(frozen=True)
class _Var:
    name: str


@dataclass(frozen=True)
class _Dot:
    pass


_Operand = _Const | _Func | _Chain


@dataclass(frozen=True)
class _Command:
    args: tuple[_Operand, ...]
    pos: int


@dataclass(frozen=True)
class _Pipe:
    decl: tuple[str, ...]
    assign: bool
    commands: tuple[_Command, ...]


@dataclass(frozen=True)
class _Action:
    pipe: _Pipe


@dataclass(frozen=True)
class _Control:
    keyword: str  # if, with, range
    pipe: _Pipe
    body: tuple[_Node, ...]
    otherwise: tuple[_Node, ...]


_Node = str | _Action | _Control

# ---------------------------------------------------------------- parser

_UNSUPPORTED = {
    "query", "first", "label", "value", "strvalue", "args", "safeHtml", "graphLink",
    "tableLink", "sortByLabel", "pathPrefix", "externalURL", "toTime", "parseDuration",
    "stripDomain", "urlquery", "html", "js", "print", "println", "call", "slice",
    "define", "template", "block", "break", "continue", "tmpl",
}  # fmt: skip


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.items = _lex(text)
        self.index = 0
        self.variables: list[str] = ["$"]

    def parse(self) -> tuple[_Node, ...]:
        nodes, end = self.block()
        if end is not None:
            raise _fail(self.text, end.pos, f"unexpected {{{{{end.tokens[0].text}}}}}")
        return nodes

    def block(self) -> tuple[tuple[_Node, ...], _ActionItem | None]:
        """Nodes up to an ``{{else}}``/``{{end}}`` (returned) or the end of the text."""
        nodes: list[_Node] = []
        while self.index < len(self.items):
            item = self.items[self.index]
            self.index += 1
            if isinstance(item, str):
                if item:
                    nodes.append(item)
                continue
            if not item.tokens:
                raise _fail(self.text, item.pos, "missing value for command")
            word = item.tokens[0]
            if word.kind == "ident" and word.text in ("else", "end"):
                return tuple(nodes), item
            if word.kind == "ident" and word.text in ("if", "with", "range"):
                nodes.append(self.control(word.text, list(item.tokens[1:]), item.pos))
            else:
                nodes.append(_Action(self.pipeline(list(item.tokens), item.pos, "command")))
        return tuple(nodes), None

    def control(self, keyword: str, tokens: list[_Token], pos: int) -> _Control:
        mark = len(self.variables)
        pipe = self.pipeline(_strip_spaces(tokens), pos, keyword)
        body, end = self.block()
        otherwise: tuple[_Node, ...] = ()
        if end is None:
            raise _fail(self.text, pos, f"unexpected EOF in {{{{{keyword}}}}}")
        rest = _strip_spaces(list(end.tokens[1:]))
        if end.tokens[0].text == "else":
            if keyword == "if" and rest and rest[0].text == "if" and rest[0].kind == "ident":
                otherwise = (self.control("if", rest[1:], end.pos),)
            else:
                if rest:
                    raise _fail(self.text, end.pos, f"unexpected {rest[0].text!r} in else")
                otherwise, end = self.block()
                if end is None or end.tokens[0].text != "end" or len(end.tokens) > 1:
                    raise _fail(self.text, pos, f"expected end for {{{{{keyword}}}}}")
        elif rest:
            raise _fail(self.text, end.pos, f"unexpected {rest[0].text!r} in end")
        del self.variables[mark:]
        return _Control(keyword, pipe, body, otherwise)

    def pipeline(self, tokens: list[_Token], pos: int, context: str) -> _Pipe:
        decl, assign, tokens = self.declaration(tokens, context)
        if not tokens:
            raise _fail(self.text, pos, f"missing value for {context}")
        commands: list[_Command] = []
        while True:
            cut = _depth_zero_index(tokens, "pipe")
            words = _strip_spaces(tokens[:cut])
            if not words:
                raise _fail(self.text, pos, "missing command in pipeline")
            commands.append(self.command(words, len(commands)))
            if cut == len(tokens):
                break
            tokens = tokens[cut + 1 :]
        for name in decl:
            if not assign:
                self.variables.append(name)
        return _Pipe(decl, assign, tuple(commands))

    def declaration(
        self, tokens: list[_Token], context: str
    ) -> tuple[tuple[str, ...], bool, list[_Token]]:
        solid = [(i, t) for i, t in enumerate(tokens) if t.kind != "space"]
        kinds = [t.kind for _, t in solid[:4]]
        if kinds[:2] in (["var", "declare"], ["var", "assign"]):
            name = solid[0][1]
            if kinds[1] == "assign" and name.text not in self.variables:
                raise _fail(self.text, name.pos, f'undefined variable "{name.text}"')
            return (name.text,), kinds[1] == "assign", _strip_spaces(tokens[solid[1][0] + 1 :])
        if context == "range" and kinds == ["var", "comma", "var", "declare"]:
            names = (solid[0][1].text, solid[2][1].text)
            return names, False, _strip_spaces(tokens[solid[3][0] + 1 :])
        return (), False, tokens

    def command(self, words: list[_Token], stage: int) -> _Command:
        args: list[_Operand] = []
        i = 0
        while i < len(words):
            operand, i = self.operand(words, i)
            args.append(operand)
            if i < len(words):
                if words[i].kind != "space":
                    raise _fail(self.text, words[i].pos, f"unexpected {words[i].text!r} in operand")
                i += 1
        first, name, pos = args[0], words[0].text, words[0].pos
        if not isinstance(first, _Func):
            if name == "nil":
                raise _fail(self.text, pos, "nil is not a command")
            if len(args) > 1:
                raise _fail(self.text, pos, f"can't give argument to non-function {name}")
            if stage and isinstance(first, _Const):
                raise _fail(self.text, pos, f"non executable command in pipeline stage {stage + 1}")
        return _Command(tuple(args), words[0].pos)

    def operand(self, words: list[_Token], i: int) -> tuple[_Operand, int]:
        token = words[i]
        base: _Var | _Dot | _Pipe
        fields: list[str] = []
        if token.kind == "ident":
            if token.text == "nil":
                return _Const(None), i + 1
            if token.text in _UNSUPPORTED:
                raise _fail(
                    self.text,
                    token.pos,
                    f'function "{token.text}" is not supported by the monitor',
                )
            if token.text not in _FUNCTIONS and token.text not in ("and", "or"):
                raise _fail(self.text, token.pos, f'function "{token.text}" not defined')
            return _Func(token.text), i + 1
        if token.kind == "const":
            return _Const(token.value), i + 1
        if token.kind == "var":
            if token.text not in self.variables:
                raise _fail(self.text, token.pos, f'undefined variable "{token.text}"')
            base = _Var(token.text)
        elif token.kind == "dot":
            base = _Dot()
        elif token.kind == "field":
            base, fields = _Dot(), [token.text]
        elif token.kind == "lparen":
            close = i + 1 + _depth_zero_index(words[i + 1 :], "rparen")
            if close >= len(words):
                raise _fail(self.text, token.pos, "unclosed left paren")
            inner = _strip_spaces(words[i + 1 : close])
            base = self.pipeline(inner, token.pos, "parenthesized pipeline")
            i = close
        else:
            raise _fail(self.text, token.pos, f"unexpected {token.text!r} in operand")
        i += 1
        while i < len(words) and words[i].kind == "field":
            fields.append(words[i].text)
            i += 1
        return _Chain(base, tuple(fields)), i


def _depth_zero_index(tokens: Sequence[_Token], kind: str) -> int:
    """Index of the first ``kind`` token outside parentheses, or ``len(tokens)``."""
    depth = 0
    for i, token in enumerate(tokens):
        if token.kind == kind and depth == 0:
            return i
        depth += {"lparen": 1, "rparen": -1}.get(token.kind, 0)
    return len(tokens)


@functools.lru_cache(maxsize=4096)
def _parse(text: str) -> tuple[_Node, ...]:
    return _Parser(PREFIX + text).parse()


def check_template(text: str) -> None:
    """Raise :class:`TemplateError` if ``text`` is not a template the monitor can expand."""
    _parse(text)


# ---------------------------------------------------------------- Go formatting


def _go_type(value: GoValue) -> str:
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
    return "<nil>" if value is None else "template.alertData"


def _special_float(value: float) -> str | None:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return None


def format_float_g(value: float) -> str:
    """Go's ``%v`` of a float64: the shortest digits, exponent form below 1e-4 or from 1e6."""
    special = _special_float(value)
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


def _print(value: GoValue) -> str:
    """A value as ``{{ value }}`` prints it (Go's ``fmt.Sprint``)."""
    if value is None:
        return "<no value>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return format_float_g(value)
    if isinstance(value, dict):
        return "map[" + " ".join(f"{k}:{v}" for k, v in sorted(value.items())) + "]"
    if isinstance(value, _Data):
        fields = (value.Labels, value.ExternalLabels, value.ExternalURL, value.Value)
        return "{" + " ".join(_print(field) for field in fields) + "}"
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
        extra = ", ".join(f"{_go_type(a)}={_print(a)}" for a in args[used:])
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
            special = _special_float(arg)
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
    elif isinstance(arg, dict) and verb in "vs":
        return _pad(flags, width, _print(arg))
    if arg is None:
        return f"%!{verb}(<nil>)"
    return f"%!{verb}({_go_type(arg)}={_format_one(flags, width, precision, 'v', arg)})"


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


# ---------------------------------------------------------------- functions


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
            raise _ExecError(f'strconv.ParseFloat: parsing "{value}": invalid syntax') from None
    raise _ExecError(f"can't convert {_go_type(value)} to float")


def _want_str(value: GoValue) -> str:
    if not isinstance(value, str):
        raise _ExecError(f"wrong type for value; expected string; got {_go_type(value)}")
    return value


def _g4(value: float, suffix: str = "") -> str:
    special = _special_float(value)
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


def _humanize(arg: GoValue) -> str:
    value = _to_float(arg)
    if value == 0 or not math.isfinite(value):
        return _g4(value)
    if abs(value) >= 1:
        return _g4(*_scaled(value, 1000, "kMGTPEZY"))
    return _g4(*_scaled_down(value))


def _humanize1024(arg: GoValue) -> str:
    value = _to_float(arg)
    if abs(value) <= 1 or not math.isfinite(value):
        return _g4(value)
    return _g4(*_scaled(value, 1024, ("ki", "Mi", "Gi", "Ti", "Pi", "Ei", "Zi", "Yi")))


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


def _humanize_percentage(arg: GoValue) -> str:
    return _g4(_to_float(arg) * 100, "%")


def _humanize_timestamp(arg: GoValue) -> str:
    value = _to_float(arg)
    if not math.isfinite(value):
        return _g4(value)
    if abs(value * 1e9) >= 2**63:
        raise _ExecError(
            f"{format_float_g(value)} cannot be represented as a nanoseconds timestamp"
            " since it overflows int64"
        )
    millis = int(int(value * 1e9) / 1_000_000)
    try:
        moment = datetime.datetime(1970, 1, 1) + datetime.timedelta(milliseconds=millis)
    except OverflowError:
        raise _ExecError(f"timestamp {format_float_g(value)} is out of range") from None
    fraction = f".{millis % 1000:03d}".rstrip("0").rstrip(".")
    return moment.strftime("%Y-%m-%d %H:%M:%S") + fraction + " +0000 UTC"


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
        raise _ExecError(f"error parsing regexp: {exc}: `{pattern}`") from None


def _match(pattern: GoValue, text: GoValue) -> bool:
    return _regex(pattern).search(_want_str(text)) is not None


_TEMPLATE_REF = re.compile(r"\$(\$|\{(\w+)\}|(\w+))")


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


def _strip_port(arg: GoValue) -> str:
    """Go's ``net.SplitHostPort`` host, or the input when it has no port."""
    text = _want_str(arg)
    if text.startswith("["):
        end = text.find("]")
        return text[1:end] if end > 0 and text[end + 1 : end + 2] == ":" else text
    host, colon, _ = text.rpartition(":")
    return host if colon and ":" not in host else text


def _index(item: GoValue, *keys: GoValue) -> GoValue:
    for key in keys:
        if isinstance(item, dict) and isinstance(key, str):
            item = item.get(key, "")
        elif isinstance(item, str) and isinstance(key, int) and not isinstance(key, bool):
            data = item.encode()
            if not 0 <= key < len(data):
                raise _ExecError(f"error calling index: index out of range: {key}")
            item = data[key]
        else:
            raise _ExecError(
                f"error calling index: cannot index {_go_type(item)} with {_go_type(key)}"
            )
    return item


def _len(item: GoValue) -> int:
    if isinstance(item, str):
        return len(item.encode())
    if isinstance(item, dict):
        return len(item)
    raise _ExecError(f"error calling len: len of type {_go_type(item)}")


def _kind(value: GoValue) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    return "invalid"


def _comparable(name: str, a: GoValue, b: GoValue, ordered: bool) -> None:
    if _kind(a) == "invalid" or _kind(b) == "invalid" or (ordered and _kind(a) == "bool"):
        raise _ExecError(f"error calling {name}: invalid type for comparison")
    if _kind(a) != _kind(b):
        raise _ExecError(f"error calling {name}: incompatible types for comparison")


def _eq(first: GoValue, *others: GoValue) -> bool:
    if not others:
        raise _ExecError("error calling eq: missing argument for comparison")
    for other in others:
        _comparable("eq", first, other, ordered=False)
        if first == other:
            return True
    return False


def _ne(a: GoValue, b: GoValue) -> bool:
    return not _eq(a, b)


def _less(name: str, a: GoValue, b: GoValue) -> bool:
    _comparable(name, a, b, ordered=True)
    return a < b  # type: ignore[operator]


def _less_or_equal(name: str, a: GoValue, b: GoValue) -> bool:
    return _less(name, a, b) or a == b


def _lt(a: GoValue, b: GoValue) -> bool:
    return _less("lt", a, b)


def _le(a: GoValue, b: GoValue) -> bool:
    return _less_or_equal("le", a, b)


def _gt(a: GoValue, b: GoValue) -> bool:
    """Go's ``gt`` is ``not le``: true for NaN operands."""
    return not _less_or_equal("gt", a, b)


def _ge(a: GoValue, b: GoValue) -> bool:
    return not _less("ge", a, b)


def _truth(value: GoValue) -> bool:
    if isinstance(value, (str, dict)):
        return len(value) > 0
    if isinstance(value, float) and math.isnan(value):
        return True
    return bool(value) if value is not None else False


_Function = Callable[..., GoValue]
# name: (function, number of parameters, variadic)
_FUNCTIONS: dict[str, tuple[_Function, int, bool]] = {
    "printf": (lambda fmt, *args: sprintf(_want_str(fmt), args), 1, True),
    "humanize": (_humanize, 1, False),
    "humanize1024": (_humanize1024, 1, False),
    "humanizeDuration": (_humanize_duration, 1, False),
    "humanizePercentage": (_humanize_percentage, 1, False),
    "humanizeTimestamp": (_humanize_timestamp, 1, False),
    "toUpper": (lambda s: _want_str(s).upper(), 1, False),
    "toLower": (lambda s: _want_str(s).lower(), 1, False),
    "title": (_title, 1, False),
    "reReplaceAll": (_re_replace_all, 3, False),
    "match": (_match, 2, False),
    "stripPort": (_strip_port, 1, False),
    "index": (_index, 1, True),
    "len": (_len, 1, False),
    "eq": (_eq, 1, True),
    "ne": (_ne, 2, False),
    "lt": (_lt, 2, False),
    "le": (_le, 2, False),
    "gt": (_gt, 2, False),
    "ge": (_ge, 2, False),
    "not": (lambda v: not _truth(v), 1, False),
}

# ---------------------------------------------------------------- evaluator


class _Executor:
    def __init__(self, data: _Data) -> None:
        self.variables: list[tuple[str, GoValue]] = [("$", data)]
        self.out: list[str] = []

    def run(self, nodes: Sequence[_Node], dot: GoValue) -> None:
        for node in nodes:
            if isinstance(node, str):
                self.out.append(node)
            elif isinstance(node, _Action):
                value = self.pipe(node.pipe, dot)
                if not node.pipe.decl:
                    self.out.append(_print(value))
            else:
                mark = len(self.variables)
                self.control(node, dot)
                del self.variables[mark:]

    def control(self, node: _Control, dot: GoValue) -> None:
        if node.keyword != "range":
            value = self.pipe(node.pipe, dot)
            if _truth(value):
                self.run(node.body, value if node.keyword == "with" else dot)
            else:
                self.run(node.otherwise, dot)
            return
        value = self.pipe(node.pipe, dot, bind=False)
        if isinstance(value, dict) or value is None:
            entries: list[tuple[GoValue, GoValue]] = sorted((value or {}).items())
        elif isinstance(value, int) and not isinstance(value, bool):
            raise _ExecError(f"range can't iterate over {value}")
        else:
            raise _ExecError(f"range can't iterate over {_print(value)}")
        if not entries:
            self.run(node.otherwise, dot)
        for key, item in entries:
            mark = len(self.variables)
            names = node.pipe.decl
            if len(names) == 1:
                self.variables.append((names[0], item))
            elif len(names) == 2:
                self.variables.extend(((names[0], key), (names[1], item)))
            self.run(node.body, item)
            del self.variables[mark:]

    def pipe(self, pipe: _Pipe, dot: GoValue, bind: bool = True) -> GoValue:
        final: tuple[GoValue, ...] = ()  # the previous command's value, if any
        for command in pipe.commands:
            final = (self.command(command, dot, final),)
        result = final[0]
        if pipe.assign:
            index = max(i for i, (name, _) in enumerate(self.variables) if name == pipe.decl[0])
            self.variables[index] = (pipe.decl[0], result)
        elif bind:
            self.variables.extend((name, result) for name in pipe.decl)
        return result

    def command(self, command: _Command, dot: GoValue, final: tuple[GoValue, ...]) -> GoValue:
        first, rest = command.args[0], command.args[1:]
        if isinstance(first, _Func):
            return self.call(first.name, rest, dot, final)
        if final:
            raise _ExecError(f"can't give argument to non-function {_describe(first)}")
        return self.operand(first, dot)

    def call(
        self, name: str, operands: Sequence[_Operand], dot: GoValue, final: tuple[GoValue, ...]
    ) -> GoValue:
        thunks: list[Callable[[], GoValue]] = [
            functools.partial(self.operand, operand, dot) for operand in operands
        ]
        thunks.extend(functools.partial(_identity, value) for value in final)
        if name in ("and", "or"):
            if not thunks:
                raise _ExecError(f"wrong number of args for {name}: want at least 1 got 0")
            for thunk in thunks:
                value = thunk()
                if _truth(value) != (name == "and"):
                    return value
            return value
        function, count, variadic = _FUNCTIONS[name]
        if len(thunks) < count or (not variadic and len(thunks) != count):
            want = f"at least {count}" if variadic else str(count)
            raise _ExecError(f"wrong number of args for {name}: want {want} got {len(thunks)}")
        return function(*(thunk() for thunk in thunks))

    def operand(self, operand: _Operand, dot: GoValue) -> GoValue:
        if isinstance(operand, _Const):
            return operand.value
        if isinstance(operand, _Func):
            return self.call(operand.name, (), dot, ())
        base = operand.base
        if isinstance(base, _Var):
            value = next(v for name, v in reversed(self.variables) if name == base.name)
        elif isinstance(base, _Dot):
            value = dot
        else:
            value = self.pipe(base, dot)
        for field in operand.fields:
            value = _field(value, field)
        return value


def _identity(value: GoValue) -> GoValue:
    return value


def _describe(operand: _Operand) -> str:
    if isinstance(operand, _Const):
        return _print(operand.value)
    return "." + ".".join(operand.fields) if isinstance(operand, _Chain) else str(operand)


def _field(value: GoValue, name: str) -> GoValue:
    if isinstance(value, dict):
        return value.get(name, "")
    if isinstance(value, _Data) and name in ("Labels", "ExternalLabels", "ExternalURL", "Value"):
        field: GoValue = getattr(value, name)
        return field
    if value is None:
        raise _ExecError(f"nil pointer evaluating interface {{}}.{name}")
    raise _ExecError(f"can't evaluate field {name} in type {_go_type(value)}")


def expand(
    text: str,
    *,
    labels: Mapping[str, str],
    value: float,
    external_labels: Mapping[str, str] | None = None,
    external_url: str = "",
) -> str:
    """Expand an alert template as Prometheus does; errors become ``<error expanding ...>``."""
    try:
        nodes = _parse(text)
        data = _Data(dict(labels), dict(external_labels or {}), external_url, float(value))
        executor = _Executor(data)
        executor.run(nodes, data)
    except (TemplateError, _ExecError, ValueError, OverflowError) as exc:
        return f"<error expanding template: {exc}>"
    return "".join(executor.out)

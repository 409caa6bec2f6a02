"""Splitting a template into text and actions, and an action into tokens (as Go's
text/template lexer does)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from lossguard.monitor.rules.templating.model import PREFIX, GoValue, TemplateError


@dataclass(frozen=True)
class Token:
    kind: str  # ident field var dot const lparen rparen pipe declare assign comma space
    text: str
    pos: int
    value: GoValue = None


@dataclass(frozen=True)
class ActionItem:
    tokens: tuple[Token, ...]
    pos: int


Item = str | ActionItem

_SPACE = " \t\r\n"
_NUMBER = re.compile(r"[+-]?(0[xX][0-9a-fA-F_]+|(\d[\d_]*\.?[\d_]*|\.\d[\d_]*)([eE][+-]?\d+)?)")
_IDENT = re.compile(r"\w+")
_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}
_ESCAPES.update({"\\": "\\", '"': '"', "'": "'"})
_STRING_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[0-7]{3}|.)")


def syntax_error(text: str, pos: int, message: str) -> TemplateError:
    user = max(pos - len(PREFIX), 0)
    body = text[len(PREFIX) :]
    line = body.count("\n", 0, user) + 1
    col = user - (body.rfind("\n", 0, user) + 1) + 1
    return TemplateError(f"{line}:{col}: {message}")


def lex(text: str) -> list[Item]:
    """Split a template into text and actions (lists of tokens), applying trim markers."""
    items: list[Item] = []
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
            items.append(ActionItem(tuple(tokens), start))


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return i


def _lex_comment(text: str, i: int, start: int) -> tuple[int, bool]:
    """The end of the comment opening at ``i``, and whether it ends with a trim marker."""
    close = text.find("*/", i + 2)
    if close < 0:
        raise syntax_error(text, start, "unclosed comment")
    after = close + 2
    if text.startswith("}}", after):
        return after + 2, False
    if text[after : after + 1] in tuple(_SPACE) and text.startswith("-}}", after + 1):
        return after + 4, True
    raise syntax_error(text, start, "comment ends before closing delimiter")


def _lex_action(text: str, i: int, start: int) -> tuple[list[Token], int, bool]:
    """The tokens up to the closing ``}}``, its end, and whether it has a trim marker."""
    tokens: list[Token] = []
    depth = 0
    while True:
        if i >= len(text):
            raise syntax_error(text, start, "unclosed action")
        char = text[i]
        if text.startswith("}}", i):
            _check_closed(text, i, depth)
            return strip_spaces(tokens), i + 2, False
        if char in _SPACE:
            end = _skip_space(text, i)
            if text.startswith("-}}", end):
                _check_closed(text, end, depth)
                return strip_spaces(tokens), end + 3, True
            if end >= len(text) or not text.startswith("}}", end):
                tokens.append(Token("space", " ", i))
            i = end
        elif char in "\"`'":
            token, i = _lex_quoted(text, i)
            tokens.append(token)
        elif char == "$":
            match = _IDENT.match(text, i + 1)
            end = match.end() if match else i + 1
            tokens.append(Token("var", text[i:end], i))
            i = end
        elif char == "." and not text[i + 1 : i + 2].isdigit():
            match = _IDENT.match(text, i + 1)
            if match:
                tokens.append(Token("field", match.group(), i))
                i = match.end()
            else:
                tokens.append(Token("dot", ".", i))
                i += 1
        elif (number := _NUMBER.match(text, i)) and (char not in "+-" or number.end() > i + 1):
            end = number.end()
            if end < len(text) and (text[end].isalnum() or text[end] == "_"):
                raise syntax_error(text, i, f"bad number syntax: {text[i : end + 1]!r}")
            tokens.append(Token("const", text[i:end], i, _number(text[i:end])))
            i = end
        elif char.isalpha() or char == "_":
            match = _IDENT.match(text, i)
            assert match is not None
            word = match.group()
            if word in ("true", "false"):
                tokens.append(Token("const", word, i, word == "true"))
            else:
                tokens.append(Token("ident", word, i))
            i = match.end()
        elif text.startswith(":=", i):
            tokens.append(Token("declare", ":=", i))
            i += 2
        elif char in "()|=,":
            kinds = {"(": "lparen", ")": "rparen", "|": "pipe", "=": "assign", ",": "comma"}
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth < 0:
                raise syntax_error(text, i, "unexpected right paren")
            tokens.append(Token(kinds[char], char, i))
            i += 1
        else:
            raise syntax_error(text, i, f"unexpected {char!r} in command")


def _check_closed(text: str, i: int, depth: int) -> None:
    """Refuse an action that ends inside parentheses."""
    if depth > 0:
        raise syntax_error(text, i, "unclosed left paren")


def strip_spaces(tokens: list[Token]) -> list[Token]:
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


def _lex_quoted(text: str, i: int) -> tuple[Token, int]:
    quote = text[i]
    end = i + 1
    while end < len(text) and text[end] != quote:
        if quote != "`" and text[end] == "\n":
            break
        end += 2 if quote != "`" and text[end] == "\\" else 1
    if end >= len(text) or text[end] != quote:
        raise syntax_error(
            text,
            i,
            "unterminated quoted string" if quote != "'" else "unterminated character constant",
        )
    body = text[i + 1 : end]
    if quote == "`":
        return Token("const", text[i : end + 1], i, body.replace("\r", "")), end + 1
    try:
        value = _STRING_ESCAPE.sub(lambda m: _unescape(m.group(1), quote), body)
    except ValueError as exc:
        raise syntax_error(text, i, f"{exc} in {text[i : end + 1]}") from None
    if quote == "'":
        if len(value) != 1:
            raise syntax_error(text, i, f"malformed character constant: {text[i : end + 1]}")
        return Token("const", text[i : end + 1], i, ord(value)), end + 1
    return Token("const", text[i : end + 1], i, value), end + 1


def _unescape(escape: str, quote: str) -> str:
    if escape[0] in "xuU01234567" and len(escape) > 1:
        code = int(escape[1:], 16) if escape[0] in "xuU" else int(escape, 8)
        return chr(code)
    if escape in _ESCAPES and (escape not in "'\"" or escape == quote):
        return _ESCAPES[escape]
    raise ValueError("invalid syntax")

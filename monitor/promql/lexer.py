"""PromQL tokens, lexed as Prometheus's lexer does (numbers vs durations, strings, operators)."""

from __future__ import annotations

import string
from collections.abc import Iterator
from dataclasses import dataclass

from lossguard.monitor.promql.errors import ParseError

NUMBER, DURATION, STRING, IDENT, EOF = "number", "duration", "string", "identifier", "end"
_SYMBOLS = ("==", "!=", "=~", "!~", ">=", "<=", *"(){}[],=><+-*/%^@:")
_DIGITS = string.digits
_ALPHA = string.ascii_letters + "_"
_ALNUM = _ALPHA + _DIGITS


@dataclass(frozen=True)
class Token:
    """``kind`` is one of the constants above, or the operator itself (``"+"``, ``"=~"``...)."""

    kind: str
    text: str
    pos: int

    def describe(self) -> str:
        if self.kind == EOF:
            return "end of input"
        if self.kind == STRING:
            return f"string {self.text}"
        if self.kind in (NUMBER, DURATION, IDENT):
            return f'{self.kind} "{self.text}"'
        return f'"{self.text}"'


def _is_alnum(char: str) -> bool:
    return bool(char) and char in _ALNUM


def tokens(text: str) -> Iterator[Token]:
    """Lex ``text`` lazily; the last token is ``EOF``. Raises :class:`ParseError`."""
    lexer = _Lexer(text)
    while True:
        token = lexer.next()
        yield token
        if token.kind == EOF:
            return


class _Lexer:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.brackets = 0  # inside [...] a ":" is the subquery colon, not part of a name
        self.braces = 0  # inside {...} "inf" and "nan" are label names, not numbers

    def error(self, message: str, pos: int) -> ParseError:
        return ParseError(message, self.text, pos)

    def peek(self, offset: int = 0) -> str:
        return self.text[self.pos + offset : self.pos + offset + 1]

    def accept(self, chars: str) -> bool:
        if self.peek() and self.peek() in chars:
            self.pos += 1
            return True
        return False

    def accept_run(self, chars: str) -> None:
        while self.accept(chars):
            pass

    def next(self) -> Token:
        self.skip_space()
        start = self.pos
        char = self.peek()
        if not char:
            return Token(EOF, "", start)
        if char in _DIGITS or (char == "." and self.peek(1) and self.peek(1) in _DIGITS):
            return self.number_or_duration(start)
        if char in "\"'`":
            return self.quoted(start)
        if char in _ALPHA or (char == ":" and not self.brackets):
            while _is_alnum(self.peek()) or (self.peek() == ":" and not self.brackets):
                self.pos += 1
            word = self.text[start : self.pos]
            number = not self.braces and word.lower() in ("inf", "nan")
            return Token(NUMBER if number else IDENT, word, start)
        for symbol in _SYMBOLS:
            if self.text.startswith(symbol, start):
                self.pos += len(symbol)
                self.brackets += {"[": 1, "]": -1}.get(symbol, 0)
                self.braces += {"{": 1, "}": -1}.get(symbol, 0)
                return Token(symbol, symbol, start)
        raise self.error(f'unexpected character "{char}"', start)

    def skip_space(self) -> None:
        while True:
            self.accept_run(" \t\r\n")
            if self.peek() != "#":
                return
            while self.peek() and self.peek() != "\n":
                self.pos += 1

    def number_or_duration(self, start: int) -> Token:
        digits = _DIGITS
        if self.accept("0") and self.accept("xX"):
            digits += "abcdefABCDEF"
        self.accept_run(digits)
        if self.accept("."):
            self.accept_run(digits)
        if self.accept("eE"):
            self.accept("+-")
            self.accept_run(_DIGITS)
        if not _is_alnum(self.peek()):
            return Token(NUMBER, self.text[start : self.pos], start)
        if self.accept("smhdwy"):
            self.accept("s")
            while self.accept(_DIGITS):
                self.accept_run(_DIGITS)
                if not self.accept("smhdw"):
                    break
                self.accept("s")
            else:
                if not _is_alnum(self.peek()):
                    return Token(DURATION, self.text[start : self.pos], start)
        raise self.error(
            f'bad number or duration syntax: "{self.text[start : self.pos + 1]}"', start
        )

    def quoted(self, start: int) -> Token:
        quote = self.peek()
        self.pos += 1
        while (char := self.peek()) != quote:
            if not char or (char == "\n" and quote != "`"):
                raise self.error("unterminated quoted string", start)
            self.pos += 2 if char == "\\" and quote != "`" else 1
        self.pos += 1
        return Token(STRING, self.text[start : self.pos], start)

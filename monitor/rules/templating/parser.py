"""Parsing a template into nodes, refusing what Prometheus's alert templates cannot run."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from lossguard.monitor.rules.templating.functions import FUNCTIONS, QUERY
from lossguard.monitor.rules.templating.lexer import (
    ActionItem,
    Token,
    lex,
    strip_spaces,
    syntax_error,
)
from lossguard.monitor.rules.templating.model import PREFIX
from lossguard.monitor.rules.templating.nodes import (
    Action,
    Chain,
    Command,
    Const,
    Control,
    Dot,
    Func,
    Node,
    Operand,
    Pipe,
    Var,
)

_UNSUPPORTED = {
    "args", "safeHtml", "graphLink", "tableLink", "pathPrefix", "externalURL", "toTime",
    "parseDuration", "stripDomain", "urlquery", "html", "js", "print", "println", "call",
    "slice", "define", "template", "block", "break", "continue", "tmpl",
}  # fmt: skip


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.items = lex(text)
        self.index = 0
        self.variables: list[str] = ["$"]

    def parse(self) -> tuple[Node, ...]:
        nodes, end = self.block()
        if end is not None:
            raise syntax_error(self.text, end.pos, f"unexpected {{{{{end.tokens[0].text}}}}}")
        return nodes

    def block(self) -> tuple[tuple[Node, ...], ActionItem | None]:
        """Nodes up to an ``{{else}}``/``{{end}}`` (returned) or the end of the text."""
        nodes: list[Node] = []
        while self.index < len(self.items):
            item = self.items[self.index]
            self.index += 1
            if isinstance(item, str):
                if item:
                    nodes.append(item)
                continue
            if not item.tokens:
                raise syntax_error(self.text, item.pos, "missing value for command")
            word = item.tokens[0]
            if word.kind == "ident" and word.text in ("else", "end"):
                return tuple(nodes), item
            if word.kind == "ident" and word.text in ("if", "with", "range"):
                nodes.append(self.control(word.text, list(item.tokens[1:]), item.pos))
            else:
                nodes.append(Action(self.pipeline(list(item.tokens), item.pos, "command")))
        return tuple(nodes), None

    def control(self, keyword: str, tokens: list[Token], pos: int) -> Control:
        mark = len(self.variables)
        pipe = self.pipeline(strip_spaces(tokens), pos, keyword)
        body, end = self.block()
        otherwise: tuple[Node, ...] = ()
        if end is None:
            raise syntax_error(self.text, pos, f"unexpected EOF in {{{{{keyword}}}}}")
        rest = strip_spaces(list(end.tokens[1:]))
        if end.tokens[0].text == "else":
            if keyword == "if" and rest and rest[0].text == "if" and rest[0].kind == "ident":
                otherwise = (self.control("if", rest[1:], end.pos),)
            else:
                if rest:
                    raise syntax_error(self.text, end.pos, f"unexpected {rest[0].text!r} in else")
                otherwise, end = self.block()
                if end is None or end.tokens[0].text != "end" or len(end.tokens) > 1:
                    raise syntax_error(self.text, pos, f"expected end for {{{{{keyword}}}}}")
        elif rest:
            raise syntax_error(self.text, end.pos, f"unexpected {rest[0].text!r} in end")
        del self.variables[mark:]
        return Control(keyword, pipe, body, otherwise)

    def pipeline(self, tokens: list[Token], pos: int, context: str) -> Pipe:
        decl, assign, tokens = self.declaration(tokens, context)
        if not tokens:
            raise syntax_error(self.text, pos, f"missing value for {context}")
        commands: list[Command] = []
        while True:
            cut = _depth_zero_index(tokens, "pipe")
            words = strip_spaces(tokens[:cut])
            if not words:
                raise syntax_error(self.text, pos, "missing command in pipeline")
            commands.append(self.command(words, len(commands)))
            if cut == len(tokens):
                break
            tokens = tokens[cut + 1 :]
        for name in decl:
            if not assign:
                self.variables.append(name)
        return Pipe(decl, assign, tuple(commands))

    def declaration(
        self, tokens: list[Token], context: str
    ) -> tuple[tuple[str, ...], bool, list[Token]]:
        solid = [(i, t) for i, t in enumerate(tokens) if t.kind != "space"]
        kinds = [t.kind for _, t in solid[:4]]
        if kinds[:2] in (["var", "declare"], ["var", "assign"]):
            name = solid[0][1]
            if kinds[1] == "assign" and name.text not in self.variables:
                raise syntax_error(self.text, name.pos, f'undefined variable "{name.text}"')
            return (name.text,), kinds[1] == "assign", strip_spaces(tokens[solid[1][0] + 1 :])
        if context == "range" and kinds == ["var", "comma", "var", "declare"]:
            names = (solid[0][1].text, solid[2][1].text)
            return names, False, strip_spaces(tokens[solid[3][0] + 1 :])
        return (), False, tokens

    def command(self, words: list[Token], stage: int) -> Command:
        args: list[Operand] = []
        i = 0
        while i < len(words):
            operand, i = self.operand(words, i)
            args.append(operand)
            if i < len(words):
                if words[i].kind != "space":
                    raise syntax_error(
                        self.text, words[i].pos, f"unexpected {words[i].text!r} in operand"
                    )
                i += 1
        first, name, pos = args[0], words[0].text, words[0].pos
        if not isinstance(first, Func):
            if name == "nil":
                raise syntax_error(self.text, pos, "nil is not a command")
            if len(args) > 1:
                raise syntax_error(self.text, pos, f"can't give argument to non-function {name}")
            if stage and isinstance(first, Const):
                raise syntax_error(
                    self.text, pos, f"non executable command in pipeline stage {stage + 1}"
                )
        return Command(tuple(args), words[0].pos)

    def operand(self, words: list[Token], i: int) -> tuple[Operand, int]:
        token = words[i]
        base: Var | Dot | Pipe
        fields: list[str] = []
        if token.kind == "ident":
            if token.text == "nil":
                return Const(None), i + 1
            if token.text in _UNSUPPORTED:
                raise syntax_error(
                    self.text,
                    token.pos,
                    f'function "{token.text}" is not supported by the monitor',
                )
            if token.text not in FUNCTIONS and token.text not in ("and", "or", QUERY):
                raise syntax_error(self.text, token.pos, f'function "{token.text}" not defined')
            return Func(token.text), i + 1
        if token.kind == "const":
            return Const(token.value), i + 1
        if token.kind == "var":
            if token.text not in self.variables:
                raise syntax_error(self.text, token.pos, f'undefined variable "{token.text}"')
            base = Var(token.text)
        elif token.kind == "dot":
            base = Dot()
        elif token.kind == "field":
            base, fields = Dot(), [token.text]
        elif token.kind == "lparen":
            close = i + 1 + _depth_zero_index(words[i + 1 :], "rparen")
            if close >= len(words):
                raise syntax_error(self.text, token.pos, "unclosed left paren")
            inner = strip_spaces(words[i + 1 : close])
            base = self.pipeline(inner, token.pos, "parenthesized pipeline")
            i = close
        else:
            raise syntax_error(self.text, token.pos, f"unexpected {token.text!r} in operand")
        i += 1
        while i < len(words) and words[i].kind == "field":
            fields.append(words[i].text)
            i += 1
        return Chain(base, tuple(fields)), i


def _depth_zero_index(tokens: Sequence[Token], kind: str) -> int:
    """Index of the first ``kind`` token outside parentheses, or ``len(tokens)``."""
    depth = 0
    for i, token in enumerate(tokens):
        if token.kind == kind and depth == 0:
            return i
        depth += {"lparen": 1, "rparen": -1}.get(token.kind, 0)
    return len(tokens)


@functools.lru_cache(maxsize=4096)
def parse(text: str) -> tuple[Node, ...]:
    return _Parser(PREFIX + text).parse()


def check_template(text: str) -> None:
    """Raise :class:`TemplateError` if ``text`` is not a template the monitor can expand."""
    parse(text)

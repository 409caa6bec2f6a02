"""The PromQL that a template's ``query`` calls run, as far as it is known before they run: a
constant string, or ``printf`` of a constant format (as rules build them:
``query (printf "count(up{run_id=%q} == 0)" $labels.run_id)``), its verbs filled with
placeholders. The rules loader checks these against the evaluator's subset and keeps the metric
names they select."""

from __future__ import annotations

import re

from lossguard.monitor.rules.templating import nodes as tree
from lossguard.monitor.rules.templating.functions import QUERY
from lossguard.monitor.rules.templating.parser import parse

_VERB = re.compile(r"%[-+# 0]*\d*(?:\.\d*)?(.?)", re.DOTALL)
_NUMERIC_VERBS = frozenset("bdeEfFgGoxX")
_NAME_CHAR = re.compile(r".*[\w:.]")


class QueryText:
    """A ``query`` argument known before it runs: ``exact`` for a constant string; otherwise
    a ``printf`` format whose verbs hold placeholders, which selects the same metric names:
    ``"_"`` for ``%q`` (a quoted label value), ``0`` for a number verb that stands alone. A
    format with any other verb (``%s`` could be part of a name) is not known."""

    def __init__(self, text: str, exact: bool) -> None:
        self.text = text
        self.exact = exact

    def __repr__(self) -> str:
        return f"QueryText({self.text!r}, exact={self.exact})"


def template_queries(text: str) -> list[QueryText | None]:
    """One entry per ``query`` call in the template ``text`` (already checked): its query, or
    None where the argument is only known when the template runs. A variable declared as a
    constant or a ``printf`` of one (``$q := printf `up{run_id=%q}` $labels.run_id``) may go
    into a later ``printf`` as ``%s``."""
    found: list[QueryText | None] = []
    _walk(parse(text), {}, found)
    return found


_Env = dict[str, "QueryText | None"]


def _walk(nodes: tuple[tree.Node, ...], env: _Env, found: list[QueryText | None]) -> None:
    for node in nodes:
        if isinstance(node, tree.Action):
            _pipe(node.pipe, env, found)
        elif isinstance(node, tree.Control):
            _pipe(node.pipe, env, found)
            _walk(node.body, env, found)
            _walk(node.otherwise, env, found)


def _pipe(pipe: tree.Pipe, env: _Env, found: list[QueryText | None]) -> None:
    for index, command in enumerate(pipe.commands):
        for operand in command.args:
            if isinstance(operand, tree.Chain) and isinstance(operand.base, tree.Pipe):
                _pipe(operand.base, env, found)
        first = command.args[0]
        if isinstance(first, tree.Func) and first.name == QUERY:
            found.append(_argument(pipe, index, env))
    for name in pipe.decl:
        known = len(pipe.decl) == 1 and len(pipe.commands) == 1
        env[name] = _command(pipe.commands[0], env) if known else None


def _argument(pipe: tree.Pipe, index: int, env: _Env) -> QueryText | None:
    """The query of the ``index``-th command (a ``query`` call): its operand, or the value the
    previous command pipes into it."""
    args = pipe.commands[index].args
    if len(args) == 2:
        return _operand(args[1], env)
    if len(args) == 1 and index > 0:
        return _command(pipe.commands[index - 1], env)
    return None


def _operand(operand: tree.Operand, env: _Env) -> QueryText | None:
    if isinstance(operand, tree.Const):
        return QueryText(operand.value, True) if isinstance(operand.value, str) else None
    if isinstance(operand, tree.Chain) and not operand.fields:
        if isinstance(operand.base, tree.Var):
            return env.get(operand.base.name)
        inner = operand.base
        if isinstance(inner, tree.Pipe) and not inner.decl and len(inner.commands) == 1:
            return _command(inner.commands[0], env)
    return None


def _command(command: tree.Command, env: _Env) -> QueryText | None:
    args = command.args
    if len(args) == 1:
        return _operand(args[0], env)
    first, fmt = args[0], args[1]
    printf = isinstance(first, tree.Func) and first.name == "printf"
    if printf and isinstance(fmt, tree.Const) and isinstance(fmt.value, str):
        return _filled(fmt.value, [_operand(arg, env) for arg in args[2:]])
    return None


def _filled(fmt: str, args: list[QueryText | None]) -> QueryText | None:
    parts: list[str] = []
    end = 0
    used = 0
    for verb in _VERB.finditer(fmt):
        parts.append(fmt[end : verb.start()])
        end = verb.end()
        before, after = fmt[verb.start() - 1 : verb.start()], fmt[end : end + 1]
        if verb[0] == "%%":
            parts.append("%")
            continue
        arg = args[used] if used < len(args) else None
        used += 1
        if verb[1] == "q":
            parts.append('"_"')
        elif verb[1] in _NUMERIC_VERBS and not _NAME_CHAR.match(before + after):
            parts.append("0")
        elif verb[1] in "sv" and arg is not None:
            parts.append(arg.text)
        else:
            return None
    parts.append(fmt[end:])
    return QueryText("".join(parts), False)

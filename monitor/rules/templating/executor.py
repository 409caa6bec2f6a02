"""Running a parsed template over an alert's data, and ``expand``: what rules call."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

from lossguard.monitor.rules.templating import nodes as tree
from lossguard.monitor.rules.templating.functions import FUNCTIONS, QUERY, truth
from lossguard.monitor.rules.templating.gofmt import go_print, go_type
from lossguard.monitor.rules.templating.model import (
    ExecError,
    GoValue,
    QueryError,
    QuerySample,
    TemplateData,
    TemplateError,
    TemplateQuery,
)
from lossguard.monitor.rules.templating.parser import parse


class _Executor:
    def __init__(self, data: TemplateData, query: TemplateQuery | None) -> None:
        self.variables: list[tuple[str, GoValue]] = [("$", data)]
        self.out: list[str] = []
        self.query = query

    def run(self, nodes: Sequence[tree.Node], dot: GoValue) -> None:
        for node in nodes:
            if isinstance(node, str):
                self.out.append(node)
            elif isinstance(node, tree.Action):
                value = self.pipe(node.pipe, dot)
                if not node.pipe.decl:
                    self.out.append(go_print(value))
            else:
                mark = len(self.variables)
                self.control(node, dot)
                del self.variables[mark:]

    def control(self, node: tree.Control, dot: GoValue) -> None:
        if node.keyword != "range":
            value = self.pipe(node.pipe, dot)
            if truth(value):
                self.run(node.body, value if node.keyword == "with" else dot)
            else:
                self.run(node.otherwise, dot)
            return
        value = self.pipe(node.pipe, dot, bind=False)
        entries: list[tuple[GoValue, GoValue]]
        if isinstance(value, list):
            entries = list(enumerate(value))
        elif isinstance(value, dict) or value is None:
            entries = sorted((value or {}).items())
        elif isinstance(value, int) and not isinstance(value, bool):
            raise ExecError(f"range can't iterate over {value}")
        else:
            raise ExecError(f"range can't iterate over {go_print(value)}")
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

    def pipe(self, pipe: tree.Pipe, dot: GoValue, bind: bool = True) -> GoValue:
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

    def command(self, command: tree.Command, dot: GoValue, final: tuple[GoValue, ...]) -> GoValue:
        first, rest = command.args[0], command.args[1:]
        if isinstance(first, tree.Func):
            return self.call(first.name, rest, dot, final)
        if final:
            raise ExecError(f"can't give argument to non-function {_describe(first)}")
        return self.operand(first, dot)

    def call(
        self, name: str, operands: Sequence[tree.Operand], dot: GoValue, final: tuple[GoValue, ...]
    ) -> GoValue:
        thunks: list[Callable[[], GoValue]] = [
            functools.partial(self.operand, operand, dot) for operand in operands
        ]
        thunks.extend(functools.partial(_identity, value) for value in final)
        if name in ("and", "or"):
            if not thunks:
                raise ExecError(f"wrong number of args for {name}: want at least 1 got 0")
            for thunk in thunks:
                value = thunk()
                if truth(value) != (name == "and"):
                    return value
            return value
        if name == QUERY:
            return self.run_query(thunks)
        function, count, variadic = FUNCTIONS[name]
        if len(thunks) < count or (not variadic and len(thunks) != count):
            want = f"at least {count}" if variadic else str(count)
            raise ExecError(f"wrong number of args for {name}: want {want} got {len(thunks)}")
        return function(*(thunk() for thunk in thunks))

    def run_query(self, thunks: Sequence[Callable[[], GoValue]]) -> list[QuerySample]:
        if len(thunks) != 1:
            raise ExecError(f"wrong number of args for query: want 1 got {len(thunks)}")
        expr = thunks[0]()
        if not isinstance(expr, str):
            raise ExecError(f"wrong type for value; expected string; got {go_type(expr)}")
        if self.query is None:
            raise ExecError("error calling query: no query engine to run it here")
        try:
            return self.query(expr)
        except QueryError as exc:
            raise ExecError(f"error calling query: {exc}") from None

    def operand(self, operand: tree.Operand, dot: GoValue) -> GoValue:
        if isinstance(operand, tree.Const):
            return operand.value
        if isinstance(operand, tree.Func):
            return self.call(operand.name, (), dot, ())
        base = operand.base
        if isinstance(base, tree.Var):
            value = next(v for name, v in reversed(self.variables) if name == base.name)
        elif isinstance(base, tree.Dot):
            value = dot
        else:
            value = self.pipe(base, dot)
        for field in operand.fields:
            value = _field(value, field)
        return value


def _identity(value: GoValue) -> GoValue:
    return value


def _describe(operand: tree.Operand) -> str:
    if isinstance(operand, tree.Const):
        return go_print(operand.value)
    return "." + ".".join(operand.fields) if isinstance(operand, tree.Chain) else str(operand)


def _field(value: GoValue, name: str) -> GoValue:
    if isinstance(value, dict):
        return value.get(name, "")
    if isinstance(value, QuerySample) and name in ("Labels", "Value"):
        sample_field: GoValue = getattr(value, name)
        return sample_field
    if isinstance(value, TemplateData) and name in (
        "Labels",
        "ExternalLabels",
        "ExternalURL",
        "Value",
    ):
        field: GoValue = getattr(value, name)
        return field
    if value is None:
        raise ExecError(f"nil pointer evaluating interface {{}}.{name}")
    raise ExecError(f"can't evaluate field {name} in type {go_type(value)}")


def expand(
    text: str,
    *,
    labels: Mapping[str, str],
    value: float,
    external_labels: Mapping[str, str] | None = None,
    external_url: str = "",
    query: TemplateQuery | None = None,
) -> str:
    """Expand an alert template as Prometheus does; errors become ``<error expanding ...>``.
    ``query`` answers the template's ``query`` calls (at the evaluation's time)."""
    try:
        nodes = parse(text)
        data = TemplateData(dict(labels), dict(external_labels or {}), external_url, float(value))
        executor = _Executor(data, query)
        executor.run(nodes, data)
    except (TemplateError, ExecError, ValueError, OverflowError) as exc:
        return f"<error expanding template: {exc}>"
    return "".join(executor.out)

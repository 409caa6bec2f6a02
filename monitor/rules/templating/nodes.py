"""The parse tree of a template: constants, functions, variables, pipelines, actions and the
``if``/``with``/``range`` controls."""

from __future__ import annotations

from dataclasses import dataclass

from lossguard.monitor.rules.templating.model import GoValue


@dataclass(frozen=True)
class Const:
    """A literal: a number, string, character, boolean or ``nil``."""

    value: GoValue


@dataclass(frozen=True)
class Func:
    """A function, called with the operands after it and the value piped into it."""

    name: str


@dataclass(frozen=True)
class Chain:
    """A variable (``$x``), the dot (``.``) or a parenthesised pipeline, then fields."""

    base: Var | Dot | Pipe
    fields: tuple[str, ...]


@dataclass(frozen=True)
class Var:
    """A variable such as ``$labels``; ``$`` is the template's data."""

    name: str


@dataclass(frozen=True)
class Dot:
    """The dot: the value the template is running on."""


Operand = Const | Func | Chain


@dataclass(frozen=True)
class Command:
    """One stage of a pipeline: its operands and where it starts in the text."""

    args: tuple[Operand, ...]
    pos: int


@dataclass(frozen=True)
class Pipe:
    """Commands joined by ``|``, and the variables it declares (``:=``) or assigns (``=``)."""

    decl: tuple[str, ...]
    assign: bool
    commands: tuple[Command, ...]


@dataclass(frozen=True)
class Control:
    """``{{if}}``, ``{{with}}`` or ``{{range}}``: its pipeline, body and ``{{else}}`` part."""

    keyword: str  # if, with, range
    pipe: Pipe
    body: tuple[Node, ...]
    otherwise: tuple[Node, ...]


@dataclass(frozen=True)
class Action:
    """An action that prints its pipeline's value, unless the pipeline declares variables."""

    pipe: Pipe


Node = str | Action | Control

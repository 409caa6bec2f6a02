"""The shape of the house (docs/design.md "Layout"): no import circles; ``common/`` imports nothing
else of lossguard; nothing outside ``agent/`` imports ``lossguard.agent``; ``ctl/``, the monitor
and the supervisor import only ``common/`` beside themselves and never torch. Each wall is shown
able to fail."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.live

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "common": "lossguard.common",
    "agent": "lossguard.agent",
    "ctl": "lossguard.ctl",
    "monitor": "lossguard.monitor",
    "supervisor": "lossguard.supervisor",
}


def module_files() -> dict[str, Path]:
    """Every lossguard module, by dotted name."""
    modules = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def import_statements(path: Path, name: str) -> Iterator[tuple[str, list[str]]]:
    """``(module, names)`` for each import in ``path``, anywhere in it (function bodies and
    TYPE_CHECKING blocks included); relative imports resolved against ``name``; ``names``:
    what ``from module import ...`` names (empty for ``import module``)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}".rstrip(".")
            yield base, [alias.name for alias in node.names]


def imported_modules(path: Path, name: str, known: set[str]) -> set[str]:
    """The lossguard modules that ``path`` imports anywhere in it (a circle through a function
    body or a TYPE_CHECKING block is still a circle)."""
    found: set[str] = set()
    for base, names in import_statements(path, name):
        if not names:
            found.add(base)
        for alias in names:
            candidate = f"{base}.{alias}"
            found.add(candidate if candidate in known else base)
    return {module for module in found if module in known and module != name}


def test_no_import_circles() -> None:
    modules = module_files()
    graph = {name: imported_modules(path, name, set(modules)) for name, path in modules.items()}
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"import circle: {' -> '.join(exc.args[1])}")


def test_the_circle_check_sees_a_circle(tmp_path: Path) -> None:
    """The check itself can fail: two modules that import each other form a circle."""
    (tmp_path / "a.py").write_text("from lossguard.agent.b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from lossguard.agent.a import y\n")
    known = {"lossguard.agent.a", "lossguard.agent.b"}
    graph = {
        "lossguard.agent.a": imported_modules(tmp_path / "a.py", "lossguard.agent.a", known),
        "lossguard.agent.b": imported_modules(tmp_path / "b.py", "lossguard.agent.b", known),
    }
    with pytest.raises(graphlib.CycleError):
        tuple(graphlib.TopologicalSorter(graph).static_order())


def lossguard_imports(path: Path, name: str) -> set[str]:
    """Every ``lossguard`` module that ``path`` names in an import, whether or not it exists."""
    found = {module for module, _ in import_statements(path, name)}
    return {module for module in found if module == "lossguard" or module.startswith("lossguard.")}


WALLS = {
    "lossguard.common": ("lossguard.common",),
    "lossguard.ctl": ("lossguard.common", "lossguard.ctl"),
    "lossguard.monitor": ("lossguard.common", "lossguard.monitor"),
    "lossguard.supervisor": ("lossguard.common", "lossguard.supervisor"),
}
"""What each torch-free package may import of lossguard (``lossguard.common`` itself)."""


def breaches(modules: dict[str, Path]) -> dict[str, list[str]]:
    """The modules that import across their package's wall, with what they import."""
    found = {}
    for name, path in modules.items():
        package = next((p for p in WALLS if name == p or name.startswith(p + ".")), None)
        if package is None:
            continue
        allowed = WALLS[package]
        beyond = sorted(
            module
            for module in lossguard_imports(path, name)
            if not any(module == a or module.startswith(a + ".") for a in allowed)
        )
        if beyond:
            found[name] = beyond
    return found


def test_each_torch_free_package_imports_only_what_its_wall_allows() -> None:
    assert breaches(module_files()) == {}


def test_nothing_outside_the_agent_imports_it() -> None:
    """The torch-free packages (walled above) and the dashboards."""
    outside = {
        f"dashboards.{path.stem}": path for path in sorted((ROOT / "dashboards").rglob("*.py"))
    }
    importing = {
        name: sorted(m for m in lossguard_imports(path, name) if m.startswith("lossguard.agent"))
        for name, path in {**module_files(), **outside}.items()
        if not name.startswith("lossguard.agent")
    }
    assert {name: found for name, found in importing.items() if found} == {}


MONITOR_CLI = "lossguard.monitor.cli"


@pytest.mark.parametrize(
    ("name", "source", "crossed"),
    [
        (
            "lossguard.monitor.x",
            "from lossguard.agent.guard import Guard\n",
            "lossguard.agent.guard",
        ),
        (
            "lossguard.supervisor.x",
            "def f():\n    import lossguard.monitor.cli\n",
            "lossguard.monitor.cli",
        ),
        ("lossguard.common.x", "from lossguard.supervisor import cli\n", "lossguard.supervisor"),
        ("lossguard.common.rundir.x", "from ...agent import guard\n", "lossguard.agent"),
        (
            "lossguard.ctl.x",
            "from lossguard.monitor.runs import read_runs\n",
            "lossguard.monitor.runs",
        ),
        ("lossguard.ctl.x", "from ..agent.control import commands\n", "lossguard.agent.control"),
    ],
)
def test_the_walls_see_a_breach(tmp_path: Path, name: str, source: str, crossed: str) -> None:
    """The wall check itself can fail: a module that imports across its wall, at the top, in a
    function body or relatively, is reported."""
    path = tmp_path / "x.py"
    path.write_text(source)
    assert breaches({name: path}) == {name: [crossed]}


def torch_check(names: list[str]) -> subprocess.CompletedProcess[str]:
    """Import each of ``names`` in a fresh interpreter; fails naming the first that loads
    torch."""
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "    assert 'torch' not in sys.modules, name + ' imported torch'\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_the_torch_free_packages_never_import_torch() -> None:
    names = [n for n in module_files() if not n.startswith("lossguard.agent")]
    result = torch_check([*names, "lossguard.agent"])  # Guard and the trainer load torch
    assert result.returncode == 0, result.stderr


def test_the_torch_check_sees_torch() -> None:
    result = torch_check(["lossguard.common", "lossguard.agent.guard"])
    assert result.returncode != 0 and "lossguard.agent.guard imported torch" in result.stderr


def test_the_built_in_trainer_sits_on_top_of_guard() -> None:
    """Guard in a user's own loop needs nothing of the built-in trainer: outside ``train/``,
    no agent module imports it but ``lossguard-agent`` (``agent/cli.py``), which runs it."""
    modules = module_files()
    trainer = "lossguard.agent.train"
    command = "lossguard.agent.cli"
    offending = {
        name: sorted(m for m in imported_modules(path, name, set(modules)) if m.startswith(trainer))
        for name, path in modules.items()
        if name.startswith("lossguard.agent") and not name.startswith((trainer, command))
    }
    assert {name: found for name, found in offending.items() if found} == {}

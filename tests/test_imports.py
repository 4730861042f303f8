"""The rooms' import graph: no cycle, no room reaching up into the CLI, a gateway without torch.

Every import statement counts, module level or inside a function (a function-level import
hides a cycle, it does not remove it); only those under `if TYPE_CHECKING:` are left out,
since they never run.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("common", "gateway", "gpu_node", "scheduler", "billing", "edgeserve")
# What each room may import of the others (ARCHITECTURE.md's "must not" column).
MAY_IMPORT = {
    "common": set(),
    "scheduler": {"common"},
    "billing": {"common"},
    "gateway": {"common", "scheduler", "billing"},
    "gpu_node": {"common", "scheduler", "billing"},
    "edgeserve": set(ROOMS),
}


def _modules() -> dict[str, Path]:
    found = {}
    for room in ROOMS:
        for path in (ROOT / room).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that `path` imports at run time."""
    tree = ast.parse(path.read_text())
    unreached: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            unreached.update(id(sub) for sub in ast.walk(node))
    names = []
    for node in ast.walk(tree):
        if id(node) in unreached:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    found = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_module_of_ours_is_part_of_an_import_cycle() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_each_room_imports_only_the_rooms_below_it() -> None:
    reaching_up = sorted(
        (module, imported)
        for module, imports in _graph().items()
        for imported in imports
        if (room := module.partition(".")[0]) != (other := imported.partition(".")[0])
        and other not in MAY_IMPORT[room]
    )
    assert reaching_up == []


def test_the_gateway_imports_without_torch_or_the_engine() -> None:
    program = "import sys, gateway.app, gateway.stores; print(*sorted(sys.modules), sep=chr(10))"
    loaded = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
        check=True, cwd=ROOT,
    ).stdout.split()  # fmt: skip
    assert "gateway.app" in loaded
    assert [m for m in loaded if m.partition(".")[0] in ("torch", "gpu_node", "edgeserve")] == []

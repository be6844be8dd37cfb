"""The package's imports run one way: server -> client -> engine -> models -> layers ->
kernels, with the shared types below their users, and no module imports one that imports it
back, at module level, inside a function (a deferred import is still a circle) or under
`if TYPE_CHECKING:` (an annotation's import is still a dependency: the modules cannot be read
apart). Read from the source, its `import` statements."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import kdaserve

ROOT = Path(kdaserve.__file__).parent

# Top to bottom; a module may import its own level or any below, never one above. Each name is
# a top-level package or module of kdaserve ("" the package itself).
LEVELS: list[set[str]] = [
    {"__main__", "cli"},
    {"bench", "training"},
    {"server"},
    {"", "llm"},
    {"client"},
    {"engine"},
    {"speculative"},
    {"checkpoint", "tokenizer_writer", "hub_writer"},
    {"models"},
    {"layers"},
    {"cache", "forward_batch", "step_record", "scheduled_batch", "sampling_filters",
     "detokenizer"},
    {"config", "engine_config", "hub_schema", "request", "tokenizer", "datasets",
     "vision_config", "multimodal", "image_processor"},
    {"kernels"},
]
LEVEL = {name: i for i, names in enumerate(LEVELS) for name in names}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """module -> the kdaserve modules it imports (a `from m import x` names m, or m.x where
    that is a module)."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's package
                    package = name.split(".")
                    if path.name != "__init__.py":
                        package = package[:-1]
                    base = ".".join(package[:len(package) - node.level + 1])
                    module = f"{base}.{node.module}" if node.module else base
                else:
                    module = node.module or ""
                targets = [module, *(f"{module}.{a.name}" for a in node.names)]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_every_package_has_a_level() -> None:
    tops = {top(m) for m in imports()} | {top(t) for ts in imports().values() for t in ts}
    assert tops <= set(LEVEL), f"give these a level: {sorted(tops - set(LEVEL))}"


def test_no_import_circle() -> None:
    assert cycles(imports()) == []


def test_no_import_runs_up() -> None:
    up = sorted(f"{a} -> {b}" for a, targets in imports().items() for b in targets
                if LEVEL[top(b)] < LEVEL[top(a)])
    assert up == []


def test_the_checks_see_circles_and_upward_imports() -> None:
    """The checks themselves, on a graph that has both."""
    graph = {"kdaserve.engine.a": {"kdaserve.engine.b"}, "kdaserve.engine.b": {"kdaserve.engine.a"},
             "kdaserve.kernels.k": {"kdaserve.server.s"}}
    assert cycles(graph) == [["kdaserve.engine.a", "kdaserve.engine.b"]]
    assert [b for a, ts in graph.items() for b in ts if LEVEL[top(b)] < LEVEL[top(a)]] == \
        ["kdaserve.server.s"]


def test_tests_share_helpers_through_conftest_only() -> None:
    """No test module imports another test module (shared helpers live in conftest.py or
    tests/ports.py), and no script imports the tests."""
    repo = ROOT.parent
    found = []
    for path in [*(repo / "tests").rglob("*.py"), *(repo / "scripts").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or "", *(a.name for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                last = name.split(".")[-1]
                if last.startswith("test_") or (path.parts[-2] == "scripts"
                                                and name.split(".")[0] == "tests"):
                    found.append(f"{path.relative_to(repo)}: {name}")
    assert found == []

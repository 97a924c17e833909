"""The package's layering, read from the source: no import cycles (function-local imports count
too), the fleet imports nothing from the simulation, and the device side never imports the
server package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: source folders and the package each is installed as (pyproject.toml's package-dir)
PACKAGES = {"edgefl": "edgefl", "server": "edgefl.server", "exporters": "edgefl.exporters"}


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [*package.split("."), *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except what sits under ``if TYPE_CHECKING:`` (imports for type hints
    only, which never run and so cannot make an import cycle)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            test = child.test if isinstance(child, ast.If) else None
            if test is not None and ast.unparse(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the edgefl modules it imports anywhere in its body, type-only imports aside
    (each name resolved to the longest module it names)."""
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in _runtime_nodes(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                names = [base, *(f"{base}.{a.name}" for a in node.names)]
            for name in names:
                target = resolve(name)
                if target and target != module:
                    edges.setdefault(module, set()).add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert _cycles(_imports(_modules())) == []


def test_the_fleet_imports_nothing_from_the_simulation_and_devices_nothing_from_the_server():
    edges = _imports(_modules())
    for module, targets in edges.items():
        if module.startswith("edgefl.fleet"):
            assert not any(t.startswith("edgefl.sim") for t in targets), module
    device_side = ["edgefl.device", "edgefl.build", "edgefl.methods", "edgefl.config"]
    device_side += [m for m in edges if m.startswith(("edgefl.transport", "edgefl.algorithms", "edgefl.filters"))]
    for module in device_side:
        assert not any(t.startswith("edgefl.server") for t in edges.get(module, ())), module


#: the round policies: they play over the endpoint's public API
POLICIES = ("edgefl.server.policy", "edgefl.server.rounds", "edgefl.server.asynchronous")


def test_policies_import_the_endpoint_and_the_endpoint_imports_no_policy():
    """The server's layers: transport <- endpoint (protocol: checks, reassembly, acks, presence,
    exchanges) <- round policies (sync rounds with stages, async updates) <- session. The
    endpoint and the transport know no policy; a policy knows no transport class (it is handed a
    clock and the endpoint) and calls nothing private of another module."""
    edges = _imports(_modules())
    below_policies = ["edgefl.server.endpoint", "edgefl.stages", "edgefl.server.clock", "edgefl.server.records"]
    below_policies += [m for m in edges if m.startswith(("edgefl.transport", "edgefl.filters"))]
    for module in below_policies:
        assert not any(t in POLICIES or t == "edgefl.server.session" for t in edges.get(module, ())), module
    for policy in POLICIES:
        assert "edgefl.server.endpoint" in edges[policy] or "edgefl.server.policy" in edges[policy], policy
        assert not any(t.startswith(("edgefl.transport.mqtt", "edgefl.sim", "edgefl.fleet")) for t in edges[policy]), policy


def test_no_module_calls_a_private_method_of_another_object_of_the_server():
    """``other._name(...)`` across objects is how the old orchestrator and its asynchronous loop
    were tied together; the server's modules call only public methods of what they hold."""
    private_call = re.compile(r"\b(?!self\b|cls\b)[a-z_][a-z0-9_]*\._[a-z][a-z0-9_]*\(")
    offenders = [f"{path.name}: {m.group(0)}" for path in (ROOT / "server").rglob("*.py")
                 for m in private_call.finditer(path.read_text())]
    assert offenders == []


def test_the_walk_sees_a_cycle_when_there_is_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_type_only_imports_are_not_edges():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\nimport c\n")
    imported = {a.name for n in _runtime_nodes(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported == {"b", "c"}

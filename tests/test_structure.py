"""The package's shape: no import cycles, no import from a higher layer of docs/internals.md (lazy imports
included), nothing outside the tools wing imports it, no ``ctypes`` in the core."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "afd_ext"
WING = {"tools", "__main__", "testing"}  # the tools and their two doors at the package root


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(mods: dict[str, pathlib.Path], name: str) -> set[str]:
    """Package modules ``name`` imports anywhere in its body (function-level imports too)."""
    pkg = name if mods[name].name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(mods[name].read_text())):
        if isinstance(node, ast.ImportFrom):
            base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            targets = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t and t != name:
                out.add(t)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    mods = _modules()
    graph = {m: _imports(mods, m) for m in mods}
    assert graph["afd_ext.connector"] >= {"afd_ext.schedule", "afd_ext.spec"}  # the scan sees imports
    cycles = _cycles(graph)
    assert not cycles, f"import cycles: {cycles}"


def doc_layers(text: str) -> list[set[str]]:
    """The ```layers block of docs/internals.md: per line, lowest first, its names without ``.py`` or ``/``."""
    block = text.split("```layers\n", 1)[1].split("```", 1)[0]
    lines = (line.split("#", 1)[0].split() for line in block.splitlines())
    return [{n.removesuffix(".py").rstrip("/") for n in names} for names in lines if names]


def _unit(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def layering_violations(layers: list[set[str]], graph: dict[str, set[str]]) -> list[str]:
    """Each import from a higher layer or into the wing from outside it, and each module on no layer."""
    level = {name: i for i, names in enumerate(layers) for name in names}
    out = [f"{m} is on no layer of docs/internals.md" for m in sorted(graph) if _unit(m) not in level]
    for m in sorted(graph):
        a = _unit(m)
        for d in sorted(graph[m]):
            b = _unit(d)
            if level.get(b, -1) > level.get(a, len(layers)):
                out.append(f"{m} (layer {level[a]}) imports {d} (layer {level[b]})")
            if b in WING and a not in WING:
                out.append(f"{m} imports the tools wing ({d})")
    return out


def test_no_module_imports_from_a_higher_layer_nor_the_wing():
    mods = _modules()
    layers = doc_layers((ROOT.parent / "docs" / "internals.md").read_text())
    assert {"transport", "rendezvous", "tools"} <= set().union(*layers)  # the block was read
    assert layering_violations(layers, {m: _imports(mods, m) for m in mods}) == []


def test_the_layering_check_finds_a_planted_upward_import():
    layers = [{"__init__", "errors"}, {"transport"}, {"connector"}, {"tools", "testing"}]
    clean = {"afd_ext": {"afd_ext.errors"}, "afd_ext.errors": set(), "afd_ext.transport.base": {"afd_ext.errors"},
             "afd_ext.connector.step": {"afd_ext.transport.base"}, "afd_ext.tools.cli": {"afd_ext.connector"},
             "afd_ext.testing": {"afd_ext.tools.testing"}}
    assert layering_violations(layers, clean) == []
    assert layering_violations(layers, {**clean, "afd_ext.transport.base": {"afd_ext.connector.step"}}) == [
        "afd_ext.transport.base (layer 1) imports afd_ext.connector.step (layer 2)"]
    assert layering_violations(layers, {**clean, "afd_ext.connector.step": {"afd_ext.testing"}}) == [
        "afd_ext.connector.step (layer 2) imports afd_ext.testing (layer 3)",
        "afd_ext.connector.step imports the tools wing (afd_ext.testing)"]
    assert layering_violations([*layers[:3], {"testing"}, {"tools"}], {**clean, "afd_ext.new": set()}) == [
        "afd_ext.new is on no layer of docs/internals.md",
        "afd_ext.testing (layer 3) imports afd_ext.tools.testing (layer 4)"]


def test_ctypes_is_not_in_the_core():
    users = sorted(m for m, p in _modules().items() if "ctypes" in _imports_raw(p))
    # The bench's baseline of minimal peer kernels loads a library that is not the extension.
    core = [m for m in users if m != "afd_ext.tools.bench.peer_structure"]
    assert not core, f"ctypes imported by {core} (only the bench's baselines may use it)"


def _imports_raw(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names

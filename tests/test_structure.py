"""The package's shape: no import cycles (lazy imports included), no ``ctypes`` in the core."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "afd_ext"


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

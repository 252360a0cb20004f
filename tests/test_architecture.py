"""The package's import graph: no module of ``dilated`` imports, directly or through others, a module
that imports it back (function-local imports count), and the library does not import its
benchmark harness (``dilated.bench``)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dilated"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, modules) -> set[str]:
    """The package modules ``name`` imports anywhere in its file (``from .x import y`` counts as
    importing ``x.y`` where that is a module, else ``x``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _without_packages(graph):
    """Package ``__init__`` modules import their submodules to export names; a submodule that imports
    its own package's ``__init__`` closes no real cycle, so those edges are left out."""
    return {v: {w for w in ws if not v.startswith(w + ".")} for v, ws in graph.items()}


def test_no_import_cycles_inside_the_package():
    cycles = _cycles(_without_packages(_graph()))
    assert not cycles, "import cycles (each a set of modules importing one another): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_the_library_does_not_import_the_benchmark_harness():
    graph = _graph()
    core = {v: sorted(w for w in ws if w == "dilated.bench" or w.startswith("dilated.bench."))
            for v, ws in graph.items() if not (v == "dilated.bench" or v.startswith("dilated.bench."))}
    assert not {v: ws for v, ws in core.items() if ws}


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_layers_import_downward_only():
    """The top level (attention, the dense pieces, the backends) imports neither subpackage; LongNet
    on one device does not import context parallelism; only ``dilated/__init__`` exports both."""
    def layer(module):
        for sub in ("longnet", "parallel", "bench"):
            if module == f"dilated.{sub}" or module.startswith(f"dilated.{sub}."):
                return sub
        return "top"

    allowed = {"top": {"top"}, "longnet": {"top", "longnet"}, "parallel": {"top", "longnet", "parallel"},
               "bench": {"top", "longnet", "parallel", "bench"}}
    wrong = {v: sorted(w for w in ws if layer(w) not in allowed[layer(v)])
             for v, ws in _graph().items() if v != "dilated"}
    assert not {v: ws for v, ws in wrong.items() if ws}

"""The package's import graph has no cycle, and the layout keeps its direction: the pipeline (pure code)
never imports the serving core, the faces or the deployment code; the serving core never imports a face.

Every ``import`` / ``from ... import`` of a ``toktier_backend`` module counts, at module level, inside
functions and under ``TYPE_CHECKING`` alike: a lazy import hides a cycle from the interpreter, not from a
reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "toktier_backend"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")
            if "trtllm_ensemble" not in p.parts and "__pycache__" not in p.parts}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The deepest known module that ``name`` (a dotted import target) names or lies in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """``module -> modules it imports`` over ``toktier_backend`` (package ``__init__`` modules included)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                # ``from pkg import sub`` depends on the submodule; ``from mod import name`` on the module
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in modules else src for a in node.names]
            for t in targets:
                if not t.startswith("toktier_backend"):
                    continue
                dep = _resolve(t, modules)
                if dep and dep != mod:
                    graph[mod].add(dep)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
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


def _edges_between(graph, src_prefix: str, dst_prefixes: tuple[str, ...]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, deps in graph.items() if a.startswith(src_prefix)
                  for b in deps if b.startswith(dst_prefixes))


def test_the_cycle_check_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_reads_relative_and_lazy_imports():
    graph = import_graph()
    assert "toktier_backend.errors" in graph["toktier_backend.tokenizer"]
    assert len(graph) > 40


def test_no_import_cycle():
    graph = {m: {d for d in deps if not d == "toktier_backend"} for m, deps in import_graph().items()}
    # the package __init__ re-exports the public API; importing "toktier_backend" itself is a use of that
    # API, not of a module in the layout
    assert _cycles(graph) == []


def test_pipeline_is_below_serving_and_faces():
    graph = import_graph()
    upper = ("toktier_backend.serving", "toktier_backend.faces", "toktier_backend.deploy",
             "toktier_backend.tokenizer", "toktier_backend.demo", "toktier_backend.cli")
    assert _edges_between(graph, "toktier_backend.pipeline", upper) == []


def test_serving_core_imports_no_face():
    graph = import_graph()
    assert _edges_between(graph, "toktier_backend.serving", ("toktier_backend.faces", "toktier_backend.deploy")) == []

"""The import structure of ``quanta/``, read from the source (``ast``, nothing imported).

- The model floor (``quanta.model.*``) is the lowest: none of its modules imports a quanta module
  outside it, at module level or inside a function.
- No import cycle among quanta's modules, counting the imports that run when a module is loaded
  (module level, ``try``/``if`` blocks and class bodies; not function bodies, not ``if TYPE_CHECKING``).
- No cycle either counting every import (inside functions and for type checkers too).

An import names a module: ``from quanta.x import y`` is ``quanta.x.y`` where that is a module, else
``quanta.x``. A package's ``__init__`` is its own module (``quanta.sim``); importing a submodule is not
counted as importing its package.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "quanta"

@dataclass(frozen=True)
class Import:
    target: str
    line: int
    at_load: bool  # runs when the importing module is loaded (not in a function, not for type checkers)


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _statements(body: list[ast.stmt], at_load: bool):
    """``(statement, at_load)`` for every statement under ``body``, nested ones included."""
    for node in body:
        yield node, at_load
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _statements(node.body, False)
        elif isinstance(node, ast.If) and _is_type_checking(node):
            yield from _statements(node.body, False)
            yield from _statements(node.orelse, at_load)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    yield from _statements([child], at_load)
                elif isinstance(child, ast.excepthandler):
                    yield from _statements(child.body, at_load)


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """The quanta modules that module ``name`` imports (see the module docstring)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node, at_load in _statements(ast.parse(path.read_text(encoding="utf-8")).body, True):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for n in names:
            target = _resolve(n, modules) if n.split(".")[0] == "quanta" else None
            if target and target != name:
                found.append(Import(target, node.lineno, at_load))
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, list[Import]]:
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _in_model(name: str) -> bool:
    return name == "quanta.model" or name.startswith("quanta.model.")


def test_the_model_floor_imports_nothing_above_it():
    modules = module_files()
    graph = import_graph(modules)
    bad = [f"{name} ({modules[name].relative_to(ROOT.parent)}:{imp.line}) imports {imp.target}"
           for name, imps in graph.items() if _in_model(name) for imp in imps if not _in_model(imp.target)]
    assert not bad, "quanta.model imports from above it:\n" + "\n".join(bad)


def test_no_import_cycle_among_quantas_modules():
    graph = import_graph(module_files())
    edges = {name: {imp.target for imp in imps if imp.at_load} for name, imps in graph.items()}
    found = cycles(edges)
    assert not found, "import cycles (module-level imports):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_cycle_through_lazy_imports_either():
    graph = import_graph(module_files())
    edges = {name: {imp.target for imp in imps} for name, imps in graph.items()}
    found = cycles(edges)
    assert not found, "import cycles (counting imports in functions and for type checkers):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_the_reader_sees_every_kind_of_import(tmp_path):
    """The checks can fail: a made-up package whose modules import each other in every form."""
    pkg = tmp_path / "quanta"
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model" / "__init__.py").write_text("")
    (pkg / "launch.py").write_text("from quanta.model import low\n")
    (pkg / "model" / "low.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from quanta import launch\n"
                                          "try:\n    from . import mid\nexcept ImportError:\n    pass\n")
    (pkg / "model" / "mid.py").write_text("import quanta.model.low as low\n\n\ndef f():\n    from quanta.launch import x\n")
    modules = module_files(pkg)
    graph = import_graph(modules)
    assert [(i.target, i.at_load) for i in graph["quanta.launch"]] == [("quanta.model.low", True)]
    assert [(i.target, i.at_load) for i in graph["quanta.model.low"]] == [("quanta.launch", False), ("quanta.model.mid", True)]
    assert [(i.target, i.at_load) for i in graph["quanta.model.mid"]] == [("quanta.model.low", True), ("quanta.launch", False)]
    edges = {n: {i.target for i in imps if i.at_load} for n, imps in graph.items()}
    assert cycles(edges) == [["quanta.model.low", "quanta.model.mid"]]
    every = {n: {i.target for i in imps} for n, imps in graph.items()}
    assert cycles(every) == [["quanta.launch", "quanta.model.low", "quanta.model.mid"]]

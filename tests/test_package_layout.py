"""The package layout's rules (docs/contributing.md, "Layout"), checked on the source itself.

* No import cycle among ``distgrad.*`` modules. An edge ``a -> b`` is every ``import`` statement
  of module ``a`` that names ``b``, at module level or inside a function or class body alike
  (a function-level import is a cycle deferred, not removed); imports under
  ``if TYPE_CHECKING:`` are annotations only and do not count. ``from pkg import name`` is an
  edge to ``pkg.name`` when that is a module, else to ``pkg``. Importing ``pkg.sub`` runs
  ``pkg/__init__`` first; that implicit step is not an edge (it would make every package whose
  ``__init__`` re-exports a submodule a cycle).
* The offline report (``distgrad.report.*``) is never imported at training time: it is not
  reachable, through any import edge above, from the package root, the instrument, the engines,
  the exporters or the framework integrations; and importing them in a fresh process loads no
  ``distgrad.report`` module.
* At most 8 modules at the top of ``distgrad/``.

The reference the graph test is checked against: a hand-built graph with a known cycle, and the
same parser's edges for one module compared with the imports its source visibly has.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "distgrad"

#: what runs inside a training process (the offline report, the CLI and the config generator are
#: the only other entry points)
TRAINING_ROOTS = ("distgrad", "distgrad.api", "distgrad.core.instrument", "distgrad.integrations.hf",
                  "distgrad.integrations.lightning")


def module_names() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Import nodes anywhere in ``tree`` (function and class bodies included), skipping the bodies
    of ``if TYPE_CHECKING:`` (their ``else`` branches still count)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The ``distgrad`` modules that module ``name`` (source ``path``) imports."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    def add(target: str) -> None:
        # the longest known module prefix: ``distgrad.x.y.attr`` -> ``distgrad.x.y``
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)

    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "distgrad" or alias.name.startswith("distgrad."):
                    add(alias.name)
            continue
        if node.level:
            base = name.split(".") if is_pkg else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        if not (mod == "distgrad" or mod.startswith("distgrad.")):
            continue
        for alias in node.names:
            sub = f"{mod}.{alias.name}"
            add(sub if sub in modules else mod)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: import_edges(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        # iterative Tarjan: the package's graph is small, but recursion depth is not ours to spend
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def reachable(graph: dict[str, set[str]], roots) -> set[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo.extend(graph.get(v, ()))
    return seen


def test_cycle_finder_on_known_graphs():
    # a 3-cycle plus a tail and a separate 2-cycle; a DAG has none
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert sorted(cycles(g)) == [["a", "b", "c"], ["e", "f"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_edges_parser_counts_function_level_and_skips_type_checking(tmp_path):
    src = ("from __future__ import annotations\n"
           "from typing import TYPE_CHECKING\n"
           "import distgrad.x.y as xy\n"
           "from distgrad.x import z, CONST\n"
           "from . import w\n"
           "if TYPE_CHECKING:\n"
           "    from distgrad.hidden import T\n"
           "else:\n"
           "    import distgrad.shown\n"
           "def f():\n"
           "    from distgrad.late import g\n"
           "class C:\n"
           "    def m(self):\n"
           "        import distgrad.x.y.deeper\n")
    p = tmp_path / "mod.py"
    p.write_text(src)
    modules = {k: Path() for k in ["distgrad.x", "distgrad.x.y", "distgrad.x.z", "distgrad.x.w",
                                    "distgrad.hidden", "distgrad.shown", "distgrad.late",
                                    "distgrad.x.mod"]}
    assert import_edges("distgrad.x.mod", p, modules) == {
        "distgrad.x.y", "distgrad.x.z", "distgrad.x", "distgrad.x.w", "distgrad.shown", "distgrad.late"}


def test_no_import_cycle():
    found = cycles(import_graph())
    assert found == [], "import cycles among distgrad modules:\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_report_not_reachable_from_training_code():
    graph = import_graph()
    roots = [r for r in TRAINING_ROOTS if r in graph]
    roots += [m for m in graph if m.startswith(("distgrad.engines.", "distgrad.export."))]
    assert len(roots) > len(TRAINING_ROOTS)
    bad = sorted(m for m in reachable(graph, roots) if m == "distgrad.report" or m.startswith("distgrad.report."))
    assert bad == [], f"training-time modules reach the offline report: {bad}"


def test_report_not_loaded_at_training_time():
    # the same check as loaded modules, in a fresh interpreter: the package, the instrument and
    # every exporter imported (TensorBoard's sink too), then sys.modules inspected
    code = ("import json, sys\n"
            "import distgrad, distgrad.core.instrument, distgrad.api\n"
            "import distgrad.export.prometheus, distgrad.export.jsonl, distgrad.export.tensorboard\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('distgrad'))))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    loaded = json.loads(out.strip().splitlines()[-1])
    assert "distgrad.core.instrument" in loaded
    assert [m for m in loaded if m.startswith("distgrad.report")] == []


def test_top_level_modules():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 8, top

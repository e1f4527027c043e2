"""The module import graph of ``hyper_parallel/`` has no cycle, and no private name crosses a package.

The graph is built statically with ``ast`` from every ``.py`` file under ``hyper_parallel/``:
an edge ``a -> b`` for every ``import b`` / ``from b import x`` in ``a`` at any depth (module
level, inside functions, under ``if TYPE_CHECKING``), where ``from pkg import sub`` counts as
an edge to ``pkg.sub`` when ``sub`` is a module. Package ``__init__`` modules are nodes of
their own (``pkg``). Implicit parent-package imports are not edges (every submodule would
otherwise "import" its package). A lazy import inside a function still counts: lazy imports
that only break a cycle hide it, they do not remove it.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "hyper_parallel")
PKG = "hyper_parallel"

# Exceptions (an edge allowed to close a cycle, a private name allowed across packages): none.
# Add one only with a comment naming the change that removes it.
ALLOWED_CYCLE_EDGES: set = set()          # none: every former exception was fixed at its source
ALLOWED_PRIVATE_IMPORTS: set = set()


def _modules(root: str = ROOT) -> dict:
    mods = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
            is_pkg = rel.endswith(".__init__")
            name = rel[: -len(".__init__")] if is_pkg else rel
            mods[name] = (path, is_pkg)
        for f in files:     # compiled extension modules (hyper_parallel._C): leaves of the graph
            if f.endswith((".so", ".pyd")):
                rel = os.path.relpath(os.path.join(dirpath, f.split(".")[0]), os.path.dirname(root))
                mods.setdefault(rel.replace(os.sep, "."), (None, False))
    return mods


def _imports(name: str, path: str, is_pkg: bool, mods: dict):
    """Yield (target module, imported names or None, lineno) for every import in the file."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = name if is_pkg else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in mods:
                    yield sub, None, node.lineno
                else:
                    yield mod, a.name, node.lineno


def _private_members(path: str) -> set:
    """Private (not dunder) names a file's classes define: methods and class-body assignments."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    out = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in cls.body:
            names = [node.name] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else [
                t.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)]
            out |= {n for n in names if n.startswith("_") and not n.startswith("__")}
    return out


def _private_attribute_uses(path: str) -> list:
    """(line, attr) for every ``<expr>._attr`` (not dunder) on anything but ``self`` / ``cls``."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    return [(node.lineno, node.attr) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]


def _graph(root: str = ROOT, pkg: str = PKG):
    mods = _modules(root)
    edges: dict = {m: set() for m in mods}
    private: list = []
    for name, (path, is_pkg) in mods.items():
        if path is None:
            continue
        src_pkg = name if is_pkg else name.rpartition(".")[0]
        for target, attr, line in _imports(name, path, is_pkg, mods):
            if not target.startswith(pkg):
                continue
            while target not in mods and "." in target:     # `import a.b.c` of a non-module attr
                target = target.rpartition(".")[0]
            if target == name:
                continue
            edges[name].add(target)
            if attr and attr.startswith("_") and not attr.startswith("__"):
                dst_pkg = target if mods[target][1] else target.rpartition(".")[0]
                if src_pkg != dst_pkg and (name, target, attr) not in ALLOWED_PRIVATE_IMPORTS:
                    private.append(f"{name}:{line} imports private {attr} from {target}")
    # a private member of a class of another package, used where no class of this package defines it
    members: dict = {}          # package -> private member names its classes define
    for name, (path, is_pkg) in mods.items():
        if path is not None:
            members.setdefault(name if is_pkg else name.rpartition(".")[0], set()).update(_private_members(path))
    for name, (path, is_pkg) in mods.items():
        if path is None:
            continue
        src_pkg = name if is_pkg else name.rpartition(".")[0]
        for line, attr in _private_attribute_uses(path):
            owners = sorted(p for p, names in members.items() if attr in names)
            if owners and src_pkg not in owners and (name, owners[0], attr) not in ALLOWED_PRIVATE_IMPORTS:
                private.append(f"{name}:{line} uses private member {attr} of a class of {owners[0]}")
    return edges, private


def _cycles(edges: dict) -> list:
    """Strongly connected components with more than one module (Tarjan), each as a sorted list."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if (v, w) in ALLOWED_CYCLE_EDGES:
                continue
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

    import sys
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 10000))
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(old)
    return out


def _describe(comp: list, edges: dict) -> str:
    inside = set(comp)
    lines = [f"cycle among {len(comp)} modules:"]
    for m in comp:
        for t in sorted(edges[m] & inside):
            lines.append(f"  {m} -> {t}")
    return "\n".join(lines)


def test_graph_sees_known_edges():
    """The static graph finds real imports (module level, relative, lazy in a function)."""
    edges, _ = _graph()
    cp = "hyper_parallel.distributed.context_parallel"
    assert f"{cp}.registry" in edges[f"{cp}.wrappers.entry_points"]
    assert f"{cp}.catalogue" in edges[f"{cp}.methods.factory"]
    assert f"{cp}.wrappers.heads" in edges[f"{cp}.wrappers"]


def test_lazy_import_cycle_and_private_name_are_found(tmp_path):
    """A cycle closed only by an import inside a function, and a private name taken from
    another package, are both reported (synthetic package)."""
    pkg = tmp_path / "toy"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub.c import _hidden\n    return _hidden\n")
    (pkg / "sub" / "c.py").write_text("import toy.a\n_hidden = 1\n\nclass R:\n    def _resolve(self):\n"
                                      "        pass\n")
    (pkg / "d.py").write_text("from .sub.c import R\n\ndef g(r):\n    return r._resolve()\n")
    edges, private = _graph(str(pkg), "toy")
    assert edges["toy.b"] == {"toy.sub.c"} and edges["toy.sub.c"] == {"toy.a"}
    assert _cycles(edges) == [["toy.a", "toy.b", "toy.sub.c"]]
    assert sorted(private) == ["toy.b:2 imports private _hidden from toy.sub.c",
                               "toy.d:4 uses private member _resolve of a class of toy.sub"], private


def test_no_import_cycle():
    edges, _ = _graph()
    comps = _cycles(edges)
    print(f"{len(edges)} modules, {sum(len(v) for v in edges.values())} edges, {len(comps)} cycles")
    assert not comps, "\n".join(_describe(c, edges) for c in comps)


def test_cycle_detector_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_private_name_across_packages():
    _, private = _graph()
    assert not private, "\n".join(private)


def test_every_module_imports():
    """Every module of the package imports in a fresh interpreter (a stale path left by a move,
    e.g. ``strategies.base`` after the method folders, fails here rather than at a user's first
    declaration of that method). ``_C`` is the engine's extension, loaded through ``ops``."""
    import subprocess
    import sys

    code = ("import importlib, pkgutil, torch, hyper_parallel\n"
            "bad = []\n"
            "for m in pkgutil.walk_packages(hyper_parallel.__path__, 'hyper_parallel.'):\n"
            "    if m.name.endswith('._C'):\n"
            "        continue\n"
            "    try:\n"
            "        importlib.import_module(m.name)\n"
            "    except Exception as exc:\n"
            "        bad.append(f'{m.name}: {type(exc).__name__}: {exc}')\n"
            "print('\\n'.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert not out.stdout.strip(), out.stdout

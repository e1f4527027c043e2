"""Say each thing once: every CP method's registry name and every transformers model class name the
package knows is written in one place under ``hyper_parallel/``, and ``distributed/`` depends on
nothing under ``models/`` (by import or by an importable string).

A *name* is a string literal exactly equal to it (``ast``: docstrings and messages that mention it
in a sentence are prose, not a second definition). Its *place*:

* a built-in attention method: its row (the ``catalogue`` package) and its own folder
  ``methods/<strategy_module>/`` (the strategy the row names);
* a method a model family adds, and a model class: that family's folder ``models/<model_type>/``;
* a generic token-mixer core's method: its row and its module under ``mixers/``.

Model classes are the classes transformers defines in ``models/<model_type>/modeling_*.py`` whose
name starts with that model's name (``LlamaAttention``; not the generic ``Attention`` / ``MLP``).
The literals are read after the registries have been filled, from every family in the package.
"""
from __future__ import annotations

import ast
import collections
import os
import re

import pytest

import hyper_parallel  # noqa: F401  imports every family: the catalogue is complete
from hyper_parallel.distributed.context_parallel import catalogue

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "hyper_parallel")
CP = os.path.join("distributed", "context_parallel")

#: literals equal to a registry name that name something else, each with the reason
NOT_A_METHOD = {
    (os.path.join("distributed", "config.py"), "load_balance"):
        "a retired accelerator field of that name, refused with the wrapper that replaced it",
}


def _literals() -> dict:
    """relative file path -> list of the string constants in it."""
    out = {}
    for dirpath, _dirs, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                tree = ast.parse(open(path, encoding="utf-8").read(), path)
                out[os.path.relpath(path, PKG)] = [n.value for n in ast.walk(tree)
                                                   if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return out


def _place(rel: str) -> str:
    """The place a file belongs to: a family folder, a method folder, the catalogue, or the file."""
    parts = rel.split(os.sep)
    if parts[0] == "models" and len(parts) > 2:
        return os.path.join(*parts[:2])
    if rel.startswith(os.path.join(CP, "methods")) and len(parts) > 4:
        return os.path.join(*parts[:4])
    if rel.startswith(os.path.join(CP, "catalogue")):
        return os.path.join(CP, "catalogue")
    return rel


def _home(row) -> set:
    """Where ``row``'s name may be written."""
    mods = {o.module for o in row.offers if o.module}
    if row.kind == "attention":
        return {os.path.join(CP, "catalogue"), os.path.join(CP, "methods", row.strategy_module)}
    places = set()
    for m in mods:
        rel = m.split(".", 1)[1].replace(".", os.sep)
        rel = rel + ".py" if os.path.exists(os.path.join(PKG, rel + ".py")) else os.path.join(rel, "__init__.py")
        places.add(_place(rel))
    if all(m.startswith(catalogue.MIXERS_MODULE) for m in mods):   # a generic core: its row is in the catalogue
        places.add(os.path.join(CP, "catalogue"))
    return places


def _model_classes() -> set:
    import transformers

    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    names = set()
    for model in os.listdir(root):
        key = model.replace("_", "").lower()
        for f in os.listdir(os.path.join(root, model)) if os.path.isdir(os.path.join(root, model)) else ():
            if f.startswith("modeling_") and f.endswith(".py"):
                text = open(os.path.join(root, model, f), encoding="utf-8").read()
                names.update(c for c in re.findall(r"^class (\w+)\(", text, re.M)
                             if c.replace("_", "").lower().startswith(key))
    return names


def _where(lits: dict) -> dict:
    where = collections.defaultdict(set)
    for rel, values in lits.items():
        for v in values:
            where[v].add(rel)
    return where


def test_each_method_registry_name_is_written_in_its_home_only():
    where = _where(_literals())
    bad, seen = [], 0
    for row in catalogue.METHODS.values():
        home = _home(row)
        for name in {row.name} | {o.registry_name for o in row.offers if o.registry_name}:
            files = {f for f in where.get(name, ()) if (f, name) not in NOT_A_METHOD}
            seen += bool(files)
            stray = sorted(f for f in files if _place(f) not in home)
            if stray:
                bad.append(f"{name!r} (home {sorted(home)}) also written in {stray}")
    print(f"{len(catalogue.METHODS)} rows, {seen} registry names found written; stray: {len(bad)}")
    assert seen >= len(catalogue.METHODS), "the scan found no row's name: the scan is broken"
    assert not bad, "\n".join(bad)


def test_each_model_class_name_is_written_in_one_family_folder():
    classes = _model_classes()
    assert {"LlamaAttention", "FalconH1Mixer", "Lfm2ShortConv", "Qwen3_5GatedDeltaNet"} <= classes
    where = _where(_literals())
    named = {c: where[c] for c in classes if c in where}
    bad = [f"{c}: {sorted(files)}" for c, files in sorted(named.items())
           if len({_place(f) for f in files}) != 1 or not _place(next(iter(files))).startswith("models" + os.sep)]
    print(f"{len(named)} transformers model classes named in the package; outside one family folder: {len(bad)}")
    assert len(named) >= 20, sorted(named)
    assert not bad, "\n".join(bad)


def _imports_and_paths(path: str):
    """(what, line) for every import target and every importable dotted string in the file."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    package = rel[:-1]           # a module's package; an __init__'s own package
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                yield f"{mod}.{a.name}", node.lineno
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"[\w.]+", node.value):
            yield node.value, node.lineno


def test_distributed_depends_on_nothing_under_models():
    bad, checked = [], 0
    for dirpath, _dirs, files in os.walk(os.path.join(PKG, "distributed")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                checked += 1
                for target, line in _imports_and_paths(path):
                    if target == "hyper_parallel.models" or target.startswith("hyper_parallel.models."):
                        bad.append(f"{os.path.relpath(path, ROOT)}:{line}: {target}")
    print(f"{checked} modules under distributed/; references to hyper_parallel.models: {len(bad)}")
    assert checked > 50 and not bad, "\n".join(bad)


@pytest.mark.parametrize("relative", [True, False])
def test_the_reference_scan_sees_a_models_import(tmp_path, relative):
    """The scan itself: a relative and an importlib-string reference to models/ are both found."""
    pkg = tmp_path / "hyper_parallel" / "distributed"
    pkg.mkdir(parents=True)
    src = ("from ..models import llama\n" if relative
           else "import importlib\nimportlib.import_module('hyper_parallel.models.llama')\n")
    (pkg / "probe.py").write_text(src)
    global ROOT
    saved, ROOT = ROOT, str(tmp_path)
    try:
        found = [t for t, _ in _imports_and_paths(str(pkg / "probe.py")) if t.startswith("hyper_parallel.models")]
    finally:
        ROOT = saved
    assert found, src


def test_every_family_folder_is_imported_by_the_package():
    """``hyper_parallel.models`` lists its families by hand (their order is the catalogue's and the
    messages'); a folder it forgets would never register. In a fresh interpreter (no test has
    imported a family itself), every ``models/<model_type>/`` package is imported once
    ``hyper_parallel`` is."""
    import json
    import subprocess
    import sys

    root = os.path.join(PKG, "models")
    folders = sorted(d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "__init__.py")))
    probe = ("import json, sys, hyper_parallel; "
             "print(json.dumps(sorted(m.split('.')[2] for m in sys.modules if m.count('.') == 2 "
             "and m.startswith('hyper_parallel.models.'))))")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    imported = set(json.loads(res.stdout.strip().splitlines()[-1]))
    missing = [d for d in folders if d not in imported]
    print(f"{len(folders)} family folders; not imported by hyper_parallel.models: {missing}")
    assert len(folders) >= 20 and not missing, missing

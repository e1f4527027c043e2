"""docs/architecture.md matches the tree: every file path it names exists, it names no absolute
path, and the claims about generation and the plan pipeline hold in the code."""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "architecture.md")
TOP = ("docs/", "tests/", "examples/", "csrc/", "scripts/", "benchmarks/", "shared/")


def _doc() -> str:
    return open(DOC, encoding="utf-8").read()


def _code_paths_text() -> str:
    """The doc less its design-name glossary (names of the design's files, not of ours)."""
    return _doc().split("Design names -> code:")[0]


def _basenames() -> set:
    out = set()
    for d in ("hyper_parallel", "docs", "tests", "csrc", "examples", "scripts", "benchmarks"):
        for _dirpath, _dirs, files in os.walk(os.path.join(ROOT, d)):
            out.update(files)
    return out | set(os.listdir(ROOT))


def _exists(path: str, basenames: set) -> bool:
    path = path.split("::")[0]
    if path.startswith("shared/"):          # the design beside the checkout, not in it
        return True
    if "/" not in path:                     # a bare file name: some file of the tree has it
        return path in basenames
    candidates = [os.path.join(ROOT, path)] if path.startswith(TOP) else [
        os.path.join(ROOT, "hyper_parallel", path), os.path.join(ROOT, "hyper_parallel", "distributed", path),
        os.path.join(ROOT, "hyper_parallel", "distributed", "context_parallel", path)]
    return any(os.path.exists(c) for c in candidates)


def test_every_named_file_exists():
    text = _code_paths_text()
    names = set(re.findall(r"`([\w./<>-]+\.(?:py|md|h|cpp|yaml|sh))(?:::\w+)?`", text))
    names |= set(re.findall(r"\b((?:[\w-]+/)+[\w-]+\.py)\b", text))
    # the recipes' placeholders (my.py, <model_type>) name files a reader would add
    names = {n for n in names if "<" not in n and "*" not in n and not os.path.basename(n).startswith("my.")}
    assert len(names) > 40, sorted(names)
    basenames = _basenames()
    missing = sorted(n for n in names if not _exists(n, basenames))
    print(f"{len(names)} paths named, {len(missing)} missing")
    assert not missing, missing


def test_no_absolute_path():
    bad = re.findall(r"(?<![\w.])/(?:work|home|root|tmp|usr)/\S*", _doc())
    assert not bad, bad


def test_plan_is_built_once_in_the_setup_and_applied_by_the_trainer():
    """The doc's 'one plan per run': the set-up plans, the trainer applies ``setup.plan`` and
    does not plan again."""
    import inspect

    from hyper_parallel.distributed import infrastructure
    from hyper_parallel.trainer import base

    assert "ShardingPlanner(" in inspect.getsource(infrastructure.setup_distributed)
    src = inspect.getsource(base)
    assert "ShardingPlanner" not in src and "PlanOverrideResolver" not in src
    assert "self.setup.plan" in inspect.getsource(base.BaseTrainer.parallelize)


def test_entry_points_are_written_by_the_factory_only():
    """Recipe 1: no entry point is written by hand — the entry modules define no function."""
    import ast

    wrappers = os.path.join(ROOT, "hyper_parallel", "distributed", "context_parallel", "wrappers")
    for name in ("entry_points.py", "async_entry_points.py", "__init__.py"):
        tree = ast.parse(open(os.path.join(wrappers, name), encoding="utf-8").read())
        defs = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        assert not defs, (name, defs)

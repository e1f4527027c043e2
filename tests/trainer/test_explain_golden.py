"""``hyper-train CONFIG --explain`` on every example config equals its golden copy
(``tests/trainer/golden_explain/``): the plan, the per-rank bytes, the communication and the work
spread are a pure function of the config. The resident-set figures measure this process and are
compared up to their numbers, the token store's progress lines (cold cache only) not at all. A config reading the documents ``scripts/build_example_data.py``
writes (``examples/data/stdlib/``: built from this Python's standard library, absent in a fresh
clone) reads the shipped slice of them instead, so the first batch is the same everywhere.
``HYPER_PARALLEL_UPDATE_GOLDEN=1`` rewrites the copies (review the diff)."""
from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import yaml

from . import _workers as W

GOLDEN = Path(__file__).parent / "golden_explain"
EXAMPLES = sorted(p for d in ("examples", "examples/cp") for p in (Path(W.ROOT) / d).glob("*.yaml"))
GENERATED = "examples/data/stdlib/"                  # what scripts/build_example_data.py writes
SHIPPED_SLICE = "examples/data/stdlib_small.jsonl"   # a slice of it, in the repository


#: the token store's progress lines: printed only when its cache is cold, with its path and a time
_CACHE_LINES = ("first run on these files:", "tokenized ")


def _mask(text: str) -> str:
    """The lines with this process's resident set keep their words, not their numbers; the token
    store's progress lines are dropped."""
    return "\n".join(re.sub(r"\d+\.\d+ GB", "<GB>", line) if "resident set" in line else line
                     for line in text.splitlines() if not line.startswith(_CACHE_LINES))


def _explain(path: Path) -> str:
    from hyper_parallel.trainer import cli

    files = (yaml.safe_load(path.read_text()).get("data") or {}).get("files") or []
    overrides = [f"data.files=[{SHIPPED_SLICE}]"] if any(str(f).startswith(GENERATED) for f in files) else []
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main([str(path.relative_to(W.ROOT)), "--explain", *overrides])
    assert rc == 0, (path, rc)
    return out.getvalue()


def test_explain_of_every_example_equals_its_golden_copy(monkeypatch):
    monkeypatch.chdir(W.ROOT)
    assert len(EXAMPLES) >= 30, EXAMPLES
    update = os.environ.get("HYPER_PARALLEL_UPDATE_GOLDEN") == "1"
    differ = []
    for path in EXAMPLES:
        got = _explain(path)
        golden = GOLDEN / f"{path.parent.name}__{path.stem}.txt"
        if update:
            golden.write_text(got)
        if not golden.exists() or _mask(golden.read_text()) != _mask(got):
            differ.append(path.name)
    print(f"{len(EXAMPLES)} example configs explained; differing from the golden copy: {differ}")
    assert not differ, f"--explain output changed for {differ} (HYPER_PARALLEL_UPDATE_GOLDEN=1 rewrites the copies)"

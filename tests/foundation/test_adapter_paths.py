"""Each async model adapter is one module, ``models/<model_type>/async_cp.py``, and the design's public
``_target_`` path ``hyper_parallel.models.<model_type>.adapter.distributed.context_parallel_async``
still imports it in a fresh interpreter (an import alias, no folders on disk)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from hyper_parallel.distributed.context_parallel import catalogue
from hyper_parallel.models.handoff_attention import adapter_module

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_PROBE = r"""
import importlib, json, sys
from hyper_parallel.distributed.context_parallel import catalogue
from hyper_parallel.models.handoff_attention import adapter_module
out = {}
for arch in catalogue.async_adapters():
    public = adapter_module(arch)
    mod = importlib.import_module(public)
    targets = [catalogue.async_entry_name(m.name, arch) for m in catalogue.async_methods()]
    out[arch] = {"file": mod.__file__, "name": mod.__name__,
                 "modules": [getattr(mod, t).__module__ for t in targets], "all": list(mod.__all__)}
    exec(f"from {public} import SPEC as _spec")
    assert _spec.arch == arch
print(json.dumps(out))
"""


def test_public_adapter_paths_resolve_to_one_module_per_model():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert sorted(got) == sorted(catalogue.async_adapters())
    for arch, r in got.items():
        public = adapter_module(arch)
        assert os.path.relpath(r["file"], ROOT) == os.path.join("hyper_parallel", "models", arch, "async_cp.py"), r
        assert r["name"] == f"hyper_parallel.models.{arch}.async_cp"
        assert r["modules"] and set(r["modules"]) == {public}, r      # qualnames unchanged by the move
        assert r["all"][0] == "SPEC" and len(r["all"]) == 1 + len(catalogue.async_methods())
        assert not os.path.exists(os.path.join(ROOT, "hyper_parallel", "models", arch, "adapter")), arch

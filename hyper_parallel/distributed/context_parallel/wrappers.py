"""Built-in CP wrappers (public ``_target_`` API). Bodies are implemented by the wrappers issue.

Paths fixed by the design (section 3.1.1):
  hyper_parallel.distributed.context_parallel.wrappers.sdpa_hf_cp_wrapper
  ...sdpa_hf_ulysses_cp_wrapper, ...sdpa_hf_hybrid_cp_wrapper(ulysses_degree),
  ...sdpa_hf_load_balance_cp_wrapper, and the sdpa_qkv_* twins.
"""
from __future__ import annotations

from .registry import inner_wrapper, register_inner_wrapper


def _not_yet(name):
    def forward(*args, **kwargs):
        raise NotImplementedError(f"{name}: the wrapper body lands with the wrappers issue")
    return forward


@inner_wrapper(method="colossal", style="hf")
def sdpa_hf_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Sync Colossal (K/V AllGather) for HF ``forward(hidden_states)`` + SDPA attention."""
    return _not_yet("sdpa_hf_cp_wrapper")


register_inner_wrapper("sdpa_hf", sdpa_hf_cp_wrapper)

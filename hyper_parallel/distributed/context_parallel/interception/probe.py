"""Probing a module's original forward on tiny dummy inputs (:func:`probe_module`,
:func:`hf_probe_inputs`): which attention calls it makes, with what; nothing computed or sent."""
from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Optional

import torch
import torch.nn as nn

from .hf_interface import ensure_hf_interface_registered, install_private_config, interceptor_for
from .scope import AttentionCall, CPInterceptionError

log = logging.getLogger("hyper_parallel.distributed.context_parallel.interception")


def _param_sample(module: nn.Module):
    for p in module.parameters():
        return p
    return None


def _rotary_dims(module: nn.Module, head_dim: int) -> list:
    """Candidate cos/sin widths: the head dim, then a partial rotary width (Phi, StableLM, ...)."""
    dims = [head_dim]
    cfg = getattr(module, "config", None)
    for attr in ("rotary_ndims", "rotary_dim", "rotary_emb_dim"):
        v = getattr(module, attr, None)
        if isinstance(v, int) and v > 0:
            dims.append(v)
    qk_rope = getattr(cfg, "qk_rope_head_dim", None) if cfg is not None else None
    if isinstance(qk_rope, int) and qk_rope > 0:
        dims.append(qk_rope)
    rope = getattr(cfg, "rope_parameters", None) if cfg is not None else None
    frac = getattr(cfg, "partial_rotary_factor", None) if cfg is not None else None
    if frac is None and isinstance(rope, dict):
        frac = rope.get("partial_rotary_factor")
    if isinstance(frac, (int, float)) and 0 < frac < 1:
        dims.append(int(head_dim * frac))
    dims.append(head_dim // 2)       # rotate-half layouts that pass half-width cos/sin (gpt-oss)
    return list(dict.fromkeys(d for d in dims if d > 0))


def hf_probe_inputs(module: nn.Module, seq: int = 2, rot_dim: Optional[int] = None) -> Optional[dict]:
    """Tiny inputs for an HF ``forward(hidden_states, position_embeddings, attention_mask, ...)``.

    Required parameters the probe cannot know (e.g. Falcon's ``alibi``, ``layer_past``) get None.
    """
    p = _param_sample(module)
    if p is None or p.device.type == "meta" or type(p).__name__ == "DTensor" or hasattr(p, "_local_tensor"):
        return None
    cfg = getattr(module, "config", None)
    hidden = getattr(cfg, "hidden_size", None)
    if hidden is None:
        q_proj = getattr(module, "q_proj", None)
        hidden = getattr(q_proj, "in_features", None)
    if hidden is None:      # no config / q_proj (e.g. a linear attention): its own width, else its first Linear's
        hidden = getattr(module, "hidden_size", None) or next(
            (m.in_features for m in module.children() if isinstance(m, nn.Linear)), None)
    head_dim = getattr(module, "head_dim", None)
    if head_dim is None and cfg is not None and getattr(cfg, "qk_rope_head_dim", None):
        head_dim = cfg.qk_rope_head_dim
    if head_dim is None and cfg is not None:      # e.g. a linear attention keeping no head_dim of its own
        heads = getattr(cfg, "num_attention_heads", None)
        head_dim = getattr(cfg, "head_dim", None) or (hidden // heads if hidden and heads else None)
    if hidden is None or head_dim is None:
        return None
    rot = rot_dim or head_dim
    params = inspect.signature(module.forward).parameters
    kwargs: dict = {"hidden_states": torch.zeros(1, seq, hidden, dtype=p.dtype, device=p.device)}
    if "position_embeddings" in params:
        kwargs["position_embeddings"] = (torch.ones(1, seq, rot, dtype=p.dtype, device=p.device),
                                         torch.zeros(1, seq, rot, dtype=p.dtype, device=p.device))
    if "attention_mask" in params:
        kwargs["attention_mask"] = None
    if "position_ids" in params:
        kwargs["position_ids"] = torch.arange(seq, device=p.device)[None]
    for name, par in params.items():
        if name not in kwargs and par.default is inspect.Parameter.empty and par.kind in (
                par.POSITIONAL_OR_KEYWORD, par.KEYWORD_ONLY):
            kwargs[name] = None
    return kwargs


@dataclasses.dataclass
class ProbeResult:
    """What a probe forward of a module's original forward did (nothing computed, nothing sent)."""

    count: int                           # attention calls intercepted
    route: str                           # "hf_interface" | "sdpa" | "none"
    calls: list = dataclasses.field(default_factory=list)    # AttentionCall (train mode)


def _probe_once(module: nn.Module, primitive: str, owner: str, rot_dim):
    kwargs = hf_probe_inputs(module, rot_dim=rot_dim)
    if kwargs is None:
        return None
    calls: list = []

    def zeros(call: AttentionCall) -> torch.Tensor:
        calls.append(call)
        q, v = call.q, call.v
        return q.new_zeros(q.shape[0], q.shape[1], q.shape[2], v.shape[-1])

    undo = None
    was_training = module.training
    try:
        if primitive in ("hf_interface",):
            ensure_hf_interface_registered()
            try:
                undo = install_private_config(module)
            except CPInterceptionError:
                return 0, []          # no HF config to route: the interface route sees no call
        module.train(True)     # the dropout the module passes in training is what CP must honour
        with torch.no_grad(), interceptor_for(primitive)(owner, module, zeros, max_calls=1 << 30,
                                                          check=False) as scope:
            module.forward(**kwargs)
        return scope.count, calls
    finally:
        module.train(was_training)
        if undo is not None:
            undo()


def probe_module(module: nn.Module, primitive: str, owner: str = "") -> Optional[ProbeResult]:
    """Run the module's *original* forward on tiny dummy inputs (train mode) and record its calls.

    ``primitive`` "hf_any" tries the HF attention-interface route first (private config naming
    :data:`HF_CP_INTERFACE`: the call carries mask, scaling, dropout, sliding_window, softcap,
    sinks) and falls back to direct SDPA calls (the module's own config, e.g. Falcon's
    ``_attn_implementation == "sdpa"`` branch); the route that saw calls is returned.
    Returns None when the module cannot be probed (no HF signature, meta/DTensor parameters,
    or its forward raised for reasons unrelated to the attention call; logged as a WARNING).
    """
    head_dim = getattr(module, "head_dim", None)
    dims = _rotary_dims(module, head_dim) if isinstance(head_dim, int) else [None]
    routes = ["hf_interface", "sdpa"] if primitive == "hf_any" else [primitive]
    if primitive == "hf_any" and getattr(module, "config", None) is None:
        routes = ["sdpa"]
    last_exc = None
    for route in routes:
        for rot in dims:
            try:
                res = _probe_once(module, route, owner, rot)
            except CPInterceptionError:
                raise
            except Exception as exc:  # noqa: BLE001 - try the next rotary width / route
                last_exc = exc
                continue
            if res is None:
                return None
            count, calls = res
            if count:
                return ProbeResult(count, route, calls)
            break     # ran without a call: try the next route
    if last_exc is not None:
        log.warning("%s: the probe forward of %s (primitive=%s) raised %s: %s; the misfire / "
                    "double-interception preflight check is skipped for this module (it is still "
                    "detected at the first real forward)", owner or "CP wrapper", type(module).__name__,
                    primitive, type(last_exc).__name__, last_exc)
        return None
    return ProbeResult(0, "none", [])

"""Tensor-parallel placement plans for decoder layers, and the per-parameter TP record.

A plan maps a decoder-layer-relative FQN to a style::

    colwise  nn.Linear output features sharded over tp (weight Shard(0), bias Shard(0));
             input Replicate, output a local tensor of out_features / tp
    rowwise  nn.Linear input features sharded over tp (weight Shard(1), bias Replicate);
             input the local shard, output all-reduced (Replicate) local tensor

Built-in plans (Llama / Qwen2 / Qwen3 / Mistral dense decoder layers)::

    self_attn.q_proj/k_proj/v_proj: colwise    self_attn.o_proj: rowwise
    mlp.gate_proj/up_proj:           colwise    mlp.down_proj:    rowwise

Everything else (embeddings, norms, QK-norm, lm_head) stays replicated. Attention heads are
split with the projections: the applier records the TP-local head counts on each attention
module (``__hp_local_heads__``) and divides ``num_heads``-style attributes, so CP wrappers
validate against the heads this rank actually computes. HF attention reshapes with ``-1``
heads, so no forward change is needed.

:class:`TPGradInfo` (returned by ``apply_sharding_plan``) says, per parameter FQN, whether
the parameter is TP-sharded (its local gradient-norm^2 must be summed over the tp group) or
replicated over tp (count it once) — the domain for gradient-norm clipping.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator, Mapping, Optional

import torch.nn as nn

TP_STYLES = ("colwise", "rowwise")

DENSE_DECODER_TP_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}

_TP_PLANS: dict[str, dict] = {arch: dict(DENSE_DECODER_TP_PLAN) for arch in ("llama", "qwen2", "qwen3", "mistral")}


def register_tp_plan(architecture: str, layer_plan: Mapping[str, str]) -> None:
    """Register (or replace) the decoder-layer TP plan of an HF ``model_type``."""
    bad = {k: v for k, v in layer_plan.items() if v not in TP_STYLES}
    if bad:
        raise ValueError(f"register_tp_plan({architecture!r}): styles must be one of {TP_STYLES}, got {bad}")
    _TP_PLANS[architecture] = dict(layer_plan)


def get_tp_plan(model: nn.Module) -> Optional[dict]:
    cfg = getattr(model, "config", None)
    arch = getattr(cfg, "model_type", None)
    return dict(_TP_PLANS[arch]) if arch in _TP_PLANS else None


def find_decoder_layers(model: nn.Module) -> list[str]:
    """FQNs of the decoder layers: the entries of the ``ModuleList`` holding the attention layers.

    Prefers HF's ``model.layers``-style list (children whose class ends with ``DecoderLayer``
    or which own a ``self_attn``); falls back to every module whose class name ends with
    ``DecoderLayer``.
    """
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and all(
                type(c).__name__.endswith(("DecoderLayer", "Block")) or hasattr(c, "self_attn") for c in mod):
            return [f"{name}.{i}" if name else str(i) for i in range(len(mod))]
    return [n for n, m in model.named_modules() if n and type(m).__name__.endswith("DecoderLayer")]


def check_tp_plan(model: nn.Module, layers: list[str], plan: Mapping[str, str], tp_size: int) -> None:
    """Raise ValueError when a planned module is missing / not Linear / not divisible by tp."""
    names = dict(model.named_modules())
    for layer in layers:
        for rel, style in plan.items():
            fqn = f"{layer}.{rel}"
            mod = names.get(fqn)
            if mod is None:
                raise ValueError(f"TP plan names '{rel}' but decoder layer '{layer}' has no such submodule")
            if not isinstance(mod, nn.Linear):
                raise ValueError(f"TP plan entry '{fqn}' is a {type(mod).__name__}, expected nn.Linear")
            n = mod.out_features if style == "colwise" else mod.in_features
            what = "out_features" if style == "colwise" else "in_features"
            if n % tp_size:
                raise ValueError(f"'{fqn}' ({style}) has {what}={n}, not divisible by tp_size={tp_size}")


@dataclasses.dataclass(frozen=True)
class TPParamInfo:
    """How one parameter is laid out over the tp mesh."""

    fqn: str
    sharded: bool                 # True: each tp rank holds a distinct shard (sum norm^2 over tp)
    style: str                    # "colwise" | "rowwise" | "replicate"
    shard_dim: Optional[int]      # dim of the full parameter split over tp (None when replicated)


class TPGradInfo(Mapping):
    """``{parameter FQN: TPParamInfo}`` plus the tp mesh (``tp_size == 1``: everything replicated).

    Gradient-norm clipping: ``norm^2 = sum_tp(sum_{sharded} |g_local|^2) + sum_{replicated} |g|^2``
    (replicated gradients are identical on every tp rank; count them once).

    ``partial_grad``: replicated parameters that act on TP-local heads (inside an attention
    module, between the colwise q/k/v and the rowwise o projection, e.g. Qwen3's
    ``q_norm``/``k_norm``). Each tp rank's gradient of such a parameter covers only its own
    heads, so the trainer must SUM-all-reduce it over the tp group before clipping/stepping.
    """

    def __init__(self, infos: dict, tp_mesh=None, tp_size: int = 1, partial_grad=()):
        self._infos = dict(infos)
        self.tp_mesh = tp_mesh
        self.tp_size = tp_size
        self.partial_grad: list[str] = list(partial_grad)

    def __getitem__(self, fqn: str) -> TPParamInfo:
        return self._infos[fqn]

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    @property
    def sharded(self) -> list[str]:
        return [k for k, v in self._infos.items() if v.sharded]

    @property
    def replicated(self) -> list[str]:
        return [k for k, v in self._infos.items() if not v.sharded]

    def is_sharded(self, fqn: str) -> bool:
        return self._infos[fqn].sharded

    def __repr__(self) -> str:
        return f"TPGradInfo(tp_size={self.tp_size}, sharded={len(self.sharded)}, replicated={len(self.replicated)})"


def replicated_grad_info(model: nn.Module) -> TPGradInfo:
    return TPGradInfo({n: TPParamInfo(n, False, "replicate", None) for n, _ in model.named_parameters()})


def _adjust_heads(layer: nn.Module, tp_size: int) -> None:
    from .context_parallel.wrappers import module_heads

    for mod in layer.modules():
        has_heads = any(isinstance(getattr(mod, a, None), int) for a in ("num_heads", "num_attention_heads"))
        if not (hasattr(mod, "q_proj") and hasattr(mod, "k_proj")) and not has_heads:
            continue                                  # attention modules and their core submodules only
        hq, hk = module_heads(mod, tp_size)
        for attr in ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads"):
            val = getattr(mod, attr, None)
            if isinstance(val, int) and not isinstance(val, bool):
                setattr(mod, attr, val // tp_size)
        if hq is not None and hk is not None:
            mod.__hp_local_heads__ = (hq, hk)


def apply_tensor_parallel(model: nn.Module, tp_mesh, layers: list[str], plan: Mapping[str, str]) -> TPGradInfo:
    """``parallelize_module`` every decoder layer with ``plan`` on ``tp_mesh``; return the TP record."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp_size = tp_mesh.size()
    names = dict(model.named_modules())
    check_tp_plan(model, layers, plan, tp_size)
    placed: dict[str, tuple] = {}
    for layer_fqn in layers:
        layer = names[layer_fqn]
        _adjust_heads(layer, tp_size)
        styles = {rel: (ColwiseParallel() if s == "colwise" else RowwiseParallel()) for rel, s in plan.items()}
        parallelize_module(layer, tp_mesh, styles)
        for rel, s in plan.items():
            mod = names[f"{layer_fqn}.{rel}"]
            for pname, _ in mod.named_parameters(recurse=False):
                fqn = f"{layer_fqn}.{rel}.{pname}"
                if s == "colwise":
                    placed[fqn] = (True, "colwise", 0)
                elif pname == "weight":
                    placed[fqn] = (True, "rowwise", 1)
                else:
                    placed[fqn] = (False, "rowwise", None)   # rowwise bias is replicated
    infos = {}
    for n, _ in model.named_parameters():
        sharded, style, dim = placed.get(n, (False, "replicate", None))
        infos[n] = TPParamInfo(n, sharded, style, dim)
    partial = []
    for layer_fqn in layers:
        for sub, mod in names[layer_fqn].named_modules():
            if not (hasattr(mod, "q_proj") and hasattr(mod, "k_proj")):
                continue                              # attention modules only: heads are TP-local inside
            base = f"{layer_fqn}.{sub}" if sub else layer_fqn
            partial += [f"{base}.{n}" for n, _ in mod.named_parameters() if f"{base}.{n}" not in placed]
    return TPGradInfo(infos, tp_mesh, tp_size, partial_grad=partial)

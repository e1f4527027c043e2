"""Tensor-parallel placement plans for decoder layers, and the per-parameter TP record.

A plan maps a decoder-layer-relative FQN to a style::

    colwise  nn.Linear output features sharded over tp (weight Shard(0), bias Shard(0));
             input Replicate, output a local tensor of out_features / tp
    rowwise  nn.Linear input features sharded over tp (weight Shard(1), bias Replicate);
             input the local shard, output all-reduced (Replicate) local tensor
    replicated_with_grad_allreduce
             a module kept replicated whose parameters act on TP-local heads (Qwen3/Gemma3
             q_norm/k_norm): listed in ``TPGradInfo.partial_grad`` (gradient SUM over tp)

Where the plan comes from (:func:`get_tp_plan`): a plan registered with :func:`register_tp_plan`
for the model's ``model_type`` (an explicit override), else what transformers declares
(``model.tp_plan`` / ``config.base_model_tp_plan``), translated by
:func:`~.tp_plan_translation.translate_tp_plan` (refused styles raise naming style and module).

Decoder layers (:func:`find_decoder_layers`) are what transformers declares as its unsplittable
blocks (``_no_split_modules``: ``LlamaDecoderLayer``, ``GPTNeoXLayer``, ``BloomBlock``, ...) that sit
in a ``ModuleList``; the layer-list heuristic is the fallback for models that declare none.

Everything not in the plan (embeddings, norms, lm_head, MoE experts) stays replicated. Attention
heads are split with the projections: the applier records the TP-local head counts on each
attention module of a layer it shards (``__hp_local_heads__``) and divides ``num_heads``-style
attributes, so CP wrappers validate against the heads this rank actually computes. HF attention
reshapes with ``-1`` heads, so no forward change is needed.

:class:`TPGradInfo` (returned by ``apply_sharding_plan``) says, per parameter FQN, whether
the parameter is TP-sharded (its local gradient-norm^2 must be summed over the tp group) or
replicated over tp (count it once) — the domain for gradient-norm clipping.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Iterator, Mapping, Optional

import torch.nn as nn

from .context_parallel.wrappers.heads import module_heads

log = logging.getLogger("hyper_parallel.tp")

TP_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")

# explicit overrides by model_type (register_tp_plan); models without one use their declared plan
_TP_PLANS: dict[str, dict] = {}


def register_tp_plan(architecture: str, layer_plan: Mapping[str, str]) -> None:
    """Register (or replace) the decoder-layer TP plan of an HF ``model_type``; it overrides the
    plan the model declares."""
    bad = {k: v for k, v in layer_plan.items() if v not in TP_STYLES}
    if bad:
        raise ValueError(f"register_tp_plan({architecture!r}): styles must be one of {TP_STYLES}, got {bad}")
    _TP_PLANS[architecture] = dict(layer_plan)


def get_tp_plan(model: nn.Module, layers: Optional[list] = None) -> Optional[dict]:
    """The decoder-layer-relative TP plan of ``model``: the registered override for its
    ``model_type``, else its declared transformers plan translated onto ``layers`` (default:
    :func:`find_decoder_layers`); None when there is neither. Raises
    :class:`~.errors.CPConfigError` when the declared plan has a style that cannot be honoured."""
    from .tp_plan_translation import translate_tp_plan

    cfg = getattr(model, "config", None)
    arch = getattr(cfg, "model_type", None)
    if arch in _TP_PLANS:
        return dict(_TP_PLANS[arch])
    tr = translate_tp_plan(model, find_decoder_layers(model) if layers is None else layers)
    if tr is None or not tr.plan:
        return None
    if tr.replicated:
        log.info("TP plan from %s; left replicated (exact): %s", tr.source,
                 ", ".join(f"{k} ({v[0]})" for k, v in tr.replicated.items()))
    return dict(tr.plan)


def _no_split_classes(model: nn.Module) -> set:
    names: set = set()
    for m in model.modules():
        declared = getattr(m, "_no_split_modules", None)
        if isinstance(declared, (list, tuple, set)):
            names.update(str(n) for n in declared)
    return names


def decoder_layers_from_declaration(model: nn.Module) -> list[str]:
    """FQNs of the ``ModuleList`` entries whose class transformers declares unsplittable
    (``_no_split_modules`` of the model and its sub-models), outermost only, in module order."""
    classes = _no_split_classes(model)
    if not classes:
        return []
    out: list[str] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList):
            continue
        for key, child in mod.named_children():      # the keys, not positions (a pipeline stage keeps its layers' indices)
            fqn = f"{name}.{key}" if name else key
            if type(child).__name__ in classes and not any(fqn.startswith(o + ".") for o in out):
                out.append(fqn)
    return out


def find_decoder_layers(model: nn.Module) -> list[str]:
    """FQNs of the decoder layers (the TP, activation-checkpointing and FSDP2 units).

    First what transformers declares (:func:`decoder_layers_from_declaration`); then, for
    models that declare nothing, the first ``ModuleList`` whose children end with
    ``DecoderLayer``/``Block`` or own a ``self_attn``; then every ``*DecoderLayer`` module.
    A registered vision tower's blocks are not decoder layers (they run per rank on whole media,
    replicated: docs/vlm.md).
    """
    from .context_parallel.vision import vision_tower

    tower = vision_tower(model)
    declared = [f for f in decoder_layers_from_declaration(model) if tower is None or not tower.holds(f)]
    if declared:
        return declared
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and all(
                type(c).__name__.endswith(("DecoderLayer", "Block")) or hasattr(c, "self_attn") for c in mod):
            return [f"{name}.{key}" if name else key for key, _c in mod.named_children()]
    return [n for n, m in model.named_modules() if n and type(m).__name__.endswith("DecoderLayer")]


def check_tp_plan(model: nn.Module, layers: list[str], plan: Mapping[str, str], tp_size: int) -> None:
    """Raise ValueError when a planned entry matches no decoder layer, has an unknown style, is
    not an nn.Linear (colwise/rowwise) or is not divisible by tp. An entry may be absent from some
    layers (dense and MoE layers of one model differ); it must exist in at least one."""
    names = dict(model.named_modules())
    for rel, style in plan.items():
        if style not in TP_STYLES:
            raise ValueError(f"TP plan entry '{rel}' has style {style!r}; expected one of {TP_STYLES}")
        found = [f"{layer}.{rel}" for layer in layers if f"{layer}.{rel}" in names]
        if not found:
            first = layers[0] if layers else "<none>"
            raise ValueError(f"TP plan names '{rel}' but decoder layer '{first}' has no such submodule "
                             f"(nor does any of the {len(layers)} decoder layers)")
        if style == "replicated_with_grad_allreduce":
            continue
        for fqn in found:
            mod = names[fqn]
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

    def __repr__(self) -> str:
        return f"TPGradInfo(tp_size={self.tp_size}, sharded={len(self.sharded)}, replicated={len(self.replicated)})"


def replicated_grad_info(model: nn.Module) -> TPGradInfo:
    return TPGradInfo({n: TPParamInfo(n, False, "replicate", None) for n, _ in model.named_parameters()})


def _adjust_heads(layer: nn.Module, tp_size: int, colwise_parents=()) -> None:
    """Divide the head attributes of the layer's attention modules by tp and record
    ``__hp_local_heads__``. Attention modules: those with ``q_proj``/``k_proj``, an int head-count
    attribute, or a ``head_dim``/``head_size`` and a colwise-sharded child (fused QKV, e.g.
    GPT-NeoX's ``attention.query_key_value``; ``colwise_parents`` are their layer-relative FQNs)."""

    for sub, mod in layer.named_modules():
        has_heads = any(isinstance(getattr(mod, a, None), int) for a in ("num_heads", "num_attention_heads"))
        fused = sub in colwise_parents and any(isinstance(getattr(mod, a, None), int)
                                               for a in ("head_dim", "head_size"))
        if not (hasattr(mod, "q_proj") and hasattr(mod, "k_proj")) and not has_heads and not fused:
            continue                                  # attention modules and their core submodules only
        hq, hk = module_heads(mod, tp_size)
        for attr in ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads"):
            val = getattr(mod, attr, None)
            if isinstance(val, int) and not isinstance(val, bool):
                setattr(mod, attr, val // tp_size)
        if hq is not None and hk is not None:
            mod.__hp_local_heads__ = (hq, hk)


def apply_tensor_parallel(model: nn.Module, tp_mesh, layers: list[str], plan: Mapping[str, str]) -> TPGradInfo:
    """``parallelize_module`` every decoder layer with the entries of ``plan`` it has, on
    ``tp_mesh``; return the TP record.

    ``colwise`` -> ``ColwiseParallel()``, ``rowwise`` -> ``RowwiseParallel()`` (DTensor parameters,
    local activations); ``replicated_with_grad_allreduce`` modules stay replicated and their
    parameters join ``partial_grad`` together with every other replicated parameter of an
    attention module whose projections are sharded. Head attributes are divided by tp only in the
    layers where something was sharded."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp_size = tp_mesh.size()
    names = dict(model.named_modules())
    check_tp_plan(model, layers, plan, tp_size)
    placed: dict[str, tuple] = {}
    partial: list[str] = []
    sharded_layers = []
    for layer_fqn in layers:
        layer = names[layer_fqn]
        present = {rel: s for rel, s in plan.items() if f"{layer_fqn}.{rel}" in names}
        styles = {rel: (ColwiseParallel() if s == "colwise" else RowwiseParallel())
                  for rel, s in present.items() if s in ("colwise", "rowwise")}
        if not styles:
            continue
        sharded_layers.append(layer_fqn)
        _adjust_heads(layer, tp_size, {rel.rpartition(".")[0] for rel, s in present.items() if s == "colwise"})
        parallelize_module(layer, tp_mesh, styles)
        for rel, s in present.items():
            mod = names[f"{layer_fqn}.{rel}"]
            for pname, _ in mod.named_parameters(recurse=s == "replicated_with_grad_allreduce"):
                fqn = f"{layer_fqn}.{rel}.{pname}"
                if s == "replicated_with_grad_allreduce":
                    partial.append(fqn)
                elif s == "colwise":
                    placed[fqn] = (True, "colwise", 0)
                elif pname == "weight":
                    placed[fqn] = (True, "rowwise", 1)
                else:
                    placed[fqn] = (False, "rowwise", None)   # rowwise bias is replicated
    infos = {}
    for n, _ in model.named_parameters():
        sharded, style, dim = placed.get(n, (False, "replicate", None))
        infos[n] = TPParamInfo(n, sharded, style, dim)
    for layer_fqn in sharded_layers:
        for sub, mod in names[layer_fqn].named_modules():
            if not (hasattr(mod, "q_proj") and hasattr(mod, "k_proj")):
                continue                              # attention modules only: heads are TP-local inside
            base = f"{layer_fqn}.{sub}" if sub else layer_fqn
            partial += [f"{base}.{n}" for n, _ in mod.named_parameters()
                        if f"{base}.{n}" not in placed and f"{base}.{n}" not in partial]
    return TPGradInfo(infos, tp_mesh, tp_size, partial_grad=partial)

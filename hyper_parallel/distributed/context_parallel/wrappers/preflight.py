"""Preflight checks of the built-in attention wrappers (before any collective).

What a module must look like for a style (:func:`check_style`, :func:`check_impl`), what is
refused statically (:func:`check_features`: attention dropout > 0, ALiBi;
:func:`check_core_features`: windows/softcap on the qkv styles), what an attention call may
carry (:func:`check_call`, at the probe and at every real call), and the probe forward
(:func:`probe`, :func:`check_probe`: a train-mode forward on a 2-token dummy input counting
attention calls — 0 = misfire, >1 = double interception). :func:`make_validate` assembles the
``validate`` hook of an entry point. Every check raises ValueError naming the wrapper (``who``),
the module and the fix. Local only: no collective.
"""
from __future__ import annotations

import inspect
import weakref

import torch
import torch.nn as nn

from .. import catalogue
from ..interception import AttentionCall, probe_module
from ..semantics import attention_chunk_size, mixer_hint, query_position_rescale, uncarried_attention_semantics
from .heads import check_heads

__all__ = ["check_style", "check_impl", "check_features", "check_core_features", "check_call",
           "check_core_call", "probe", "check_probe", "make_validate"]

_HF_PARAM = "hidden_states"
_QKV_NAMES = (("q", "query", "q_states", "query_states"), ("k", "key", "k_states", "key_states"),
              ("v", "value", "v_states", "value_states"))


def _forward_params(module: nn.Module) -> list:
    return list(inspect.signature(module.forward).parameters.values())


def check_style(style: str, module: nn.Module, who: str) -> None:
    if getattr(module, "__hp_cp_wrapped__", None):
        raise ValueError(f"{who}: {type(module).__name__} already carries CP wrapper "
                         f"{module.__hp_cp_wrapped__}; one attention takes exactly one wrapper")
    params = _forward_params(module)
    names = [p.name for p in params]
    if style == "hf":
        if _HF_PARAM not in names:
            raise ValueError(
                f"{who}: {type(module).__name__}.forward{tuple(names)} has no 'hidden_states' parameter, so it is "
                "not an HF attention forward; use the *_qkv wrapper for forward(q, k, v, ...) modules or point "
                "inner_target at the HF attention module")
    else:
        pos = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:3]
        ok = len(pos) == 3 and all(p.name in allowed for p, allowed in zip(pos, _QKV_NAMES))
        if not ok:
            raise ValueError(
                f"{who}: {type(module).__name__}.forward{tuple(names)} does not start with (q, k, v) / "
                "(query, key, value); the *_qkv wrappers bind a forward(q, k, v, ...) core attention — use the "
                "*_hf wrapper for HF forward(hidden_states, ...) modules")


def check_impl(primitive: str, module: nn.Module, who: str, wrapper_kind: str) -> None:
    cfg = getattr(module, "config", None)
    impl = getattr(cfg, "_attn_implementation", None) if cfg is not None else None
    if impl is None:
        return
    # sdpa_hf*: SDPA models, and eager models whose attention goes through transformers' attention
    # interface (Gemma2 softcap, gpt-oss sinks: transformers refuses SDPA for them) — the probe
    # then proves the module really calls the interface (an eager matmul attention misfires).
    allowed = ("sdpa", "eager") if primitive == "hf_any" else (
        ("sdpa",) if primitive == "sdpa" else ("flex_attention",))
    if impl not in allowed:
        want = allowed[0]
        # the HF-forward style that intercepts what this implementation calls
        primitive_of = {"flex_attention": "hf_interface", "sdpa": "hf_any", "eager": "hf_any"}.get(impl)
        other = next((s.prefix for s in catalogue.STYLES.values() if s.primitive == primitive_of), None)
        hint = (f"declare the {other}* wrapper instead" if other else
                f"build the model with attn_implementation='{want}'")
        raise ValueError(
            f"{who}: {wrapper_kind} wrappers need attn_implementation='{want}', but "
            f"{type(module).__name__} uses attn_implementation='{impl}'; {hint}")


def _dropout_p(obj) -> float:
    if isinstance(obj, nn.Dropout):
        return float(obj.p)
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        return float(obj)
    return 0.0


def check_features(module: nn.Module, who: str) -> None:
    """Static refusals: attention-probability dropout > 0 and ALiBi (an additive position bias).

    Sliding windows, softcap and sinks are read from the attention call itself (the HF
    interface kwargs) and carried to the engine; a module that calls SDPA directly cannot
    carry them and is refused by the probe / at the call (:func:`check_call`).
    """
    cfg = getattr(module, "config", None)
    name = type(module).__name__
    for attr in ("attention_dropout", "attn_dropout", "attn_pdrop", "attention_probs_dropout_prob"):
        for owner, where in ((module, name), (cfg, "config")):
            val = getattr(owner, attr, None) if owner is not None else None
            p = _dropout_p(val)
            if p > 0:
                raise ValueError(
                    f"{who}: {where}.{attr}={val} ({name}): attention dropout > 0 is not supported by the CP "
                    f"attention (no dropout in the engine); set attention_dropout: 0.0 (attn_pdrop for GPT-2)")
    for what in uncarried_attention_semantics(module):
        raise ValueError(f"{who}: {name} computes {what}; no built-in CP attention method carries it, so CP "
                         "would compute something else — refused. Use accelerator.cp_size: 1 for this model, "
                         "or a model-specific CP wrapper that computes it")
    takes_alibi = "alibi" in inspect.signature(module.forward).parameters
    if (cfg is not None and getattr(cfg, "alibi", False) is True) or (
            takes_alibi and (cfg is None or not hasattr(cfg, "alibi"))):   # Bloom: always ALiBi
        raise ValueError(f"{who}: {name} uses ALiBi: its additive position bias arrives in "
                         "the attention mask, which CP does not carry (the engine refuses alibi_slopes); "
                         "ALiBi is not supported")


def check_module_position_semantics(module: nn.Module, who: str, where: str) -> None:
    """Refuse Llama 4 chunked attention / temperature tuning for a route (``where``) that cannot
    apply :func:`~.routes.carry_module_semantics` before its collectives."""
    chunk = attention_chunk_size(module)
    one = torch.zeros(1, dtype=torch.int64)
    if chunk is not None or query_position_rescale(module, one, one) is not None:
        what = (f"chunked attention (attention_chunk_size={chunk})" if chunk is not None else
                "attention temperature tuning (positions of the module's local input)")
        raise ValueError(f"{who}: {what} is not carried by {where}; use the synchronous *_hf wrapper "
                         "on the HF attention module")


def check_core_features(module: nn.Module, who: str) -> None:
    """qkv styles bind q/k/v only: a window or softcap on the module cannot be carried."""
    cfg = getattr(module, "config", None)
    if getattr(module, "sliding_window", None) is not None:
        raise ValueError(f"{who}: sliding-window attention (sliding_window={module.sliding_window}) is not "
                         "carried by the *_qkv wrappers; use the *_hf wrapper on the HF attention module")
    check_module_position_semantics(module, who, "the *_qkv wrappers (they see only q/k/v)")
    soft = getattr(cfg, "attn_logit_softcapping", None) if cfg is not None else None
    if soft:
        raise ValueError(f"{who}: attention logit softcapping ({soft}) is not carried by the *_qkv wrappers; "
                         "use the *_hf wrapper on the HF attention module")


def check_call(call: AttentionCall, module: nn.Module, who: str, *, at: str) -> None:
    """Refuse what a call carries that CP would not compute exactly; ``at`` names where (probe/run)."""
    name = type(module).__name__
    if call.extra:
        raise ValueError(f"{who}: {name}'s attention call passes {sorted(call.extra)} ({at}), which the CP "
                         "attention does not understand; refused rather than dropped")
    if call.dropout_p and (call.module_training or call.source == "sdpa"):
        raise ValueError(f"{who}: {name}'s attention call passes dropout={call.dropout_p} in training ({at}); "
                         "attention dropout > 0 is not supported by the CP attention")
    if not call.is_causal and call.source == "hf_interface":
        raise ValueError(f"{who}: {name} is non-causal (is_causal=False, {at}); the built-in CP wrappers "
                         "compute causal decoder attention only")
    if call.window is not None and (isinstance(call.window, bool) or not isinstance(call.window, int)
                                    or call.window < 1):
        raise ValueError(f"{who}: {name}'s attention call passes sliding_window={call.window!r} ({at}); "
                         "expected an int >= 1 or None")
    if call.source == "sdpa":
        win = getattr(module, "sliding_window", None)
        if win is not None:
            raise ValueError(f"{who}: {name} (sliding_window={win}) calls SDPA directly, so the window exists "
                             f"only inside its mask ({at}); CP cannot read it from the call. Route the module "
                             "through transformers' attention interface (ALL_ATTENTION_FUNCTIONS)")
        m = call.attn_mask
        if isinstance(m, torch.Tensor) and m.dtype.is_floating_point:
            bias = torch.isfinite(m) & (m != 0) & (m > torch.finfo(m.dtype).min / 2)
            if bool(bias.any()):
                raise ValueError(f"{who}: {name} passes SDPA an additive float mask with finite non-zero "
                                 f"values ({at}), e.g. ALiBi or a relative position bias; CP computes only "
                                 "causal + padding + documents + window and refuses the bias")


def check_core_call(call: AttentionCall, who: str, *, at: str) -> bool:
    """A ``*_qkv`` core's SDPA call: refuse what CP cannot carry; return the call's causality.

    ``is_causal`` is carried (True: causal on global positions; False: full attention over every
    global key), padding and documents always come from the CP batch. A mask the caller or the
    core passes (``attn_mask``) is refused: it is local to this rank's chunk, and what it encodes
    (padding, documents, a bias, a custom pattern) cannot be read back from it. Attention dropout
    and unknown arguments are refused. Local only: raises ValueError before any collective, the
    same on every rank (the call's structure, not its values, decides)."""
    if call.extra:
        raise ValueError(f"{who}: the attention call passes {sorted(call.extra)} ({at}), which the CP attention "
                         "does not understand; refused rather than dropped")
    if call.dropout_p:
        raise ValueError(f"{who}: attention dropout_p={call.dropout_p} ({at}) is not supported by the CP attention")
    m = call.attn_mask
    if m is not None:
        desc = f"a {m.dtype} tensor of shape {tuple(m.shape)}" if isinstance(m, torch.Tensor) else type(m).__name__
        raise ValueError(
            f"{who}: its scaled_dot_product_attention call passes attn_mask ({desc}, {at}); the *_qkv wrappers "
            "cannot carry a caller-given mask (it covers only this rank's chunk, and what it encodes cannot be "
            "read from it). Fix: call SDPA without attn_mask — is_causal=True for causal or is_causal=False for "
            "full attention — and give padding and packed documents through the CP batch (shard_batch_for_cp: "
            "attention_mask / seq_lens), or write a custom wrapper for this mask")
    return bool(call.is_causal)


_PROBE_CACHE: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def probe(primitive: str, module: nn.Module, who: str):
    cache = _PROBE_CACHE.setdefault(module, {})
    if primitive not in cache:
        cache[primitive] = probe_module(module, primitive, owner=who)
    return cache[primitive]


def check_probe(primitive: str, module: nn.Module, who: str, *, cp_size: int = 2) -> None:
    res = probe(primitive, module, who)
    what = {"sdpa": "torch.nn.functional.scaled_dot_product_attention",
            "hf_interface": "its HF attention interface",
            "hf_any": "torch.nn.functional.scaled_dot_product_attention"}[primitive]
    if res is None:
        return
    if res.count == 0:
        extra = " call (nor an HF attention-interface call)" if primitive == "hf_any" else " call"
        hint = "; " + mixer_hint(module, cp_size) if primitive == "hf_any" else ""
        raise ValueError(
            f"{who}: a probe forward of {type(module).__name__} made no {what}{extra}, so the wrapper would "
            f"never run (misfire); check attn_implementation and inner_target{hint}")
    if res.count > 1:
        raise ValueError(
            f"{who}: a probe forward of {type(module).__name__} made {res.count} {what} calls; the wrapper "
            "replaces exactly one (double interception) — use a model-specific wrapper or a narrower inner_target")
    for call in res.calls:
        check_call(call, module, who, at="preflight probe, train mode")


def make_validate(name: str, method: str, style: str):
    """The ``validate`` hook of built-in entry point ``name`` (catalogue ``method`` x ``style``):
    style/signature, ``attn_implementation``, static feature refusals, the method's head and
    degree rule (TP-local heads with ``tp_size``) and, for HF styles with ``probe``, the probe
    forward. Raises ValueError naming the entry point; no collective."""
    st = catalogue.STYLES[style]
    primitive, kind = st.primitive, st.kind

    def validate(target_module: nn.Module, *, cp_size: int, tp_size: int = 1, ulysses_degree=None,
                 probe: bool = True) -> None:
        who = name
        check_style(st.forward, target_module, who)
        if st.forward == "hf":
            check_impl(primitive, target_module, who, kind)
        check_features(target_module, who)
        if st.forward == "qkv":
            check_core_features(target_module, who)
        check_heads(method, target_module, cp_size, tp_size, ulysses_degree, who)
        if probe and st.forward == "hf":
            check_probe(primitive, target_module, who, cp_size=cp_size)

    validate.__qualname__ = f"validate[{name}]"
    return validate

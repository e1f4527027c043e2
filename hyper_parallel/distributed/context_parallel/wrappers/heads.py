"""Head counting and the head/degree rule of a CP method (public: adapters and TP use them).

* :func:`module_heads` — (q heads, kv heads) a rank computes for an attention module (TP-local);
* :func:`check_heads` — the catalogue's head and degree rules of a method for a module
  (:mod:`..catalogue`: Colossal / Head-Tail any GQA ratio; Ulysses (degree cp_size) and Hybrid
  (``1 < ulysses_degree < cp_size``) any GQA ratio with at least as many query heads as the
  degree — the per-rank split is :func:`..methods.ulysses.layout.ulysses_head_layout`);
* :func:`head_layout_lines` — the plan summary's per-rank query / KV heads of Ulysses and Hybrid;
* :func:`unrepeat_kv` — K/V that HF repeated for GQA (``repeat_kv``) as a strided view of the
  Hk distinct heads (no copy), so only Hk heads are communicated.

Local only: no collective, the module is not modified.
"""
from __future__ import annotations

from typing import Optional

import torch.nn as nn

from .. import catalogue
from ..interception import AttentionCall
from ..methods.base import check_gqa
from ..methods.ulysses.layout import ulysses_head_layout
from ..methods.ulysses.strategy import check_head_split

__all__ = ["module_heads", "check_heads", "unrepeat_kv", "head_layout_lines"]


def module_heads(module: nn.Module, tp_size: int = 1) -> tuple[Optional[int], Optional[int]]:
    """(q heads, kv heads) this rank computes for ``module`` (TP-local).

    After TP the applier records ``__hp_local_heads__``; otherwise the counts come from
    ``num_heads``/``num_key_value_heads`` attributes or the HF config, divided by ``tp_size``.
    """
    local = getattr(module, "__hp_local_heads__", None)
    if local is not None:
        return local
    cfg = getattr(module, "config", None)
    hq = None
    for attr in ("num_heads", "num_attention_heads", "n_heads"):
        if isinstance(getattr(module, attr, None), int):
            hq = getattr(module, attr)
            break
    if hq is None and cfg is not None:
        hq = getattr(cfg, "num_attention_heads", None)
    hk = None
    for attr in ("num_key_value_heads", "num_kv_heads", "n_kv_heads"):
        if isinstance(getattr(module, attr, None), int):
            hk = getattr(module, attr)
            break
    if hk is None and cfg is not None:
        hk = getattr(cfg, "num_key_value_heads", None) or hq
    if hk is None and hq is not None:
        groups = getattr(module, "num_key_value_groups", None)
        hk = hq // groups if isinstance(groups, int) and groups > 0 else hq
    if tp_size > 1:
        for name, h in (("num_q_heads", hq), ("num_kv_heads", hk)):
            if h is not None and h % tp_size:
                raise ValueError(f"{name}={h} of {type(module).__name__} is not divisible by tp_size={tp_size}")
        hq = hq // tp_size if hq is not None else None
        hk = hk // tp_size if hk is not None else None
    return hq, hk


def check_heads(method: str, module: nn.Module, cp_size: int, tp_size: int = 1, ulysses_degree=None,
                who: str = "CP wrapper") -> None:
    """Raise ValueError (prefixed ``who``) when ``module``'s TP-local heads or ``ulysses_degree``
    break ``method``'s rules in the catalogue; heads that cannot be read from the module are left
    to the strategy's check of the real tensors at apply/run time.

    For Ulysses/Hybrid every layout :func:`..methods.ulysses.layout.ulysses_head_layout` splits
    exactly is accepted (uneven counts, KV heads replicated when fewer than the degree): the sync
    strategies compute from that layout and the async A2As take ``heads=layout.q_heads /
    layout.kv_heads``. Refused: fewer query heads than the degree, ``Hq % Hk != 0``."""
    row = catalogue.get_method(method)
    catalogue.check_degree(row, cp_size, ulysses_degree, who)
    hq, hk = module_heads(module, tp_size)
    if hq is None or hk is None:
        return  # heads unknown here: the strategy checks the real tensors at apply/run time
    tp_note = f" (per TP rank, tp_size={tp_size})" if tp_size > 1 else ""
    split = catalogue.head_split(row, cp_size, ulysses_degree)
    try:
        if split is None:
            check_gqa(who, hq, hk)
        else:
            check_head_split(who, hq, hk, *split, cp_size=cp_size if row.degree == "param" else None)
    except ValueError as exc:
        raise ValueError(f"{exc}{tp_note}") from None


def head_layout_lines(targets, cp_size: int, tp_size: int = 1) -> list:
    """Plan-summary lines: for every resolved CP target (``.info.method``, ``.params``,
    ``.inner_module``, ``.fqn``) whose method splits heads (Ulysses, Hybrid), the per-rank query /
    KV heads of its Ulysses group (TP-local heads), one line per distinct layout. Targets whose
    heads cannot be read are left out. Local only."""
    seen: dict = {}
    for t in targets:
        method = t.info.method if getattr(t, "info", None) is not None else None
        try:
            row = catalogue.get_method(method) if method else None
        except (KeyError, ValueError):
            row = None
        if row is None or row.head_rule != "split":
            continue
        degree = cp_size if row.degree == "cp" else t.params.get(row.degree_param)
        try:
            hq, hk = module_heads(t.inner_module, tp_size)
            lay = ulysses_head_layout(hq, hk, int(degree)) if None not in (hq, hk, degree) else None
        except (ValueError, TypeError):
            lay = None
        if lay is not None:
            note = f" per TP rank (tp_size={tp_size})" if tp_size > 1 else ""
            seen.setdefault(f"{row.name} {lay.describe()}{note}", []).append(t.fqn)
    return [f"  {d} on {len(f)} module(s): {f[0]}{', ...' if len(f) > 1 else ''}" for d, f in seen.items()]


def unrepeat_kv(call: AttentionCall):
    """(k, v) of an intercepted call with Hk heads: HF's ``repeat_kv`` copies (``k_rep[:, h*g + j]
    == k[:, h]``, ``call.kv_groups == g``, not ``enable_gqa``) become the strided view
    ``k_rep[:, ::g]`` (same storage); anything else is returned as given."""
    q, k, v = call.q, call.k, call.v
    g = call.kv_groups
    if not call.enable_gqa and g > 1 and k.shape[1] == q.shape[1] and q.shape[1] % g == 0:
        # repeat_kv output: head h*g + j is a copy of kv head h -> a strided view, no gather of copies
        return k[:, ::g], v[:, ::g]
    return k, v

"""Route selection for :func:`hyper_parallel.ops.attention` on CUDA: which exact kernel runs a call.

A call is described by :class:`CallMeta` (built on the host from the call's tensors by
:func:`describe`: positions as *runs* of consecutive positions, doc ids, window, softcap, sinks,
ALiBi, head dims, dtype, whether the caller needs the lse, whether ``flash_attn`` is installed);
:func:`plan` maps it to a :class:`Plan` naming one route of :data:`ROUTES` plus the key order
and the pieces the route computes. The table in docs/attention_engine.md ("CUDA routes") is this
module's contract; tests/ops/test_cuda_routes.py checks every case picks its documented route.

Pieces (route ``sdpa_lse_merge``): for a query run ``[qa, qb)`` and a key run ``[ka, kb)`` under the
causal rule, keys ``[ka, min(kb, qa))`` are visible to every query (a *full* piece), keys
``[max(ka, qa), min(kb, qb))`` form a *square* causal block with the queries at the same positions,
and the queries after that block see all of it (another full piece). Every query of a piece sees
at least one of its keys, so no kernel ever meets an empty row.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

#: route name -> kernel it runs (the docs table is checked against these names).
ROUTES = {
    "sdpa_full": "F.scaled_dot_product_attention, no mask (flash / cuDNN / efficient)",
    "sdpa_lower_right": "F.scaled_dot_product_attention with causal_lower_right, one call per query run",
    "sdpa_lse_merge": "aten flash attention with logsumexp per piece, merged by log-sum-exp",
    "flash_varlen": "flash varlen over the document segments (flash-attn's, else torch's own; window / softcap)",
    "flash_window": "flash with window_size / softcap (flash-attn's, else torch's own), one call per query run",
    "flex": "FlexAttention with the position block mask (general fallback)",
}

_HALF = (torch.float16, torch.bfloat16)
#: at most this many kernel calls per attention call (scattered positions: FlexAttention instead)
MAX_CALLS = 32


@dataclass(frozen=True)
class Run:
    """``n`` consecutive positions ``pos, pos+1, ...`` stored at tensor indices ``idx, idx+1, ...``."""
    idx: int
    pos: int
    n: int


@dataclass(frozen=True)
class Piece:
    """Queries ``[q0, q1)`` against keys ``[k0, k1)`` (indices after the plan's key order);
    ``causal``: a square block, query ``i`` sees keys ``k0 .. k0 + (i - q0)``; else all keys."""
    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


@dataclass(frozen=True)
class CallMeta:
    device: str
    dtype: torch.dtype
    head_dim: int
    v_head_dim: int
    causal: bool
    q_runs: tuple | None  # None: per-batch positions differ (no shared runs)
    k_runs: tuple | None
    docs: bool = False
    window: int | None = None
    softcap: bool = False
    sinks: bool = False
    alibi: bool = False
    need_lse: bool = False
    flash: bool = False       # a flash kernel with window / varlen is usable (flash_usable)
    flash_attn: bool = False  # ... and it is the flash-attn package's (softcap)


@dataclass(frozen=True)
class Plan:
    route: str
    key_order: tuple | None = None  # runs (idx, n) concatenated into position order; None: as given
    pieces: tuple = ()               # sdpa_lse_merge: Pieces; sdpa_lower_right / flash_window: (q0, q1, k0, k1) per query run
    reason: str = ""


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def flash_usable(device: str, dtype: torch.dtype, head_dim: int, v_head_dim: int) -> bool:
    """A flash kernel with window / varlen applies (torch's own, or the flash-attn package):
    CUDA tensors, fp16 / bf16, one head size, a multiple of 8 up to 256."""
    return (device == "cuda" and dtype in _HALF and head_dim == v_head_dim and head_dim % 8 == 0
            and head_dim <= 256)


def runs_of(pos: torch.Tensor) -> tuple | None:
    """Runs of consecutive positions of a ``[S]`` / ``[B, S]`` index tensor (one host sync);
    None when the rows of a ``[B, S]`` tensor differ."""
    if pos.dim() == 2:
        if pos.shape[0] > 1 and not bool((pos == pos[:1]).all()):
            return None
        pos = pos[0]
    if pos.numel() == 0:
        return ()
    p = pos.to(torch.int64)
    starts = [0] + (torch.nonzero(p[1:] - p[:-1] != 1).flatten() + 1).tolist()
    vals = p[starts].tolist()
    ends = starts[1:] + [p.numel()]
    return tuple(Run(s, v, e - s) for s, v, e in zip(starts, vals, ends))


def describe(q, k, v, q_pos, k_pos, causal, q_doc, window, softcap, sinks, alibi_slopes,
             need_lse, flash_attn=None) -> CallMeta:
    """The :class:`CallMeta` of one attention call (positions read once on the host).
    ``flash_attn``: None = look (:func:`flash_attn_installed`, :func:`flash_usable`); True =
    stand-ins for the package's functions are given (tests)."""
    usable = flash_usable(q.device.type, q.dtype, q.shape[-1], v.shape[-1])
    if flash_attn is None:
        flash_attn = usable and flash_attn_installed()
    return CallMeta(device=q.device.type, dtype=q.dtype, head_dim=q.shape[-1], v_head_dim=v.shape[-1],
                    causal=causal, q_runs=runs_of(q_pos), k_runs=runs_of(k_pos),
                    docs=q_doc is not None, window=window, softcap=softcap is not None,
                    sinks=sinks is not None, alibi=alibi_slopes is not None, need_lse=need_lse,
                    flash=bool(usable or flash_attn), flash_attn=bool(flash_attn))


def sorted_keys(k_runs) -> tuple[tuple | None, tuple]:
    """(key order, runs after it): runs concatenated in position order when that merges some of
    them (a copy of K/V, O(S·D)); ``(None, k_runs)`` when they are already sorted or nothing merges."""
    order = sorted(k_runs, key=lambda r: r.pos)
    merged: list[Run] = []
    at = 0
    for r in order:
        if merged and merged[-1].pos + merged[-1].n == r.pos:
            last = merged[-1]
            merged[-1] = Run(last.idx, last.pos, last.n + r.n)
        else:
            merged.append(Run(at, r.pos, r.n))
        at += r.n
    if len(merged) == len(k_runs):
        return None, tuple(k_runs)
    return tuple((r.idx, r.n) for r in order), tuple(merged)


def causal_pieces(qr: Run, kr: Run) -> list[Piece]:
    """Pieces of query run ``qr`` against key run ``kr`` under the causal rule (module docstring)."""
    qa, qb, ka, kb = qr.pos, qr.pos + qr.n, kr.pos, kr.pos + kr.n
    qi, ki = qr.idx - qa, kr.idx - ka  # tensor index = position + offset
    out = []
    if ka < min(kb, qa):
        out.append(Piece(qr.idx, qr.idx + qr.n, kr.idx, ki + min(kb, qa), False))
    s, e = max(ka, qa), min(kb, qb)
    if s < e:
        out.append(Piece(qi + s, qi + e, ki + s, ki + e, True))
        if e < qb:
            out.append(Piece(qi + e, qi + qb, ki + s, ki + e, False))
    return out


def _lower_right_calls(q_runs, k_runs):
    """(q0, q1, k0, k1) per query run when its visible keys are one run starting at or before
    it (one lower-right causal call each, keys clipped at the run's end); else None."""
    calls = []
    for qr in q_runs:
        kr = [r for r in k_runs if r.pos <= qr.pos + qr.n - 1]
        if len(kr) != 1 or kr[0].pos > qr.pos or kr[0].pos + kr[0].n < qr.pos + qr.n:
            return None
        r = kr[0]
        calls.append((qr.idx, qr.idx + qr.n, r.idx, r.idx + (qr.pos + qr.n - r.pos)))
    return tuple(calls)


def _lse_kernel_ok(m: CallMeta) -> str:
    if m.head_dim != m.v_head_dim:
        return "Dv != D (the flash kernels need one head size)"
    if m.device == "cuda" and (m.dtype not in _HALF or m.head_dim % 8 or m.head_dim > 256):
        return "the CUDA flash kernel with logsumexp needs fp16/bf16 and D % 8 == 0, D <= 256"
    return ""


def plan(m: CallMeta) -> Plan:
    """The route of one call (the docs table, top to bottom: the first row that applies)."""
    if m.alibi:
        return Plan("flex", reason="ALiBi is a score_mod")
    if m.q_runs is None or m.k_runs is None:
        return Plan("flex", reason="per-batch positions differ")
    if len(m.q_runs) > MAX_CALLS:
        return Plan("flex", reason=f"more than {MAX_CALLS} query runs (scattered positions)")
    plain = not (m.docs or m.window is not None or m.softcap)
    order, k_runs = sorted_keys(m.k_runs) if m.causal else (None, m.k_runs)
    # On CUDA the SDPA routes need the flash kernel: without it SDPA would fall back to its math
    # kernel or (lower-right bias) materialise the Sq x Sk mask. CPU: tests of the routes' math.
    sdpa_ok = m.device != "cuda" or m.flash
    if plain and not m.sinks and not m.need_lse and sdpa_ok:
        if not m.causal:
            return Plan("sdpa_full", reason="full visibility")
        calls = _lower_right_calls(m.q_runs, k_runs)
        if calls is not None:
            return Plan("sdpa_lower_right", order, calls, "each query run sees one key run")
    if plain:
        why = _lse_kernel_ok(m)
        if why:
            return Plan("flex", reason=why)
        if not m.causal:
            total = sum(r.n for r in m.q_runs)
            nk = sum(r.n for r in m.k_runs)
            return Plan("sdpa_lse_merge", None, (Piece(0, total, 0, nk, False),), "full, lse needed")
        pieces = tuple(p for qr in m.q_runs for kr in k_runs for p in causal_pieces(qr, kr))
        if len(pieces) > MAX_CALLS:
            return Plan("flex", reason=f"{len(pieces)} pieces > {MAX_CALLS} (scattered key positions)")
        return Plan("sdpa_lse_merge", order, pieces, "pieces merged by log-sum-exp")
    flash_ok = (m.flash and m.causal and (m.flash_attn or not m.softcap)
                and not (m.sinks or m.need_lse) and m.head_dim == m.v_head_dim)
    if flash_ok:
        calls = _lower_right_calls(m.q_runs, k_runs)
        if calls is not None and m.docs and len(calls) == 1:
            return Plan("flash_varlen", order, calls, "packed documents, one query run")
        if calls is not None and not m.docs:
            return Plan("flash_window", order, calls, "window / softcap in the flash kernel")
    return Plan("flex", reason="no exact kernel route for this mask" if not flash_ok
                else "flash-attn cannot express these runs")

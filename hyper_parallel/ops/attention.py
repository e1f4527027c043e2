"""Position-masked attention: the one computation every context-parallel strategy ends in.

See ``docs/attention_engine.md`` for the full contract. In short::

    out = attention(q, k, v, q_pos=..., k_pos=..., causal=True, q_doc=None, k_doc=None,
                    scale=None, return_lse=False, window=None, softcap=None, sinks=None,
                    alibi_slopes=None, kv_group=None, kv_offset=0)

* ``q`` ``[B, Hq, Sq, D]``, ``k`` ``[B, Hk, Sk, D]``, ``v`` ``[B, Hk, Sk, Dv]`` (any strides;
  ``Dv`` may differ from ``D``), one floating dtype
  (float16, bfloat16, float32, float64), ``Hq % Hk == 0`` (without a head map); query head ``h``
  reads kv head ``h // (Hq // Hk)`` (GQA / MQA without repeating K/V in memory). ``kv_group`` / ``kv_offset``
  generalise the map to ``(h + kv_offset) // kv_group`` (a Ulysses rank whose query heads start
  or end inside a KV group: no copy of K/V per query head).
* ``q_pos`` ``[Sq]`` or ``[B, Sq]``, ``k_pos`` ``[Sk]`` or ``[B, Sk]``: integer *global*
  sequence positions, in any order (contiguous, zigzag, several ranges).
* ``q_doc`` / ``k_doc`` (optional, together, same shapes as the positions): document ids for
  packed sequences; a key with a negative doc id (``-1``: padding) is never attended.
* ``q_block`` / ``k_block`` (optional, together, same shapes as the positions): bidirectional
  block ids (one image's tokens, Gemma 3; ``-1`` = no block). With ``causal`` a key of the query's
  own block (``q_block[i] == k_block[j] >= 0``) is visible even in the query's future.
* Key ``j`` is visible to query ``i`` iff ``(not causal or k_pos[j] <= q_pos[i] or
  q_block[i] == k_block[j] >= 0)``, inside the window if any, and (no docs, or
  ``q_doc[i] == k_doc[j] >= 0``): transformers' window AND (causal OR block).
* ``window`` (left sliding window ``q_pos - window < k_pos``), ``softcap`` (``c tanh(s / c)``),
  ``sinks`` (``[Hq]`` valueless softmax logits; the returned lse includes them),
  ``alibi_slopes`` (``[Hq]``: ``+ slope * (k_pos - q_pos)``).
* Returns ``out`` ``[B, Hq, Sq, Dv]`` (contiguous, q's dtype) and, with ``return_lse``, the
  natural-log ``lse`` ``[B, Hq, Sq]`` in float32 (float64 for float64 inputs). Queries that see no
  key get ``out = 0``, ``lse = -inf`` and zero gradients (never NaN).
* Differentiable in q, k, v (and through ``lse``); positions / docs get no gradient. The
  backward recomputes the probabilities from q, k, v, out and lse; it stores no ``Sq x Sk``
  matrix.

Devices: CPU runs the C++ engine (``hyper_parallel._C``: ``torch.ops.hyper_parallel.attn_fwd`` /
``attn_bwd``, registered with fake kernels and autograd so it works under ``torch.compile`` and
``torch.autograd.gradcheck``); CUDA runs the exact kernel route ``ops.cuda_routes.plan`` picks
(SDPA flash / cuDNN, flash pieces merged by log-sum-exp, flash-attn; FlexAttention with a position
block mask as the fallback; docs/attention_engine.md "CUDA routes"); NPU runs ``torch_npu.npu_fusion_attention``; anything else raises.
"""
from __future__ import annotations

import math
from numbers import Integral, Real

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

try:  # loading the shared library runs its TORCH_LIBRARY registrations
    from hyper_parallel import _C  # noqa: F401
    _EXT_ERROR: Exception | None = None
except ImportError as exc:  # pragma: no cover - exercised only on an unbuilt checkout
    _C = None
    _EXT_ERROR = exc

_BUILD_HINT = (
    "hyper_parallel.ops.attention needs the C++ attention engine (hyper_parallel._C) on CPU, "
    "but it is not built or failed to load{why}. Build it from the repository root with "
    "`pip install --no-build-isolation -e .` (or `python setup.py build_ext --inplace`)."
)


def _require_extension() -> None:
    if _C is None:
        why = f" ({_EXT_ERROR})" if _EXT_ERROR is not None else ""
        raise ImportError(_BUILD_HINT.format(why=why)) from _EXT_ERROR


def engine_info() -> str:
    """One line describing the CPU engine (kernel ISA, threads, tile sizes)."""
    _require_extension()
    return torch.ops.hyper_parallel.engine_info()


# --------------------------------------------------------------------------------------------
# validation
def _check_index(t, name: str, batch: int, length: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"attention: {name} must be an integer tensor, got {t.dtype}")
    ok = (t.dim() == 1 and t.shape[0] == length) or (
        t.dim() == 2 and t.shape[0] in (1, batch) and t.shape[1] == length)
    if not ok:
        raise ValueError(
            f"attention: {name} must have shape [{length}] or [{batch}, {length}], "
            f"got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"attention: {name} is on {t.device} but q is on {device}")


def _validate_per_head(name: str, t, q) -> None:
    """``t`` (sinks / alibi_slopes) is None or a floating ``[Hq]`` tensor on q's device."""
    if t is None:
        return
    Hq = q.shape[1]
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"attention: {name} must be a torch.Tensor [Hq] or None, "
                         f"got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"attention: {name} must be a floating tensor, got {t.dtype}")
    if tuple(t.shape) != (Hq,):
        raise ValueError(f"attention: {name} must have shape [Hq] = [{Hq}], got {list(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"attention: {name} is on {t.device} but q is on {q.device}")


def _validate_alibi(alibi_slopes, q, softcap) -> None:
    _validate_per_head("alibi_slopes", alibi_slopes, q)
    if alibi_slopes is None:
        return
    if alibi_slopes.requires_grad:
        raise ValueError("attention: alibi_slopes are constants (no gradient is computed for "
                         "them); pass a tensor that does not require grad")
    if softcap is not None:
        raise ValueError("attention: alibi_slopes and softcap together are not supported")


def _validate_options(window, softcap):
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, Integral) or window < 1:
            raise ValueError(f"attention: window must be an int >= 1 or None, got {window!r}")
        if window > 2**31 - 1:
            raise ValueError(f"attention: window must fit in int32, got {window}")
        window = int(window)
    if softcap is not None:
        if (isinstance(softcap, bool) or not isinstance(softcap, Real)
                or not math.isfinite(float(softcap)) or float(softcap) <= 0):
            raise ValueError(f"attention: softcap must be a finite number > 0 or None, "
                             f"got {softcap!r}")
        softcap = float(softcap)
    return window, softcap


def kv_head_map(num_q_heads: int, num_kv_heads: int, kv_group=None, kv_offset=0) -> tuple:
    """The checked ``(kv_group, kv_offset)`` of :func:`attention`: query head ``h`` reads KV head
    ``(h + kv_offset) // kv_group``. ``kv_group=None``: plain GQA (``Hq % Hk == 0`` -> ``(Hq // Hk,
    0)``). Given: ``kv_group >= 1``, ``0 <= kv_offset < kv_group`` and the query heads must read
    exactly KV heads ``0 .. Hk-1`` (``(Hq - 1 + kv_offset) // kv_group == Hk - 1``). ValueError otherwise."""
    Hq, Hk = int(num_q_heads), int(num_kv_heads)
    if isinstance(kv_offset, bool) or not isinstance(kv_offset, Integral):
        raise ValueError(f"attention: kv_offset must be an int, got {kv_offset!r}")
    if kv_group is None:
        if Hk == 0 or Hq % Hk or kv_offset:
            raise ValueError(f"attention: q heads Hq={Hq} must be a multiple of k/v heads Hk={Hk} "
                             f"(and kv_offset 0, got {kv_offset}) unless kv_group is given")
        return Hq // Hk, 0
    if isinstance(kv_group, bool) or not isinstance(kv_group, Integral) or kv_group < 1 \
            or not 0 <= kv_offset < kv_group:
        raise ValueError(f"attention: need an int kv_group >= 1 and 0 <= kv_offset < kv_group, got "
                         f"kv_group={kv_group!r}, kv_offset={kv_offset!r}")
    if Hk == 0 or (Hq > 0 and (Hq - 1 + kv_offset) // kv_group != Hk - 1):
        raise ValueError(f"attention: query heads 0..{Hq - 1} at kv_offset {kv_offset} with kv_group {kv_group} "
                         f"read KV heads 0..{(Hq - 1 + kv_offset) // kv_group}, but k/v have Hk={Hk} heads "
                         "(each must be read by at least one query head)")
    return int(kv_group), int(kv_offset)


def kv_map_in_place(device) -> bool:
    """Whether :func:`attention` on ``device`` reads K/V through a head map (``kv_group``) in place:
    the CPU engine does; CUDA and NPU copy K/V per query head first (:func:`expand_kv_heads`), so
    what they save for backward is that copy, not the K/V passed in."""
    return torch.device(device).type == "cpu"


def expand_kv_heads(x: torch.Tensor, num_q_heads: int, kv_group: int, kv_offset: int) -> torch.Tensor:
    """``[B, Hk, S, D]`` -> ``[B, Hq, S, D]``: KV head ``(h + kv_offset) // kv_group`` for query head
    ``h`` (a copy; for backends without the head map in their kernel)."""
    idx = (torch.arange(num_q_heads, device=x.device) + kv_offset) // kv_group
    return x.index_select(1, idx)


def _validate(q, k, v, q_pos, k_pos, causal, q_doc, k_doc, scale) -> float:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"attention: {name} must be 4-D [B, H, S, D], got shape {list(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"attention: {name} must be float16/bfloat16/float32/float64, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"attention: q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(
            f"attention: q, k, v must be on one device, got q={q.device}, k={k.device}, "
            f"v={v.device}")
    B, Hq, Sq, D = q.shape
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"attention: v must have k's shape [B, Hk, Sk] = {list(k.shape[:3])} "
                         f"(its head dim Dv may differ), got {list(v.shape)}")
    if k.shape[0] != B:
        raise ValueError(f"attention: k has batch {k.shape[0]} but q has batch {B}")
    if k.shape[3] != D:
        raise ValueError(f"attention: k has head dim {k.shape[3]} but q has head dim {D}")
    Sk = k.shape[2]
    if not isinstance(causal, bool):
        raise ValueError(f"attention: causal must be a bool, got {type(causal).__name__}")
    _check_index(q_pos, "q_pos", B, Sq, q.device)
    _check_index(k_pos, "k_pos", B, Sk, q.device)
    if (q_doc is None) != (k_doc is None):
        raise ValueError("attention: q_doc and k_doc must be given together (or both None)")
    if q_doc is not None:
        _check_index(q_doc, "q_doc", B, Sq, q.device)
        _check_index(k_doc, "k_doc", B, Sk, q.device)
    if scale is None:
        return 1.0 / math.sqrt(D) if D > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, Real) or not math.isfinite(float(scale)):
        raise ValueError(f"attention: scale must be a finite real number or None, got {scale!r}")
    return float(scale)


# --------------------------------------------------------------------------------------------
# public op
def _validate_blocks(q_block, k_block, q, k) -> None:
    """``q_block`` / ``k_block``: both None, or integer tensors shaped like the positions."""
    if (q_block is None) != (k_block is None):
        raise ValueError("attention: q_block and k_block must be given together (or both None)")
    if q_block is not None:
        _check_index(q_block, "q_block", q.shape[0], q.shape[2], q.device)
        _check_index(k_block, "k_block", q.shape[0], k.shape[2], q.device)


def attention(q, k, v, *, q_pos, k_pos, causal=True, q_doc=None, k_doc=None, scale=None,
              return_lse=False, window=None, softcap=None, sinks=None, alibi_slopes=None,
              kv_group=None, kv_offset=0, q_block=None, k_block=None):
    """Attention of local queries at global positions ``q_pos`` over keys at ``k_pos``.

    Args:
        q: ``[B, Hq, Sq, D]`` queries. k: ``[B, Hk, Sk, D]``, v: ``[B, Hk, Sk, Dv]`` (the value
            head dim ``Dv`` may differ from ``D``, as in MLA); ``Hq % Hk == 0`` and query head
            ``h`` uses kv head ``h // (Hq // Hk)`` (unless ``kv_group`` is given, below). Any
            strides; one floating dtype.
        q_pos, k_pos: integer global positions, ``[S]`` (shared over the batch) or ``[B, S]``.
        causal: key ``j`` needs ``k_pos[j] <= q_pos[i]`` to be visible to query ``i``.
        q_doc, k_doc: optional document ids (same shapes as the positions, both or neither);
            visibility also needs ``q_doc[i] == k_doc[j]`` and ``k_doc[j] >= 0``.
        q_block, k_block: optional block ids (same shapes as the positions, both or neither;
            ``-1`` = none). With ``causal``, key ``j`` is also visible when
            ``q_block[i] == k_block[j] >= 0`` even if ``k_pos[j] > q_pos[i]`` (one image's tokens
            see each other, Gemma 3); the window and documents still apply: transformers'
            ``window AND (causal OR block)``. Ignored without ``causal``. CPU only (CUDA and NPU
            raise ``NotImplementedError``). The lse covers exactly the visible keys, so partial
            attentions over disjoint key sets still merge.
        scale: score scale, default ``1 / sqrt(D)``.
        return_lse: also return the natural-log logsumexp of the visible scaled scores.
        window: int >= 1 or None. Left sliding window: key ``j`` also needs
            ``k_pos[j] > q_pos[i] - window`` (with ``causal``: ``q - window < k <= q``, exactly
            transformers' sliding-window causal mask). Tiles outside every query's window are
            skipped, so the cost grows with the window, not with the key count.
        softcap: float > 0 or None. Scores ``s = scale * q.k`` become
            ``softcap * tanh(s / softcap)`` before the mask and softmax (Gemma2); exact backward.
        sinks: ``[Hq]`` floating tensor or None. A learned logit per query head that joins every
            row's softmax denominator but has no value (gpt-oss ``s_aux``); differentiable (the
            gradient is summed over batch and queries). **The returned lse includes the sink**
            (``lse = log(sum_visible exp(s) + exp(sink))``; a row that sees no key gets
            ``out = 0``, ``lse = sink``), so ``merge_partial_attention`` stays exact when the
            sinks are passed to exactly one of the partial attentions being merged (the sink is
            then counted once, like one more key with a zero value).
        alibi_slopes: ``[Hq]`` floating tensor or None (constants: no gradient). ALiBi: every
            score gets ``slope[h] * (k_pos[j] - q_pos[i])`` added after scaling (a per-row
            constant away from Bloom's ``slope * key_position``, so the same softmax; Falcon
            scales its bias by ``1/sqrt(D)``: pass ``slopes * scale`` there). The returned lse
            uses this relative bias, so partial attentions over disjoint keys merge exactly.
            Not combinable with ``softcap``.
        kv_group, kv_offset: None / 0 (default) or ints: query head ``h`` reads KV head
            ``(h + kv_offset) // kv_group`` instead of ``h // (Hq // Hk)`` — a contiguous run of
            query heads that starts ``kv_offset`` heads into a group of ``kv_group`` (a Ulysses
            rank of an uneven head layout, :meth:`~hyper_parallel.distributed.context_parallel.
            methods.ulysses.layout.UlyssesHeadLayout.kv_map_args`). The heads must read exactly
            the ``Hk`` KV heads given (:func:`kv_head_map`). The CPU engine reads K/V in place (dk /
            dv summed over each KV head's query heads); CUDA and NPU expand K/V to ``Hq`` heads first.

    Returns:
        ``out`` ``[B, Hq, Sq, Dv]`` in q's dtype (contiguous), or ``(out, lse)`` with ``lse``
        ``[B, Hq, Sq]`` float32 (float64 for float64 inputs). Queries with no visible key give
        ``out = 0``, ``lse = -inf`` and zero gradients.

    Backward (CPU): recomputes ``P = exp(q k^T * scale - lse)`` tile by tile from the saved
    q, k, v, out, lse and returns dq, dk, dv (dk / dv summed over each GQA group); positions and
    docs get ``None``. Raises ``ValueError`` naming the argument for bad shapes / dtypes, and
    ``NotImplementedError`` naming the device when it has no backend.
    """
    scale_f = _validate(q, k, v, q_pos, k_pos, causal, q_doc, k_doc, scale)
    _validate_blocks(q_block, k_block, q, k)
    group, offset = kv_head_map(q.shape[1], k.shape[1], kv_group, kv_offset)
    plain = group * k.shape[1] == q.shape[1] and offset == 0
    window, softcap = _validate_options(window, softcap)
    _validate_per_head("sinks", sinks, q)
    _validate_alibi(alibi_slopes, q, softcap)
    dev = q.device.type
    if q_block is not None and dev != "cpu":
        raise NotImplementedError(
            f"hyper_parallel.ops.attention: q_block / k_block (bidirectional blocks, e.g. Gemma 3 image tokens) "
            f"are implemented by the CPU engine only, not on '{q.device}': run on CPU, or drop the block ids "
            "(token_type_ids) and accept a causal mask inside images")
    if not plain and not kv_map_in_place(q.device):
        k, v = (expand_kv_heads(t, q.shape[1], group, offset) for t in (k, v))
        group, offset, plain = 1, 0, True
    if dev == "cpu":
        _require_extension()
        out, lse = torch.ops.hyper_parallel.attn_fwd(q, k, v, q_pos, k_pos, q_doc, k_doc,
                                                     causal, scale_f, window, softcap, sinks,
                                                     alibi_slopes, None if plain else group, offset,
                                                     q_block, k_block)
    elif dev == "cuda":
        from ._cuda import cuda_attention

        out, lse = cuda_attention(q, k, v, q_pos, k_pos, causal, q_doc, k_doc, scale_f,
                                  window=window, softcap=softcap, sinks=sinks,
                                  alibi_slopes=alibi_slopes, need_lse=return_lse)
    elif dev == "npu":
        from ._npu import npu_attention

        out, lse = npu_attention(q, k, v, q_pos, k_pos, causal, q_doc, k_doc, scale_f,
                                 window=window, softcap=softcap, sinks=sinks,
                                 alibi_slopes=alibi_slopes)
    else:
        raise NotImplementedError(
            f"hyper_parallel.ops.attention has no backend for device '{q.device}' "
            "(supported: cpu, cuda, npu)")
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------------
# torch.library glue for the C++ ops: fake kernels (torch.compile / meta) and autograd.
def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _attn_fwd_fake(q, k, v, q_pos, k_pos, q_doc, k_doc, causal, scale, window=None,
                   softcap=None, sinks=None, alibi_slopes=None, kv_group=None, kv_offset=0,
                   q_block=None, k_block=None):
    B, Hq, Sq, D = q.shape
    Dv = v.shape[3]
    return q.new_empty((B, Hq, Sq, Dv)), q.new_empty((B, Hq, Sq), dtype=_lse_dtype(q.dtype))


def _attn_bwd_fake(dout, dlse, q, k, v, out, lse, q_pos, k_pos, q_doc, k_doc, causal, scale,
                   window=None, softcap=None, sinks=None, alibi_slopes=None, kv_group=None, kv_offset=0,
                   q_block=None, k_block=None):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _attn_setup_context(ctx, inputs, output):
    q, k, v, q_pos, k_pos, q_doc, k_doc, causal, scale = inputs[:9]
    window, softcap, sinks, alibi, kv_group, kv_offset, q_block, k_block = (list(inputs[9:]) + [None] * 8)[:8]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, q_pos, k_pos, q_doc, k_doc, sinks, alibi, q_block, k_block)
    ctx.causal = causal
    ctx.scale = scale
    ctx.window = window
    ctx.softcap = softcap
    ctx.kv_group, ctx.kv_offset = kv_group, kv_offset or 0
    ctx.n_inputs = len(inputs)


def _attn_backward(ctx, dout, dlse):
    q, k, v, out, lse, q_pos, k_pos, q_doc, k_doc, sinks, alibi, q_block, k_block = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dsinks = torch.ops.hyper_parallel.attn_bwd(
        dout, dlse, q, k, v, out, lse, q_pos, k_pos, q_doc, k_doc, ctx.causal, ctx.scale,
        ctx.window, ctx.softcap, sinks, alibi, ctx.kv_group, ctx.kv_offset, q_block, k_block)
    grads = [dq, dk, dv] + [None] * (ctx.n_inputs - 3)
    if ctx.n_inputs > 11 and sinks is not None:
        grads[11] = dsinks
    return tuple(grads)


if _C is not None:
    torch.library.register_fake("hyper_parallel::attn_fwd")(_attn_fwd_fake)
    torch.library.register_fake("hyper_parallel::attn_bwd")(_attn_bwd_fake)
    torch.library.register_autograd("hyper_parallel::attn_fwd", _attn_backward,
                                    setup_context=_attn_setup_context)

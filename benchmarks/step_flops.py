"""FLOPs of one training step of a Llama-style decoder (dense GQA attention, gated MLP, untied or
tied LM head), counted analytically, and the machine's measured GEMM rate to set them against.

Formula (``T = batch x seq`` tokens, ``h`` hidden, ``i`` intermediate, ``L`` layers, ``n_q`` / ``n_kv``
query / KV heads of width ``d``, vocabulary ``V``; a multiply-add is 2 FLOPs; only matrix products
count — norms, activations, softmax, rotary rotations and the embedding lookup are left out, as
``torch.utils.flop_counter.FlopCounterMode`` leaves them out):

* matmul weights per layer ``W = h·d·(2·n_q + 2·n_kv) + 3·h·i`` (q, k, v, o projections; gate, up,
  down); forward ``F_mm = 2·T·(L·W + h·V)`` (the LM head over every position);
* attention core per layer ``F_att = 4·d·n_q·P`` with ``P`` the (query, key) pairs a head scores per
  row block summed over the batch (causal without documents: ``batch·S·(S+1)/2``) — ``QK^T`` and
  ``PV``, 2·d FLOPs each per pair;
* model FLOPs of the step ``3·F_mm + (1 + b)·L·F_att``: backward is 2x forward for every matmul
  (input and weight gradients) and ``b`` x for the attention core (``b = 2.5`` for a flash-style
  kernel that recomputes ``QK^T`` in backward — the C++ engine, FlexAttention, SDPA's fused
  kernels — ``b = 2`` for eager attention that keeps the probabilities);
* hardware FLOPs add what the step computes twice: activation checkpointing recomputes every
  layer's forward (``L·(2·T·W + F_att)``), the tiled LM-head loss recomputes the head
  (``2·T·h·V``), the tiled MLP recomputes every MLP forward (``2·T·L·3·h·i``).

The attention engine is a custom op that ``FlopCounterMode`` does not see; these formulas count it.
``tests/trainer/test_step_flops.py`` checks them against ``FlopCounterMode`` on a small HF Llama
(eager attention, where every product is an aten matmul).
"""
from __future__ import annotations

import dataclasses
import time

import torch

__all__ = ["StepFlops", "causal_pairs", "gemm_rate", "llama_step_flops"]


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """FLOPs of one step: forward matmuls (all layers + head), forward attention core (all layers),
    model FLOPs (forward + backward, nothing counted twice) and hardware FLOPs (with recompute)."""
    matmul_fwd: float
    attention_fwd: float
    model: float
    hardware: float


def causal_pairs(seq: int, batch: int = 1) -> int:
    """(query, key) pairs of causal attention over ``batch`` rows of ``seq`` tokens, per head."""
    return batch * seq * (seq + 1) // 2


def llama_step_flops(cfg, batch: int, seq: int, *, pairs: int | None = None, attn_bwd_factor: float = 2.5,
                     recompute_layers: bool = False, recompute_head: bool = False,
                     recompute_mlp: bool = False) -> StepFlops:
    """The module doc's formula for an HF Llama-style config (``hidden_size``, ``intermediate_size``,
    ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``vocab_size``, optional
    ``head_dim``; a dict or a config object). ``pairs``: scored pairs per head over the batch
    (default :func:`causal_pairs`). ``recompute_mlp``: the tiled MLP's backward recomputes each
    MLP forward (``2·T·3·h·i`` per layer), on top of ``recompute_layers``."""
    get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
    h, i, n_layers = get("hidden_size"), get("intermediate_size"), get("num_hidden_layers")
    n_q = get("num_attention_heads")
    n_kv = get("num_key_value_heads") or n_q
    d = get("head_dim") or h // n_q
    vocab = get("vocab_size")
    tokens = batch * seq
    pairs = causal_pairs(seq, batch) if pairs is None else pairs
    layer_w = h * d * (2 * n_q + 2 * n_kv) + 3 * h * i
    mm_layers, mm_head = 2.0 * tokens * n_layers * layer_w, 2.0 * tokens * h * vocab
    att = 4.0 * d * n_q * pairs * n_layers
    model = 3 * (mm_layers + mm_head) + (1 + attn_bwd_factor) * att
    hardware = model + (mm_layers + att if recompute_layers else 0.0) + (mm_head if recompute_head else 0.0) \
        + (2.0 * tokens * n_layers * 3 * h * i if recompute_mlp else 0.0)
    return StepFlops(mm_layers + mm_head, att, model, hardware)


def gemm_rate(dtype: torch.dtype, n: int = 1024, *, threads: int | None = None, seconds: float = 1.0) -> float:
    """Measured ``torch.mm`` rate (FLOP/s) of ``n x n @ n x n`` in ``dtype`` on the CPU with ``threads``
    intra-op threads (default: the current setting, restored after): the best of repeated calls
    during about ``seconds`` after a warm-up call."""
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        torch.mm(a, b)
        best, end = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        return 2.0 * n ** 3 / best
    finally:
        torch.set_num_threads(old)

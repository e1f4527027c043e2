"""Async Ulysses / Hybrid on the head layouts the even split cannot take (uneven splits, replicated KV heads).

The async adapters split heads with :func:`...methods.ulysses.layout.ulysses_head_layout`, as
the sync wrappers do: KV heads fewer than the degree are replicated to every rank whose query
heads use them (backward sums the copies' gradients), and query heads not divisible by the
degree go in uneven contiguous blocks. Cases (fp32, one batch with packed documents and right
padding, errors relative to the reference's largest |logit| / |gradient|, gradients of every
parameter summed over CP):

* async Ulysses at cp 2: Llama and Qwen3 with MQA (4 query / 1 KV head: the KV head goes to
  both ranks), Qwen3 with 3 query / 1 KV head (uneven: 2 + 1 query heads);
* async Hybrid at cp 4 (ulysses_degree 2): Llama with 4/1 heads, Qwen3 with 3/1.

Each equals CP=1 and the sync wrapper on the same layout, leaves no handle pending, and launches
and waits each of Q/K/V exactly once per layer, forward and backward
(:func:`tests.async_cp.test_async_adapters._check`).
"""
from tests.async_cp._workers import METHODS
from tests.async_cp.test_async_adapters import _check, _run

MQA, UNEVEN = (4, 1), (3, 1)


def test_async_ulysses_mqa_and_uneven_heads_cp2(ranks):
    cases = [("llama", "ulysses", "packed_padding", 32, MQA), ("qwen3", "ulysses", "packed_padding", 32, MQA),
             ("qwen3", "ulysses", "packed_padding", 32, UNEVEN)]
    _check(ranks(METHODS["ulysses"][0]).run(_run, cases, timeout=600), "ulysses")


def test_async_hybrid_mqa_and_uneven_heads_cp4(ranks):
    cases = [("llama", "hybrid", "packed_padding", 32, MQA), ("qwen3", "hybrid", "packed_padding", 32, UNEVEN)]
    _check(ranks(METHODS["hybrid"][0]).run(_run, cases, timeout=600), "hybrid")

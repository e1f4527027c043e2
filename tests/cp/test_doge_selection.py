"""Doge's dynamic mask as a selection (``hyper_parallel.models.doge.dynamic_mask``), one process:
the blocked selector equals the stated rule — per KV head, the ``keep_window_size`` visible keys
with the largest bias, ties to the lower key index — computed by brute force, for every query block
size, with and without documents / padding / a sliding window, on tie-free and tie-heavy biases;
and transformers' dense mask with the same rule (``prepare_dynamic_mask_ordered``) agrees."""
from __future__ import annotations

import types

import pytest
import torch


def brute_force(bias, doc, keep, window):
    B, Hk, S = bias.shape
    out = torch.zeros(B, Hk, S, S, dtype=torch.bool)
    for b in range(B):
        for h in range(Hk):
            for i in range(S):
                vis = [j for j in range(S) if j <= i and doc[b, j] == doc[b, i] and doc[b, j] >= 0
                       and (window is None or j > i - window)]
                vis.sort(key=lambda j: (-float(bias[b, h, j]), j))
                out[b, h, i, vis[:keep]] = True
    return out


@pytest.mark.parametrize("ties", [False, True])
def test_selector_is_the_stated_rule(ties):
    from hyper_parallel.models.doge.dynamic_mask import keep_window_selector, key_ranks

    g = torch.Generator().manual_seed(0)
    B, Hk, S, keep = 2, 2, 24, 5
    bias = torch.randn(B, Hk, S, generator=g)
    if ties:
        bias = (bias * 1.5).round()               # a handful of values: ties everywhere
    doc = torch.tensor([[0] * 14 + [1] * 10, [0] * 6 + [1] * 13 + [-1] * 5])
    n_checked = 0
    for window in (None, 9):
        want = brute_force(bias, doc, keep, window)
        for lb in (1, 7, S):
            select, width = keep_window_selector(key_ranks(bias), keep, torch.arange(S), doc, doc, window)
            got = torch.zeros_like(want)
            for l0 in range(0, S, lb):
                sel, ok = select(l0, min(S, l0 + lb))
                assert sel.shape[-1] == width == keep
                rows = torch.zeros(B, Hk, sel.shape[2], S, dtype=torch.int64).scatter_add_(-1, sel, ok.long())
                got[:, :, l0:l0 + sel.shape[2]] = rows > 0
            bad = int((got != want).sum())
            print(f"ties={ties} window={window} block={lb}: {int(want.sum())} kept (query, key) pairs, {bad} differ")
            assert bad == 0
            n_checked += 1
    assert n_checked == 6


def test_dense_mask_with_the_rule_keeps_the_same_keys():
    """transformers' dense path with the rule bound (the CP=1 reference) keeps the selector's keys."""
    import transformers as T

    from hyper_parallel.models.doge.dynamic_mask import keep_window_selector, key_ranks, prepare_dynamic_mask_ordered

    torch.manual_seed(0)
    cfg = T.DogeConfig(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=2, intermediate_size=32, keep_window_size=4)
    m = T.AutoModelForCausalLM.from_config(cfg).model.layers[0].self_attn
    m.prepare_dynamic_mask = types.MethodType(prepare_dynamic_mask_ordered, m)
    S = 16
    dt = torch.randint(0, 3, (1, 2, S)).float()                  # ties
    causal = torch.tril(torch.ones(S, S, dtype=torch.bool))[None, None]
    dense = m.prepare_dynamic_mask(torch.zeros(1, S, 32), dt, 4, causal) > torch.finfo(torch.float32).min
    select, _ = keep_window_selector(key_ranks(dt), 4, torch.arange(S), None, None)
    sel, ok = select(0, S)
    got = torch.zeros(1, 2, S, S, dtype=torch.int64).scatter_add_(-1, sel, ok.long()) > 0
    assert torch.equal(got, dense), (got != dense).nonzero()

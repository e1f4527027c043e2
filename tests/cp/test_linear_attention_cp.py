"""Exact CP for the linear-attention mixers of Kimi Linear (KDA, ``kda_state_passing``) and MiniMax
(lightning attention, ``lightning_state_passing``): the recurrent state passed between ranks through
the same affine-state composition as the Gated DeltaNet's. Real transformers classes, tiny random
configs (tests/cp/linear_attention_models.py), train(), dropout 0, fp32; the softmax attention
declared with Colossal / Ulysses / Head-Tail where the layout allows it; logits and EVERY gradient
vs CP=1 for plain, padded and packed rows, the preflight proof passing (tests/cp/test_mixer_cp.py
helpers and tolerance); the incoming state dropped is visibly wrong (negative control)."""
from __future__ import annotations

import time

import pytest

from tests.cp.test_mixer_cp import TOL, _check, dropped_state_case, mixer_cases


@pytest.mark.parametrize("arch,mixer", [("kimi_linear", "kda_sp"), ("minimax", "lightning_sp")])
def test_linear_attention_state_passing_exact_cp2(ranks, arch, mixer):
    """cp 2: Colossal attention on plain / padded / packed rows (S=45: documents cross the rank edge,
    MiniMax runs several lightning blocks per rank), Ulysses on padded / packed; the incoming state
    dropped must be visibly wrong."""
    t0 = time.perf_counter()
    pool = ranks(2)
    _check(pool.run(mixer_cases, [
        ((arch, "colossal", mixer, 2), {"S": 45}),
        ((arch, "ulysses", mixer, 2), {"kinds": ("padding", "packed"), "S": 37}),
    ], timeout=600.0))
    for res in pool.run(dropped_state_case, arch, mixer, timeout=300.0):
        step = res["steps"][0]
        print(f"{arch} {mixer} with the incoming state dropped (negative control): logits rel "
              f"{step['logits_rel']:.2e}, grads {step['grads']:.2e}")
        assert step["logits_rel"] > 10 * TOL or step["grads"] > 10 * TOL, step
    print(f"wall {time.perf_counter() - t0:.1f}s")

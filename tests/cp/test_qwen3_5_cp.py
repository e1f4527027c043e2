"""Exact CP for Qwen3.5 text (transformers ``qwen3_5`` / ``qwen3_5_moe``): a hybrid of Gated DeltaNet
(linear attention) and gated full attention whose RoPE takes 3-D (mrope) positions built from the
1-D ids. Real transformers classes, tiny random configs, train(), dropout 0, fp32, cp 2 on gloo:
the plan (attention ``sdpa_hf`` / ``sdpa_hf_ulysses``, the GDN ``gated_deltanet_state_passing`` /
``gated_deltanet_ulysses``) applied with the preflight proof; logits and every gradient vs CP=1 for
plain, padded and packed rows (tests/cp/test_mixer_cp.py helpers and tolerance)."""
from __future__ import annotations

import time

from tests.cp.test_mixer_cp import _check, mixer_cases


def test_qwen3_5_text_exact_cp2(ranks):
    """Qwen3.5 text x {Colossal + GDN state passing, Ulysses + GDN Ulysses}; Qwen3.5-MoE x Colossal + GDN Ulysses."""
    t0 = time.perf_counter()
    _check(ranks(2).run(mixer_cases, [
        (("qwen3_5", "colossal", "gdn_sp", 2), {}),
        (("qwen3_5", "ulysses", "gdn_ulysses", 2), {"kinds": ("padding", "packed"), "S": 29}),
        (("qwen3_5_moe", "colossal", "gdn_ulysses", 2), {"kinds": ("plain", "packed")}),
    ], timeout=600.0))
    print(f"wall {time.perf_counter() - t0:.1f}s")

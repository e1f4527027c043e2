"""Vision-language models under CP (context_parallel/vision.py): the vision tower spread over the CP
group, each image or video token's embedding sent to the rank whose shard holds its placeholder; logits and
every gradient (vision tower included) against the same model on one rank. fp32, tolerance 1e-5."""
from __future__ import annotations

import pytest

from hyper_parallel.distributed.context_parallel.vision import assign_media

from tests.vlm._workers import packed_parity, vlm_parity

TOL = 1e-5


CASES = [(2, "colossal", 48, "qwen2_5_vl", False), (4, "colossal", 48, "qwen2_5_vl", True),
         (2, "head_tail", 48, "qwen2_5_vl", False), (2, "ulysses", 48, "qwen2_5_vl", False),
         (2, "balanced", 128, "qwen2_5_vl", False), (2, "colossal", 48, "qwen2_vl", True),
         (2, "colossal", 48, "qwen3_vl", False), (4, "ulysses", 48, "qwen3_vl", False)]


@pytest.mark.parametrize("cp,method,S,arch,video", CASES,
                         ids=[f"{a}-cp{c}-{m}{'-video' if v else ''}" for c, m, _s, a, v in CASES])
def test_qwen_vl_media_spread_over_cp_equal_one_rank(ranks, cp, method, S, arch, video):
    """CP 2 and 4, Head-Tail, Ulysses and the balanced split (a shard's placeholders are not contiguous);
    images, and with a video of 2 frames beside them (images and videos assigned together)."""
    res = ranks(cp).run(vlm_parity, cp, S, method=method, arch=arch, video=video, timeout=600)
    assert sum(got["local_tokens"] for got in res) == 28 + 8 * video and all(got["local_tokens"] for got in res), res
    for r, got in enumerate(res):
        print(f"{arch} {method} cp {cp}{' video' if video else ''} rank {r}: encodes media {got['images_mine']}, "
              f"{got['local_tokens']} media tokens "
              f"in its shard; logits rel {got['logits']:.2e}, grads rel {got['grads']:.2e} (worst {got['worst']}; "
              f"vision grad max {got['vision_grad_max']:.2e}; tol {TOL:g})")
        assert got["logits"] <= TOL and got["grads"] <= TOL and got["vision_grad_max"] > 0, got


def test_images_are_assigned_by_patch_rows():
    assert assign_media([16, 32, 64], 2) == [1, 1, 0]
    assert assign_media([16, 32, 64], 4) == [2, 1, 0]
    assert assign_media([], 2) == []


@pytest.mark.parametrize("method", ["colossal", "ulysses"])
def test_packed_multimodal_rows_equal_one_rank(ranks, method):
    """Rows packing a text-only sample with a multimodal one (positions per sample from get_rope_index,
    transformers' 4-row layout): equal to the same packed rows on one rank, where each sample computes
    as if it were alone (checked on the reference)."""
    for r, got in enumerate(ranks(2).run(packed_parity, 2, method, timeout=600)):
        print(f"packed multimodal rows, {method} rank {r}: logits rel {got['logits']:.2e}, grads rel {got['grads']:.2e} "
              f"(tol {TOL:g}); {got['documents']} documents per row at most; the reference's second sample vs "
              f"itself alone: {got['alone']:.2e}")
        assert got["logits"] <= TOL and got["grads"] <= TOL and got["documents"] == 2 and got["alone"] <= 1e-5, got


def test_frozen_tower_equals_one_rank_with_no_tower_gradient(ranks):
    """A frozen tower (``media_embeddings_for_cp(..., frozen=True)``): the media encoded without autograd and
    exchanged once; the language model's logits and gradients equal the one-rank model whose tower does
    not require gradients, and no tower parameter gets a gradient on any rank."""
    for r, got in enumerate(ranks(2).run(vlm_parity, 2, 48, "colossal", "qwen2_5_vl", False, True, timeout=600)):
        print(f"frozen tower rank {r}: logits rel {got['logits']:.2e}, grads rel {got['grads']:.2e} (tol {TOL:g}); "
              f"tower parameters with a gradient: {got['tower_grads']}")
        assert got["logits"] <= TOL and got["grads"] <= TOL and got["tower_grads"] == 0, got

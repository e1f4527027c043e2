"""LLaVA, the full Qwen3.5 / Qwen3.5-MoE class and Qwen3-VL videos under CP (docs/vlm.md): the tower
spread over the CP group, each medium encoded by one rank, its tokens exchanged to the ranks holding
their placeholders; logits and every gradient (vision tower included) against the same model on one
rank (packed rows: against each sample alone). fp32, tolerance 1e-5. And an unregistered VLM (Mllama,
cross-attention) refused at planning in one message naming its vision attention and the fix."""
from __future__ import annotations

import time

import pytest

from tests.vlm._family_workers import build_mllama, family_parity, packed_family_parity

TOL = 1e-5


def _report(label: str, res: list) -> None:
    for r, got in enumerate(res):
        print(f"{label} rank {r}: logits rel {got['logits']:.2e}, grads rel {got['grads']:.2e} (worst {got['worst']}; "
              f"tower grad max {got['vision_grad_max']:.2e}; tol {TOL:g})"
              + (f"; encodes media {got['media_mine']}, placeholders in its shard {got['in_shard']}"
                 if "media_mine" in got else f"; {got['documents']} documents per row at most"))
        assert got["logits"] <= TOL and got["grads"] <= TOL and got["vision_grad_max"] > 0, got


CASES = [("llava", "colossal", False, "default"), ("llava", "ulysses", False, "full"),
         ("qwen3_5", "colossal", True, "default"), ("qwen3_5_moe", "ulysses", False, "default"),
         ("qwen3_vl", "colossal", True, "default")]


@pytest.mark.parametrize("arch,method,video,strategy", CASES,
                         ids=[f"{a}-{m}{'-video' if v else ''}{'-' + s if a == 'llava' else ''}"
                              for a, m, v, s in CASES])
def test_vlm_family_media_spread_over_cp2_equal_one_rank(ranks, arch, method, video, strategy):
    """CP 2: LLaVA (one image size, 16 tokens per image with the "default" strategy from layer -2, 17
    with "full" from layers -3 and -1 concatenated), Qwen3.5 with a Gated DeltaNet method declared beside
    the attention (images of 4, 8 and 16 tokens and a 2-frame video whose frames, separated by timestamp
    text, fall on both shards), Qwen3.5-MoE (Ulysses + GDN Ulysses), Qwen3-VL with that video."""
    t0 = time.perf_counter()
    res = ranks(2).run(family_parity, arch, 2, method, video=video, strategy=strategy, timeout=600)
    _report(f"{arch} {method}{' video' if video else ''} {strategy}", res)
    for kind, n in res[0]["tokens"].items():          # every placeholder reached exactly one shard
        assert sum(got["in_shard"][kind] for got in res) == n, res
    if video:
        assert all(got["in_shard"]["video"] for got in res), res          # the video's frames on both ranks
    targets, tower = res[0]["cp_targets"], res[0]["tower"]                # "*.self_attn" leaves the tower alone
    print("CP targets:", targets)
    assert targets and all(t.startswith("model.language_model.") for t in targets), (tower, targets)
    print(f"wall {time.perf_counter() - t0:.1f}s")


@pytest.mark.parametrize("arch", ["llava", "qwen3_5", "qwen3_vl"])
def test_packed_family_rows_equal_each_sample_alone(ranks, arch):
    """Rows packing a text-only sample with a multimodal one (LLaVA: 1-D positions restarting per
    sample; Qwen: each sample's 3-D ids in the 4-row layout; Qwen3-VL's multimodal sample a video),
    ``independent`` documents, CP 2 Colossal (+ GDN state passing): equal to each sample alone on one rank."""
    t0 = time.perf_counter()
    res = ranks(2).run(packed_family_parity, arch, 2, "colossal", timeout=600)
    _report(f"packed {arch}", res)
    assert all(got["documents"] == 2 for got in res), res
    print(f"wall {time.perf_counter() - t0:.1f}s")


def test_unregistered_cross_attention_vlm_refused_at_planning():
    """Mllama (no tower registered) at cp 2: one CPConfigError naming its first vision attention, the
    model type and the fix, whether or not methods are declared (planning only, no process group)."""
    from hyper_parallel.distributed.plan import ShardingPlanner

    model = build_mllama()
    base = {"when": "cp", "region_dispatch": False, "inner_target": "self"}
    for over in (None, [{**base, "match": "*.self_attn", "inner_wrapper": "sdpa_hf"},
                        {**base, "match": "*.cross_attn", "inner_wrapper": "sdpa_hf"}]):
        with pytest.raises(Exception) as ei:
            ShardingPlanner(plan_overrides=over).plan(model, None, cp_size=2)
        msg = f"{type(ei.value).__name__}: {ei.value}"
        print(msg)
        assert msg.startswith("CPConfigError"), msg
        assert "model.vision_model.transformer.layers.0.self_attn" in msg and "'mllama'" in msg, msg
        assert "attention of a vision encoder" in msg and "not registered" in msg, msg
        assert "accelerator.cp_size=1" in msg and "models/<model_type>/vision.py" in msg, msg


def test_llava_media_it_cannot_encode_refused_before_any_exchange():
    """LLaVA's tower takes one image size (its position embeddings are not interpolated): an image of
    another size, in its grid or its pixels, is refused by name before any exchange (no process group);
    so are pixels that do not match their grids and placeholders that do not match the media."""
    import torch

    from hyper_parallel.distributed.context_parallel.vision import media_embeddings_for_cp
    from tests.vlm._family_workers import LLAVA_SIZE, build_family

    model, _ref = build_family("llava")
    ids = torch.full((1, 40), 5)
    ids[0, 2:18] = model.config.image_token_id
    good = torch.tensor([[LLAVA_SIZE, LLAVA_SIZE]])
    for pixels, grid in ((torch.randn(1, 3, 16, 16), torch.tensor([[16, 16]])), (torch.randn(1, 3, 16, 16), good)):
        with pytest.raises(ValueError, match=f"takes {LLAVA_SIZE} x {LLAVA_SIZE} images only") as ei:
            media_embeddings_for_cp(model, ids, {"image": (pixels, grid)}, None, "all_gather")
        print(ei.value)
    with pytest.raises(ValueError, match="pixel values hold 2 rows, but their grids") as ei:     # pixels vs grids
        media_embeddings_for_cp(model, ids, {"image": (torch.randn(2, 3, LLAVA_SIZE, LLAVA_SIZE), good)}, None,
                                "all_gather")
    print(ei.value)
    with pytest.raises(ValueError, match="16 placeholder tokens .* encode to 32") as ei:         # placeholders
        media_embeddings_for_cp(model, ids, {"image": (torch.randn(2, 3, LLAVA_SIZE, LLAVA_SIZE), good.repeat(2, 1))},
                                None, "all_gather")
    print(ei.value)
    out = media_embeddings_for_cp(model, ids, {"image": (torch.randn(1, 3, LLAVA_SIZE, LLAVA_SIZE), good)}, None,
                                  "all_gather")
    assert out["image"].pooler_output[0].shape == (16, model.config.text_config.hidden_size)

"""Gemma 3 under CP: the SigLIP tower + projector spread over the CP group, and the bidirectional attention
inside each image (transformers' token_type_ids masks) carried to the engine as block ids of the global rows,
exact where an image crosses a shard edge. Logits and every gradient (tower included) against the same model
on one rank given token_type_ids; fp32, tolerance 1e-5."""
from __future__ import annotations

import pytest
import torch

from tests.vlm._gemma3_workers import IMAGE, PLACES, TOKENS, gemma3_batch, gemma3_parity

TOL = 1e-5
CASES = [(2, "colossal", None), (2, "ulysses", None), (2, "head_tail", None), (4, "colossal", None),
         (4, "hybrid", None), (2, "balanced", None), (2, "colossal", "validate")]


@pytest.mark.parametrize("cp,method,mode", CASES, ids=[f"cp{c}-{m}{'-' + v if v else ''}" for c, m, v in CASES])
def test_gemma3_images_across_shard_edges_equal_one_rank(ranks, cp, method, mode):
    """Images cross the shard edges (CP 2: 14..17 over 16; CP 4: 7..10 over 8 and 22..25 over 24; Head-Tail's
    sub-chunks likewise); CP 4 Colossal runs the sliding layer's trimmed exchange, widened to the later chunk
    holding the rest of an image; Hybrid (CP 4, Ulysses 2 x Colossal 2) and the balanced split (rows of 128,
    images crossing 64) take the ids like the documents; validate mode checks every call against the layer's own attention under
    transformers' mask with the image blocks. The reference's bidirectional part is checked to matter."""
    res = ranks(cp).run(gemma3_parity, cp, method, mode, timeout=600)
    assert sum(got["local_tokens"] for got in res) == len(PLACES) * TOKENS, res
    for r, got in enumerate(res):
        print(f"gemma3 {method} cp {cp} rank {r}: {got['local_tokens']} image tokens in its shard; logits rel "
              f"{got['logits']:.2e}, grads rel {got['grads']:.2e} (worst {got['worst']}; vision grad max "
              f"{got['vision_grad_max']:.2e}; tol {TOL:g}); reference with vs without token_type_ids: "
              f"{got['bidirectional']:.2e}")
        assert got["bidirectional"] > 1e-3, "the bidirectional image mask must change the reference"
        assert got["blocks"] == 3 and got["vision_grad_max"] > 0, got
        assert got["logits"] <= TOL and got["grads"] <= TOL, got


def test_image_block_ids_are_the_runs_of_placeholders():
    """One id per image run, numbered per global row; an image straddling a shard edge keeps one id."""
    from types import SimpleNamespace

    from hyper_parallel.distributed.context_parallel import shard_batch_for_cp
    from hyper_parallel.models.gemma3 import image_block_ids

    ids, _ = gemma3_batch()
    blk = image_block_ids(ids, SimpleNamespace(image_token_id=IMAGE))
    assert blk[0, 14:18].tolist() == [1] * 4 and blk[1, 22:26].tolist() == [1] * 4 and blk[1, 27:31].tolist() == [2] * 4
    assert bool((blk[ids != IMAGE] == -1).all())
    halves = [shard_batch_for_cp({"input_ids": ids}, (r, 2), "all_gather", block_ids=blk).meta for r in range(2)]
    assert torch.equal(halves[0].key_block, halves[1].key_block)
    assert halves[0].block_reach(0, 16) == 18 and halves[0].block_reach(16, 32) == 32
    with pytest.raises(ValueError, match="block_ids must be an integer tensor"):
        shard_batch_for_cp({"input_ids": ids}, (0, 2), "all_gather", block_ids=blk[:, :8])
    from hyper_parallel.distributed.context_parallel.meta import refuse_blocks

    refuse_blocks(shard_batch_for_cp({"input_ids": ids}, (0, 2), "all_gather").meta, "m")      # no blocks: nothing
    with pytest.raises(ValueError, match=r"m \(top-k\): the batch carries bidirectional blocks \(CPBatchMeta.key_block"):
        refuse_blocks(halves[0], "m (top-k)")
    with pytest.raises(ValueError, match="travel as block_ids"):
        shard_batch_for_cp({"input_ids": ids, "token_type_ids": (ids == IMAGE).long()}, (0, 2), "all_gather")

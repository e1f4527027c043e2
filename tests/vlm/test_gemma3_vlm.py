"""Gemma 3 under CP: the SigLIP tower + projector spread over the CP group, and the bidirectional attention
inside each image (transformers' token_type_ids masks) carried to the engine as block ids of the global rows,
exact where an image crosses a shard edge. Logits and every gradient (tower included) against the same model
on one rank given token_type_ids (packed rows: each sample alone, given its token_type_ids); fp32,
tolerance 1e-5."""
from __future__ import annotations

import pytest
import torch

from tests.vlm._gemma3_workers import IMAGE, PACKED, PLACES, TOKENS, gemma3_batch, gemma3_packed_parity, gemma3_parity

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


@pytest.mark.parametrize("method", ["colossal", "ulysses"])
def test_gemma3_packed_multimodal_rows_equal_each_sample_alone(ranks, method):
    """Packed rows (row 0: a text-only sample + a sample whose image crosses the CP=2 edge; row 1: one sample
    with two images), positions restarting per sample, ``packed_documents="independent"``, image blocks of the
    global rows: logits of every token and every gradient (tower included) against each sample run alone on
    one rank given its token_type_ids. Transformers' own packed row is printed, not compared: its sliding
    layer loses the image blocks of a later sample."""
    res = ranks(2).run(gemma3_packed_parity, 2, method, timeout=600)
    assert sum(got["local_tokens"] for got in res) == sum(len(p[3]) for p in PACKED) * TOKENS, res
    for r, got in enumerate(res):
        print(f"gemma3 packed rows, {method} rank {r}: logits rel {got['logits']:.2e}, grads rel {got['grads']:.2e} "
              f"(worst {got['worst']}; vision grad max {got['vision_grad_max']:.2e}; tol {TOL:g}); "
              f"{got['documents']} documents per row at most; samples alone with vs without token_type_ids: "
              f"{got['bidirectional']:.2e}; transformers' packed row vs the samples alone: "
              f"{got['transformers_packed']:.2e}")
        assert got["documents"] == 2 and got["bidirectional"] > 1e-3 and got["vision_grad_max"] > 0, got
        assert got["logits"] <= TOL and got["grads"] <= TOL, got
        assert got["transformers_packed"] > 1e-3, ("transformers' packed row now equals the samples alone: "
                                                   "shard_batch_for_cp may take packed_documents='as_transformers' "
                                                   "with block_ids", got)


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


def test_blocks_on_packed_rows_need_independent():
    """block_ids on a row of several packed documents: only packed_documents='independent' is taken (transformers'
    packed sliding mask differs, see the packed parity test); undeclared or 'as_transformers' is refused on every
    rank alike, and rows without an image, or not packed, keep every declaration."""
    from types import SimpleNamespace

    from hyper_parallel.distributed.context_parallel import shard_batch_for_cp
    from hyper_parallel.models.gemma3 import image_block_ids

    ids, _ = gemma3_batch()
    pos = torch.arange(32).expand(2, 32).clone()
    pos[0, 10:] -= 10                                       # row 0: two documents, its image (14..17) in the second
    blk = image_block_ids(ids, SimpleNamespace(image_token_id=IMAGE))
    batch = {"input_ids": ids, "position_ids": pos}
    for rank in range(2):
        for declared in (None, "as_transformers"):
            with pytest.raises(ValueError, match=rf"packed_documents={declared!r} with block_ids on a row of several "
                                                 r"packed documents.*declare packed_documents='independent'"):
                shard_batch_for_cp(batch, (rank, 2), "all_gather", packed_documents=declared, block_ids=blk)
        meta = shard_batch_for_cp(batch, (rank, 2), "all_gather", packed_documents="independent", block_ids=blk).meta
        assert meta.documents == "independent" and meta.packs_documents and torch.equal(meta.key_block[:, :32], blk)
    no_image = torch.full_like(blk, -1)
    assert shard_batch_for_cp(batch, (0, 2), "all_gather", packed_documents="as_transformers",
                              block_ids=no_image).meta.packs_documents
    unpacked = {"input_ids": ids, "position_ids": torch.arange(32).expand(2, 32)}
    assert shard_batch_for_cp(unpacked, (0, 2), "all_gather", block_ids=blk).meta.key_block is not None


def test_token_type_ids_without_block_ids_is_refused(ranks):
    """Gemma 3's token_type_ids given to the CP forward with no block ids in the batch would be dropped
    (the CP attention reads visibility from the meta only, so images would attend causally): refused on
    every rank at the forward's entry, naming the input and the fix; with block ids it is taken."""
    from tests.vlm._gemma3_workers import gemma3_token_type_ids_without_blocks

    for rank, got in enumerate(ranks(2).run(gemma3_token_type_ids_without_blocks, 2, timeout=300)):
        print(f"rank {rank}: {got}")
        assert "'token_type_ids' was given to the forward under CP" in got["without"] and "block_ids" in got["without"]
        assert got["with"] == "taken, logits differ by 0.0e+00", got
        assert "'token_type_ids' was given to the forward under CP" in got["positional"], got

"""The vision tower spread over the CP group: what the tower keeps for backward per rank, against the CP size.

A Qwen2.5-VL (4 vision blocks, hidden 128, fp32) and a global batch of 2 rows holding 8 images of the same
size (16 x 16 patches each, 64 tokens), on 1, 2 and 4 CPU gloo ranks. Per rank: the bytes autograd keeps
from the media step (:func:`hyper_parallel.distributed.context_parallel.vision.media_embeddings_for_cp`:
this rank's images encoded, the token exchange), counted per storage while the result is alive
(``cost_model.saved_bytes``, the parameters excluded), and the images the rank encoded.

Prints a table and writes ``benchmarks/results/vlm_vision_memory.json`` (with the CPU).

    python benchmarks/vlm_vision_memory.py
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from _machine import cpu_name  # noqa: E402
from _pools import rows_of  # noqa: E402

IMAGES, GRID, S = 8, (1, 16, 16), 640


def one_rank(cp: int) -> dict:
    import torch
    import torch.distributed as dist
    import transformers as T

    from hyper_parallel.distributed.context_parallel.cost_model import saved_bytes
    from hyper_parallel.distributed.context_parallel.vision import assign_media, media_embeddings_for_cp
    from hyper_parallel.distributed.mesh import MeshContext, MeshSizes

    vc = dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=128, patch_size=2,
              spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[3], in_chans=3)
    tc = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]},
              max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg = T.Qwen2_5_VLConfig(vision_config=vc, text_config=tc, image_token_id=200, video_token_id=201,
                             vision_start_token_id=202, vision_end_token_id=203)
    torch.manual_seed(0)
    model = T.Qwen2_5_VLForConditionalGeneration(cfg).float().train()
    tokens = GRID[0] * GRID[1] * GRID[2] // 4
    ids = torch.randint(3, 200, (2, S), generator=torch.Generator().manual_seed(1))
    for k in range(IMAGES):          # 4 images per row, each with its start and end token
        b, j = divmod(k, IMAGES // 2)
        at = 2 + j * (tokens + 8)
        ids[b, at] = 202
        ids[b, at + 1:at + 1 + tokens] = 200
        ids[b, at + 1 + tokens] = 203
    grids = torch.tensor([GRID] * IMAGES)
    pix = torch.randn(IMAGES * GRID[0] * GRID[1] * GRID[2], 3 * 2 * 2 * 2)
    mesh = MeshContext.shared(MeshSizes(cp=cp)) if cp > 1 else None
    params = frozenset(p.untyped_storage()._cdata for p in model.parameters())
    kept = saved_bytes(lambda: media_embeddings_for_cp(model, ids, {"image": (pix, grids)},
                                                       mesh.cp_mesh if mesh else None, "all_gather"), exclude=params)
    rank = dist.get_rank() if dist.is_initialized() else 0
    owner = assign_media(grids.prod(-1).tolist(), cp)
    return {"cp": cp, "rank": rank, "images_encoded": sum(1 for o in owner if o == rank), "kept_bytes": kept}


def main() -> None:
    rows = rows_of([(cp, one_rank, (cp,)) for cp in (1, 2, 4)])
    base = max(r["kept_bytes"] for r in rows if r["cp"] == 1)
    print(f"{'cp':>3} {'rank':>4} {'images':>6} {'kept for backward':>18} {'/ cp 1':>7}")
    for r in rows:
        r["kept_over_cp1"] = r["kept_bytes"] / base
        print(f"{r['cp']:>3} {r['rank']:>4} {r['images_encoded']:>6} {r['kept_bytes'] / 1e6:>15.2f} MB {r['kept_over_cp1']:>7.3f}")
    out = os.path.join(ROOT, "benchmarks", "results", "vlm_vision_memory.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"cpu": cpu_name(), "images": IMAGES, "grid": GRID, "rows": rows}, f, indent=1)
    print(f"wrote {out} ({cpu_name()})")


if __name__ == "__main__":
    main()

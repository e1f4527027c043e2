"""Vision-language models under CP on real transformers classes (module-level: picklable for the pool).

A tiny Qwen2.5-VL or Qwen2-VL, a global batch of 2 rows holding images of several sizes; the CP run spreads the
vision tower over the CP group and exchanges each image token's embedding to the rank holding its
placeholder; compared with the same model on one rank (logits of every token, every gradient,
vision tower included, relative to the reference's largest).
"""
from __future__ import annotations

import torch

from hyper_parallel.distributed.context_parallel import shard_batch_for_cp
from hyper_parallel.distributed.context_parallel.meta import cp_batch_context
from hyper_parallel.distributed.context_parallel.vision import assign_media
from hyper_parallel.distributed.plan import ShardingPlanner, apply_sharding_plan

from tests.wrappers._workers import METHODS, _full, mesh_ctx

IMAGE, VIDEO, START, END = 100, 101, 102, 103
PATCH, MERGE, TPATCH = 2, 2, 2


def build_vlm(arch: str = "qwen2_5_vl"):
    """(model, one-rank reference) with identical weights: a tiny Qwen2.5-VL (windowed and full vision
    blocks), Qwen2-VL or Qwen3-VL (deepstack); 2 language layers with mrope."""
    import transformers as T

    if arch == "qwen2_5_vl":
        cls, cfg_cls = T.Qwen2_5_VLForConditionalGeneration, T.Qwen2_5_VLConfig
        vc = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=TPATCH, window_size=8, fullatt_block_indexes=[1],
                  in_chans=3)
    elif arch == "qwen3_vl":        # deepstack: the first block's features added in the first language layers
        cls, cfg_cls = T.Qwen3VLForConditionalGeneration, T.Qwen3VLConfig
        vc = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=TPATCH, deepstack_visual_indexes=[0],
                  num_position_embeddings=64, in_channels=3)
    else:
        cls, cfg_cls = T.Qwen2VLForConditionalGeneration, T.Qwen2VLConfig
        vc = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=TPATCH, in_channels=3)
    tc = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16,
              rope_scaling=({"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}
                            if arch == "qwen3_vl" else {"type": "mrope", "mrope_section": [2, 3, 3]}),
              max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg = cfg_cls(vision_config=vc, text_config=tc, image_token_id=IMAGE, video_token_id=VIDEO,
                  vision_start_token_id=START, vision_end_token_id=END)
    return twins(cls, cfg)


def twins(cls, cfg):
    """(model, one-rank reference): two fp32 ``cls(cfg)`` in train mode with identical weights (seed 0)."""
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls(cfg).float().train()
    ref = cls(cfg).float().train()
    ref.load_state_dict(model.state_dict())
    return model, ref


def image_batch(S: int = 48, seed: int = 3, video: bool = False):
    """2 rows of ``S`` tokens: row 0 holds images of 4 and 8 tokens near its start (and with ``video`` a
    video of 2 frames, 8 tokens, after them), row 1 an image of 16 near its end; random text around.
    -> ``(input_ids, {"image": (pixel_values, grid_thw)[, "video": ...]}, tokens per kind)``."""
    g = torch.Generator().manual_seed(seed)
    grids = {"image": torch.tensor([[1, 4, 4], [1, 4, 8], [1, 8, 8]])}
    if video:
        grids["video"] = torch.tensor([[2, 4, 4]])
    tokens = {k: [int(t * h * w) // MERGE ** 2 for t, h, w in v.tolist()] for k, v in grids.items()}
    ids = torch.randint(3, IMAGE, (2, S), generator=g)
    rows = (((3, [("image", 0), ("image", 1)] + ([("video", 0)] if video else [])), (S - 24, [("image", 2)])))
    for b, (start, items) in enumerate(rows):
        at = start
        for kind, i in items:
            n = tokens[kind][i]
            ids[b, at] = START
            ids[b, at + 1:at + 1 + n] = IMAGE if kind == "image" else VIDEO
            ids[b, at + 1 + n] = END
            at += n + 5
    media = {k: (torch.randn(int(v.prod(-1).sum()), 3 * TPATCH * PATCH * PATCH, generator=g), v)
             for k, v in grids.items()}
    return ids, media, tokens


def _plan(model, cp: int, method: str, match: str = "*.self_attn", mode: str | None = None):
    """(mesh, plan, model with CP applied) for ``method`` on every language-model attention (``match``);
    ``mode="validate"``: every CP call also checked against the module's own attention (validate mode)."""
    mesh = mesh_ctx(cp)
    entry = [{"match": match, "when": "cp", "region_dispatch": False, "inner_target": "self",
              "inner_wrapper": "sdpa_hf_balanced" if method == "balanced" else METHODS[method][1]}]
    plan = ShardingPlanner(plan_overrides=entry).plan(model, mesh, cp_size=cp)
    model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False, preflight_proof=False,
                                   **({"mode": mode} if mode else {}))
    return mesh, plan, model


def _cp_step(model, mesh, plan, ids, pos, media: dict, w, documents=None, block_ids=None, frozen=False):
    """The CP forward+backward of ``sum(logits * w)`` on this rank's shard, the media spread over the
    CP group (``block_ids``: the global rows' bidirectional blocks, Gemma 3); -> (local logits, batch meta)."""
    from hyper_parallel.distributed.context_parallel.vision import media_embeddings_for_cp

    local = shard_batch_for_cp({"input_ids": ids, "position_ids": pos}, mesh.cp_mesh, plan.batch_policy,
                               packed_documents=documents, block_ids=block_ids)
    meta, S = local.meta, ids.shape[1]
    feats = media_embeddings_for_cp(model, ids, media, mesh.cp_mesh, plan.batch_policy, frozen=frozen)
    with cp_batch_context(meta):
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False,
                       mm_encoder_outputs=feats).logits
        wl = torch.zeros(w.shape[0], meta.global_seq_len, w.shape[-1])
        wl[:, :S] = w
        (logits * wl.index_select(1, meta.q_index)).sum().backward()
    return logits.detach(), meta, local


def _errors(model, ref, logits, ref_logits, meta, mesh, S: int, tower: str = "visual") -> dict:
    """Logits of this rank's tokens and every gradient (summed over CP) against the reference, relative
    to its largest; the worst parameter and the vision tower's (parameters named with ``tower``) largest
    reference gradient."""
    from hyper_parallel import platform as P

    q = meta.q_index
    keep = q < S
    diff = (logits[:, keep] - ref_logits.detach()[:, q[keep]]).abs().max().item() if keep.any() else 0.0
    ref_params = dict(ref.named_parameters())
    gmax = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    gerr, worst, vis = 0.0, "", 0.0
    for name, p in model.named_parameters():
        g = P.all_reduce(p.grad if p.grad is not None else torch.zeros(p.shape), mesh.cp_group)
        rg = ref_params[name].grad
        e = (_full(g) - (rg if rg is not None else 0)).abs().max().item()
        if tower in name and rg is not None:
            vis = max(vis, rg.abs().max().item())
        if e >= gerr:
            gerr, worst = e, name
    return {"logits": diff / ref_logits.abs().max().item(), "grads": gerr / gmax, "worst": worst, "vision_grad_max": vis}


def vlm_parity(cp: int = 2, S: int = 48, method: str = "colossal", arch: str = "qwen2_5_vl", video: bool = False,
               frozen: bool = False) -> dict:
    """One forward+backward at ``cp`` with the CP ``method`` (colossal, ulysses, head_tail; balanced: the
    balanced split, whose shards hold non-contiguous placeholders) against one rank. ``frozen``: the tower
    frozen on both sides (``requires_grad`` off on the reference; ``frozen=True`` on the CP side)."""
    model, ref = build_vlm(arch)
    if frozen:
        for m in (model, ref):
            m.model.visual.requires_grad_(False)
    ids, media, tokens = image_batch(S, video=video)
    mtt = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    grids = {f"{k}_grid_thw": v[1] for k, v in media.items()}
    pos, _ = ref.model.get_rope_index(ids, mtt, **grids)
    V = ref.config.text_config.vocab_size
    w = torch.randn(2, S, V, generator=torch.Generator().manual_seed(9))
    pixels = {("pixel_values" if k == "image" else "pixel_values_videos"): v[0] for k, v in media.items()}
    ref_logits = ref(input_ids=ids, mm_token_type_ids=mtt, use_cache=False, **pixels, **grids).logits
    (ref_logits * w).sum().backward()

    mesh, plan, model = _plan(model, cp, method)
    logits, meta, local = _cp_step(model, mesh, plan, ids, pos, media, w, frozen=frozen)
    assert (meta.perm is not None) == (method == "balanced")
    owner = assign_media([r for k in media for r in media[k][1].prod(-1).tolist()], cp)
    return {**_errors(model, ref, logits, ref_logits, meta, mesh, S),
            "images_mine": [i for i, o in enumerate(owner) if o == mesh.cp_rank],
            "local_tokens": int(((local["input_ids"] == IMAGE) | (local["input_ids"] == VIDEO)).sum()),
            "tower_grads": sum(p.grad is not None for p in model.model.visual.parameters())}

def _sample(n: int, images: list, g) -> torch.Tensor:
    """One sample of ``n`` tokens with the given images' placeholder runs (``images``: token counts)."""
    ids = torch.randint(3, IMAGE, (n,), generator=g)
    at = 2
    for t in images:
        ids[at], ids[at + 1:at + 1 + t], ids[at + 1 + t] = START, IMAGE, END
        at += t + 4
    return ids


def packed_parity(cp: int = 2, method: str = "colossal") -> dict:
    """Packed multimodal rows: row 0 = a text-only sample (16 tokens) + a sample with a 4-token image
    (32), row 1 = a sample with images of 8 and 16 tokens (48). Positions per sample from the model's
    get_rope_index (it does not know packing), concatenated as transformers' 4-row layout (row 0 the
    text positions, restarting per sample: the documents). Reference: the same packed rows on one rank."""
    model, ref = build_vlm("qwen2_5_vl")
    g = torch.Generator().manual_seed(5)
    grids = torch.tensor([[1, 4, 4], [1, 4, 8], [1, 8, 8]])
    rows = [[(_sample(16, [], g), []), (_sample(32, [4], g), [0])], [(_sample(48, [8, 16], g), [1, 2])]]
    ids, pos = [], []
    for row in rows:
        r_ids, r_pos = [], []
        for s, imgs in row:
            mtt = (s == IMAGE).int()[None]
            if imgs:
                p3, _ = ref.model.get_rope_index(s[None], mtt, image_grid_thw=grids[imgs])
            else:
                p3 = torch.arange(s.numel())[None, None].expand(3, 1, -1)
            r_ids.append(s)
            r_pos.append(torch.cat([torch.arange(s.numel())[None, None], p3]))      # [4, 1, n]
        ids.append(torch.cat(r_ids))
        pos.append(torch.cat(r_pos, dim=2))
    ids, pos = torch.stack(ids), torch.cat(pos, dim=1)                                  # [2, 48], [4, 2, 48]
    S, V = ids.shape[1], ref.config.text_config.vocab_size
    pix = torch.randn(int(grids.prod(-1).sum()), 3 * TPATCH * PATCH * PATCH, generator=g)
    w = torch.randn(2, S, V, generator=torch.Generator().manual_seed(9))
    ref_logits = ref(input_ids=ids, position_ids=pos, pixel_values=pix, image_grid_thw=grids, use_cache=False).logits
    (ref_logits * w).sum().backward()
    with torch.no_grad():       # what the packed row means: row 0's second sample as if it were alone
        rows0 = int(grids[0].prod())
        alone = ref(input_ids=ids[:1, 16:], position_ids=pos[:, :1, 16:], pixel_values=pix[:rows0],
                    image_grid_thw=grids[:1], use_cache=False).logits
    alone_diff = (alone[0] - ref_logits.detach()[0, 16:]).abs().max().item()

    mesh, plan, model = _plan(model, cp, method)
    logits, meta, _local = _cp_step(model, mesh, plan, ids, pos, {"image": (pix, grids)}, w,
                                    documents="as_transformers")
    docs = int(meta.key_doc.max()) + 1 if meta.key_doc is not None else 1
    return {**_errors(model, ref, logits, ref_logits, meta, mesh, S), "documents": docs, "alone": alone_diff}

"""Three more vision-language families under CP (module-level: picklable for the pool): LLaVA (a CLIP
tower + projector, 1-D positions, one image size), the full Qwen3.5 / Qwen3.5-MoE class (the hybrid
Gated-DeltaNet + attention decoder, declared as the text path declares it) and Qwen3-VL videos (frames
separated by timestamp text). Each rank encodes its media, the tokens are exchanged, the language
model runs under CP; logits of every token and every gradient (vision tower included) against the
same model on one rank (tests/vlm/_workers.py's step and errors).
"""
from __future__ import annotations

import torch

from hyper_parallel.distributed.context_parallel.vision import assign_media, vision_tower
from hyper_parallel.distributed.plan import ShardingPlanner, apply_sharding_plan

from tests.vlm._workers import END, IMAGE, MERGE, PATCH, START, TPATCH, VIDEO, _cp_step, _errors, build_vlm, twins
from tests.wrappers._workers import METHODS, mesh_ctx

LLAVA_SIZE, LLAVA_PATCH = 8, 2          # every LLaVA image 8 x 8 pixels: 16 patches
GDN = {"colossal": "gated_deltanet_state_passing", "ulysses": "gated_deltanet_ulysses"}


def build_family(arch: str, strategy: str = "default"):
    """(model, one-rank reference) with identical weights: ``llava`` (CLIP tower of 3 layers, features of
    ``strategy`` from layer -2, or with ``"full"`` layers -3 and -1 concatenated; a 2-layer Llama),
    ``qwen3_5`` / ``qwen3_5_moe`` (2 vision blocks; language layers GDN / attention / GDN with 3-D mrope)
    or ``qwen3_vl`` (tests/vlm/_workers.py's)."""
    import transformers as T

    if arch == "qwen3_vl":
        return build_vlm("qwen3_vl")
    special = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llava":
        vc = T.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                                image_size=LLAVA_SIZE, patch_size=LLAVA_PATCH, projection_dim=32)
        tc = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                           **special)
        cfg = T.LlavaConfig(vision_config=vc, text_config=tc, image_token_id=IMAGE,
                            vision_feature_select_strategy=strategy,
                            vision_feature_layer=-2 if strategy == "default" else [-3, -1])
        cls = T.LlavaForConditionalGeneration
    else:
        text = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, layer_types=["linear_attention", "full_attention", "linear_attention"],
                    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_conv_kernel_dim=4, max_position_embeddings=512,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                     "mrope_section": [2, 1, 1], "mrope_interleaved": True}, **special)
        vision = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                      patch_size=PATCH, temporal_patch_size=TPATCH, spatial_merge_size=MERGE,
                      num_position_embeddings=64, in_channels=3)
        if arch == "qwen3_5_moe":
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32)
            cfg_cls, cls = T.Qwen3_5MoeConfig, T.Qwen3_5MoeForConditionalGeneration
        else:
            text.update(intermediate_size=64)
            cfg_cls, cls = T.Qwen3_5Config, T.Qwen3_5ForConditionalGeneration
        cfg = cfg_cls(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                      vision_start_token_id=START, vision_end_token_id=END)
    return twins(cls, cfg)


# ------------------------------------------------------------------------------------------- batches
def media_of(arch: str, cfg, items: list, g) -> tuple:
    """``(media, runs)`` for ``items`` (``("image" | "video", (t, h, w))`` patch grids; a LLaVA image: its
    fixed ``(H, W)`` in pixels): ``media`` as ``media_embeddings_for_cp`` takes it, and per item the token
    ids it lays out: LLaVA's image tokens alone; a Qwen image ``START tokens END``; a Qwen3 video frame by
    frame, each frame ``<2 timestamp tokens> START frame END`` (the processor's layout), so one video's
    placeholders are not contiguous."""
    from hyper_parallel.models.llava.vision import tokens_per_image

    media = {}
    for kind in ("image", "video"):
        gl = [grid for k, grid in items if k == kind]
        if gl:
            grid = torch.tensor(gl)
            pv = (torch.randn(len(gl), 3, LLAVA_SIZE, LLAVA_SIZE, generator=g) if arch == "llava" else
                  torch.randn(int(grid.prod(-1).sum()), 3 * TPATCH * PATCH * PATCH, generator=g))
            media[kind] = (pv, grid)
    runs = []
    for kind, grid in items:
        if arch == "llava":
            runs.append([IMAGE] * tokens_per_image(cfg))
        elif kind == "image":
            runs.append([START] + [IMAGE] * (grid[1] * grid[2] // MERGE ** 2) + [END])
        else:
            t, h, w = grid
            runs.append([tok for _f in range(t) for tok in [int(x) for x in torch.randint(3, IMAGE, (2,), generator=g)]
                         + [START] + [VIDEO] * (h * w // MERGE ** 2) + [END]])
    return media, runs


def lay_out(runs_per_row: list, S: int, g) -> torch.Tensor:
    """``[B, S]`` ids: per row, ``(start, run)`` placed at ``start``, random text elsewhere."""
    ids = torch.randint(3, IMAGE, (len(runs_per_row), S), generator=g)
    for b, row in enumerate(runs_per_row):
        for start, run in row:
            ids[b, start:start + len(run)] = torch.tensor(run)
    return ids


def family_batch(arch: str, model, S: int = 64, seed: int = 3, video: bool = False) -> tuple:
    """2 rows of ``S``: row 0 an image near its start (and with ``video`` a 2-frame video across the
    middle, so its frames land on both CP 2 shards), row 1 two images; Qwen images of 4, 8 and 16 tokens,
    LLaVA's of its fixed size. -> ``(input_ids, media, positions)``, positions from the model's own
    ``get_rope_index`` (Qwen) or ``arange`` (LLaVA)."""
    g = torch.Generator().manual_seed(seed)
    if arch == "llava":
        items = [("image", (LLAVA_SIZE, LLAVA_SIZE))] * 3
    else:
        items = [("image", (1, 4, 4)), ("image", (1, 4, 8)), ("image", (1, 8, 8))] + [("video", (2, 4, 4))] * video
    media, runs = media_of(arch, model.config, items, g)
    rows = [[(2, runs[0])] + ([(20, runs[3])] if video else []), [(3, runs[1]), (S - len(runs[2]) - 4, runs[2])]]
    ids = lay_out(rows, S, g)
    return ids, media, positions(arch, model, ids, media)


def positions(arch: str, model, ids: torch.Tensor, media: dict) -> torch.Tensor:
    """The model's positions for rows ``ids`` holding ``media``: 1-D for LLaVA, else get_rope_index's 3-D ids."""
    if arch == "llava":
        return torch.arange(ids.shape[1]).expand(ids.shape[0], -1).clone()
    mtt = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    grids = {f"{k}_grid_thw": v[1] for k, v in media.items()}
    return model.model.get_rope_index(ids, mtt, **grids)[0]


def ref_inputs(arch: str, media: dict) -> dict:
    """The reference forward's media keywords (the model encodes on one rank)."""
    if arch == "llava":
        return {"pixel_values": media["image"][0]} if media else {}
    out = {}
    for k, (pv, grid) in media.items():
        out["pixel_values" if k == "image" else "pixel_values_videos"] = pv
        out[f"{k}_grid_thw"] = grid
    return out


# ------------------------------------------------------------------------------------------- CP runs
def _plan(model, arch: str, cp: int, method: str, documents=None):
    """(mesh, plan, model with CP applied): ``method`` on the language model's attentions (``*.self_attn``:
    the registered tower's own ``self_attn`` modules — LLaVA's CLIP — are left out by the planner) and,
    for Qwen3.5, the Gated DeltaNet layers declared as the text path declares them."""
    mesh = mesh_ctx(cp)
    base = {"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self"}
    entry = [{**base, "inner_wrapper": METHODS[method][1]}]
    if arch.startswith("qwen3_5"):
        entry.append({**base, "match": "*.linear_attn", "inner_wrapper": GDN[method]})
    plan = ShardingPlanner(plan_overrides=entry, packed_documents=documents).plan(model, mesh, cp_size=cp)
    model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False, preflight_proof=False)
    return mesh, plan, model


def family_parity(arch: str, cp: int = 2, method: str = "colossal", video: bool = False, S: int = 64,
                  strategy: str = "default") -> dict:
    """One forward+backward at ``cp`` against one rank on the same global rows."""
    model, ref = build_family(arch, strategy)
    ids, media, pos = family_batch(arch, ref, S, video=video)
    w = torch.randn(2, S, ref.config.text_config.vocab_size, generator=torch.Generator().manual_seed(9))
    extra = {} if arch == "llava" else {"mm_token_type_ids": (ids == IMAGE).int() + 2 * (ids == VIDEO).int()}
    ref_logits = ref(input_ids=ids, use_cache=False, **extra, **ref_inputs(arch, media)).logits
    (ref_logits * w).sum().backward()

    mesh, plan, model = _plan(model, arch, cp, method)
    cp_targets = sorted(t.fqn for t in plan.cp_targets)
    logits, meta, local = _cp_step(model, mesh, plan, ids, pos, media, w)
    tower = vision_tower(model)
    owner = assign_media([int(r) for k in media for r in tower.rows(media[k][1])], cp)
    kinds = {IMAGE: "image", VIDEO: "video"}
    in_shard = {kinds[t]: int((local["input_ids"] == t).sum()) for t in kinds}
    return {**_errors(model, ref, logits, ref_logits, meta, mesh, S, tower=tower.prefix),
            "media_mine": [i for i, o in enumerate(owner) if o == mesh.cp_rank], "in_shard": in_shard,
            "tokens": {k: int((ids == t).sum()) for t, k in kinds.items()}, "cp_targets": cp_targets,
            "tower": tower.prefix}


def _sample(arch: str, cfg, n: int, items: list, g) -> tuple:
    """One sample of ``n`` tokens holding ``items`` after 2 text tokens (``media_of``) -> (ids [n], media)."""
    media, runs = media_of(arch, cfg, items, g)
    ids = torch.randint(3, IMAGE, (n,), generator=g)
    at = 2
    for run in runs:
        ids[at:at + len(run)] = torch.tensor(run)
        at += len(run) + 2
    return ids, media


def packed_family_parity(arch: str, cp: int = 2, method: str = "colossal") -> dict:
    """Packed rows, ``independent`` documents: row 0 = a text-only sample (16 tokens) + a multimodal
    sample (32: an image, for Qwen3-VL a 2-frame video), row 1 = one multimodal sample (48: two images).
    Positions per sample (LLaVA: ``arange`` restarting per sample; Qwen: the sample's own get_rope_index
    ids in transformers' 4-row layout, row 0 the text positions restarting — the documents), media in
    row-major order. Reference: each sample alone on one rank (the meaning of a packed row; transformers'
    Gated DeltaNet does not split a row into documents), its logits and the sum of its gradients."""
    model, ref = build_family(arch)
    g = torch.Generator().manual_seed(5)
    mm0 = [("video", (2, 4, 4))] if arch == "qwen3_vl" else \
        [("image", (LLAVA_SIZE, LLAVA_SIZE) if arch == "llava" else (1, 4, 4))]
    mm1 = [("image", (LLAVA_SIZE, LLAVA_SIZE))] * 2 if arch == "llava" else [("image", (1, 4, 8)), ("image", (1, 8, 8))]
    rows = [[(16, []), (32, mm0)], [(48, mm1)]]
    samples, ids, pos = [], [], []
    for b, row in enumerate(rows):
        r_ids, r_pos, at = [], [], 0
        for n, items in row:
            s, media = _sample(arch, ref.config, n, items, g)
            p = positions(arch, ref, s[None], media)                     # [1, n] or [3, 1, n]
            if arch != "llava":
                p = torch.cat([torch.arange(n)[None, None], p])          # [4, 1, n]: the text row first
            samples.append((b, at, s, media, p))
            r_ids.append(s)
            r_pos.append(p)
            at += n
        ids.append(torch.cat(r_ids))
        pos.append(torch.cat(r_pos, dim=-1))
    ids, pos = torch.stack(ids), torch.cat(pos, dim=-2)                  # [2, 48], [2, 48] or [4, 2, 48]
    S, V = ids.shape[1], ref.config.text_config.vocab_size
    w = torch.randn(2, S, V, generator=torch.Generator().manual_seed(9))
    ref_logits = torch.zeros(2, S, V)
    for b, at, s, media, p in samples:          # the reference: each sample alone, one rank
        out = ref(input_ids=s[None], position_ids=p, use_cache=False, **ref_inputs(arch, media)).logits
        (out[0] * w[b, at:at + s.numel()]).sum().backward()
        ref_logits[b, at:at + s.numel()] = out[0].detach()
    glob = {}                                   # the global media, in row-major order of their placeholders
    for _b, _at, _s, media, _p in samples:
        for k, (pv, grid) in media.items():
            glob.setdefault(k, []).append((pv, grid))
    glob = {k: (torch.cat([m[0] for m in v]), torch.cat([m[1] for m in v])) for k, v in glob.items()}

    mesh, plan, model = _plan(model, arch, cp, method, documents="independent")
    logits, meta, _local = _cp_step(model, mesh, plan, ids, pos, glob, w, documents="independent")
    docs = int(meta.key_doc.max()) + 1 if meta.key_doc is not None else 1
    return {**_errors(model, ref, logits, ref_logits, meta, mesh, S, tower=vision_tower(model).prefix),
            "documents": docs}


# ------------------------------------------------------------------------------------------- refusals
def build_mllama():
    """A tiny Mllama (a cross-attention VLM: the language model attends to the tower's features through
    cross-attention layers), on the meta device: planning only."""
    import transformers as T

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                  image_size=16, patch_size=4, vision_output_dim=64, max_num_tiles=2, intermediate_layers_indices=[0],
                  supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, cross_attention_layers=[1], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):           # planning reads the module tree only
        return T.MllamaForConditionalGeneration(T.MllamaConfig(vision_config=vision, text_config=text))

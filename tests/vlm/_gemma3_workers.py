"""Gemma 3 (``Gemma3ForConditionalGeneration``) under CP, module-level for the rank pool.

A tiny Gemma 3: a 1-layer SigLIP on 8x8 images (16 patches, average-pooled to ``mm_tokens_per_image = 4``
tokens), 2 language layers (one sliding-window, one full), 2 rows of 32 tokens holding 5 images placed so
that images cross the CP shard edges (contiguous halves and quarters, and the Head-Tail sub-chunks). The
reference is the same model on one rank, in train mode, given ``token_type_ids`` (so transformers builds
its bidirectional image masks); the CP run carries the same visibility as block ids of the global rows.
"""
from __future__ import annotations

import torch

from tests.vlm._workers import _cp_step, _errors, _plan

IMAGE, BOI, EOI = 100, 101, 102
TOKENS = 4           # mm_tokens_per_image
WINDOW = 3           # sliding window, shorter than an image: the window cuts inside a block
# (row, first placeholder) of each image: row 0 crosses the CP=2 edge at 16 (14..17) and the CP=4 edge at 8
# (7..10); row 1 crosses 24 (22..25) and holds one image in a single shard (3..6) and one at the row's end
PLACES = [(0, 7), (0, 14), (1, 3), (1, 22), (1, 27)]


def build_gemma3():
    """(model, one-rank reference) with identical weights; the projector's weight (zero at init in
    transformers) drawn at random, so the images reach the language model and the tower gets gradients."""
    import transformers as T

    tc = T.Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                            layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
                            attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vc = T.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=8, patch_size=2, num_channels=3, vision_use_head=False, attention_dropout=0.0)
    cfg = T.Gemma3Config(text_config=tc, vision_config=vc, mm_tokens_per_image=TOKENS, image_token_index=IMAGE,
                         boi_token_index=BOI, eoi_token_index=EOI)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = T.Gemma3ForConditionalGeneration(cfg).float().train()
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.5)
    ref = T.Gemma3ForConditionalGeneration(cfg).float().train()
    ref.load_state_dict(model.state_dict())
    return model, ref


def gemma3_batch(S: int = 32, seed: int = 3, shift: int = 0):
    """``(input_ids [2, S], pixel_values [5, 3, 8, 8])``: BOI, 4 placeholders, EOI per image at PLACES
    (moved ``shift`` tokens right)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, IMAGE, (2, S), generator=g)
    for b, at in PLACES:
        at += shift
        ids[b, at - 1], ids[b, at:at + TOKENS], ids[b, (at + TOKENS) % S] = BOI, IMAGE, EOI
    return ids, torch.randn(len(PLACES), 3, 8, 8, generator=g)


def gemma3_parity(cp: int = 2, method: str = "colossal", mode: str | None = None) -> dict:
    """One forward+backward at ``cp`` with ``method`` against one rank; also how much the bidirectional
    part moves the reference's logits (``token_type_ids`` given vs not). The balanced split pads rows to
    128 and holds halves of them: its rows are 128 tokens with the images moved to cross 64. ``mode="validate"``: each CP
    attention call is also compared with the layer's own attention under transformers' mask built with the
    blocks (raises on a mismatch)."""
    from hyper_parallel.models.gemma3 import image_block_ids, image_media

    model, ref = build_gemma3()
    ids, pix = gemma3_batch(128, shift=50) if method == "balanced" else gemma3_batch()
    S, V = ids.shape[1], ref.config.text_config.vocab_size
    tt = (ids == IMAGE).long()
    w = torch.randn(2, S, V, generator=torch.Generator().manual_seed(9))
    ref_logits = ref(input_ids=ids, pixel_values=pix, token_type_ids=tt, use_cache=False).logits
    (ref_logits * w).sum().backward()
    with torch.no_grad():
        causal_only = ref(input_ids=ids, pixel_values=pix, use_cache=False).logits
    bidir = ((causal_only - ref_logits.detach()).abs().max() / ref_logits.detach().abs().max()).item()

    mesh, plan, model = _plan(model, cp, method, match="model.language_model.layers.*.self_attn", mode=mode)
    pos = torch.arange(S).expand(2, S)
    blocks = image_block_ids(ids, model.config)
    logits, meta, local = _cp_step(model, mesh, plan, ids, pos, {"image": image_media(pix)}, w, block_ids=blocks)
    return {**_errors(model, ref, logits, ref_logits, meta, mesh, S, tower="vision_tower"), "bidirectional": bidir,
            "local_tokens": int((local["input_ids"] == IMAGE).sum()), "blocks": int(blocks.max()) + 1}


# packed rows (``gemma3_packed_parity``): (row, start, length, first placeholder of each image, local to the
# sample); row 0 = a text-only sample + a sample whose image crosses the CP=2 edge at 16 (14..17), row 1 = one
# sample with two images (5..8 in one shard, 14..17 across the edge)
PACKED = [(0, 0, 10, []), (0, 10, 22, [4]), (1, 0, 32, [5, 14])]


def gemma3_packed_parity(cp: int = 2, method: str = "colossal") -> dict:
    """Packed multimodal rows (:data:`PACKED`), positions restarting per sample, against each sample run
    alone on one rank (with its own images and ``token_type_ids``): logits of every token and every
    gradient (tower included). The CP side is declared ``packed_documents="independent"`` and carries the
    image blocks of the global rows. Transformers' own packed row is not the reference: its sliding layer
    reads the image blocks at the samples' restarting positions instead of the row's indices, so an image
    of a later sample loses its bidirectional part there; how far that row is from the samples alone is
    returned (``transformers_packed``), with how much the bidirectional part moves the samples alone."""
    from hyper_parallel.models.gemma3 import image_block_ids, image_media

    model, ref = build_gemma3()
    g = torch.Generator().manual_seed(5)
    S, V = 32, ref.config.text_config.vocab_size
    ids, pos = torch.zeros(2, S, dtype=torch.long), torch.zeros(2, S, dtype=torch.long)
    for b, at, n, images in PACKED:
        s = torch.randint(3, IMAGE, (n,), generator=g)
        for i in images:
            s[i - 1], s[i:i + TOKENS], s[i + TOKENS] = BOI, IMAGE, EOI
        ids[b, at:at + n], pos[b, at:at + n] = s, torch.arange(n)
    pix = torch.randn(sum(len(p[3]) for p in PACKED), 3, 8, 8, generator=g)
    w = torch.randn(2, S, V, generator=torch.Generator().manual_seed(9))

    ref_logits, first, bidir = torch.zeros(2, S, V), 0, 0.0
    for b, at, n, images in PACKED:        # the reference: each sample alone, its gradients summed
        s, px = ids[b:b + 1, at:at + n], pix[first:first + len(images)]
        kw = {"pixel_values": px, "token_type_ids": (s == IMAGE).long()} if images else {}
        out = ref(input_ids=s, use_cache=False, **kw).logits
        (out * w[b:b + 1, at:at + n]).sum().backward()
        ref_logits[b, at:at + n] = out[0].detach()
        if images:
            with torch.no_grad():
                causal = ref(input_ids=s, pixel_values=px, use_cache=False).logits
            bidir = max(bidir, ((causal - out.detach()).abs().max() / out.detach().abs().max()).item())
        first += len(images)
    with torch.no_grad():
        packed = ref(input_ids=ids, position_ids=pos, pixel_values=pix, token_type_ids=(ids == IMAGE).long(),
                     use_cache=False).logits
    hf_packed = ((packed - ref_logits).abs().max() / ref_logits.abs().max()).item()

    mesh, plan, model = _plan(model, cp, method, match="model.language_model.layers.*.self_attn")
    blocks = image_block_ids(ids, model.config)
    logits, meta, local = _cp_step(model, mesh, plan, ids, pos, {"image": image_media(pix)}, w,
                                   documents="independent", block_ids=blocks)
    docs = int(meta.key_doc.max()) + 1 if meta.key_doc is not None else 1
    return {**_errors(model, ref, logits, ref_logits, meta, mesh, S, tower="vision_tower"), "documents": docs,
            "local_tokens": int((local["input_ids"] == IMAGE).sum()), "bidirectional": bidir,
            "transformers_packed": hf_packed}


def gemma3_token_type_ids_without_blocks(cp: int = 2) -> dict:
    """The CP forward given the shard's ``token_type_ids`` directly, without block ids in the batch (what
    a plain transformers loop passes): refused at the forward's entry (the message), and given with
    block ids it is taken (the logits equal the run without it)."""
    from hyper_parallel.distributed.context_parallel import cp_batch_context, shard_batch_for_cp
    from hyper_parallel.distributed.context_parallel.vision import media_embeddings_for_cp
    from hyper_parallel.models.gemma3 import image_block_ids, image_media

    model, _ = build_gemma3()
    ids, pix = gemma3_batch()
    mesh, plan, model = _plan(model, cp, "colossal", match="model.language_model.layers.*.self_attn")
    pos = torch.arange(ids.shape[1]).expand(2, -1)
    tt = (ids == IMAGE).long()
    out = {}
    for name, blocks in (("without", None), ("with", image_block_ids(ids, model.config))):
        local = shard_batch_for_cp({"input_ids": ids, "position_ids": pos, "token_type_ids": tt}, mesh.cp_mesh,
                                   plan.batch_policy, block_ids=blocks, passthrough=("token_type_ids",))
        feats = media_embeddings_for_cp(model, ids, {"image": image_media(pix)}, mesh.cp_mesh, plan.batch_policy)
        local_tt = tt.index_select(1, local.meta.q_index.clamp(max=ids.shape[1] - 1))
        with cp_batch_context(local.meta), torch.no_grad():
            try:
                logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False,
                               mm_encoder_outputs=feats, token_type_ids=local_tt).logits
                plain = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False,
                              mm_encoder_outputs=feats).logits
                out[name] = f"taken, logits differ by {(logits - plain).abs().max().item():.1e}"
            except ValueError as exc:
                out[name] = str(exc)
        if blocks is None:               # the same input given by position
            import inspect

            params = list(inspect.signature(type(model).forward).parameters)[1:]
            pos_args = [None] * params.index("token_type_ids") + [local_tt]
            pos_args[params.index("input_ids")] = local["input_ids"]
            pos_args[params.index("position_ids")] = local["position_ids"]
            with cp_batch_context(local.meta), torch.no_grad():
                try:
                    model(*pos_args, use_cache=False, mm_encoder_outputs=feats)
                    out["positional"] = "taken"
                except ValueError as exc:
                    out["positional"] = str(exc)
    return out

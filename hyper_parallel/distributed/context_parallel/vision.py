"""A vision-language model's media under CP: the vision tower spread over the CP group, each rank
receiving the embeddings of the media tokens in its own sequence shard (docs/vlm.md).

A VLM family registers its tower (:func:`register_vision_tower`, from ``models/<model_type>/``): where
it lives, its placeholder token, how many tokens a medium encodes to, and how to encode a list of
media. Only then does the planner accept the model at ``cp_size > 1`` (the tower's attention runs per
rank on whole media, not under CP); :func:`media_embeddings_for_cp` is the step's entry point.

Every CP rank holds the same global batch. :func:`assign_media` gives each image to a rank, balancing
the patch rows the tower encodes; :func:`exchange_media_tokens` sends each encoded token's embedding to
the rank whose shard holds its placeholder (a dropless uneven all-to-all; backward: the reverse
exchange, so each image's gradient returns to the rank that encoded it and the tower's backward runs
there), in the order transformers' ``masked_scatter`` fills the rank's local ``[B, L]`` placeholders.
A rank that encodes nothing still joins both exchanges.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
from typing import Callable, Optional

import torch

from .batch import shard_batch_for_cp
from .comm.primitives import AllToAllUneven, resolve_group
from .meta import current_cp_batch_meta

__all__ = ["MediaKind", "MediaInputs", "VisionTower", "register_vision_tower", "vision_tower", "assign_media",
           "exchange_media_tokens", "media_token_layout", "media_embeddings_for_cp", "media_input_names", "media_module",
           "install_block_input_guard"]

_MEDIA_INPUT = re.compile(r"pixel_values|flattened_patches|image_patches")      # transformers' media inputs
_MEDIA_MODULE = re.compile(r"vision|visual|vq|image|patch|img", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class MediaKind:
    """One kind of medium of a tower (``"image"``, ``"video"``): its placeholder ``token_id(config)``;
    ``encode(model, pixel_values, grid_thw)`` -> the list of per-token tensors of those media, each
    ``[tokens, w]`` in order (the embeddings, then any per-token extras such as Qwen3-VL's deepstack
    features); ``widths(config)`` -> their ``w``; ``wrap(tensors)`` -> the model's encoder output for
    ``mm_encoder_outputs`` built from this rank's rows of each; ``check(config, pixel_values, grid_thw)``
    (optional) raises ``ValueError`` on media the tower cannot encode (every rank, before any exchange)."""

    token_id: Callable
    encode: Callable
    widths: Callable
    wrap: Callable
    check: Optional[Callable] = None


@dataclasses.dataclass(frozen=True)
class MediaInputs:
    """How a family turns raw media into its model inputs (the trainer's media source, docs/vlm.md):
    ``preprocess(config, kind, items, max_pixels)`` -> ``(pixel_values, grid_thw)`` of a list of media
    (an image: a PIL image; a video: a list of PIL frames), the model's own image processor built from
    ``config`` (nothing downloaded); ``placeholders(config, kind, tokens)`` -> the token ids one medium of
    ``tokens`` tokens takes in the text; ``positions(model, input_ids [1, n], grids)`` -> the sample's
    ``[3, 1, n]`` rope positions (``grids``: kind -> grid_thw of its media, in order)."""

    preprocess: Callable
    placeholders: Callable
    positions: Callable


@dataclasses.dataclass(frozen=True)
class VisionTower:
    """A VLM family's media path: ``prefix`` (the tower's module path: its attentions are not CP
    boundaries), ``kinds`` (name -> :class:`MediaKind`, the keys of transformers' ``mm_encoder_outputs``),
    ``tokens(config, grid_thw)`` (tokens per medium), ``rows(grid_thw)`` (``pixel_values`` rows per
    medium), ``inputs`` (:class:`MediaInputs`, or None: the trainer's media source refuses the family) and
    ``block_input`` (the model-forward input through which transformers makes tokens attend
    bidirectionally, e.g. Gemma 3's ``token_type_ids``, or None: :func:`install_block_input_guard`)."""

    prefix: str
    kinds: dict
    tokens: Callable
    rows: Callable
    inputs: Optional[MediaInputs] = None
    block_input: Optional[str] = None

    def holds(self, fqn: str) -> bool:
        """Whether module ``fqn`` belongs to the tower (not a CP boundary, not a CP rotary module)."""
        return fqn.startswith(self.prefix + ".")


_TOWERS: dict = {}


def register_vision_tower(model_type: str, tower: VisionTower) -> None:
    """Register ``model_type``'s tower (from its ``models/<model_type>/`` folder)."""
    _TOWERS[model_type] = tower


def vision_tower(model) -> Optional[VisionTower]:
    """The registered tower of ``model``'s ``config.model_type``, or None."""
    return _TOWERS.get(getattr(getattr(model, "config", None), "model_type", None))


def carried_towers(with_inputs: bool = False) -> tuple:
    """The model types whose media are carried under CP (for messages); ``with_inputs``: only those
    whose raw media the trainer's media source can read (:class:`MediaInputs` registered)."""
    return tuple(t for t, v in _TOWERS.items() if v.inputs is not None or not with_inputs)


def install_block_input_guard(model, replace_forward: Callable) -> None:
    """Refuse the tower's ``block_input`` (e.g. Gemma 3's ``token_type_ids``) given to ``model.forward``
    (by keyword or position) under a CP batch meta without bidirectional blocks: the model would build
    its mask from it, which the CP attention never reads (it takes visibility from
    ``CPBatchMeta.key_block`` only), so the images would silently attend causally. Raised at the
    forward's entry, on every rank given the input, before the forward's own collectives. Outside a CP
    batch (no meta) the forward is the model's. The fix: the blocks as
    ``shard_batch_for_cp(..., block_ids=...)`` (the input may then stay)."""
    tower = vision_tower(model)
    name = getattr(tower, "block_input", None)
    if name is None:
        return
    original = model.forward
    signature = inspect.signature(original)

    def forward(*args, **kwargs):
        meta = current_cp_batch_meta(required=False)
        if meta is not None and meta.key_block is None:
            given = kwargs[name] if name in kwargs else signature.bind_partial(*args).arguments.get(name)
            if given is not None:
                raise ValueError(
                    f"{type(model).__name__}: '{name}' was given to the forward under CP, but the CP batch carries no "
                    f"bidirectional blocks; the CP attention reads visibility from the batch meta only, so the image "
                    f"tokens would attend causally. Fix: pass the blocks as shard_batch_for_cp(..., block_ids="
                    f"image_block_ids(input_ids, config)) of the global rows ('{name}' may then stay; docs/vlm.md, "
                    "'Gemma 3')")
        return original(*args, **kwargs)

    forward.__wrapped__ = original
    replace_forward(model, forward)


def media_input_names(model) -> list:
    """The parameters of ``model.forward`` that take images or video (``pixel_values``, ``image_patches``,
    ...): a model with any is a VLM, planned at cp > 1 only with its tower registered."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return []
    return [p for p in params if _MEDIA_INPUT.search(p)]


def media_module(model) -> str:
    """The path of ``model``'s outermost module named like a media encoder (vision, visual, vq, image,
    patch), or ``""`` (for messages)."""
    for fqn, _ in model.named_modules():
        if fqn and _MEDIA_MODULE.search(fqn.rsplit(".", 1)[-1]):
            return fqn
    return ""


def assign_media(cost: list, cp_size: int) -> list:
    """Rank of each medium (largest first to the least loaded rank; ties to the lower rank)."""
    load, owner = [0] * cp_size, [0] * len(cost)
    for i in sorted(range(len(cost)), key=lambda i: (-cost[i], i)):
        r = min(range(cp_size), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + cost[i]
    return owner


def media_token_layout(input_ids: torch.Tensor, token_id: int, tokens: list, cp_size: int, policy) -> tuple:
    """``(medium, offset, needs)``: for every placeholder of ``token_id`` in the global ``input_ids``
    ``[B, S]`` (row-major order: the order of the media's tokens), its medium and index in it; and per
    CP rank the placeholders its shard holds, in its local row-major order (the order ``masked_scatter``
    fills them), as indices into that list."""
    where = (input_ids == token_id)
    if int(where.sum()) != sum(tokens):
        raise ValueError(f"{int(where.sum())} placeholder tokens (id {token_id}) in the batch, but the media encode "
                         f"to {sum(tokens)} ({tokens} per medium): give each medium its placeholders")
    medium = torch.repeat_interleave(torch.arange(len(tokens)), torch.tensor(tokens))
    offset = torch.cat([torch.arange(n) for n in tokens]) if tokens else torch.zeros(0, dtype=torch.long)
    ordinal = torch.full(input_ids.shape, -1, dtype=torch.long)
    ordinal[where] = torch.arange(int(where.sum()))
    S = input_ids.shape[1]
    needs = []
    for r in range(cp_size):
        q = shard_batch_for_cp({"input_ids": input_ids}, (r, cp_size), policy).meta.q_index
        q = q[q < S]
        local = ordinal[:, q]                             # [B, L_r] in local row-major order
        needs.append(local[local >= 0])
    return medium, offset, needs


def exchange_media_tokens(embeds: torch.Tensor, owner: list, medium: torch.Tensor, offset: torch.Tensor,
                          needs: list, tokens: list, cp_mesh) -> torch.Tensor:
    """This rank's placeholder embeddings ``[n_local, H]`` in local order. ``embeds``: the rows of the
    media this rank encoded (``owner[i] == rank``), concatenated in medium order (``[0, H]`` with
    ``requires_grad`` when it encodes none). Differentiable (backward: the reverse exchange)."""
    group = resolve_group(cp_mesh)
    cp = len(needs)
    rank = torch.distributed.get_rank(group) if cp > 1 else 0
    # where medium i's rows start in its owner's embeds (the media a rank encoded, in medium order)
    mine_rows = torch.tensor(tokens, dtype=torch.long) * torch.tensor([o == rank for o in owner], dtype=torch.long)
    starts = torch.cumsum(mine_rows, 0) - mine_rows
    own = torch.tensor(owner, dtype=torch.long)[medium]           # the owner of each placeholder's medium
    sends = [needs[d][own[needs[d]] == rank] for d in range(cp)]
    send_counts = [int(g.numel()) for g in sends]
    send = torch.cat(sends) if sends else torch.zeros(0, dtype=torch.long)
    mine = needs[rank]
    recv_counts = [int((own[mine] == s).sum()) for s in range(cp)]
    x = embeds[starts[medium[send]] + offset[send]]
    got = AllToAllUneven.apply(x.contiguous(), group, send_counts, recv_counts, 0, "cp.media_tokens", 1) \
        if cp > 1 else x
    # received grouped by source rank, each group in this rank's local order: back to local order
    order = torch.cat([torch.nonzero(own[mine] == s).flatten() for s in range(cp)]) if mine.numel() else mine
    out = torch.empty_like(got)
    return out.index_copy(0, order, got) if got.numel() else got


def media_embeddings_for_cp(model, input_ids: torch.Tensor, media: dict, cp_mesh, policy, *,
                            frozen: bool = False) -> dict:
    """This CP rank's ``mm_encoder_outputs`` for the global batch ``input_ids [B, S]``: ``media`` maps a
    kind of the registered tower (``"image"``, ``"video"``) to ``(pixel_values, grid_thw)``; returns kind
    -> the model's encoder output holding the rows of the placeholders in this rank's shard (local
    order). The media of all kinds are assigned together by patch rows (:func:`assign_media`), each
    rank encodes its own with the tower, and every token's tensors are exchanged to the rank holding its
    placeholder (one exchange per kind). Pass the result as ``mm_encoder_outputs`` with the local
    ``input_ids``. Collective over ``cp_mesh``; differentiable (the tower's gradient returns to the rank
    that encoded each medium). ``frozen`` (a frozen tower; every rank alike): the media are encoded without
    autograd and exchanged once, with no backward exchange — the tower keeps no activations and gets no
    gradient."""
    tower = vision_tower(model)
    if tower is None:
        raise ValueError(f"no vision tower registered for model_type {getattr(model.config, 'model_type', '?')!r} "
                         f"(carried: {carried_towers()})")
    unknown = sorted(set(media) - set(tower.kinds))
    if unknown:
        raise ValueError(f"media kinds {unknown} are not carried for {model.config.model_type} "
                         f"(carried: {sorted(tower.kinds)})")
    group = resolve_group(cp_mesh)
    cp = torch.distributed.get_world_size(group) if group is not None else 1
    rank = torch.distributed.get_rank(group) if group is not None else 0
    kinds = list(media)
    rows = {k: [int(r) for r in tower.rows(media[k][1])] for k in kinds}
    owners = assign_media([r for k in kinds for r in rows[k]], cp)      # all kinds balanced together
    # every kind's checks, token counts and placeholder layout first: a batch refused is refused on every
    # rank before any exchange
    for k in kinds:
        pixel_values, grid_thw = media[k]
        if sum(rows[k]) != pixel_values.shape[0]:
            raise ValueError(f"{model.config.model_type} {k}s: pixel values hold {pixel_values.shape[0]} rows, but "
                             f"their grids {grid_thw.tolist()} make {sum(rows[k])}: give the grids of these pixels")
        if tower.kinds[k].check is not None:
            tower.kinds[k].check(model.config, pixel_values, grid_thw)
    tokens = {k: [int(t) for t in tower.tokens(model.config, media[k][1])] for k in kinds}
    layouts = {k: media_token_layout(input_ids, tower.kinds[k].token_id(model.config), tokens[k], cp, policy)
               for k in kinds}
    out, at = {}, 0
    weight = model.get_input_embeddings().weight
    for k in kinds:
        kind, (pixel_values, grid_thw) = tower.kinds[k], media[k]
        owner, at = owners[at:at + len(rows[k])], at + len(rows[k])
        widths = [int(w) for w in kind.widths(model.config)]
        mine = [i for i in range(len(owner)) if owner[i] == rank]
        starts = [0] + torch.tensor(rows[k]).cumsum(0).tolist()
        if mine:      # one tensor per token: the embedding and its extras side by side, exchanged once
            pv = torch.cat([pixel_values[starts[i]:starts[i + 1]] for i in mine])
            with torch.no_grad() if frozen else contextlib.nullcontext():
                embeds = torch.cat(kind.encode(model, pv, grid_thw[mine]), dim=-1)
        else:         # still joins both exchanges (its backward receives nothing)
            embeds = torch.zeros(0, sum(widths), dtype=weight.dtype, device=weight.device, requires_grad=not frozen)
        medium, offset, needs = layouts[k]
        local = exchange_media_tokens(embeds, owner, medium, offset, needs, tokens[k], cp_mesh)
        out[k] = kind.wrap(list(local.split(widths, dim=-1)))
    return out

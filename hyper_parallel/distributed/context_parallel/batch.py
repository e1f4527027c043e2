"""CP batch contract (docs/strategies/batch_contract.md): a global collated batch -> this CP rank's local shard + meta.

Order of work (no collective anywhere; cp rank/size come from the mesh):
  1. validate fields (training only: no ``past_key_values``/``use_cache=True``; no 4-D mask;
     unknown tensors rejected unless listed in ``passthrough``);
  2. on the *global* sequence: key doc ids (packed ``seq_lens``/``seq_lens_padded`` -> doc
     index, or — transformers' convention — ``position_ids`` restarting inside a row: a new
     document wherever consecutive positions do not differ by 1, exactly
     ``masking_utils.find_packed_sequence_indices`` at CP=1; both given and cutting the rows
     differently -> refused; ``attention_mask`` 0 -> -1; unlike transformers, which ignores the
     restarts when a 2-D mask is passed, CP keeps the documents and the padding), ``position_ids`` (arange per row, restarting per
     document when packed) and ``shift_labels`` (next token of ``labels`` else ``input_ids``;
     last token, padding targets and document boundaries -> ``ignore_index``);
  3. pad S to the policy multiple (cp for all_gather/ulysses/hybrid, 2*cp for load_balance):
     pad keys get doc -1, pad labels ``ignore_index``, pad ids ``pad_token_id``, pad embeds 0;
  4. slice the contiguous chunk ``cp_rank`` of every sequence field; recompute packed lengths
     for the local chunk. Policy ``balanced`` permutes the padded row first (one block permutation
     per micro-batch, :mod:`.balance.split`; ``meta.perm``) and slices the permuted row.

Fields ([B, S, ...]): input_ids, inputs_embeds [B,S,H], labels, shift_labels, position_ids
([B|1, S], or multimodal 3-D [3|4, B|1, S]: :mod:`.rope_mrope`), attention_mask ([B,S] 1/0 key validity: it becomes key doc -1 in the meta —
the local slice is returned for reference only; wrappers read the meta), seq_lens /
seq_lens_padded ([B, n_docs]: doc i occupies a slot of seq_lens_padded[b,i] tokens, the first
seq_lens[b,i] of them real). Non-tensor scalars (bool/int/float/str/None) pass through.

transformers' flattening convention (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``):
``cu_seq_lens_q`` / ``cu_seq_lens_k`` (1-D, cumulative document starts over the row-major
flattened ``B*S`` tokens, ``[0, ..., total]``) and the scalars ``max_length_q`` / ``max_length_k``
describe the same documents as ``seq_lens``; they are read as ``seq_lens`` (q and k must be equal
— training is self-attention — every document lies inside one row, and they must agree with
restarting ``position_ids`` when both are given) and are not passed on: the local batch carries
the local ``seq_lens`` and the meta the global documents. Giving them together with ``seq_lens``
is refused (one description of the documents).
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ...platform import group_rank, group_size
from . import catalogue
from .balance.split import balanced_permutation, local_counts
from .comm import all_gather_seq
from .batch_flattening import cu_to_seq_lens
from .meta import PACKED_DOCUMENTS, CPBatchMeta
from .rope_mrope import attach_mrope, split_mrope_positions

__all__ = ["CPBatch", "shard_batch_for_cp", "gather_from_cp", "policy_multiple", "cp_coords"]

SEQ_FIELDS = ("input_ids", "inputs_embeds", "labels", "shift_labels", "position_ids", "attention_mask")
PACK_FIELDS = ("seq_lens", "seq_lens_padded")
# policy / method name or alias -> (policy, S multiple factor of cp_size), from the method catalogue
_POLICIES = catalogue.batch_policies()
#: the policy of a batch no method reorders or pads beyond ``cp``: contiguous chunks (also CP = 1)
CONTIGUOUS_POLICY = catalogue.attention_methods()[0].batch_policy
_SCALARS = (bool, int, float, str, type(None))


class CPBatchError(ValueError):
    """A global batch that cannot be sharded for CP (raised before any collective)."""


class CPBatch(dict):
    """This rank's local tensors (a dict) plus ``.meta`` (:class:`CPBatchMeta`),
    ``.num_valid_tokens_local`` (local ``shift_labels != ignore_index`` count, None without
    labels/ids), ``.seq_len`` (unpadded global S) and ``.pad_len`` (policy padding added)."""

    meta: CPBatchMeta
    num_valid_tokens_local: Optional[int]
    seq_len: int
    pad_len: int


def cp_coords(cp_mesh) -> tuple[int, int]:
    """(cp_rank, cp_size) from a 1-D DeviceMesh, ProcessGroup, MeshContext, (rank, size) or None."""
    if cp_mesh is None:
        return 0, 1
    if hasattr(cp_mesh, "cp_mesh") and hasattr(cp_mesh, "cp_rank"):
        return cp_coords(cp_mesh.cp_mesh)
    if isinstance(cp_mesh, DeviceMesh):
        if cp_mesh.ndim != 1:
            raise CPBatchError(f"shard_batch_for_cp needs the 1-D cp mesh, got dims {cp_mesh.mesh_dim_names}")
        return cp_mesh.get_local_rank(), cp_mesh.size()
    if isinstance(cp_mesh, dist.ProcessGroup):
        return group_rank(cp_mesh), group_size(cp_mesh)
    if isinstance(cp_mesh, tuple) and len(cp_mesh) == 2 and all(isinstance(x, int) for x in cp_mesh):
        rank, size = cp_mesh
        if not 0 <= rank < size:
            raise CPBatchError(f"cp coordinates (rank={rank}, size={size}) are out of range")
        return rank, size
    raise CPBatchError(f"cannot read cp rank/size from {type(cp_mesh).__name__}")


def policy_multiple(policy, cp_size: int) -> tuple[str, int]:
    """(policy name, S multiple) for a policy string or a strategy instance."""
    if isinstance(policy, str):
        if policy not in _POLICIES:
            raise CPBatchError(f"unknown CP padding policy {policy!r}; expected one of {sorted(_POLICIES)}")
        name, factor = _POLICIES[policy]
        return name, factor * cp_size
    if hasattr(policy, "padding_multiple") and hasattr(policy, "name"):
        return policy.name, int(policy.padding_multiple(cp_size))
    raise CPBatchError(f"policy must be a string or a ContextParallelStrategy, got {type(policy).__name__}")


# ----------------------------------------------------------------------------- validation
def _validate(batch: dict, passthrough: set) -> tuple[int, int]:
    if not isinstance(batch, dict):
        raise CPBatchError(f"global_batch must be a dict of tensors, got {type(batch).__name__}")
    if batch.get("past_key_values") is not None:
        raise CPBatchError("past_key_values is not supported by CP training (Phase 1 rejects KV caches)")
    if batch.get("use_cache") is True:
        raise CPBatchError("use_cache=True is not supported by CP training; pass use_cache=False")
    for key, val in batch.items():
        if key in passthrough or key in SEQ_FIELDS or key in PACK_FIELDS or key == "past_key_values":
            continue
        if not isinstance(val, _SCALARS):
            raise CPBatchError(
                f"unknown batch field {key!r} ({type(val).__name__}"
                f"{' ' + str(tuple(val.shape)) if isinstance(val, torch.Tensor) else ''}): CP does not guess "
                "how to shard it; declare it in passthrough=(...) to pass it through unchanged"
                + ("; token_type_ids that make tokens attend bidirectionally (a VLM's image blocks) travel as "
                   "block_ids=[B, S] block ids of the global rows instead (docs/vlm.md)" if key == "token_type_ids"
                   else "")
            )
    clash = sorted(passthrough & set(SEQ_FIELDS + PACK_FIELDS))
    if clash:
        raise CPBatchError(f"passthrough={clash} names CP-sharded fields; only unknown fields pass through")
    for key in SEQ_FIELDS + PACK_FIELDS:
        if key in batch and batch[key] is not None and not isinstance(batch[key], torch.Tensor):
            raise CPBatchError(f"batch field {key!r} must be a tensor, got {type(batch[key]).__name__}")
    mask = batch.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise CPBatchError(
            f"attention_mask must be a [B, S] 1/0 key-validity mask, got a {mask.dim()}-D tensor "
            f"{tuple(mask.shape)}: CP never slices a square/4-D mask; pass padding as a 2-D mask or "
            "packed documents as seq_lens"
        )
    ref = next((k for k in ("input_ids", "inputs_embeds", "labels") if batch.get(k) is not None), None)
    if ref is None:
        raise CPBatchError("the batch needs input_ids, inputs_embeds or labels to define [B, S]")
    B, S = batch[ref].shape[:2]
    for key in SEQ_FIELDS:
        t = batch.get(key)
        if t is None:
            continue
        if key == "inputs_embeds":
            ok = t.dim() == 3 and tuple(t.shape[:2]) == (B, S)
        elif key == "position_ids":
            ok = t.dim() == 2 and t.shape[0] in (1, B) and t.shape[1] == S
        else:
            ok = t.dim() == 2 and tuple(t.shape) == (B, S)
        if not ok:
            raise CPBatchError(f"batch field {key!r} has shape {tuple(t.shape)}, expected [B={B}, S={S}"
                               f"{', H' if key == 'inputs_embeds' else ''}] (from {ref!r})")
    lens, padded = batch.get("seq_lens"), batch.get("seq_lens_padded")
    if padded is not None and lens is None:
        raise CPBatchError("seq_lens_padded needs seq_lens (the real length of every document)")
    if lens is not None:
        if lens.dim() != 2 or lens.shape[0] != B:
            raise CPBatchError(f"seq_lens must be [B={B}, n_docs], got {tuple(lens.shape)}")
        if padded is not None and padded.shape != lens.shape:
            raise CPBatchError(f"seq_lens_padded {tuple(padded.shape)} must match seq_lens {tuple(lens.shape)}")
        slots = padded if padded is not None else lens
        if (lens < 0).any() or (slots < lens).any():
            raise CPBatchError("seq_lens must be >= 0 and seq_lens_padded >= seq_lens")
        total = slots.sum(dim=1)
        if (total > S).any():
            raise CPBatchError(f"packed documents need {total.max().item()} tokens in a row but S={S}")
    return B, S


# ----------------------------------------------------------------------------- global metadata
def _pack_layout(lens: torch.Tensor, padded: Optional[torch.Tensor], S: int):
    """Global doc ids [B,S] (-1 outside documents) and per-slot restarting positions [B,S]."""
    slots = (padded if padded is not None else lens).to(torch.int64)
    lens = lens.to(torch.int64)
    B, n = slots.shape
    cum = slots.cumsum(dim=1)
    start = cum - slots
    j = torch.arange(S, dtype=torch.int64, device=slots.device).expand(B, S).contiguous()
    idx = torch.searchsorted(cum, j, right=True)                      # slot holding token j (n = none)
    inside = idx < n
    safe = idx.clamp(max=max(n - 1, 0))
    off = j - start.gather(1, safe)
    doc = torch.where(inside & (off < lens.gather(1, safe)), safe, torch.full_like(j, -1))
    tail = j - cum[:, -1:] if n else j
    pos = torch.where(inside, off, tail)
    return doc, pos, start, lens, slots


def _restart_docs(pos: torch.Tensor) -> Optional[torch.Tensor]:
    """Doc ids [B, S] from restarting ``position_ids`` exactly as transformers finds packed
    sequences at CP=1 (``masking_utils.find_packed_sequence_indices``: a new document wherever
    consecutive positions do not differ by 1), or None when no row restarts."""
    first = pos[:, :1] - 1
    diff = torch.diff(pos, prepend=first, dim=-1)
    doc = (diff != 1).cumsum(-1)
    if not bool((doc[:, -1] != 0).any()):
        return None
    return doc.to(torch.int64)


def _check_restarts_agree(restart: torch.Tensor, doc: torch.Tensor) -> None:
    """Explicit ``seq_lens`` and restarting ``position_ids`` must cut the rows at the same tokens."""
    both = (doc[:, 1:] >= 0) & (doc[:, :-1] >= 0)
    cut_lens = doc[:, 1:] != doc[:, :-1]
    cut_pos = restart[:, 1:] != restart[:, :-1]
    bad = both & (cut_lens != cut_pos)
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        raise CPBatchError(
            f"position_ids restart (a packed-document boundary in transformers' convention) and seq_lens "
            f"disagree in row {b} between tokens {j} and {j + 1}: seq_lens "
            f"{'cuts' if bool(cut_lens[b, j]) else 'does not cut'} there, position_ids "
            f"{'restart' if bool(cut_pos[b, j]) else 'do not restart'}; CP does not guess which one is meant — "
            "pass one consistent description of the documents")


def _shift(src: torch.Tensor, doc: Optional[torch.Tensor], ignore_index: int) -> torch.Tensor:
    out = torch.full_like(src, ignore_index)
    out[:, :-1] = src[:, 1:]
    if doc is not None:
        bad = (doc[:, 1:] < 0) | (doc[:, 1:] != doc[:, :-1])
        out[:, :-1] = out[:, :-1].masked_fill(bad, ignore_index)
    return out


def _pad(t: torch.Tensor, n: int, value) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[1] = n
    return torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim=1)


def _local_lengths(start: torch.Tensor, length: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return ((start + length).clamp(max=hi) - start.clamp(min=lo)).clamp(min=0)


# ----------------------------------------------------------------------------- public API
def shard_batch_for_cp(global_batch: dict, cp_mesh, policy="all_gather", *, ignore_index: int = -100,
                       pad_token_id: int = 0, passthrough: Iterable[str] = (),
                       packed_documents: Optional[str] = None,
                       block_ids: Optional[torch.Tensor] = None) -> CPBatch:
    """Shard a global collated batch for this CP rank; see the module docstring for the contract.

    ``cp_mesh``: the 1-D cp DeviceMesh, its ProcessGroup, a MeshContext, explicit
    ``(cp_rank, cp_size)``, or None (cp 1). ``policy``: "all_gather" | "ulysses" | "hybrid" |
    "load_balance" (aliases "colossal", "head_tail") or a strategy instance (its
    ``padding_multiple``). Returns a :class:`CPBatch`; ``meta.key_doc`` is [B, S_padded] global doc
    ids (-1 = padding) or None when there is neither padding nor packing. ``packed_documents``:
    ``meta.documents`` (:data:`.meta.PACKED_DOCUMENTS`, what a row of several documents means).
    ``block_ids``: ``[B, S]`` integer bidirectional block ids of the GLOBAL rows (``-1`` = none; e.g. Gemma 3's
    image blocks, ``models.gemma3.image_block_ids(token_type_ids)``): ``meta.key_block``, padded with -1
    and sliced by the methods like the documents, so a query also sees the later keys of its block. With
    blocks on a row of several packed documents only ``packed_documents="independent"`` is taken.
    """
    if packed_documents not in (None,) + PACKED_DOCUMENTS:
        raise CPBatchError(f"packed_documents must be one of {PACKED_DOCUMENTS} or None, got {packed_documents!r}")
    passthrough = set(passthrough)
    global_batch, mrope = split_mrope_positions(cu_to_seq_lens(global_batch, CPBatchError), CPBatchError)   # 3-D positions
    B, S = _validate(global_batch, passthrough)
    cp_rank, cp_size = cp_coords(cp_mesh)
    policy_name, multiple = policy_multiple(policy, cp_size)
    b = global_batch
    ref = next(b[k] for k in ("input_ids", "inputs_embeds", "labels") if b.get(k) is not None)
    dev = ref.device

    # -- global doc ids / positions / shift labels (before padding and slicing) -------------
    doc = pos = None
    packed = b.get("seq_lens") is not None
    if packed:
        doc, pos, start, lens, slots = _pack_layout(b["seq_lens"].to(dev), None if b.get("seq_lens_padded") is None
                                                    else b["seq_lens_padded"].to(dev), S)
    restart = None
    if b.get("position_ids") is not None:
        restart = _restart_docs(b["position_ids"].to(dev).expand(B, S))
    if restart is not None:
        if packed:
            _check_restarts_agree(restart, doc)
        else:
            # transformers' packed convention (position_ids restarting inside a row, no seq_lens):
            # documents on the *global* rows, as transformers derives them at CP=1
            packed = True
            doc = restart
    mask = b.get("attention_mask")
    if mask is not None:
        valid = mask.to(dev) != 0
        doc = torch.where(valid, doc if doc is not None else torch.zeros(B, S, dtype=torch.int64, device=dev),
                          torch.full((B, S), -1, dtype=torch.int64, device=dev))
    if b.get("position_ids") is not None:
        pos = b["position_ids"].expand(B, S)
    elif pos is None:
        pos = torch.arange(S, dtype=torch.int64, device=dev).expand(B, S)
    shift = b.get("shift_labels")
    if shift is None:
        src = b.get("labels") if b.get("labels") is not None else b.get("input_ids")
        shift = _shift(src, doc, ignore_index) if src is not None else None

    # -- pad to the policy multiple ---------------------------------------------------------
    S_pad = -(-S // multiple) * multiple
    n_pad = S_pad - S
    has_pad = n_pad > 0 or (doc is not None and bool((doc < 0).any()))
    key_doc = None
    if packed or has_pad:
        base = doc if doc is not None else torch.zeros(B, S, dtype=torch.int64, device=dev)
        key_doc = _pad(base.to(torch.int64), n_pad, -1)
    full = {}
    for key, value in (("input_ids", pad_token_id), ("inputs_embeds", 0), ("labels", ignore_index),
                       ("attention_mask", 0)):
        if b.get(key) is not None:
            full[key] = _pad(b[key], n_pad, value)
    if shift is not None:
        full["shift_labels"] = _pad(shift, n_pad, ignore_index)
    if n_pad:
        cont = pos[:, -1:] + 1 + torch.arange(n_pad, dtype=pos.dtype, device=pos.device)
        pos = torch.cat([pos, cont], dim=1)
    full["position_ids"] = pos

    # -- slice the contiguous local chunk (of the balanced permutation of the row, policy 'balanced') --
    L = S_pad // cp_size
    lo, hi = cp_rank * L, (cp_rank + 1) * L
    glob_pos, perm = full["position_ids"], None
    if catalogue.token_layout(policy_name) == catalogue.BALANCED:
        perm = balanced_permutation(key_doc, B, S_pad, cp_size, policy)
        full = {k: v.index_select(1, perm.to(v.device)) for k, v in full.items()}
    count = _local_lengths if perm is None else (lambda st, n, a, z: local_counts(perm, a, z, st, n))
    out = CPBatch({k: v[:, lo:hi] for k, v in full.items()})
    if b.get("seq_lens") is not None:
        out["seq_lens"] = count(start, lens, lo, hi).to(b["seq_lens"].dtype)
        if b.get("seq_lens_padded") is not None:
            out["seq_lens_padded"] = count(start, slots, lo, hi).to(b["seq_lens_padded"].dtype)
    for key, val in b.items():
        if key in passthrough or (key not in out and key not in SEQ_FIELDS + PACK_FIELDS
                                  and key != "past_key_values"):
            out[key] = val
    key_block = None
    if block_ids is not None:
        if not isinstance(block_ids, torch.Tensor) or block_ids.dtype.is_floating_point or \
                block_ids.dtype == torch.bool or tuple(block_ids.shape) != (B, S):
            raise CPBatchError(f"block_ids must be an integer tensor [B, S] = [{B}, {S}] of the global rows, got "
                               f"{getattr(block_ids, 'dtype', type(block_ids).__name__)} "
                               f"{list(getattr(block_ids, 'shape', []))}")
        key_block = _pad(torch.where(block_ids >= 0, block_ids, -1).to(device=dev, dtype=torch.int64), n_pad, -1)
    out.meta = CPBatchMeta(cp_rank=cp_rank, cp_size=cp_size, global_seq_len=S_pad, local_seq_len=L,
                           key_doc=key_doc, policy=policy_name, causal=True, perm=perm,
                           position_ids=glob_pos, seq_len=S,   # global order, for RoPE (rope.py)
                           documents=packed_documents, key_block=key_block)
    if packed_documents != "independent" and key_block is not None and bool((key_block >= 0).any()) \
            and out.meta.packs_documents:
        # transformers 5.24 (create_masks_for_vision_model) applies the image blocks of its sliding layers
        # before remapping the indices to the documents' restarting positions: a later document's queries
        # read the block ids at the row's first indices, so its image loses its bidirectional part (and text
        # there may gain one). The engine applies the blocks at the row's indices: each document alone, which
        # is then the one meaning CP computes, and it is declared, not assumed.
        raise CPBatchError(
            f"packed_documents={packed_documents!r} with block_ids on a row of several packed documents: plain "
            "transformers' sliding-window mask reads the image blocks at the documents' restarting positions "
            "instead of the row's indices (a later document's image loses its bidirectional attention there), "
            "which CP does not reproduce; declare packed_documents='independent' (each document as if alone, its "
            "images bidirectional; docs/vlm.md, \"Gemma 3\")")
    # documents derived from restarting position_ids: the wrappers check on the first call that the
    # model's own (local) mask separates them too (some models build their mask without position_ids)
    out.meta.__dict__["docs_from_positions"] = restart is not None and b.get("seq_lens") is None
    if mrope is not None:
        attach_mrope(out, mrope, n_pad)
    out.num_valid_tokens_local = (int((out["shift_labels"] != ignore_index).sum())
                                  if "shift_labels" in out else None)
    out.seq_len, out.pad_len = S, n_pad
    return out


def gather_from_cp(local_tensor: torch.Tensor, cp_mesh, dim: int = 1) -> torch.Tensor:
    """Concatenate every CP rank's ``local_tensor`` along ``dim`` in cp-rank (= global) order.

    Differentiable through the platform all_gather; backward is a ReduceScatter(sum), i.e. the
    adjoint when every rank's loss consumes the gathered tensor. Padding is kept (slice with
    ``batch.seq_len``). cp 1 / None is the identity.
    """
    if hasattr(cp_mesh, "cp_mesh") and hasattr(cp_mesh, "cp_rank"):
        cp_mesh = cp_mesh.cp_mesh
    return all_gather_seq(local_tensor, cp_mesh, dim=dim, tag="cp.gather_from_cp")

"""transformers' flattening convention read as the batch contract's ``seq_lens`` (docs/strategies/
batch_contract.md): ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (1-D cumulative document starts over the
row-major flattened ``B*S`` tokens) and ``max_length_*`` -> ``seq_lens [B, n_docs]``. Local, no
collective; :func:`.batch.shard_batch_for_cp` calls it first."""
from __future__ import annotations

import torch

__all__ = ["CU_FIELDS", "CU_SCALARS", "cu_to_seq_lens"]

CU_FIELDS = ("cu_seq_lens_q", "cu_seq_lens_k")          # transformers' flattening convention
CU_SCALARS = ("max_length_q", "max_length_k")


def cu_to_seq_lens(batch: dict, error: type = ValueError) -> dict:
    """Read transformers' ``cu_seq_lens_*`` flattening kwargs as ``seq_lens`` ([B, n_docs]).

    Returns the batch unchanged when neither is present, else a copy with ``seq_lens`` set and the
    ``cu_seq_lens_*`` / ``max_length_*`` fields removed. Raises error for anything that
    does not describe documents inside the rows exactly once (``error``: the batch contract's
    ``CPBatchError``).
    """
    given = [k for k in CU_FIELDS if batch.get(k) is not None]
    if not given:
        return batch
    if len(given) == 1:
        raise error(f"{given[0]} given without {[k for k in CU_FIELDS if k not in given][0]}: "
                           "transformers passes both (equal for self-attention); pass both or seq_lens")
    cu_q, cu_k = batch["cu_seq_lens_q"], batch["cu_seq_lens_k"]
    for name, cu in (("cu_seq_lens_q", cu_q), ("cu_seq_lens_k", cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.is_floating_point() or cu.numel() < 2:
            raise error(f"{name} must be a 1-D integer tensor [n_docs + 1] of cumulative document "
                               f"starts, got {type(cu).__name__}{tuple(getattr(cu, 'shape', ()))}")
    if cu_q.shape != cu_k.shape or not torch.equal(cu_q.cpu(), cu_k.cpu()):
        raise error("cu_seq_lens_q and cu_seq_lens_k differ: CP training shards self-attention, "
                           "where queries and keys are the same documents")
    if batch.get("seq_lens") is not None or batch.get("seq_lens_padded") is not None:
        raise error("both cu_seq_lens_* and seq_lens describe the packed documents; CP does not "
                           "guess which one is meant — pass one of them")
    ref = next((batch[k] for k in ("input_ids", "inputs_embeds", "labels") if batch.get(k) is not None), None)
    if ref is None:
        raise error("the batch needs input_ids, inputs_embeds or labels to define [B, S]")
    B, S = ref.shape[:2]
    cu = cu_q.detach().to("cpu", torch.int64)
    if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) > B * S:
        raise error(f"cu_seq_lens_q must start at 0, never decrease and end at most at B*S={B * S} "
                           f"(the flattened batch), got {cu.tolist()}")
    bounds = set(cu.tolist())
    rows = []
    for b in range(B):
        lo, hi = b * S, (b + 1) * S
        if b and lo <= int(cu[-1]) and lo not in bounds:
            raise error(f"cu_seq_lens_q has a document crossing from row {b - 1} into row {b} "
                               f"(no boundary at token {lo} = {b}*S): every document must lie inside one row")
        inside = cu[(cu >= lo) & (cu <= hi)] - lo
        rows.append(torch.diff(inside) if inside.numel() > 1 else torch.zeros(0, dtype=torch.int64))
    n = max(1, max(r.numel() for r in rows))
    lens = torch.zeros(B, n, dtype=torch.int64)
    for b, r in enumerate(rows):
        lens[b, :r.numel()] = r
    out = {k: v for k, v in batch.items() if k not in CU_FIELDS + CU_SCALARS}
    out["seq_lens"] = lens.to(ref.device)
    return out

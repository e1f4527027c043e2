"""Batch contract: shards concatenate back to the (padded) global reference for every field."""
import pytest
import torch

from hyper_parallel.distributed.context_parallel.batch import gather_from_cp, shard_batch_for_cp
from hyper_parallel.distributed.context_parallel.strategies import HeadTailStrategy, UlyssesStrategy
from tests.cp.common import mesh_ctx

IGN = -100


def _shards(batch, cp, policy, **kw):
    return [shard_batch_for_cp(batch, (r, cp), policy, **kw) for r in range(cp)]


def _cat(shards, key):
    return torch.cat([s[key] for s in shards], dim=1)


def _expected(ids, labels, doc, S_pad, pad_id=0):
    """Independent per-token reference: padded ids/labels, shift labels and doc ids."""
    B, S = ids.shape
    e_ids = torch.full((B, S_pad), pad_id, dtype=ids.dtype)
    e_ids[:, :S] = ids
    e_doc = torch.full((B, S_pad), -1, dtype=torch.long)
    e_doc[:, :S] = doc
    src = labels if labels is not None else ids
    e_shift = torch.full((B, S_pad), IGN, dtype=ids.dtype)
    for b in range(B):
        for i in range(S - 1):
            if e_doc[b, i + 1] >= 0 and e_doc[b, i + 1] == e_doc[b, i]:
                e_shift[b, i] = src[b, i + 1]
    return e_ids, e_doc, e_shift


@pytest.mark.parametrize("cp,policy", [(2, "all_gather"), (4, "ulysses"), (4, "hybrid"), (2, "load_balance"),
                                       (4, "load_balance")])
def test_plain_and_padding(cp, policy):
    g = torch.Generator().manual_seed(0)
    S = 13
    ids = torch.randint(1, 99, (2, S), generator=g)
    labels = torch.randint(1, 99, (2, S), generator=g)
    mask = torch.ones(2, S, dtype=torch.long)
    mask[0, -4:] = 0
    mask[1, :2] = 0
    emb = torch.randn(2, S, 5, generator=g)
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask, "inputs_embeds": emb}
    shards = _shards(batch, cp, policy, pad_token_id=7)
    mult = cp * (2 if policy == "load_balance" else 1)
    S_pad = -(-S // mult) * mult
    e_ids, e_doc, e_shift = _expected(ids, labels, torch.where(mask > 0, 0, -1), S_pad, pad_id=7)
    assert torch.equal(_cat(shards, "input_ids"), e_ids)
    assert torch.equal(_cat(shards, "shift_labels"), e_shift)
    e_labels = torch.full((2, S_pad), IGN, dtype=labels.dtype)
    e_labels[:, :S] = labels
    assert torch.equal(_cat(shards, "labels"), e_labels)
    assert torch.equal(_cat(shards, "position_ids"), torch.arange(S_pad).expand(2, S_pad))
    e_mask = torch.zeros(2, S_pad, dtype=mask.dtype)
    e_mask[:, :S] = mask
    assert torch.equal(_cat(shards, "attention_mask"), e_mask)
    e_emb = torch.zeros(2, S_pad, 5)
    e_emb[:, :S] = emb
    assert torch.equal(_cat(shards, "inputs_embeds"), e_emb)
    for r, s in enumerate(shards):
        m = s.meta
        assert (m.cp_rank, m.cp_size, m.global_seq_len, m.local_seq_len) == (r, cp, S_pad, S_pad // cp)
        assert m.policy == policy and torch.equal(m.key_doc, e_doc)
        assert s.seq_len == S and s.pad_len == S_pad - S
    assert sum(s.num_valid_tokens_local for s in shards) == int((e_shift != IGN).sum())


def test_no_padding_no_packing_has_no_key_doc():
    ids = torch.arange(16).reshape(2, 8)
    shards = _shards({"input_ids": ids, "attention_mask": torch.ones(2, 8)}, 4, "all_gather")
    assert all(s.meta.key_doc is None for s in shards)
    assert torch.equal(_cat(shards, "shift_labels")[:, :-1], ids[:, 1:])
    assert (_cat(shards, "shift_labels")[:, -1] == IGN).all()
    assert sum(s.num_valid_tokens_local for s in shards) == 14


@pytest.mark.parametrize("cp,policy", [(2, "all_gather"), (4, "load_balance")])
def test_packed_documents(cp, policy):
    S = 22
    ids = torch.arange(1, 2 * S + 1).reshape(2, S)
    lens = torch.tensor([[5, 3, 6], [9, 0, 4]])
    padded = torch.tensor([[6, 4, 8], [10, 0, 4]])
    shards = _shards({"input_ids": ids, "seq_lens": lens, "seq_lens_padded": padded}, cp, policy)
    mult = cp * (2 if policy == "load_balance" else 1)
    S_pad = -(-S // mult) * mult
    doc = torch.full((2, S), -1)
    pos = torch.zeros(2, S, dtype=torch.long)
    for b in range(2):
        start = 0
        for i in range(3):
            doc[b, start:start + lens[b, i]] = i
            pos[b, start:start + padded[b, i]] = torch.arange(padded[b, i])
            start += int(padded[b, i])
        pos[b, start:] = torch.arange(S - start)
    e_ids, e_doc, e_shift = _expected(ids, None, doc, S_pad)
    assert torch.equal(_cat(shards, "input_ids"), e_ids)
    assert torch.equal(_cat(shards, "shift_labels"), e_shift)
    got_pos = _cat(shards, "position_ids")
    assert torch.equal(got_pos[:, :S], pos), "positions restart per document (global, before slicing)"
    for s in shards:
        assert torch.equal(s.meta.key_doc, e_doc)
    # local seq_lens: tokens of doc i inside this chunk; they sum back to the global lengths
    L = S_pad // cp
    for r, s in enumerate(shards):
        chunk = e_doc[:, r * L:(r + 1) * L]
        assert torch.equal(s["seq_lens"], torch.stack([(chunk == i).sum(1) for i in range(3)], 1))
    assert torch.equal(sum(s["seq_lens"] for s in shards), lens)
    assert torch.equal(sum(s["seq_lens_padded"] for s in shards), padded)


def test_given_position_ids_and_strategy_policy():
    ids = torch.arange(10).reshape(1, 10)
    pos = (torch.arange(10) + 100).reshape(1, 10)
    shards = _shards({"input_ids": ids, "position_ids": pos, "shift_labels": ids}, 2, HeadTailStrategy(None))
    assert shards[0].meta.policy == "load_balance" and shards[0].meta.global_seq_len == 12
    assert torch.equal(_cat(shards, "position_ids"), (torch.arange(12) + 100).reshape(1, 12))
    assert torch.equal(_cat(shards, "shift_labels")[:, :10], ids), "given shift_labels are sliced as-is"
    shards = _shards({"input_ids": ids}, 2, UlyssesStrategy(None))
    assert shards[0].meta.global_seq_len == 10 and shards[0].meta.key_doc is None


def batch_on_mesh(cp):
    ctx = mesh_ctx(cp)
    ids = torch.arange(30).reshape(2, 15)
    local = shard_batch_for_cp({"input_ids": ids, "attention_mask": torch.ones(2, 15)}, ctx.cp_mesh, "all_gather")
    offline = shard_batch_for_cp({"input_ids": ids, "attention_mask": torch.ones(2, 15)}, (ctx.cp_rank, cp))
    emb = local["input_ids"].float().requires_grad_(True)
    full = gather_from_cp(emb, ctx.cp_mesh, dim=1)
    full.sum().backward()
    m, o = local.meta, offline.meta
    same_meta = (m.cp_rank, m.cp_size, m.global_seq_len, m.policy) == (o.cp_rank, o.cp_size, o.global_seq_len,
                                                                      o.policy) and torch.equal(m.key_doc, o.key_doc)
    return {"same": all(torch.equal(local[k], offline[k]) for k in offline) and same_meta,
            "gathered": full.detach().long(), "grad": emb.grad}


def test_batch_on_mesh_and_gather_from_cp(ranks):
    res = ranks(4).run(batch_on_mesh, 4)
    assert all(r["same"] for r in res)
    expect = torch.cat([torch.arange(30).reshape(2, 15), torch.zeros(2, 1, dtype=torch.long)], 1)
    for r in res:
        assert torch.equal(r["gathered"], expect)
        assert torch.equal(r["grad"], torch.full((2, 4), 4.0)), "gather_from_cp backward is a reduce-scatter (sum)"


# ------------------------------------------------- transformers' cu_seq_lens_* flattening convention
def _flattened(docs):
    from transformers import DataCollatorWithFlattening

    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
    return collate([{"input_ids": d} for d in docs])


@pytest.mark.parametrize("cp,policy", [(2, "all_gather"), (4, "ulysses"), (2, "load_balance")])
def test_cu_seq_lens_read_as_documents(cp, policy):
    """DataCollatorWithFlattening's real output: cu_seq_lens_* give the same documents, shift labels
    and positions as the equivalent seq_lens (and as the restarting position_ids alone), and are not
    passed on to the local batch."""
    g = torch.Generator().manual_seed(7)
    docs = [torch.randint(1, 100, (int(n),), generator=g).tolist() for n in (5, 1, 7, 4)]
    batch = _flattened(docs)
    assert "cu_seq_lens_q" in batch and batch["position_ids"].shape == batch["input_ids"].shape
    via_cu = _shards(batch, cp, policy)
    lens = torch.tensor([[len(d) for d in docs]])
    plain = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
    via_lens = _shards({**plain, "seq_lens": lens}, cp, policy)
    via_pos = _shards(plain, cp, policy)
    for a, b, c in zip(via_cu, via_lens, via_pos):
        assert not any(k in a for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"))
        assert torch.equal(a.meta.key_doc, b.meta.key_doc) and torch.equal(a.meta.key_doc, c.meta.key_doc)
        for key in ("input_ids", "shift_labels", "position_ids", "seq_lens"):
            assert torch.equal(a[key], b[key]), key
        assert torch.equal(a["shift_labels"], c["shift_labels"])
    shift = _cat(via_cu, "shift_labels")[0]
    ends = torch.tensor([len(d) for d in docs]).cumsum(0) - 1
    assert bool((shift[ends] == IGN).all()), "no target crosses a document boundary"


def test_cu_seq_lens_rows_and_tail():
    """B > 1: cu indexes the row-major flattened batch; tokens after the last document are no document."""
    ids = torch.arange(1, 17).reshape(2, 8)
    cu = torch.tensor([0, 3, 8, 12, 14], dtype=torch.int32)
    got = shard_batch_for_cp({"input_ids": ids, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone(),
                              "max_length_q": 5, "max_length_k": 5}, (0, 1), "all_gather")
    ref = shard_batch_for_cp({"input_ids": ids, "seq_lens": torch.tensor([[3, 5], [4, 2]])}, (0, 1), "all_gather")
    assert torch.equal(got.meta.key_doc, ref.meta.key_doc)
    assert torch.equal(got.meta.key_doc[1, 6:], torch.tensor([-1, -1]))


@pytest.mark.parametrize("change,msg", [
    (lambda b: b.pop("cu_seq_lens_k"), "given without cu_seq_lens_k"),
    (lambda b: b.update(cu_seq_lens_k=torch.tensor([0, 2, 5], dtype=torch.int32)), "differ"),
    (lambda b: b.update(seq_lens=torch.tensor([[3, 2]])), "pass one of them"),
    (lambda b: b.update(cu_seq_lens_q=torch.tensor([0, 4, 3]), cu_seq_lens_k=torch.tensor([0, 4, 3])),
     "never decrease"),
    (lambda b: b.update(cu_seq_lens_q=torch.tensor([0.0, 5.0]), cu_seq_lens_k=torch.tensor([0.0, 5.0])),
     "integer"),
    (lambda b: b.update(position_ids=torch.tensor([[0, 1, 0, 1, 2]])), "disagree"),
])
def test_cu_seq_lens_refusals(change, msg):
    from hyper_parallel.distributed.context_parallel.batch import CPBatchError

    batch = _flattened([[1, 2, 3], [4, 5]])
    change(batch)
    with pytest.raises(CPBatchError, match=msg):
        shard_batch_for_cp(batch, (0, 2), "all_gather")


def test_cu_seq_lens_document_crossing_rows_refused():
    from hyper_parallel.distributed.context_parallel.batch import CPBatchError

    ids = torch.arange(1, 17).reshape(2, 8)
    cu = torch.tensor([0, 5, 11, 16])
    with pytest.raises(CPBatchError, match="crossing from row 0 into row 1"):
        shard_batch_for_cp({"input_ids": ids, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu}, (0, 2), "all_gather")

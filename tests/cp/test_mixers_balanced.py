"""Token-mixer methods next to the balanced split (``sdpa_hf_balanced``, batch policy ``balanced``).

A mixer method runs on the contiguous layout; under the balanced split its input moves from the
permuted slots to the contiguous chunk with one all-to-all (``comm.relayout.Relayout``), the method
runs unchanged, its output moves back (``mixers.rows.on_contiguous_layout``, installed by the plan
applier). Here:

* the relayout alone (cp 4, random permutation): round trip = identity, the moved tokens are the
  contiguous chunk, the gradient of ``to_contiguous`` is the inverse exchange;
* Qwen3-Next (Gated DeltaNet state passing) and Falcon-H1 / Bamba (Mamba2 state passing) with the
  balanced split on every attention, cp 2 and 4, packed rows with padding inside document slots
  and at the row end: logits and EVERY gradient equal CP=1 (fp32, real transformers classes, tiny
  random configs, train(), dropout 0), and LFM2's short-conv halo at cp 2; the permutation is asserted not to be the identity; a
  negative control (the relayout's return trip skipped) is visibly wrong;
* Kimi Linear's KDA, MiniMax's lightning attention, Jamba's Mamba1 and RecurrentGemma's RG-LRU
  state passing next to the balanced split at cp 2, the same check;
* GDN next to Head-Tail (contiguous at the module boundary: no relayout) at cp 2, the same check;
* the plan accepts mixers next to the balanced split and Head-Tail, and still refuses the balanced
  split mixed with another attention method, a layout with no exchange to the contiguous one, and a
  mixer called on a permuted batch without the relayout.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

TOL = 2e-5       # as tests/cp/test_mixer_cp.py: fp32 rounding only (relative to max|logits| / largest grad)
BASE = {"when": "cp", "region_dispatch": False, "inner_target": "self"}
BALANCED = {**BASE, "match": "*.self_attn", "inner_wrapper": "sdpa_hf_balanced"}
HEAD_TAIL = {**BASE, "match": "*.self_attn",
             "inner_wrapper": {"_target_": "hyper_parallel.distributed.context_parallel.wrappers."
                                           "sdpa_hf_load_balance_cp_wrapper"}}
MIXERS = {"qwen3_next": ("*.linear_attn", "gated_deltanet_state_passing"),
          "falcon_h1": ("*.mamba", "mamba2_state_passing"),
          "bamba": ("*.mamba", "mamba2_state_passing"),
          "lfm2": ("*[0-9].conv", "short_conv_halo"),
          "kimi_linear": ("model.layers.0.self_attn", "kda_state_passing"),
          "minimax": ("model.layers.0.self_attn", "lightning_state_passing"),
          "jamba": ("*.mamba", "mamba1_state_passing"),
          "recurrent_gemma": ("model.layers.0.temporal_block", "rglru_state_passing")}


# ============================================================================ rank functions
def relayout_case(seed: int) -> dict:
    from hyper_parallel import platform as P
    from hyper_parallel.distributed.context_parallel.comm import Relayout
    from tests.cp.common import mesh_ctx

    C = 4
    group = mesh_ctx(C).cp_mesh.get_group()
    r = P.group_rank(group)
    L, B, H = 6, 2, 3
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(C * L, generator=g)                    # the same on every rank
    full = torch.randn(B, C * L, H, generator=g)                 # global tokens in global order
    wgt = torch.randn(B, C * L, H, generator=g)                  # a loss weight per global token
    x = full[:, perm[r * L:(r + 1) * L]].clone().requires_grad_(True)   # this rank's permuted slots
    rl = Relayout(perm, r, C, group)
    with P.comm_counter() as fwd:
        y = rl.to_contiguous(x)
    back = rl.to_permuted(y)
    with P.comm_counter() as bwd:
        (y * wgt[:, r * L:(r + 1) * L]).sum().backward()
    moved = sum(rl.send_counts) - rl.send_counts[r]          # this rank's tokens that change rank
    ids = rl.to_contiguous(perm[r * L:(r + 1) * L].view(1, L))     # integer fields move the same way
    return {"contiguous": bool(torch.equal(y.detach(), full[:, r * L:(r + 1) * L])),
            "round_trip": bool(torch.equal(back.detach(), x.detach())),
            "grad_is_inverse": bool(torch.equal(x.grad, wgt[:, perm[r * L:(r + 1) * L]])),
            "ids": bool(torch.equal(ids[0], torch.arange(r * L, (r + 1) * L))),
            "moved": moved, "sent": sum(c.bytes_sent for c in fwd), "expected_sent": moved * B * H * 4,
            "bwd_received": sum(c.bytes_received for c in bwd), "bound": B * L * H * 4}


def packed_padded_batch(vocab: int, S: int, seed: int):
    """Two rows of packed documents (``seq_lens`` + ``seq_lens_padded``: padding inside the slots) and a
    padded row tail; documents cross several rank edges. -> (batch, [(row, start, length)])."""
    g = torch.Generator().manual_seed(seed)
    a, b = S // 3, S // 4
    lens = torch.tensor([[a - 2, b - 1, S - a - b - 5], [S - 9 - 7, 7, 0]])
    slots = torch.tensor([[a, b, S - a - b - 3], [S - 9, 7, 0]])     # row 0 ends 3 padding tokens early
    batch = {"input_ids": torch.randint(1, vocab, (2, S), generator=g), "seq_lens": lens, "seq_lens_padded": slots}
    docs = []
    for row in range(2):
        start = 0
        for n, m in zip(lens[row].tolist(), slots[row].tolist()):
            if n:
                docs.append((row, start, n))
            start += m
    return batch, docs


def parity(model, ref, mesh, plan, S: int, seed: int) -> dict:
    from tests.wrappers._workers import document_parity

    batch, docs = packed_padded_batch(model.config.vocab_size, S, seed)
    r = document_parity(model, ref, mesh, plan, batch, docs, seed + 1)
    meta = r.pop("meta")
    perm = meta.perm
    return {**r, "permuted": bool(perm is not None and not torch.equal(perm, torch.arange(perm.numel()))),
            "global_len": meta.global_seq_len}


def case(arch: str, cp: int, S: int, broken: bool = False, head_tail: bool = False) -> dict:
    from hyper_parallel.distributed.context_parallel.comm import relayout as R
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan
    from hyper_parallel.distributed.plan.planner import ShardingPlanner
    from tests.cp.common import mesh_ctx
    from tests.cp.test_mixer_cp import ATTN_FQN, build

    model, ref = build(arch).float().train(), build(arch).float().train()
    ref.load_state_dict(model.state_dict())
    mesh = mesh_ctx(cp)
    match, method = MIXERS[arch]
    attn = {**(HEAD_TAIL if head_tail else BALANCED), "match": ATTN_FQN.get(arch, "*.self_attn")}
    plan = ShardingPlanner(plan_overrides=[attn,
                                           {**BASE, "match": match, "inner_wrapper": method}]).plan(model, mesh, cp_size=cp)
    if not head_tail:
        plan.batch_policy = dataclasses.replace(plan.batch_policy, block=2)    # many blocks per rank on short rows
    policy = str(plan.batch_policy)
    model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False, preflight_proof=not broken)
    mixers = sorted(t.inner_fqn for t in plan.cp_targets if t.info.mixer)
    real = R.Relayout.to_permuted
    if broken:       # negative control: the output returns to the wrong slots (same bytes exchanged)
        R.Relayout.to_permuted = lambda self, y: real(self, y).roll(1, dims=1)
    try:
        out = parity(model, ref, mesh, plan, S, 11)
    finally:
        R.Relayout.to_permuted = real
    return {"case": f"{arch} {method} + {'Head-Tail' if head_tail else 'balanced'} cp{cp}"
                    f"{' (broken)' if broken else ''}", "policy": policy,
            "mixers": mixers, **out}


def cases(items: list) -> list:
    return [case(*c) for c in items]


def _check(out, broken: bool = False):
    for per_rank in zip(*out):
        r0 = per_rank[0]
        rel_l, rel_g = max(r["logits_rel"] for r in per_rank), max(r["grads"] for r in per_rank)
        print(f"{r0['case']} ({r0['policy']}, S padded {r0['global_len']}, mixers {r0['mixers']}, "
              f"{r0['n_grads']} nonzero grads): logits max abs {max(r['logits_abs'] for r in per_rank):.2e} rel "
              f"{rel_l:.2e}; grads max abs {max(r['grads_abs'] for r in per_rank):.2e} rel(largest grad) "
              f"{rel_g:.2e} [{r0['worst']}]; tolerance {TOL:g}")
        if r0["policy"] == "load_balance":       # Head-Tail: contiguous at the module boundary, no relayout
            assert not r0["permuted"] and r0["mixers"], r0
        else:
            assert r0["permuted"] and r0["mixers"] and r0["policy"].startswith("balanced"), r0
        if broken:
            assert rel_l > 10 * TOL and rel_g > 10 * TOL, r0
        else:
            assert rel_l <= TOL and rel_g <= TOL, r0


# ============================================================================ tests
def test_relayout_round_trip_and_gradient_is_the_inverse(ranks):
    for res in ranks(4).run(relayout_case, 5, timeout=120.0):
        print(res)
        assert res["contiguous"] and res["round_trip"] and res["grad_is_inverse"] and res["ids"], res
        assert res["moved"] > 0 and res["sent"] == res["expected_sent"] <= res["bound"], res
        assert res["bwd_received"] == res["sent"], res         # the gradient of what was sent comes back


def test_mixers_with_balanced_split_cp2_match_cp1(ranks):
    """Qwen3-Next (GDN) and Falcon-H1 (Mamba2) state passing, LFM2's short-conv halo, balanced split on
    the attention, cp 2;
    and Qwen3-Next's GDN next to Head-Tail (which keeps the contiguous layout at the boundary)."""
    _check(ranks(2).run(cases, [("qwen3_next", 2, 36), ("falcon_h1", 2, 40), ("lfm2", 2, 38),
                                ("qwen3_next", 2, 36, False, True)], timeout=600.0))


def test_recurrent_mixers_with_balanced_split_cp2_match_cp1(ranks):
    """Kimi Linear (KDA), MiniMax (lightning attention), Jamba (Mamba1) and RecurrentGemma (RG-LRU)
    state passing next to the balanced split, cp 2: the same relayout, the same check."""
    _check(ranks(2).run(cases, [("kimi_linear", 2, 36), ("minimax", 2, 38), ("jamba", 2, 40),
                                ("recurrent_gemma", 2, 36)], timeout=600.0))


def test_mixers_with_balanced_split_cp4_match_cp1(ranks):
    """The same at cp 4 (documents spread over 4 ranks' permuted slots), Bamba for Mamba2; and the
    negative control: the mixer output sent back to the wrong slots fails the same check."""
    _check(ranks(4).run(cases, [("qwen3_next", 4, 44), ("bamba", 4, 52)], timeout=600.0))
    _check(ranks(4).run(cases, [("qwen3_next", 4, 44, True)], timeout=600.0), broken=True)


# ---------------------------------------------------------------- plan rules (local, no ranks)
def test_plan_accepts_mixers_next_to_balanced_and_head_tail_and_refuses_the_rest():
    from hyper_parallel.distributed.errors import CPConfigError
    from tests.cp.test_mixer_cp import MIXER, MIXER_FQN, _plan

    for attn in ("sdpa_hf_balanced", {"_target_": "hyper_parallel.distributed.context_parallel.wrappers."
                                                   "sdpa_hf_load_balance_cp_wrapper"}):
        plan = _plan("qwen3_next", [{**BASE, "match": "*.self_attn", "inner_wrapper": attn},
                                    {**BASE, "match": MIXER_FQN["qwen3_next"], "inner_wrapper": MIXER["gdn_sp"]}])
        assert str(plan.batch_policy).split(" ")[0] in ("balanced", "load_balance"), plan.batch_policy
        assert any(t.info.mixer for t in plan.cp_targets)
    # still refused: the balanced split next to another attention method (the mixer rule does not relax it)
    from hyper_parallel.distributed.plan.planner import ShardingPlanner
    from tests.wrappers._workers import build_arch

    mixed = [{**BASE, "match": "*.0.self_attn", "inner_wrapper": "sdpa_hf_balanced"},
             {**BASE, "match": "*.1.self_attn", "inner_wrapper": "sdpa_hf"}]
    with pytest.raises(CPConfigError, match="reorders the whole sequence"):
        ShardingPlanner(plan_overrides=mixed).plan(build_arch("llama")[0], None, cp_size=2)


def test_mixer_next_to_a_layout_without_an_exchange_is_refused(monkeypatch):
    """A reordering layout with no exchange to the contiguous one (here: the balanced layout taken off
    the accepted list) is refused at planning, naming the mixer's field and module and the fix."""
    from hyper_parallel.distributed.errors import CPConfigError
    from hyper_parallel.distributed.plan import rules
    from tests.cp.test_mixer_cp import MIXER, MIXER_FQN, _plan

    monkeypatch.setattr(rules, "MIXER_LAYOUTS", ("contiguous", "head_tail"))
    with pytest.raises(CPConfigError) as err:
        _plan("qwen3_next", [{**BASE, "match": "*.self_attn", "inner_wrapper": "sdpa_hf_balanced"},
                             {**BASE, "match": MIXER_FQN["qwen3_next"], "inner_wrapper": MIXER["gdn_sp"]}])
    msg = str(err.value)
    print(msg)
    assert msg.startswith("[plan_overrides[1].inner_wrapper]") and "model.layers.0.linear_attn" in msg, msg
    assert "layout 'balanced' has no exchange to it" in msg and "Fix:" in msg, msg


def test_mixer_on_a_permuted_batch_without_the_relayout_is_refused():
    """A mixer method reached on a permuted batch without ``on_contiguous_layout`` (not installed by
    the applier) refuses before any collective, naming the method, the module and the fix."""
    from hyper_parallel.distributed.context_parallel.meta import CPBatchMeta, cp_batch_context
    from hyper_parallel.distributed.context_parallel.mixers.rows import CPMixerError, mixer_call

    meta = CPBatchMeta(cp_rank=0, cp_size=2, global_seq_len=8, local_seq_len=4, key_doc=None, policy="balanced",
                       perm=torch.tensor([4, 5, 0, 1, 6, 7, 2, 3]))
    with cp_batch_context(meta), pytest.raises(CPMixerError) as err:
        mixer_call("gated_deltanet_state_passing_cp_wrapper", "model.layers.0.linear_attn", "hidden_states",
                   object(), (torch.zeros(1, 4, 8),), {})
    print(err.value)
    assert "model.layers.0.linear_attn" in str(err.value) and "apply_sharding_plan" in str(err.value)


# ---------------------------------------------------------------- the trainer (2 ranks)
QWEN3_NEXT_TINY = {"vocab_size": 4096, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_value_heads": 4,
                   "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                   "linear_conv_kernel_dim": 4, "layer_types": ["linear_attention", "full_attention"],
                   "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32, "max_position_embeddings": 4096}


def test_trainer_qwen3_next_balanced_cp2_same_losses_as_cp1(ranks, tmp_path):
    """The trainer (preflight proof on by default) on the main job's packed rows (the shipped data
    slice, rows of 1024 tokens) with a tiny Qwen3-Next: the balanced split on the attention, GDN
    state passing on the linear attention, each packed document independent (declared: the Gated
    DeltaNet's result depends on it); the losses equal the same config at cp_size 1."""
    from tests.trainer import _workers as TW
    from tests.trainer.test_balanced_trainer import LOSS_RTOL, _cfg

    def cfg(cp: int) -> dict:
        c = _cfg(tmp_path / f"cp{cp}", f"accelerator.cp_size={cp}", "data.packed_documents=independent")
        c["model"] = {"architecture": "qwen3_next", "config": dict(QWEN3_NEXT_TINY), "seed": 0}
        c["plan_overrides"].append({**BASE, "match": "*.linear_attn", "inner_wrapper": "gated_deltanet_state_passing"})
        return c

    cp2 = ranks(2).run(TW.train_losses, cfg(2), timeout=600.0)
    cp1 = ranks(1).run(TW.train_losses, cfg(1), timeout=600.0)[0]["losses"]
    l2 = cp2[0]["losses"]
    rel = [abs(a - b) / abs(a) for a, b in zip(cp1, l2)]
    print(f"cp1 losses {cp1}\ncp2 losses {l2}\nmax rel err {max(rel):.2e} (tolerance {LOSS_RTOL:g})")
    assert cp2[1]["losses"] == l2 and len(l2) == len(cp1) == 3 and max(rel) <= LOSS_RTOL

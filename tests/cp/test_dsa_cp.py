"""DeepSeek sparse attention (DeepSeek V3.2, GLM-MoE-DSA) and Doge's dynamic mask under CP=2 (gloo),
through ``ShardingPlanner.plan`` + ``apply_sharding_plan`` with its default preflight proof.

* ``dsa_all_gather``: the lightning indexer's top-k over the GLOBAL keys (``index_topk=6`` smaller
  than every document, so the selection drops keys for most queries; GLM's ``shared`` layer reuses
  the previous layer's selection) equals CP=1 — logits and every gradient — on plain, right-padded
  and packed rows;
* ``doge_dynamic_mask``: Doge's per-key bias (``A`` and ``dt_proj`` randomized so the bias varies
  over keys) equals CP=1 likewise, with documents shorter and longer than ``keep_window_size`` (the
  dynamic top-k then drops keys; tie rule in ``tests/cp/test_doge_selection.py``);
* the generic wrappers (``sdpa_hf``, ``sdpa_hf_ulysses``, Head-Tail) on these attentions are refused
  at planning, naming the semantic and the method to declare.

The reference is CP=1 through transformers with every document its own right-padded row. The
indexer scores use 16 heads: with few heads a key whose every head's ReLU is 0 scores exactly 0
and ties at the k-th place are broken arbitrarily by ``torch.topk`` at CP=1, which the CP method
refuses (tested with zeroed indexer keys); under CP no [.., L, L] tensor is created (transformers'
model-level mask is skipped; docs/wrappers.md)."""
from __future__ import annotations

import time

import torch

ATTN = {"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self"}
TOL = 1e-5          # fp32: max |cp - ref| relative to max |ref| (logits) / to the largest gradient
HEAD_TAIL = {"_target_": "hyper_parallel.distributed.context_parallel.wrappers.sdpa_hf_load_balance_cp_wrapper"}


def build(kind: str, keep_window: int = 64):
    import transformers as T

    torch.manual_seed(0)
    c = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             attn_implementation="sdpa", attention_dropout=0.0)
    dsa = dict(intermediate_size=64, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
               qk_nope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
               topk_group=1, index_topk=6, index_head_dim=16, index_n_heads=16, mlp_layer_types=["dense", "sparse"])
    if kind == "deepseek_v32":
        cfg = T.DeepseekV32Config(**c, **dsa)
    elif kind == "glm_moe_dsa":
        cfg = T.GlmMoeDsaConfig(**c, **dsa, indexer_types=["full", "shared"])
    elif kind == "doge":
        cfg = T.DogeConfig(**c, intermediate_size=64, keep_window_size=keep_window)
    else:
        raise ValueError(kind)
    model = T.AutoModelForCausalLM.from_config(cfg).train()
    if kind == "doge":          # A = 0 at init makes the bias constant over keys: randomize it
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.A.uniform_(-1.0, 1.0)
                layer.self_attn.dt_proj.weight.normal_(0.0, 0.5)
    return model


def tie_rule_reference(model) -> None:
    """The model at CP=1 with the stated tie rules, what ``doge_dynamic_mask`` / ``dsa_all_gather``
    bind to the modules they wrap: Doge's dynamic mask keeps, among equal ``dt``, the lower key index;
    the DSA indexer keeps, among equal scores, the lower key index. transformers' ``torch.topk`` keeps
    an unspecified one of equal values (a token repeated in a document ties at Doge's first layer; a
    zero indexer key scores exactly 0)."""
    import functools
    import sys
    import types

    from hyper_parallel.models.deepseek_v32.dsa import DSA_CLASSES, indexer_forward_ordered
    from hyper_parallel.models.doge.dynamic_mask import prepare_dynamic_mask_ordered

    for layer in model.model.layers:
        m = getattr(layer, "self_attn", None)
        if type(m).__name__ == "DogeAttention":
            m.prepare_dynamic_mask = types.MethodType(prepare_dynamic_mask_ordered, m)
        elif getattr(m, "indexer", None) is not None and type(m).__name__ in DSA_CLASSES:
            rope = getattr(sys.modules[type(m).__module__], DSA_CLASSES[type(m).__name__])
            m.indexer.forward = functools.partial(types.MethodType(indexer_forward_ordered, m.indexer), rope=rope)


def case(kind: str, wrapper="dsa_all_gather", kinds=("plain", "padding", "packed"), keep_window: int = 64,
         proof: bool = True) -> dict:
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan
    from hyper_parallel.distributed.plan.planner import ShardingPlanner
    from tests.cp.common import mesh_ctx
    from tests.cp.test_mixer_cp import parity_step

    t0 = time.perf_counter()
    model, ref = build(kind, keep_window), build(kind, keep_window)
    ref.load_state_dict(model.state_dict())
    tie_rule_reference(ref)     # CP=1 with the stated tie rule (transformers' topk leaves ties unspecified)
    mesh = mesh_ctx(2)
    plan = ShardingPlanner(plan_overrides=[{**ATTN, "inner_wrapper": wrapper}]).plan(model, mesh, cp_size=2)
    try:
        model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False, preflight_proof=proof)
    except Exception as exc:  # noqa: BLE001 - a refusal is the subject of one case
        return {"case": f"{kind}/{wrapper}", "refused": f"{type(exc).__name__}: {exc}"}
    steps = []
    for i, k in enumerate(kinds):
        try:
            steps.append(parity_step(model, ref, mesh, plan, k, 30, 10 * i + 3))
        except Exception as exc:  # noqa: BLE001 - a refusal is the subject of one case
            steps.append({"kind": k, "refused": f"{type(exc).__name__}: {exc}"})
    return {"case": f"{kind}/{wrapper}", "steps": steps, "time_s": time.perf_counter() - t0}


def cases(items: list) -> list:
    return [case(*it) for it in items]


def planned(kind: str, wrapper) -> str:
    from hyper_parallel.distributed.plan.planner import ShardingPlanner
    from tests.cp.common import mesh_ctx

    try:
        ShardingPlanner(plan_overrides=[{**ATTN, "inner_wrapper": wrapper}]).plan(build(kind), mesh_ctx(2), cp_size=2)
    except Exception as exc:  # noqa: BLE001 - the refusal is the subject
        return f"{type(exc).__name__}: {exc}"
    return "planned"


def plans(items: list) -> list:
    return [planned(*it) for it in items]


def _check(out):
    for per_rank in zip(*out):
        assert "refused" not in per_rank[0], per_rank[0]
        print(f"{per_rank[0]['case']}: {max(r['time_s'] for r in per_rank):.1f}s")
        for i, st in enumerate(per_rank[0]["steps"]):
            assert "refused" not in st, st
            rel_l = max(r["steps"][i]["logits_rel"] for r in per_rank)
            rel_g = max(r["steps"][i]["grads"] for r in per_rank)
            abs_l = max(r["steps"][i]["logits_abs"] for r in per_rank)
            abs_g = max(r["steps"][i]["grads_abs"] for r in per_rank)
            print(f"    {st['kind']:<8} S={st['S']}: logits max abs {abs_l:.2e} rel {rel_l:.2e}; grads max abs "
                  f"{abs_g:.2e} rel(largest grad) {rel_g:.2e}; tolerance {TOL:g}")
            assert rel_l <= TOL and rel_g <= TOL, (per_rank[0]["case"], st)


class SquareRecorder:
    """Every tensor an op creates with >= L*L elements during a CP forward+backward (a
    ``TorchDispatchMode``); ``squares``: those whose last two dims are [L, L] or [S, S] (a mask)."""

    def __init__(self, L: int, S: int):
        self.L, self.S, self.big, self.squares = L, S, 0, []

    def __call__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_flatten

        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.numel() >= self.L * self.L:
                self.big += 1
                if tuple(t.shape[-2:]) in ((self.L, self.L), (self.S, self.S)):
                    self.squares.append((str(func), tuple(t.shape), str(t.dtype)))
        return out

    def mode(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        rec = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return rec(func, types, args, kwargs)

        return _Mode()


def mask_free_case(kind: str, wrapper: str, kinds=("plain", "padding", "packed")) -> dict:
    """:func:`case` with every CP forward+backward under a :class:`SquareRecorder` (the CP=1 reference,
    which builds transformers' mask, is not recorded)."""
    import tests.wrappers._workers as W

    plain = W.cp_forward_backward
    seen = []

    def recorded(model, mesh, plan, batch, valid, seed, **kw):
        from hyper_parallel.distributed.context_parallel.batch import policy_multiple

        S = batch["input_ids"].shape[1]
        mult = policy_multiple(plan.batch_policy, 2)[1]
        S_pad = -(-S // mult) * mult
        rec = SquareRecorder(S_pad // 2, S_pad)
        with rec.mode():
            out = plain(model, mesh, plan, batch, valid, seed, **kw)
        seen.append({"L": S_pad // 2, "big": rec.big, "squares": rec.squares[:5], "n_squares": len(rec.squares)})
        return out

    W.cp_forward_backward = recorded
    try:
        res = case(kind, wrapper, kinds)
    finally:
        W.cp_forward_backward = plain
    res["recorded"] = seen
    return res


def mask_free_cases(items: list) -> list:
    return [mask_free_case(*it) for it in items]


def test_no_square_mask_under_cp(ranks):
    """DSA (DeepSeek V3.2, GLM-MoE-DSA) and Doge under CP=2: no tensor of a CP forward+backward has
    [.., L, L] (or [.., S, S]) trailing dims — transformers' model-level mask is not built — and
    logits and every gradient still equal CP=1."""
    items = [("deepseek_v32", "dsa_all_gather"), ("glm_moe_dsa", "dsa_all_gather"), ("doge", "doge_dynamic_mask")]
    out = ranks(2).run(mask_free_cases, items, timeout=500.0)
    _check(out)
    for per_rank in zip(*out):
        for r in per_rank:
            assert len(r["recorded"]) == 3, r["recorded"]
            for i, st in enumerate(r["recorded"]):
                print(f"{r['case']} {r['steps'][i]['kind']:<8} L={st['L']}: {st['big']} tensors >= L*L elements, "
                      f"{st['n_squares']} [.., L, L]-shaped {st['squares']}")
                assert st["big"] > 0 and st["n_squares"] == 0, (r["case"], st)


def test_dsa_cp2_matches_cp1(ranks):
    """DeepSeek V3.2 and GLM-MoE-DSA (shared-indexer layer) with dsa_all_gather: logits and every gradient."""
    _check(ranks(2).run(cases, [("deepseek_v32",), ("glm_moe_dsa",)], timeout=400.0))


def test_dsa_selection_is_active_and_global():
    """The tiny configs select fewer keys than the documents hold (the selection matters), and the
    blocked global top-k equals transformers' indexer on one process (no ties at 16 heads)."""
    import transformers.models.deepseek_v32.modeling_deepseek_v32 as hf
    from transformers.masking_utils import create_causal_mask

    from hyper_parallel.models.deepseek_v32 import dsa as D

    model = build("deepseek_v32")
    m = model.model.layers[0].self_attn
    S = 30
    hs = model.model.embed_tokens(torch.randint(1, 128, (2, S), generator=torch.Generator().manual_seed(1)))
    pos = torch.arange(S)[None]
    cos, sin = model.model.rotary_emb(hs, pos)
    mask = create_causal_mask(config=model.config, inputs_embeds=hs, attention_mask=None, cache=None,
                              position_ids=pos, allow_is_causal_skip=False)
    with torch.no_grad():
        q_resid = m.q_a_layernorm(m.q_a_proj(hs))
        ref = m.indexer(hs, q_resid, (cos, sin), mask[:, 0], pos).long()
        iq, ik, iw = D._indexer_inputs(m.indexer, hf.apply_rotary_pos_emb, hs, q_resid, cos, sin)
        sel, tied = D.select_topk(iq, iw, ik, m.indexer.softmax_scale, m.indexer.index_topk, torch.arange(S), None,
                                  None, block=7)
    q = torch.arange(S)[None, :, None]
    a = torch.where(ref <= q, ref, -1).sort(-1).values
    b = torch.where(sel <= q, sel, -1).sort(-1).values
    dropped = int((torch.arange(S) + 1 > m.indexer.index_topk).sum())
    print(f"queries whose visible keys exceed index_topk={m.indexer.index_topk}: {dropped}/{S} per row")
    assert dropped >= S // 2
    assert not bool(tied.any())
    assert torch.equal(a, b), (a != b).any(-1).nonzero()
    # a zero indexer key for every token: all visible keys score 0, a tie at the k-th place for
    # exactly the queries that see more than index_topk keys
    _, tied = D.select_topk(iq, iw, torch.zeros_like(ik), m.indexer.softmax_scale, m.indexer.index_topk,
                            torch.arange(S), None, None, block=7)
    assert torch.equal(tied, (torch.arange(S) + 1 > m.indexer.index_topk).expand(2, S))


def tied_case(kind: str, proof: bool) -> dict:
    """:func:`case` on a model whose indexer keys are all zero (``wk`` zeroed and the LayerNorm
    bias kept 0), so every visible key scores 0: ties at the k-th place."""
    global build
    plain = build

    def zero_keys(kind, keep_window=64):
        model = plain(kind, keep_window)
        with torch.no_grad():
            for layer in model.model.layers:
                ix = getattr(layer.self_attn, "indexer", None)
                if ix is not None:
                    ix.wk.weight.zero_()
        return model

    build = zero_keys
    try:
        return case(kind, "dsa_all_gather", ("plain", "packed"), 64, proof)
    finally:
        build = plain


def tied_cases(items: list) -> list:
    return [tied_case(*it) for it in items]


def test_dsa_ties_computed_with_the_lower_index_rule(ranks):
    """Indexer scores tied at the k-th place (every indexer key zero: every visible key scores 0) are
    computed, not refused: CP=2 (proof on) equals CP=1 with the lower-key-index tie rule — logits and
    every gradient — for DeepSeek V3.2 and GLM-MoE-DSA (its shared layer reuses the tied selection)."""
    _check(ranks(2).run(tied_cases, [("deepseek_v32", True), ("glm_moe_dsa", True)], timeout=400.0))


def test_doge_cp2_matches_cp1_within_and_beyond_keep_window(ranks):
    """Doge's dynamic mask (random A) at CP=2 equals CP=1 (transformers with the stated tie rule) —
    logits and every gradient — with documents longer than keep_window_size=8 (documents of up to
    30 tokens and the proof's 64-token probe: most queries keep 8 of their visible keys, the dynamic
    top-k over the global keys per query block; random token ids repeat inside a document, so the
    first layer has exactly tied ``dt``). Documents within keep_window_size (the engine path) are
    covered by test_no_square_mask_under_cp."""
    _check(ranks(2).run(cases, [("doge", "doge_dynamic_mask", ("plain", "padding", "packed"), 8)], timeout=400.0))


def test_generic_wrappers_refused_naming_the_semantic(ranks):
    items = [(k, w) for k in ("deepseek_v32", "glm_moe_dsa") for w in ("sdpa_hf", "sdpa_hf_ulysses", HEAD_TAIL)]
    items += [("doge", w) for w in ("sdpa_hf", "sdpa_hf_ulysses", HEAD_TAIL)]
    out = ranks(2).run(plans, items, timeout=300.0)
    for (kind, w), msg in zip(items, out[0]):
        print(f"{kind} / {w if isinstance(w, str) else 'head_tail'}: {msg[:160]}")
        want = "DeepSeek sparse attention" if kind != "doge" else "Doge's dynamic mask"
        method = "dsa_all_gather" if kind != "doge" else "doge_dynamic_mask"
        assert want in msg and f"inner_wrapper: {method}" in msg, msg

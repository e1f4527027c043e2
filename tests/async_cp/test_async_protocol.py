"""The handoff protocol's preflight and the order of launch / wait, forward and backward.

Single-process checks run the generic preflight on a tiny Llama attention given the protocol by
its adapter, with deliberately wrong protocol forwards: each must be refused by name before any
collective. The order checks run the adapters on 2 gloo ranks and read the ``async_trace``.
"""
import pytest
import torch

from hyper_parallel.distributed.context_parallel.wrappers import async_colossal_cp_wrapper
from hyper_parallel.distributed.context_parallel.wrappers.async_handoff import (HandoffPoint, install_async,
                                                                                 validate_async)

LLAMA = "hyper_parallel.models.llama.adapter.distributed.context_parallel_async"


def _attn():
    import transformers as T

    cfg = T.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(cfg).model.layers[0].self_attn


def _with_protocol():
    from hyper_parallel.models.handoff_attention import install_protocol
    from hyper_parallel.models.llama.adapter.distributed.context_parallel_async import SPEC

    attn = _attn()
    install_protocol(attn, SPEC)
    return attn


def _forward(attn, variant: str):
    """A protocol forward for ``attn``; ``variant`` breaks one rule of the contract."""
    import transformers.models.llama.modeling_llama as M

    def fwd(hidden_states, position_embeddings=None, attention_mask=None, **kw):
        shape = (*hidden_states.shape[:-1], -1, attn.head_dim)
        cos, sin = position_embeddings
        rope = lambda x: M.apply_rotary_pos_emb(x, x[:, :0], cos, sin)[0]  # noqa: E731
        k = rope(attn.k_proj(hidden_states).view(shape).transpose(1, 2))
        if variant == "pseudo_async":     # every projection first, then launch and wait back to back
            v = attn.v_proj(hidden_states).view(shape).transpose(1, 2)
            q = rope(attn.q_proj(hidden_states).view(shape).transpose(1, 2))
            k, v, q = attn.cp_k_handoff(k), attn.cp_v_handoff(v), attn.cp_q_handoff(q)
        else:
            k = attn.cp_k_handoff(k)
            if variant == "twice":
                k = attn.cp_k_handoff(k)
            v = attn.cp_v_handoff(attn.v_proj(hidden_states).view(shape).transpose(1, 2))
            q = rope(attn.q_proj(hidden_states).view(shape).transpose(1, 2))
            q = attn.cp_q_handoff(q.transpose(1, 2) if variant == "layout" else q)
            if variant == "layout":
                q = q.transpose(1, 2)
        if variant == "modified":
            v = v * 1.0
        q, k, v = attn.cp_attn_wait(q, k, v)
        iface = M.ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, M.eager_attention_forward)
        out, _ = iface(attn, q, k, v, attention_mask, scaling=attn.scaling)
        return attn.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None

    return fwd


def test_attention_without_protocol_refused_by_name():
    validate = async_colossal_cp_wrapper.__hp_inner_wrapper__.validate
    with pytest.raises(ValueError, match=r"async_colossal_cp_wrapper: LlamaAttention does not implement the async "
                                         r"handoff protocol \(no get_async_cp_handoffs\(\)\)"):
        validate(_attn(), cp_size=2)


def test_adapter_protocol_passes_generic_preflight():
    attn = _with_protocol()
    for method in ("colossal", "ulysses", "load_balance"):
        validate_async(attn, method, "t", cp_size=2, forward=attn.__hp_handoff_forward__)
    validate_async(attn, "hybrid", "t", cp_size=4, ulysses_degree=2, forward=attn.__hp_handoff_forward__)


def test_adapter_refuses_another_models_attention():
    from hyper_parallel.distributed.context_parallel.registry import import_target

    fn = import_target("hyper_parallel.models.qwen3.adapter.distributed.context_parallel_async."
                       "qwen3_async_colossal_cp_wrapper")
    with pytest.raises(ValueError, match="Qwen3 model adapter but the target is LlamaAttention"):
        fn.__hp_inner_wrapper__.validate(_attn(), cp_size=2)


@pytest.mark.parametrize("broken,match", [
    ("same", "returns the same module twice"),
    ("foreign", "is not a submodule of this LlamaAttention"),
    ("keys", "must return a dict with keys"),
])
def test_handoff_modules_distinct_and_owned(broken, match):
    attn = _with_protocol()
    mods = attn.get_async_cp_handoffs()
    if broken == "same":
        mods["k"] = mods["v"]
    elif broken == "foreign":
        mods["q"] = HandoffPoint("q")
    else:
        del mods["wait"]
    attn.get_async_cp_handoffs = lambda: mods
    with pytest.raises(ValueError, match=match):
        validate_async(attn, "colossal", "t", cp_size=2, forward=attn.__hp_handoff_forward__)


@pytest.mark.parametrize("variant,method,match", [
    ("twice", "colossal", r"called its 'k' handoff 2 times"),
    ("layout", "ulysses", r"'q' handoff outputs \(1, 2, 4, 16\); .* H = 4"),
    ("modified", "colossal", r"does not pass its 'v' handoff output to cp_attn_wait unchanged"),
    ("pseudo_async", "colossal", r"no compute in between .*pseudo-async"),
    ("pseudo_async", "ulysses", r"no compute in between .*pseudo-async"),
])
def test_probe_refuses_broken_protocol_forward(variant, method, match):
    attn = _with_protocol()
    with pytest.raises(ValueError, match=match):
        validate_async(attn, method, "t", cp_size=2, forward=_forward(attn, variant))
    validate_async(attn, method, "t", cp_size=2, forward=_forward(attn, "ok"))     # the control passes


class _NoGroupMesh:
    def get_group(self):
        return None


def test_pseudo_async_refused_at_run_time_too():
    """Preflight skipped (e.g. meta parameters): the wait hook still refuses launch-then-wait, after
    waiting every handle (none dangles)."""
    from hyper_parallel.distributed.context_parallel.meta import CPBatchMeta, cp_batch_context
    from hyper_parallel.platform import pending_handles

    attn = _with_protocol()
    fwd = install_async("colossal", attn, None, _NoGroupMesh(), "t", forward=_forward(attn, "pseudo_async"))
    h = torch.randn(1, 8, 64)
    cos, sin = torch.ones(1, 8, 16), torch.zeros(1, 8, 16)
    meta = CPBatchMeta(cp_rank=0, cp_size=1, global_seq_len=8, local_seq_len=8, key_doc=None)
    with cp_batch_context(meta), pytest.raises(ValueError, match="launch-then-wait, pseudo-async"):
        fwd(hidden_states=h, position_embeddings=(cos, sin), attention_mask=None)
    assert pending_handles() == 0
    ok = install_async("colossal", _with_protocol(), None, _NoGroupMesh(), "t")
    with cp_batch_context(meta):
        ok(hidden_states=h, position_embeddings=(cos, sin), attention_mask=None)


def _first(trace, event, name, start=0):
    for i in range(start, len(trace)):
        if trace[i] == (event, name):
            return i
    raise AssertionError(f"{(event, name)} not in trace {trace}")


def _trace(arch, method):
    from tests.async_cp._workers import trace_run

    return trace_run(arch, method)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_colossal_kv_overlap_q_branch_forward_and_backward(ranks, arch):
    """K, V launched before the Q projection and waited after it; in backward the inverse K/V
    collectives launched before the Q projection's backward and waited after it."""
    for t in ranks(2).run(_trace, arch, "colossal"):
        lk, lv, qf, wk = (_first(t, "launch", "k"), _first(t, "launch", "v"), _first(t, "compute", "q_proj"),
                          _first(t, "wait", "k"))
        assert lk < lv < qf < wk, t
        bk = _first(t, "bwd_launch", "k")
        assert bk < _first(t, "bwd_compute", "q_proj", bk) < _first(t, "bwd_wait", "k", bk), t


def test_head_tail_launch_wait_order(ranks):
    """The order the async Head-Tail docstring states, on both ranks: K, V launched, Q branch
    computed, Q dispatch (both branches) launched, everything waited, head branch then tail branch;
    backward: the inverse collectives launched, dQ waited first, then the Q branch's backward while
    dK/dV are in flight, then dV, dK waited."""
    for rank, t in enumerate(ranks(2).run(_trace, "llama", "load_balance")):
        head, tail = f"attention_chunk{rank}", f"attention_chunk{3 - rank}"
        order = [_first(t, "launch", "k"), _first(t, "launch", "v"), _first(t, "compute", "q_proj"),
                 _first(t, "launch", "q"), _first(t, "wait", "q"), _first(t, "compute", head),
                 _first(t, "compute", tail)]
        assert order == sorted(order), t
        assert max(_first(t, "wait", "k"), _first(t, "wait", "v")) < _first(t, "compute", head), t
        b = min(_first(t, "bwd_launch", n) for n in "qkv")
        bq = _first(t, "bwd_wait", "q", b)
        qb = _first(t, "bwd_compute", "q_proj", b)
        assert b < bq < qb < _first(t, "bwd_wait", "v", b) < _first(t, "bwd_wait", "k", b), t


def _custom():
    from tests.async_cp._workers import custom_adapter_parity

    return custom_adapter_parity()


def test_worked_example_adapter_equals_full_sequence(ranks):
    """docs/async_cp.md's worked example (a custom attention with the protocol + a thin
    @inner_wrapper) passes the generic preflight and equals the module on the whole sequence."""
    for r in ranks(2).run(_custom):
        print(f"worked example: output rel err {r['out']:.2e}, grads rel err {r['grads']:.2e} (tol 2e-6 / 2e-5)")
        assert r["out"] < 2e-6 and r["grads"] < 2e-5, r


def _validate_mode(path):
    from tests.wrappers._workers import validate_vs_production

    return validate_vs_production(path)


@pytest.mark.parametrize("path,cp", [("examples/cp/async_llama_colossal.yaml", 2),
                                     ("examples/cp/async_qwen2_ulysses.yaml", 2)])
def test_validate_mode_compares_and_matches_production(ranks, path, cp):
    """mode='validate': the async wrapper's output is compared with the module on the gathered
    sequence (no CPValidationError on a correct path) and logits/grads equal production bitwise."""
    assert all(ranks(cp).run(_validate_mode, path))


def _catches():
    from tests.async_cp._workers import validate_mode_catches_wrong_attention

    return validate_mode_catches_wrong_attention()


def test_validate_mode_catches_a_wrong_async_attention(ranks):
    for msg in ranks(2).run(_catches):
        assert msg.startswith("CPValidationError") and "model.layers.0.self_attn" in msg, msg

"""Attention semantics read from the call: every attention a tiny random transformers
decoder asks for is computed exactly under CP, or refused before the first step naming the module.

Parity (fp32, ``train()``, dropout 0, nothing downloaded): logits over the valid tokens (max abs
<= ``LOGIT_TOL``) and every parameter gradient (max |g_cp - g_cp1| / the reference's largest
|gradient| <= ``GRAD_TOL``) against the same model at CP=1, for

* sliding windows shorter than the sequence (``WINDOW`` = 5, S = 27/32): Mistral, Mixtral,
  Phi3, Starcoder2, Qwen2 (``use_sliding_window``), Gemma3 and Cohere2 (window + full layers);
* Gemma2 (softcap + window) and gpt-oss (sinks + window), built eager (transformers refuses
  SDPA for them) and routed through the attention interface;
* DeepSeek-V3 MLA (``v_head_dim`` 12 != qk head dim 16); Falcon / Persimmon (attention dropout
  is an ``nn.Dropout(p=0.0)`` module); Llama;
* packed rows in transformers' convention (``position_ids`` restarting inside a row, no
  ``seq_lens``), with and without right padding,

x Colossal, Ulysses and Head-Tail at cp 2 and Hybrid (u=2) at cp 4. Refusals (GPT-2's default
``attn_pdrop=0.1``, ALiBi, an unknown attention kwarg, seq_lens disagreeing with restarting
positions) assert their message. Rank functions and models: ``tests/wrappers/_workers.py``.

Which architectures x methods x batch kinds run, and which refusals are expected with which
message, come from the support matrix's rows in ``tests/wrappers/attention_matrix.py``; the
matrix in docs/wrappers.md is rendered from them (test_support_matrix_in_docs_is_generated) and
every cell is checked against the models (test_support_matrix_cells_match_the_models).
"""
from __future__ import annotations

import os

import pytest
import torch

from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.distributed.plan.planner import ShardingPlanner

from . import _models, _workers as W, attention_matrix as M

LOGIT_TOL = 1e-5          # fp32: max |logits_cp - logits_cp1| over valid tokens
GRAD_TOL = 1e-5           # fp32: max |g_cp - g_cp1| / max over all parameters of |g_cp1|

# transformers builds these models' masks without position_ids: at CP=1 restarting positions are one
# sequence, so CP refuses them (test_packed_positions_refused_where_the_model_ignores_them); their
# matrix row's packed cell is refused, so none of their parity cases is packed
NO_PACKED_POSITIONS = M.no_packed_positions()


def check(results, expect_refused=()) -> None:
    """Print the worst errors over ranks and cases next to the tolerance, then assert every case."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0].rsplit("::", 1)[-1]
    flat = [r for per_rank in results for r in per_rank]
    refused = [r for r in flat if "refused" in r]
    bad_refusals = [r for r in refused if not any(a in r["case"] for a in expect_refused)]
    assert not bad_refusals, "\n".join(f"{r['case']}: refused: {r['refused']}" for r in bad_refusals)
    ran = [r for r in flat if "refused" not in r]
    if ran:
        print(f"{test} ({len(results[0])} cases) logits: max abs {max(r['logits'] for r in ran):.2e} "
              f"rel {max(r['logits_rel'] for r in ran):.2e} (tol abs {LOGIT_TOL:g}); grads: max abs "
              f"{max(r['grads_abs'] for r in ran):.2e} rel {max(r['grads'] for r in ran):.2e} "
              f"(tol {GRAD_TOL:g} x the largest |grad|)")
    bad = [r for r in ran if r["logits"] > LOGIT_TOL or r["grads"] > GRAD_TOL]
    assert not bad, "\n".join(f"{r['case']}: logits {r['logits']:.2e} grads {r['grads']:.2e}" for r in bad)


# ---------------------------------------------------------------------------- parity
@pytest.mark.parametrize("method", M.parity_methods(cp=2))
def test_window_softcap_sinks_mla_packed_cp2(ranks, method):
    """The support matrix's cp-2 parity cases of ``method`` (every window architecture + Gemma2
    softcap, gpt-oss sinks, DeepSeek-V3 MLA, Llama packed rows; on Colossal also Falcon / Persimmon
    (Dropout(p=0) modules), eager Llama, Phi / StableLM), in one pool call."""
    cases = M.parity_cases(method)
    assert cases and W.METHODS[method][0] == 2
    check(ranks(2).run(W.semantics_cases, method, cases, timeout=600))


@pytest.mark.parametrize("method", M.parity_methods(cp=4))
def test_hybrid_cp4(ranks, method):
    """Hybrid (u=2) at cp 4: window, softcap + window, sinks + window (sinks sliced by head), packed
    (the support matrix's cp-4 parity cases)."""
    cases = M.parity_cases(method)
    assert cases and W.METHODS[method][0] == 4
    check(ranks(4).run(W.semantics_cases, method, cases, timeout=600))


def test_validate_mode_uses_the_call(ranks):
    """mode='validate' on windowed / softcapped / sink models agrees with the CP output (no error),
    and a strategy that drops the window is caught on every rank."""
    cases = [("mistral", "packed", 32), ("gemma2", "padding", 27), ("gpt_oss", "plain", 32)]
    check(ranks(2).run(W.semantics_cases, "colossal", cases, mode="validate", timeout=600))
    res = ranks(2).outcomes(W.validate_detects_dropped_window, timeout=600)
    assert all(type(r).__name__ == "CPValidationError" and "differs from the original path" in str(r)
               for r in res), res


# ---------------------------------------------------------------------------- refusals
ENTRY = {"when": "cp", "region_dispatch": False, "inner_target": "self", "inner_wrapper": "sdpa_hf"}


def _refused(arch: str, model=None, cp: int = 2) -> str:
    if model is None:
        model, _ = W.build_arch(arch)
    entry = [{**ENTRY, "match": W.ATTN_MATCH.get(arch, "*.self_attn")}]
    with pytest.raises(CPConfigError) as ei:
        ShardingPlanner(plan_overrides=entry).plan(model, None, cp_size=cp)
    return str(ei.value)


def test_refused_at_preflight_by_name():
    """Every plan-time refusal of the support matrix (GPT-2's attention dropout, Falcon's and
    Bloom's ALiBi) names the module and the reason; plus an unknown attention kwarg (Llama)."""
    plan_refusals = M.refusals(when="plan")
    assert plan_refusals
    for row, feature, refusal in plan_refusals:
        msg = _refused(refusal.arch)
        missing = [f for f in refusal.fragments if f not in msg]
        assert not missing, (row.name, feature, missing, msg)
    model, _ = W.build_arch("llama")
    msg = _refused("llama", _models.extra_kwarg_attention(model))
    assert "model.layers.0.self_attn" in msg and "passes ['foo_bias']" in msg and "refused" in msg, msg


def test_accepted_dropout_modules_and_eager():
    """nn.Dropout(p=0.0) attention dropout (Falcon, Persimmon) and eager attention modules going
    through the attention interface (Gemma2, gpt-oss, eager Llama) plan without refusal."""
    for arch in ("falcon", "persimmon", "gemma2", "gpt_oss", "llama_eager"):
        model, _ = W.build_arch(arch)
        entry = [{**ENTRY, "match": W.ATTN_MATCH.get(arch, "*.self_attn")}]
        plan = ShardingPlanner(plan_overrides=entry).plan(model, None, cp_size=2)
        assert len(plan.cp_targets) == 2, arch


def test_packed_positions_contract():
    """Restarting position_ids -> documents on the global rows (transformers' rule), labels never
    cross a document; restarting positions that disagree with seq_lens are refused."""
    from hyper_parallel.distributed.context_parallel.batch import CPBatchError, shard_batch_for_cp

    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1]])
    batch = {"input_ids": torch.arange(9)[None], "position_ids": pos}
    whole = shard_batch_for_cp(batch, (0, 1))
    assert whole.meta.key_doc.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 2]]
    assert whole["shift_labels"].tolist() == [[1, 2, -100, 4, 5, 6, -100, 8, -100]]
    second = shard_batch_for_cp(batch, (1, 2))          # rank 1 of 2: the docs are global
    assert second.meta.key_doc.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 2, -1]]
    assert second["shift_labels"].tolist() == [[6, -100, 8, -100, -100]]
    agree = shard_batch_for_cp({**batch, "seq_lens": torch.tensor([[3, 4, 2]])}, (0, 2))
    assert agree.meta.key_doc[:, :9].tolist() == whole.meta.key_doc.tolist()
    with pytest.raises(CPBatchError, match="position_ids restart .* and seq_lens disagree in row 0 between "
                                           "tokens 5 and 6"):
        shard_batch_for_cp({**batch, "seq_lens": torch.tensor([[3, 3, 3]])}, (0, 2))
    shifted = shard_batch_for_cp({"input_ids": torch.arange(9)[None], "position_ids": torch.arange(9)[None] + 5},
                                 (0, 1))
    assert shifted.meta.key_doc is None                  # shifted, not restarting: one document


def _cp1_wrapped(arch: str):
    """The model with sdpa_hf installed directly at cp 1 (no process group): the handler's checks run."""
    from hyper_parallel.distributed.context_parallel import wrappers

    model, ref = W.build_arch(arch)
    for layer in model.model.layers:
        layer.self_attn.forward = wrappers.sdpa_hf_cp_wrapper(layer.self_attn, None, None, None, None)
    return model, ref


def test_packed_positions_refused_where_the_model_ignores_them():
    """gpt-oss builds its mask without position_ids (documents see each other at CP=1): CP refuses
    restarting positions at the first forward instead of separating the documents; Llama (whose
    mask follows position_ids) runs and equals CP=1."""
    from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp
    from hyper_parallel.distributed.context_parallel.meta import cp_batch_context

    refused = {r.arch: r for _row, _feature, r in M.refusals(when="forward")}
    assert set(refused) == NO_PACKED_POSITIONS, refused
    for arch in (*refused, "llama"):
        model, ref = _cp1_wrapped(arch)
        batch, ref_inputs, valid = W.attention_batch("packed", 27, model.config.vocab_size)
        local = shard_batch_for_cp(batch, None)
        with cp_batch_context(local.meta):
            if arch in refused:
                with pytest.raises(ValueError) as ei:
                    model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False)
                missing = [f for f in refused[arch].fragments if f not in str(ei.value)]
                assert not missing, (arch, missing, str(ei.value))
                continue
            logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
        err = ((logits - ref(**ref_inputs).logits).abs() * valid[..., None]).max().item()
        print(f"{arch} packed at cp 1 through the wrapper: max abs {err:.2e} (tol {LOGIT_TOL:g})")
        assert err <= LOGIT_TOL


def test_preflight_proof_accepts_what_is_exact(ranks):
    """The whole-model preflight proof (model_proof/) now accepts windowed / softcapped / sink /
    MLA models on Colossal instead of refusing them (it used to refuse Mistral's dropped window)."""
    cases = [("mistral", "plain", 32), ("gemma2", "padding", 27), ("gpt_oss", "plain", 32),
             ("deepseek_v3", "packed", 27), ("qwen2", "packed_padding", 32)]
    check(ranks(2).run(W.semantics_cases, "colossal", cases, proof=True, timeout=600))


def test_probe_runs_for_every_architecture(caplog):
    """The preflight probe builds the inputs each attention forward needs (Falcon's alibi=None, the
    partial-rotary width of Phi / StableLM, gpt-oss's half-width cos/sin, MLA) and records the
    call's route and semantics without a 'probe ... skipped' warning."""
    import logging

    from hyper_parallel.distributed.context_parallel.interception import probe_module

    want = {"falcon": ("sdpa", None), "phi": ("hf_interface", None), "stablelm": ("hf_interface", None),
            "gpt_oss": ("hf_interface", W.WINDOW), "deepseek_v3": ("hf_interface", None),
            "mistral": ("hf_interface", W.WINDOW), "gemma2": ("hf_interface", W.WINDOW)}
    with caplog.at_level(logging.WARNING):
        for arch, (route, window) in want.items():
            model, _ = W.build_arch(arch)
            module = model.get_submodule(("transformer.h.0." if arch == "falcon" else "model.layers.0.")
                                         + W.ATTN_MATCH.get(arch, "*.self_attn")[2:])
            res = probe_module(module, "hf_any", arch)
            assert res is not None and res.count == 1 and res.route == route, (arch, res)
            assert res.calls[0].window == window and not res.calls[0].extra, (arch, res.calls[0])
            if arch == "gemma2":
                assert res.calls[0].softcap == 2.0
            if arch == "gpt_oss":
                assert res.calls[0].sinks is not None and tuple(res.calls[0].sinks.shape) == (4,)
    assert "probe forward" not in caplog.text, caplog.text


# ---------------------------------------------------------------------------- the support matrix
def _model_features(arch: str) -> set:
    """The features a model's attention actually has: what the preflight probe records for each
    attention module's call (window, softcap, sinks, Dv != D), ALiBi from the config, RoPE from a
    rotary module."""
    from hyper_parallel.distributed.context_parallel.interception import probe_module

    model, _ = W.build_arch(arch)
    suffix = W.ATTN_MATCH.get(arch, "*.self_attn")[1:]
    found = set()
    for name, module in model.named_modules():
        if not name.endswith(suffix) or name.count(".") != 3:
            continue
        res = probe_module(module, "hf_any", arch)
        for call in (res.calls if res is not None else ()):
            found |= {f for f, on in (("window", call.window is not None), ("softcap", call.softcap is not None),
                                      ("sinks", call.sinks is not None),
                                      ("mla", call.v.shape[-1] != call.q.shape[-1])) if on}
    cfg = model.config
    if getattr(cfg, "alibi", cfg.model_type == "bloom"):      # Bloom's ALiBi has no config switch
        found.add("alibi")
    if any("rotary" in type(m).__name__.lower() for m in model.modules()):
        found.add("rope")
    return found


def test_support_matrix_cells_match_the_models():
    """Every cell of the matrix holds for the models the tests build: "exact" = the feature is in
    the model (probe / config / rotary module) and the arch has parity cases (packed: a packed
    case), "—" = not in the model, "not tested" = no parity case runs it, refused = the refused
    model has the feature (the refusal tests assert the message). Methods agree with the rank side."""
    for m, (_abbrev, cp) in M.METHODS.items():
        assert W.METHODS[m][0] == cp, m
    seen = set()
    for row in M.ROWS:
        assert not seen & set(row.archs), row.name          # one row per model
        seen |= set(row.archs)
        assert all(c.arch in row.archs and c.kind in M.KINDS and c.method in M.METHODS for c in row.cases), row
        assert row.refused is None or not row.cases, row.name
        packed_cases = row.packed_archs()
        for arch in row.archs:
            has = _model_features(arch)
            ran = bool(row.methods_of(arch))
            for f in M.FEATURES:
                cell = row.cell(f)
                where = (row.name, arch, f, cell, sorted(has))
                if f == "packed":
                    if cell == M.EXACT:
                        assert packed_cases, where
                    else:
                        assert not packed_cases, where        # a packed case would make the cell "exact"
                    assert cell != M.ABSENT or not ran, where   # every decoder that runs takes position_ids
                    continue
                if cell == M.EXACT:
                    assert f in has and ran, where
                elif cell == M.ABSENT:
                    assert f not in has, where
                elif cell == M.UNTESTED:
                    assert f in has and not ran, where
                else:
                    assert isinstance(cell, M.Refused), where
                    assert cell.when == "forward" or f in _model_features(cell.arch), where


def test_support_matrix_in_docs_is_generated():
    """docs/wrappers.md's support matrix is render_markdown() of the rows the tests run
    (python -m tests.wrappers.attention_matrix --write-docs rewrites it)."""
    with open(M.DOC, encoding="utf-8") as f:
        _, block, _ = M.split_doc(f.read())
    assert block == M.render_markdown(), "run: python -m tests.wrappers.attention_matrix --write-docs"

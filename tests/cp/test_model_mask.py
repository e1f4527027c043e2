"""``interception/model_mask.py`` on one process (no collective): which base model skips transformers'
attention mask under CP, and that it builds it as before outside a CP forward. The multirank
end-to-end check (no [.., L, L] tensor in a CP step, parity with CP=1) is
``tests/cp/test_dsa_cp.py::test_no_square_mask_under_cp``."""
from __future__ import annotations

import dataclasses

import torch

from hyper_parallel.distributed.context_parallel.interception.model_mask import (IGNORES_MODEL_MASK,
                                                                                 install_no_model_mask, mask_owner)
from hyper_parallel.distributed.context_parallel.meta import cp_batch_context


def _doge():
    import transformers as T

    cfg = T.DogeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, attn_implementation="sdpa")
    return T.AutoModelForCausalLM.from_config(cfg).train()


def _mark(module, ignores: bool):
    """What the applier leaves on a CP-wrapped module: the marker and an instance forward."""
    def forward(*a, **kw):
        return type(module).forward(module, *a, **kw)
    if ignores:
        setattr(forward, IGNORES_MODEL_MASK, True)
    module.forward = forward
    module.__hp_cp_wrapped__ = "test"


def _masks_seen(model, meta=None):
    """The attention_mask each decoder layer received in one forward (under ``meta`` when given)."""
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("attention_mask")),
                                             with_kwargs=True) for layer in model.model.layers]
    ids = torch.randint(3, 60, (1, 8))
    try:
        if meta is None:
            model(input_ids=ids)
        else:
            with cp_batch_context(meta):
                model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


@dataclasses.dataclass
class _Meta:
    cp_size: int


def test_owner_is_the_base_model_holding_the_layers():
    model = _doge()
    assert mask_owner(model, "model.layers.1.self_attn") == "model"
    assert mask_owner(model, "lm_head") is None


def test_mask_skipped_only_under_cp_and_only_when_every_wrapped_module_ignores_it():
    model = _doge()
    for layer in model.model.layers:
        _mark(layer.self_attn, ignores=True)
    assert install_no_model_mask(model) == ["model"]
    assert install_no_model_mask(model) == []                     # idempotent
    before = _masks_seen(model)                                   # no CP meta: transformers' mask as before
    assert all(isinstance(m, torch.Tensor) and tuple(m.shape[-2:]) == (8, 8) for m in before), before
    assert _masks_seen(model, _Meta(cp_size=1)) and all(m is not None for m in _masks_seen(model, _Meta(1)))
    assert _masks_seen(model, _Meta(cp_size=2)) == [None, None]   # under CP: none built
    assert model.model.config._attn_implementation == "sdpa"      # the model's own config is back

    mixed = _doge()
    _mark(mixed.model.layers[0].self_attn, ignores=True)
    _mark(mixed.model.layers[1].self_attn, ignores=False)         # a method that reads the mask
    assert install_no_model_mask(mixed) == []
    assert all(m is not None for m in _masks_seen(mixed, _Meta(cp_size=2)))


def test_a_cp_forward_changes_nothing_another_thread_sees():
    """Thread A is inside a CP forward (no mask built) while thread B runs the same model without CP:
    B gets transformers' [L, L] mask and reads the model's own config throughout (nothing shared is
    swapped per call), and A still builds none."""
    import threading

    model = _doge()
    for layer in model.model.layers:
        _mark(layer.self_attn, ignores=True)
    assert install_no_model_mask(model) == ["model"]
    inside, b_done, seen = threading.Event(), threading.Event(), []

    def hook(m, a, kw):
        seen.append((threading.current_thread().name, kw.get("attention_mask")))
        if threading.current_thread().name == "A" and not inside.is_set():
            inside.set()
            assert b_done.wait(120), "thread B did not finish"

    h = model.model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    errors = []

    def run_a():
        try:
            with cp_batch_context(_Meta(cp_size=2)):
                model(input_ids=torch.randint(3, 60, (1, 8)))
        except BaseException as exc:   # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    a = threading.Thread(target=run_a, name="A")
    a.start()
    try:
        assert inside.wait(120), "thread A did not reach its first layer"
        impl_during = model.model.config._attn_implementation
        model(input_ids=torch.randint(3, 60, (1, 8)))
    finally:
        b_done.set()
        a.join(120)
        h.remove()
    assert not errors, errors
    a_masks = [m for t, m in seen if t == "A"]
    b_masks = [m for t, m in seen if t != "A"]
    print(f"config seen by B during A's CP forward: {impl_during}; masks A {a_masks}, B "
          f"{[tuple(m.shape) if m is not None else None for m in b_masks]}")
    assert impl_during == "sdpa"
    assert a_masks == [None] and len(b_masks) == 1 and tuple(b_masks[0].shape[-2:]) == (8, 8)

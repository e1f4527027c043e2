"""Rank functions of the meta-build and HF-checkpoint tests (module-level, picklable)."""
from __future__ import annotations

import torch

from . import _workers as W


def _decoder_param_shapes(model) -> dict:
    from hyper_parallel.distributed.tensor_parallel import find_decoder_layers

    layers = tuple(f + "." for f in find_decoder_layers(model))
    return {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith(layers)}


def meta_build_report(cfg: dict) -> dict:
    """Build a TextTrainer (meta build -> plan -> materialize) while recording every tensor the
    construction allocates on a real device up to the end of materialization, outside the host-side
    unit twins; compare every parameter with the ordinary (unsharded) build at the same seed."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hyper_parallel.trainer import base, tiled_head
    from hyper_parallel.trainer import model as M
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.grad_utils import full_copy
    from hyper_parallel.trainer.text import TextTrainer

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.on, self.shapes = True, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # only fresh storage counts: views and in-place / out= results alias an input
            if self.on and all(r.alias_info is None for r in func._schema.returns):
                for t in (out if isinstance(out, (tuple, list)) else (out,)):
                    if isinstance(t, torch.Tensor) and not t.is_meta and not hasattr(t, "_local_tensor"):
                        self.shapes.append((tuple(t.shape), str(func)))
            return out

    rec = Record()
    paused = {}

    def pausing(fn):
        def wrapper(*a, **kw):
            was, rec.on = rec.on, False
            try:
                return fn(*a, **kw)
            finally:
                rec.on = was
        return wrapper

    state = {"meta_at_materialize": None}
    orig_mat = base.materialize

    def materialize(model, device, **kw):
        state["meta_at_materialize"] = all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
        state["local"] = {n: (tuple(p.shape), tuple(p._local_tensor.shape) if hasattr(p, "_local_tensor")
                              else tuple(p.shape)) for n, p in model.named_parameters()}
        out = orig_mat(model, device, **kw)
        rec.on = False      # after this: the CP proof / training unshard layers by FSDP's design
        return out

    # host-side by design: the per-unit init twins and the tiled-head probe's small twin (and its forward)
    for mod, name in ((M, "_full_twin"), (base, "head_probe_model"), (tiled_head, "verify_tiled_head")):
        paused[(mod, name)] = getattr(mod, name)
        setattr(mod, name, pausing(getattr(mod, name)))
    base.materialize = materialize
    try:
        with rec:
            trainer = TextTrainer(TrainerConfig.from_dict(cfg))
    finally:
        base.materialize = orig_mat
        for (mod, name), fn in paused.items():
            setattr(mod, name, fn)
    c = TrainerConfig.from_dict(cfg)
    ref = M.HyperAutoModel.from_config(c.model)
    ref_params = dict(ref.named_parameters())
    diffs, names = {}, []
    for n, p in trainer.model.named_parameters():
        full = full_copy(p).float()
        key = n.replace("._checkpoint_wrapped_module", "")
        names.append(key)
        diffs[key] = float((full - ref_params[key].detach().float()).abs().max())
    layer_shapes = _decoder_param_shapes(ref)
    # the full shape of every decoder-layer parameter that is sharded (local shape differs)
    sharded_full = {full for n, (full, local) in state["local"].items() if n in layer_shapes and full != local and len(full) >= 2}
    full_layer_allocs = [(s, f) for s, f in rec.shapes if s in sharded_full]
    tied = bool(getattr(ref.config, "tie_word_embeddings", False))
    out = {"diffs": diffs, "names": sorted(names), "ref_names": sorted(ref_params),
           "meta_at_materialize": state["meta_at_materialize"], "local": state.get("local"),
           "full_layer_allocs": full_layer_allocs[:5], "n_allocs": len(rec.shapes),
           "tied_in_trainer": trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight if tied else None}
    # the trained path still works: one step
    out["loss"] = trainer.train_step(trainer.data.next_micro_batches(1)).loss
    return out


# ---------------------------------------------------------------------- HF checkpoints (test_hf_checkpoint.py)
def _probe_ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(7))


def train_then_export(cfg: dict, out_dir: str, tokenizer_dir=None, steps: int = 2) -> dict:
    """Train ``steps`` steps, export with save_hf; return the trained model's logits on a probe
    (full parameters gathered into the ordinary build, for the comparison only) and, on rank 0,
    those of plain ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)``."""
    import transformers

    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.hf_checkpoint import save_hf
    from hyper_parallel.trainer.model import HyperAutoModel
    from hyper_parallel.trainer.text import TextTrainer

    c = TrainerConfig.from_dict(cfg)
    trainer = TextTrainer(c)
    losses = [r.loss for r in trainer.train(steps)]
    full = trainer.named_full("param")          # test-side reference only (collective)
    save_hf(trainer, out_dir, tokenizer_dir=tokenizer_dir)
    import torch.distributed as dist

    out = {"losses": losses}
    if dist.get_rank() == 0:
        ref = HyperAutoModel.from_config(c.model)
        missing = ref.load_state_dict(full, strict=False)
        assert not missing.missing_keys or set(missing.missing_keys) <= {"lm_head.weight"}, missing
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True)
        ids = _probe_ids(ref.config.vocab_size)
        with torch.no_grad():
            a = ref.eval()(input_ids=ids).logits
            b = loaded.eval()(input_ids=ids).logits
        import os

        out.update(max_abs=float((a - b).abs().max()), scale=float(a.abs().max()),
                   files=sorted(os.listdir(out_dir)), loaded_class=type(loaded).__name__,
                   use_cache=loaded.config.use_cache)
        if tokenizer_dir is not None:
            tok = transformers.AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
            out["tokenizer_len"] = len(tok)
    return out


def load_report(cfg: dict, ckpt_dir: str) -> dict:
    """TextTrainer with model.path = ckpt_dir: its full parameters vs plain transformers' load of the
    same directory cast to the trainer's dtype (rank 0 compares); shard sizes of the decoder layers."""
    import transformers

    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.text import TextTrainer

    trainer = TextTrainer(TrainerConfig.from_dict(cfg))
    local = {n: (tuple(p.shape), tuple(p._local_tensor.shape) if hasattr(p, "_local_tensor") else tuple(p.shape))
             for n, p in trainer.model.named_parameters()}
    full = trainer.named_full("param")
    loss = trainer.train_step(trainer.data.next_micro_batches(1)).loss
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt_dir, local_files_only=True, dtype=torch.float32)
    hf_params = dict(hf.named_parameters())
    diffs = {}
    for n, t in full.items():
        ref = hf_params[n].detach().float()
        if ref.shape != t.shape:          # resized vocabulary: the checkpoint's rows
            diffs[n] = float((t[: ref.shape[0]] - ref).abs().max())
            diffs[n + "[new rows std]"] = float(t[ref.shape[0]:].std())
        else:
            diffs[n] = float((t - ref).abs().max())
    return {"diffs": diffs, "local": local, "loss": loss, "vocab": trainer.model.config.vocab_size,
            "tied": trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight}

"""No FSDP2-wrapped module returns a view (the FSDP2 "returned a view tensor" hazard).

FSDP2 registers its pre-backward hook on each wrapped module's output; an in-place op on an output
that is a view drops that hook (the all-gather before backward is skipped: wrong gradients or a
failed backward). The tiled loss head used to return its empty logits as a view of the per-token
losses, so FSDP2 warned for the LM head and the whole model on every rank. These tests fail if any
FSDP-wrapped module's differentiable output is a view again, or any such warning is raised."""
import warnings

import torch

from tests.trainer import _workers as W

VIEW_WARNING = "returned a view tensor"


def test_tiled_head_output_is_not_a_view():
    from tests.trainer.test_tiled_head import _model

    from hyper_parallel.trainer.tiled_head import install_tiled_head

    model = _model("llama")
    head = install_tiled_head(model, chunk_size=13, ignore_index=-100)
    ids = torch.randint(0, 211, (2, 40), generator=torch.Generator().manual_seed(0))
    with head.targets(ids):
        out = model(input_ids=ids)
    assert out.logits.shape == (2, 40, 0) and out.logits.requires_grad
    assert out.logits._base is None, "the tiled head's empty logits are a view"


def _fsdp_views_and_warnings(cfg: dict) -> dict:
    """Build the trainer (CP=2, FSDP2), record every FSDP module output that is a view and every
    warning of one training step."""
    from torch.distributed.fsdp import FSDPModule
    from torch.utils._pytree import tree_leaves

    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.text import TextTrainer

    trainer = TextTrainer(TrainerConfig.from_dict(cfg))
    views = []

    def check(module, args, output):
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad and t._base is not None:
                views.append(type(module).__name__)

    fsdp = [m for m in trainer.model.modules() if isinstance(m, FSDPModule)]
    handles = [m.register_forward_hook(check) for m in fsdp]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    for h in handles:
        h.remove()
    return {"fsdp_modules": len(fsdp), "views": views, "warnings": [str(w.message) for w in caught],
            "tiled": trainer.tiled_head is not None}


def test_no_fsdp_module_returns_a_view_and_no_warning(ranks, tmp_path):
    cfg = W.make_cfg("llama", cp=2, steps=1, out_dir=str(tmp_path / "run"))
    for rank, r in enumerate(ranks(2).run(_fsdp_views_and_warnings, cfg, timeout=600.0)):
        print(f"rank {rank}: {r['fsdp_modules']} FSDP modules, view outputs {r['views']}, warnings {r['warnings']}")
        assert r["tiled"] and r["fsdp_modules"] > 1, r
        assert r["views"] == [], r["views"]
        assert not [w for w in r["warnings"] if VIEW_WARNING in w], r["warnings"]

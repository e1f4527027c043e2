"""Expert parallelism (EP) beside CP: the experts of each MoE layer split over the EP group (derived
from the dense ranks, ``MeshContext.experts_mesh``), routed tokens exchanged by all-to-all, dropless
and exact. :mod:`.targets` finds and checks the experts modules (the model's ``base_model_ep_plan``),
:mod:`.dispatch` shards one and installs its exchanging forward, :mod:`.cost` says what it costs. docs/expert_parallel.md.
"""
from .cost import EPCost, ep_cost
from .dispatch import ep_forward, shard_experts
from .targets import EPTarget, declared_ep_plan, find_ep_targets

__all__ = ["EPTarget", "declared_ep_plan", "find_ep_targets", "shard_experts", "ep_forward", "install_experts",
           "EPCost", "ep_cost"]


def install_experts(model, targets, ep_mesh, replace_forward) -> None:
    """Shard every target's experts over ``ep_mesh`` and install its EP forward through
    ``replace_forward(module, fn)`` (the applier's, undone by its rollback)."""
    modules = dict(model.named_modules())
    for t in targets:
        module = modules[t.fqn]
        shard_experts(module, t, ep_mesh)
        replace_forward(module, ep_forward(module, t, ep_mesh))

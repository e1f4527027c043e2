"""One batch per CP group: the Trainer's dataloaders shard by data-parallel rank, not by rank.

Accelerate's ``prepare_data_loader`` already knows the rule "ranks of one ``cp`` (or ``tp``) group
get the same batch": given a device mesh with named ``dp_replicate`` / ``dp_shard`` / ``cp`` / ``tp``
dimensions it shards by ``rank // (cp x tp)`` over ``dp_replicate x dp_shard`` processes. The
Trainer passes ``accelerator.torch_device_mesh`` (the accelerator state's ``device_mesh``) to it for
every dataloader it builds (train, eval). :func:`shard_data_by_dp` sets that mesh to the
:class:`~hyper_parallel.distributed.mesh.MeshContext` root mesh, whose dimensions are exactly
those names (rank order ``dp_replicate, dp_shard, cp, tp``). Without an accelerate
``ParallelismConfig`` nothing else in accelerate reads it (model preparation, CP/TP contexts and
saving are gated on that config), so the model is still prepared as plain DDP over all ranks.
"""
from __future__ import annotations


def shard_data_by_dp(trainer, mesh) -> None:
    """Make every dataloader ``trainer`` builds give one batch per CP group (module doc)."""
    trainer.accelerator.state.device_mesh = mesh.root   # a ParallelismConfig is refused in .checks

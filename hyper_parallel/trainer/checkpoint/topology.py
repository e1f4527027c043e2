"""Topologies of a save and a resume: what may change between them (CP, DP, world size:
DCP reshards) and what may not (TP size: refused by name). Local only: no collective."""
from __future__ import annotations

from ...distributed.errors import CPConfigError

TOPOLOGY_KEYS = (("pp", "accelerator.pp_size"), ("cp_size", "accelerator.cp_size"),
                 ("dp_shard", "accelerator.dp_shard_size"),
                 ("dp_replicate", "accelerator.dp_replicate_size"), ("tp", "accelerator.tp_size"),
                 ("world_size", "world size"))


def topology_of(mesh) -> dict:
    s = mesh.sizes
    return {"pp": s.pp, "cp_size": s.cp, "dp_shard": s.dp_shard, "dp_replicate": s.dp_replicate, "tp": s.tp,
            "world_size": mesh.world_size}


def check_topology(path, saved: dict, current: dict) -> dict | None:
    """What a resume from a checkpoint saved with topology ``saved`` onto ``current`` needs.

    Returns None for the same topology, else ``{"from": saved, "to": current}``: the PP size (every
    stage saves its tensors under the whole model's names), the CP size, the DP sizes and the world
    size may change, because DCP reshards every FSDP2/DTensor tensor
    (model and optimizer state are saved by global shape and read back as this run's shards) and
    the data stream position is per DP rank (global micro-batches consumed). The TP size may not:
    a TP plan restructures its modules (heads split per rank, fused projections) and nothing
    checks that the saved shards map onto another TP layout, so it raises :class:`CPConfigError`
    naming ``accelerator.tp_size`` and both sizes."""
    if saved.get("tp", 1) != current["tp"]:
        raise CPConfigError(
            "schedule.resume_from",
            f"checkpoint {path} was saved with accelerator.tp_size={saved.get('tp')} but this run has "
            f"accelerator.tp_size={current['tp']}: tensor-parallel state is not resharded (the TP plan "
            "restructures its modules: attention heads and MLP columns split per rank)",
            fix=f"resume with accelerator.tp_size={saved.get('tp')} (cp_size and the DP sizes may change)")
    saved = {"pp": 1, **saved}       # saved before pipeline parallelism: one stage
    changed = [k for k, _ in TOPOLOGY_KEYS if saved.get(k) != current[k]]
    return {"from": {k: saved.get(k) for k, _ in TOPOLOGY_KEYS}, "to": dict(current)} if changed else None


def describe_reshard(reshard: dict) -> str:
    """``cp_size 2 -> 1, world_size 2 -> 1`` for the sizes that differ."""
    return ", ".join(f"{field.split('.')[-1]} {reshard['from'][k]} -> {reshard['to'][k]}"
                     for k, field in TOPOLOGY_KEYS if reshard["from"].get(k) != reshard["to"].get(k))

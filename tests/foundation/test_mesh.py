"""MeshContext shapes and Hybrid sub-mesh rank sets on real gloo ranks."""
import pytest
import torch.distributed as dist

from hyper_parallel.distributed.mesh import MeshConfigError, MeshContext, MeshSizes


def _ranks(mesh, dim=None):
    group = mesh.get_group(dim) if dim is not None else mesh.get_group()
    return dist.get_process_group_ranks(group)


def mesh_layout(sizes: dict, hybrid=()):
    ctx = MeshContext(MeshSizes(**sizes), hybrid_degrees=hybrid)
    out = {
        "cp": _ranks(ctx.cp_mesh),
        "tp": _ranks(ctx.tp_mesh),
        "dp_cp": _ranks(ctx.dp_cp_mesh),
        "dp": _ranks(ctx.dp_mesh),
        "fsdp_dims": ctx.fsdp_mesh.mesh_dim_names,
        "fsdp": ctx.fsdp_mesh.mesh.flatten().tolist(),
        "cp_rank": ctx.cp_rank,
        "hybrid": {u: (_ranks(ctx.hybrid_mesh(u), 0), _ranks(ctx.hybrid_mesh(u), 1)) for u in hybrid},
    }
    return out


def test_world1_trivial(ranks):
    [res] = ranks(1).run(mesh_layout, {"cp": 1})
    assert res["cp"] == [0] and res["dp_cp"] == [0]


@pytest.mark.parametrize("sizes,expect_cp,expect_tp,expect_dp_cp", [
    ({"cp": 2}, [[0, 1], [0, 1]], [[0], [1]], [[0, 1], [0, 1]]),
    ({"dp_shard": 2, "cp": 1}, [[0], [1]], [[0], [1]], [[0, 1], [0, 1]]),
    # TP replicas are outside the loss/token domain: each TP rank is its own dp_cp group
    ({"cp": 1, "tp": 2}, [[0], [1]], [[0, 1], [0, 1]], [[0], [1]]),
])
def test_world2(ranks, sizes, expect_cp, expect_tp, expect_dp_cp):
    res = ranks(2).run(mesh_layout, sizes)
    assert [r["cp"] for r in res] == expect_cp
    assert [r["tp"] for r in res] == expect_tp
    assert [r["dp_cp"] for r in res] == expect_dp_cp


def test_world4_dp_shard_x_cp(ranks):
    res = ranks(4).run(mesh_layout, {"dp_shard": 2, "cp": 2})
    assert [r["cp"] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp"] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r["dp_cp"] == [0, 1, 2, 3] for r in res)
    assert all(r["fsdp"] == [0, 1, 2, 3] and r["fsdp_dims"] == ("dp_shard_cp",) for r in res)
    assert [r["cp_rank"] for r in res] == [0, 1, 0, 1]


def test_world4_cp_x_tp(ranks):
    res = ranks(4).run(mesh_layout, {"cp": 2, "tp": 2})
    assert [r["cp"] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["tp"] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    # loss/token domain excludes TP replicas: each TP column is its own dp_cp group
    assert [r["dp_cp"] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_world4_hybrid_cp4_u2(ranks):
    res = ranks(4).run(mesh_layout, {"cp": 4}, hybrid=(2,))
    colossal = [r["hybrid"][2][0] for r in res]
    ulysses = [r["hybrid"][2][1] for r in res]
    assert ulysses == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert colossal == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_world8_hybrid_cp8(ranks):
    res = ranks(8).run(mesh_layout, {"cp": 8}, hybrid=(2, 4))
    u2 = [r["hybrid"][2] for r in res]
    u4 = [r["hybrid"][4] for r in res]
    assert [c for c, _ in u2][1] == [1, 3, 5, 7] and [u for _, u in u2][5] == [4, 5]
    assert [u for _, u in u4][5] == [4, 5, 6, 7] and [c for c, _ in u4][6] == [2, 6]
    for r, (col, uly) in enumerate(u2):
        assert uly == [r - r % 2, r - r % 2 + 1] and col == list(range(r % 2, 8, 2))


def test_world8_dp2_cp2_tp2(ranks):
    res = ranks(8).run(mesh_layout, {"dp_shard": 2, "cp": 2, "tp": 2})
    assert res[0]["cp"] == [0, 2] and res[0]["tp"] == [0, 1] and res[0]["dp_cp"] == [0, 2, 4, 6]
    assert res[5]["cp"] == [5, 7] and res[5]["dp"] == [1, 5]


def test_world8_dp_replicate_hsdp(ranks):
    res = ranks(8).run(mesh_layout, {"dp_replicate": 2, "dp_shard": 2, "cp": 2})
    assert res[0]["fsdp_dims"] == ("dp_replicate", "dp_shard_cp")
    assert res[0]["dp_cp"] == list(range(8))


def test_wrong_product_shows_arithmetic():
    with pytest.raises(MeshConfigError) as ei:
        MeshSizes(dp_shard=2, cp=2, tp=2).check(4)
    msg = str(ei.value)
    assert "dp_shard(2) x cp(2) x tp(2) = 8" in msg and "world_size = 4" in msg


def test_ep_must_divide_dense_domain():
    with pytest.raises(MeshConfigError, match=r"ep_size=3 must divide dp_shard\(2\) x cp\(2\) = 4"):
        MeshSizes(dp_shard=2, cp=2, ep=3).check(4)


def _undeclared_hybrid():
    ctx = MeshContext(MeshSizes(cp=4), hybrid_degrees=(2,))
    ctx.hybrid_mesh(4)


def test_undeclared_hybrid_degree_is_rejected(ranks):
    outs = ranks(4).outcomes(_undeclared_hybrid)
    assert all(isinstance(o, MeshConfigError) and "ulysses_degree=4" in str(o) for o in outs)


def shared_reuse():
    """MeshContext.shared: one context (one set of groups) per sizes + timeout, reused."""
    from hyper_parallel import platform as P

    a = MeshContext.shared(MeshSizes(cp=2))
    b = MeshContext.shared(MeshSizes(cp=2), hybrid_degrees=())
    c = MeshContext.shared(MeshSizes(dp_shard=2))
    P.set_default_timeout(123)
    try:
        d = MeshContext.shared(MeshSizes(cp=2))        # groups carry the timeout: a new context
    finally:
        P.set_default_timeout(None)
    e = MeshContext.shared(MeshSizes(cp=2))
    works = float(P.all_reduce(__import__("torch").ones(1), a.cp_mesh.get_group()).item())
    return a is b, a is c, a is d, a is e, works


def test_shared_mesh_reuses_groups(ranks):
    for same, other_sizes, other_timeout, again, works in ranks(2).run(shared_reuse):
        assert same and again and not other_sizes and not other_timeout and works == 2.0

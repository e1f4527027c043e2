"""local_compute_fn declared in YAML: installed with the cp mesh, owns the compute, CP=1 parity."""
from tests.wrappers._workers import cp_parity

TOL = 2e-4  # fp32 logits max abs; gradients max rel 1e-4


def local_compute_parity():
    return cp_parity("examples/cp/local_compute.yaml", grads=True, padding=True)


def test_local_compute_fn_matches_cp1(ranks):
    for r in ranks(2).run(local_compute_parity):
        assert "local_compute_fn" in r["summary"]
        assert r["logits"] < TOL, f"logits max abs err {r['logits']:.3e} (tol {TOL})"
        assert r["grads"] < 1e-4, f"grad max rel err {r['grads']:.3e} (tol 1e-4)"

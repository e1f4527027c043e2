"""local_compute_fn declared in YAML: installed with the cp mesh, owns the compute, CP=1 parity."""
from tests.wrappers._workers import cp_parity

# fp32 vs CP=1 (rel = max abs / max |reference|); measured logits 2.1e-7 abs, grads 5.8e-7 rel
TOL = 1e-5        # logits max abs
GRAD_RTOL = 1e-5  # gradients max rel (as tests/wrappers/test_parity.py)


def local_compute_parity():
    return cp_parity("examples/cp/local_compute.yaml", grads=True, padding=True)


def test_local_compute_fn_matches_cp1(ranks):
    for rank, r in enumerate(ranks(2).run(local_compute_parity)):
        print(f"local_compute rank {rank} logits: max abs {r['logits']:.2e} rel {r['logits_rel']:.2e} (tol abs {TOL:g})")
        print(f"local_compute rank {rank} grads: max abs {r['grads_abs']:.2e} rel {r['grads']:.2e} (tol rel {GRAD_RTOL:g})")
        assert "local_compute_fn" in r["summary"]
        assert r["logits"] < TOL, f"logits max abs err {r['logits']:.3e} (tol {TOL})"
        assert r["grads"] < GRAD_RTOL, f"grad max rel err {r['grads']:.3e} (tol {GRAD_RTOL})"

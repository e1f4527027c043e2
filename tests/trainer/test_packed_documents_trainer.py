"""The hybrid CP examples on packed rows, through the trainer: under each declared
``data.packed_documents``, CP=2 gives the CP=1 losses step for step (fp32).

Each example (``examples/cp/<model_type>_cp2.yaml``, whose result depends on what a packed row means:
a recurrent mixer, or Llama 4's row-indexed temperature) is read as ``hyper-train`` reads it, with
the data switched to the shipped standard-library text packed into rows (``data.source: files``,
``packing: true``; short documents, so a row holds several and they cross the CP-rank boundary).
``independent`` runs the declared methods at cp_size 1 as a CP group of one; ``as_transformers`` is
plain transformers at cp_size 1. Undeclared, the same file is refused at ``data.packed_documents``.
docs/wrappers.md, "Packed documents".
"""
from __future__ import annotations

import pytest

from hyper_parallel.distributed.errors import CPConfigError
from tests.trainer import _data_workers as D
from tests.trainer import _workers as TW
from tests.trainer.test_cp_examples import _cfg

#: fp32, relative, per step: the same math, another summation order (measured ~1e-7)
LOSS_RTOL = 2e-6
SEQ_LEN = 1024
#: optimizer steps per run: 2 (losses before and after one update); Llama 4's two meanings differ by only
#: ~8e-6 after one update (its temperature rescale is small on these rows), so it takes 3
STEPS = {"llama4_text_cp2.yaml": 3}
EXAMPLES = ["qwen3_next_cp2.yaml", "qwen3_5_text_cp2.yaml", "llama4_text_cp2.yaml", "nemotron_h_cp2.yaml",
            "minimax_cp2.yaml", "kimi_linear_cp2.yaml"]


def _packed(example: str, path, semantics, cp: int, docs: str) -> dict:
    data = [f"data.{k}={v}" for k, v in D.data_cfg(docs, str(path.parent / "cache"), seq_len=SEQ_LEN,
                                                    micro_batch_size=1).items() if k != "files"]
    cfg = _cfg(example, path, f"schedule.steps={STEPS.get(example, 2)}", f"accelerator.cp_size={cp}", *data,
               "model.config.vocab_size=4096")
    cfg["data"]["files"] = [docs]
    if semantics is not None:
        cfg["data"]["packed_documents"] = semantics
    cfg["data"].pop("path", None)
    return cfg


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    return D.short_docs_jsonl(str(tmp_path_factory.mktemp("packed_docs") / "docs.jsonl"), n_docs=80, lo=20, hi=400)


@pytest.mark.parametrize("example", EXAMPLES)
def test_packed_example_cp2_same_losses_as_cp1(ranks, tmp_path, docs, example):
    got = {}
    for semantics in ("independent", "as_transformers"):
        cfgs = [_packed(example, tmp_path / f"{semantics}{cp}", semantics, cp, docs) for cp in (2, 1)]
        cp2 = ranks(2).run(TW.train_losses, cfgs[0], timeout=600.0)
        cp1 = ranks(1).run(TW.train_losses, cfgs[1], timeout=600.0)
        l1, l2 = cp1[0]["losses"], cp2[0]["losses"]
        assert cp2[1]["losses"] == l2 and len(l1) == len(l2) == STEPS.get(example, 2)
        rel = [abs(a - b) / abs(a) for a, b in zip(l1, l2)]
        print(f"{example} {semantics}: cp1 {l1}\n  cp2 {l2}\n  max rel err {max(rel):.2e} (tol {LOSS_RTOL:g})")
        assert max(rel) <= LOSS_RTOL, (semantics, l1, l2)
        got[semantics] = l1
    gap = max(abs(a - b) / abs(a) for a, b in zip(got["independent"], got["as_transformers"]))
    print(f"{example}: the two meanings differ by {gap:.2e} relative")
    assert gap > 5 * LOSS_RTOL, "the two meanings agree on these rows: the declaration is not exercised"


def test_undeclared_packed_rows_are_refused_at_the_field(tmp_path, docs):
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.launch import _check_model

    for cp in (1, 2):
        cfg = _packed("qwen3_next_cp2.yaml", tmp_path / f"cp{cp}", None, cp, docs)
        with pytest.raises(CPConfigError, match=r"data\.packed_documents.*linear_attn"):
            _check_model(TrainerConfig.from_dict(cfg))    # what hyper-train checks before it launches ranks

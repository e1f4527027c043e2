"""``logging.export_hf`` at the end of a packed CP=2 run.

2 ranks, CP=2 (Head-Tail), packed standard-library documents, 2 steps; ``trainer.train()`` writes
``<out_dir>/hf`` through ``hf_checkpoint.save_hf`` with the tokenizer files of
``data.tokenizer``. Plain ``transformers`` reloads it: the reloaded model's logits on a packed row
(several documents, restarting position_ids) equal the trained model's (its full parameters in
the ordinary build) within 1e-5 x max|logits|, and the exported tokenizer encodes like the source
one (same ids, same EOS).
"""
from __future__ import annotations

from . import _data_workers as D


def test_packed_cp2_run_exports_model_and_tokenizer(ranks, tmp_path):
    docs = D.short_docs_jsonl(str(tmp_path / "docs.jsonl"), n_docs=24, lo=10, hi=150)
    data = D.data_cfg(docs, str(tmp_path / "cache"), seq_len=64, micro_batch_size=1)
    cfg = D.trainer_cfg(data, cp=2, method="head_tail", steps=2, out_dir=str(tmp_path / "run"))
    cfg["logging"]["export_hf"] = True
    res = ranks(2).run(D.train_export_packed, cfg, timeout=300)
    r0 = res[0]
    rel = r0["max_abs"] / r0["scale"]
    print(f"export after packed CP=2: reloaded logits max abs {r0['max_abs']:.3e} (relative {rel:.2e}, tol 1e-5); "
          f"files {r0['files']}")
    assert rel <= 1e-5, r0
    assert r0["docs_in_row"] >= 2
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"} <= set(r0["files"])
    assert r0["same_ids"] and r0["eos"][0] == r0["eos"][1]
    assert res[1]["losses"] == r0["losses"]

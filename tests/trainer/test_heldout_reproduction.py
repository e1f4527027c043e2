"""The held-out loss is reproducible from outside (docs/quickstart.md, "Reproduce the held-out loss").

2 ranks, CP=2 (Head-Tail), packed standard-library documents, ``eval_fraction`` 0.25, evaluation
after the last of 2 steps, ``logging.export_hf``. ``examples/heldout_loss.py`` — plain
``transformers.AutoModelForCausalLM.from_pretrained`` on the export, the config's files read and
tokenized again, the documented split / packing / per-document loss — gives the ``eval_loss``
the trainer logged within 1e-5 relative, over the same number of targets. Negative control: the
same rows run whole (attention and targets crossing documents) differ by far more.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

from . import _data_workers as D
from . import _workers as W

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5


def _script():
    spec = importlib.util.spec_from_file_location("heldout_loss", ROOT / "examples" / "heldout_loss.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_heldout_loss_reproduced_with_plain_transformers(ranks, tmp_path, monkeypatch, capsys):
    docs = D.short_docs_jsonl(str(tmp_path / "docs.jsonl"), n_docs=24, lo=10, hi=150)
    data = D.data_cfg(docs, str(tmp_path / "cache"), seq_len=64, micro_batch_size=2, eval_fraction=0.25,
                      eval_every=2, eval_batches=2)
    cfg = D.trainer_cfg(data, cp=2, method="head_tail", steps=2, out_dir=str(tmp_path / "run"))
    cfg["logging"]["export_hf"] = True
    ranks(2).run(W.train_losses, cfg, timeout=300)
    script = _script()
    step, logged, tokens = script.logged_eval_loss(cfg)
    mine = script.heldout_loss(cfg)
    rel = abs(mine["eval_loss"] - logged) / abs(logged)
    msg = (f"held-out loss: trainer (CP=2, step {step}) {logged:.7f} over {tokens} targets; plain transformers on "
           f"the export {mine['eval_loss']:.7f} over {mine['eval_tokens']}; relative {rel:.2e} (tol {TOL:g})")
    assert step == 2 and mine["eval_tokens"] == tokens
    assert rel <= TOL, (mine, logged)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))     # the command line prints both numbers
    assert script.main([str(tmp_path / "run.yaml")]) == 0
    said = capsys.readouterr().out
    print(msg)
    assert f"plain transformers: {mine['eval_loss']:.6f}" in said and f"step 2:   {logged:.6f}" in said, said

    rows = script.heldout_rows
    monkeypatch.setattr(script, "heldout_rows", lambda *a: [[sum(r, [])] for r in rows(*a)])
    merged = script.heldout_loss(cfg)
    print(f"negative control (documents merged): {merged['eval_loss']:.7f} over {merged['eval_tokens']} targets")
    assert abs(merged["eval_loss"] - logged) / abs(logged) > 20 * TOL and merged["eval_tokens"] > tokens

"""Reproduce the trainer's held-out loss with plain ``transformers`` from the HF export.

    python examples/heldout_loss.py CONFIG.yaml [k=v ...]     # the config + overrides the run used

prints the held-out loss of ``<logging.out_dir>/hf`` (``logging.export_hf: true``) computed here,
and the ``eval_loss`` the trainer logged after its last step (``<out_dir>/<json_log>``). The recipe
(docs/quickstart.md, "Reproduce the held-out loss"), for ``data.source: files``:

1. Documents: ``data.files`` (globs expanded, sorted) read by ``datasets.load_dataset`` (json /
   parquet: one document per record, its ``data.text_field``; text: one document per file),
   tokenized by the exported tokenizer without special tokens; a document with no token is
   dropped. Document ``i`` is the i-th one left.
2. Held out: ``split_documents(n_docs, eval_fraction, seed)`` (the trainer's seeded permutation:
   its first ``max(1, round(eval_fraction * n_docs))`` documents), in ascending document order.
3. Rows: each held-out document followed by the tokenizer's EOS; ``packing: true``: written back
   to back and cut into rows of ``seq_len`` tokens (a document crossing a row end continues in the
   next row as a piece of its own; only the last row is shorter, and padding carries no loss);
   ``packing: false``: one document + EOS per row, truncated to ``seq_len``. The evaluation reads
   the first ``eval_batches x dp_size x micro_batch_size`` rows (past the last row it starts over).
4. Loss: every document piece of a row runs through the model alone (positions from 0; attention
   never crosses pieces), each token predicts the next token of its own piece: the loss is the sum
   of those cross-entropies over every piece divided by their count (a piece of k tokens gives k-1
   targets). fp32, ``model.eval()``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = ["heldout_documents", "heldout_rows", "heldout_loss", "logged_eval_loss"]


def _config(config, overrides=()):
    from hyper_parallel.trainer.config import TrainerConfig

    if isinstance(config, dict):
        return TrainerConfig.from_dict(config)
    return TrainerConfig.from_yaml(str(config), list(overrides))


def heldout_documents(data, tokenizer) -> list[list[int]]:
    """Steps 1-2 of the module doc: the held-out documents' token ids, in evaluation order."""
    import datasets

    from hyper_parallel.trainer.data_sources import file_format, resolve_files
    from hyper_parallel.trainer.packing import split_documents

    datasets.disable_progress_bars()
    files = resolve_files(data.files)
    fmt = file_format(files, data.format)
    ds = datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train",
                               **({"sample_by": "document"} if fmt == "text" else {}))
    field = "text" if fmt == "text" else data.text_field
    texts = [t if isinstance(t, str) else "" for t in ds[field]]
    docs = [ids for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] if ids]
    _, held = split_documents(len(docs), data.eval_fraction, data.seed)
    return [docs[int(i)] for i in held]


def heldout_rows(data, docs: list[list[int]], eos: int, n_rows: int) -> list[list[list[int]]]:
    """Step 3: the first ``n_rows`` rows, each a list of document pieces (token id lists)."""
    S, rows = data.seq_len, []
    if not data.packing:
        rows = [[(d + [eos])[:S]] for d in docs]
    else:
        row, used = [], 0
        for d in docs:
            unit = d + [eos]
            while unit:
                take = unit[:S - used]
                row.append(take)
                used += len(take)
                unit = unit[len(take):]
                if used == S:
                    rows.append(row)
                    row, used = [], 0
        if row:
            rows.append(row)
    return [rows[g % len(rows)] for g in range(n_rows)]


@torch.no_grad()
def heldout_loss(config, export_dir=None, overrides=()) -> dict:
    """Step 4 over the rows of steps 1-3 with ``AutoModelForCausalLM.from_pretrained(export_dir)``
    (default ``<logging.out_dir>/hf``). -> ``{"eval_loss", "eval_tokens"}``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = _config(config, overrides)
    data = cfg.data
    export_dir = str(export_dir or Path(cfg.logging.out_dir) / "hf")
    tok = AutoTokenizer.from_pretrained(export_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(export_dir, local_files_only=True, dtype=torch.float32).eval()
    sizes = cfg.accelerator.mesh_sizes()
    n_rows = data.eval_batches * sizes.dp_replicate * sizes.dp_shard * data.micro_batch_size
    rows = heldout_rows(data, heldout_documents(data, tok), tok.eos_token_id, n_rows)
    total, count = 0.0, 0
    for row in rows:
        for piece in row:
            if len(piece) < 2:
                continue
            ids = torch.tensor([piece])
            logits = model(input_ids=ids, use_cache=False).logits.float()
            total += float(F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum").double())
            count += len(piece) - 1
    return {"eval_loss": total / count, "eval_tokens": count}


def logged_eval_loss(config, overrides=()) -> tuple[int, float, int]:
    """(step, eval_loss, eval_tokens) of the last held-out evaluation in the run's JSON log."""
    cfg = _config(config, overrides)
    log = json.loads((Path(cfg.logging.out_dir) / cfg.logging.json_log).read_text())
    last = [r for r in log["steps"] if r.get("eval_loss") is not None][-1]
    return last["step"], last["eval_loss"], last["eval_tokens"]


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    mine = heldout_loss(argv[0], overrides=argv[1:])
    step, logged, tokens = logged_eval_loss(argv[0], argv[1:])
    rel = abs(mine["eval_loss"] - logged) / abs(logged)
    print(f"held-out loss with plain transformers: {mine['eval_loss']:.6f} ({mine['eval_tokens']} targets)")
    print(f"the trainer logged after step {step}:   {logged:.6f} ({tokens} targets); relative difference {rel:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

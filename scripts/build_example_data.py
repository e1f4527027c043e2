#!/usr/bin/env python
"""Build the example long-context data set with no download: the Python standard library's own
source files as documents (real text of very uneven lengths, present wherever Python is), and a
small byte-level BPE tokenizer trained on them with the ``tokenizers`` library.

Outputs (defaults):

  examples/data/stdlib/stdlib_docs.jsonl    one JSON record per file: {"text", "path", "bytes"}
  examples/data/stdlib/stdlib_docs.parquet  the same records (pyarrow, via datasets)
  examples/data/stdlib_tokenizer/           tokenizer.json + tokenizer_config.json + special_tokens_map.json
                                            (AutoTokenizer.from_pretrained loads it; only with --train-tokenizer
                                            or when it is missing)

The documents are every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (sorted by path;
``test``/``tests``/``site-packages``/``__pycache__`` directories skipped; non-UTF-8 files skipped),
up to ``--max-mb`` MiB of text. The shipped tokenizer (examples/data/stdlib_tokenizer) and the
small slices the tests use (examples/data/stdlib_small.jsonl / .parquet: ``--slice`` documents)
were made with this script; rebuild them with ``--train-tokenizer --write-slice``.

    python scripts/build_example_data.py                      # documents only (seconds)
    python scripts/build_example_data.py --train-tokenizer --write-slice
"""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"test", "tests", "site-packages", "dist-packages", "__pycache__", "idlelib", "turtledemo"}
EOS, PAD = "<|endoftext|>", "<|pad|>"


def stdlib_documents(max_bytes: int | None = None) -> list[dict]:
    """The standard library's ``.py`` files as ``{"text", "path", "bytes"}`` records (module doc)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            f = Path(dirpath) / name
            try:
                text = f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():
                continue
            n = len(text.encode("utf-8"))
            if max_bytes is not None and total + n > max_bytes:
                return docs
            docs.append({"text": text, "path": str(f.relative_to(root)), "bytes": n})
            total += n
    return docs


def _replace_if_changed(tmp: Path, path: Path) -> None:
    """Keep an identical existing file untouched (its mtime keys the trainer's token cache, so an
    unchanged rebuild does not trigger a new tokenization)."""
    if path.is_file() and filecmp.cmp(tmp, path, shallow=False):
        tmp.unlink()
    else:
        os.replace(tmp, path)


def write_jsonl(docs: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for d in docs:
            fh.write(json.dumps(d, ensure_ascii=False) + "\n")
    _replace_if_changed(tmp, path)


def write_parquet(docs: list[dict], path: Path) -> None:
    import datasets

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    datasets.Dataset.from_list(docs).to_parquet(str(tmp))
    _replace_if_changed(tmp, path)


def train_tokenizer(docs: list[dict], out: Path, vocab_size: int) -> None:
    """Byte-level BPE (every string encodes; no unknown token), EOS ``<|endoftext|>`` (id 0) and
    PAD ``<|pad|>`` (id 1); saved so ``AutoTokenizer.from_pretrained(out)`` loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((d["text"] for d in docs), trainer=trainer, length=len(docs))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, bos_token=None,
                                   model_max_length=1 << 20)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"   # the class name every transformers version knows
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "examples/data/stdlib"), help="directory of the jsonl/parquet files")
    ap.add_argument("--max-mb", type=float, default=8.0, help="MiB of source text to keep (0: all)")
    ap.add_argument("--tokenizer-dir", default=str(ROOT / "examples/data/stdlib_tokenizer"))
    ap.add_argument("--train-tokenizer", action="store_true", help="(re)train the tokenizer even if it exists")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--write-slice", action="store_true",
                    help="also write examples/data/stdlib_small.{jsonl,parquet} (the tests' slice)")
    ap.add_argument("--slice", type=int, default=32, help="documents in the small slice")
    args = ap.parse_args(argv)

    max_bytes = int(args.max_mb * 2**20) if args.max_mb > 0 else None
    docs = stdlib_documents(max_bytes)
    if not docs:
        print(f"no .py files found under {sysconfig.get_paths()['stdlib']}", file=sys.stderr)
        return 1
    out = Path(args.out)
    write_jsonl(docs, out / "stdlib_docs.jsonl")
    write_parquet(docs, out / "stdlib_docs.parquet")
    sizes = sorted(d["bytes"] for d in docs)
    print(f"{len(docs)} documents, {sum(sizes) / 2**20:.1f} MiB (bytes per document: min {sizes[0]}, "
          f"median {sizes[len(sizes) // 2]}, max {sizes[-1]}) -> {out}/stdlib_docs.{{jsonl,parquet}}")
    tok_dir = Path(args.tokenizer_dir)
    if args.train_tokenizer or not (tok_dir / "tokenizer.json").is_file():
        train_tokenizer(docs, tok_dir, args.vocab_size)
        print(f"trained a {args.vocab_size}-token byte-level BPE tokenizer -> {tok_dir}")
    if args.write_slice:
        # every 7th document from the start: short and long files alike, a few hundred KiB
        small = [{"text": d["text"], "path": d["path"]} for d in docs[::7] if d["bytes"] <= 16_000][:args.slice]
        write_jsonl(small, ROOT / "examples/data/stdlib_small.jsonl")
        write_parquet(small, ROOT / "examples/data/stdlib_small.parquet")
        print(f"wrote the {len(small)}-document test slice -> examples/data/stdlib_small.{{jsonl,parquet}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Tokenized document sources: local files -> Hugging Face ``datasets`` -> a local tokenizer ->
a memory-mapped token store on disk, built once and reused.

Contract
--------
* Files: ``data.files`` (paths or globs; relative paths are tried from the working directory,
  then the repository root), read by ``datasets.load_dataset(<format>, data_files=...)``; the
  format is ``data.format`` or the files' extension (``.json``/``.jsonl`` -> json, ``.parquet``,
  ``.txt``/``.md``/``.py`` -> text). json/parquet: one document per record, its text in
  ``data.text_field``. text: one document per *file* (``sample_by="document"``).
* Tokenizer: ``AutoTokenizer.from_pretrained(data.tokenizer, local_files_only=True)`` (a local
  directory; nothing is downloaded). Documents are tokenized without special tokens; the
  tokenizer's ``eos_token_id`` separates documents when they are packed.
* Store: ``<cache_dir>/<key>/tokens.bin`` (int32, every document's tokens back to back),
  ``offsets.npy`` (int64 ``[n_docs + 1]``, document i = ``tokens[offsets[i]:offsets[i+1]]``) and
  ``meta.json``. ``key`` hashes the file list (path, size, mtime), the format, the text field and
  the tokenizer files, so a changed input builds a new store and an unchanged one is reused.
  A store is written under a temporary name and renamed, so a reader never sees half of one.
* Several ranks: :func:`open_token_store` builds on rank 0 only, inside an agreement
  (:func:`~hyper_parallel.distributed.preflight.agree_or_raise`): the other ranks wait in its
  all-gather (the collective timeout bounds the wait), a build error is raised on every rank,
  and then every rank memory-maps the same store.
"""
from __future__ import annotations

import glob as _glob
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from ..distributed.errors import CPConfigError
from .paths import REPO_ROOT, resolve_path

FORMATS = ("json", "parquet", "text")
_EXT = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".md": "text",
        ".py": "text", ".rst": "text"}
STORE_VERSION = 1
DEFAULT_CACHE = "~/.cache/hyper_parallel/tokens"


# ----------------------------------------------------------------------------- inputs
def resolve_files(patterns) -> list[Path]:
    """``data.files`` -> sorted, de-duplicated existing files; CPConfigError for a pattern that
    matches nothing."""
    if isinstance(patterns, (str, Path)):
        patterns = [patterns]
    if not patterns:
        raise CPConfigError("data.files", "is empty", fix="list the jsonl/parquet/text files (globs allowed)")
    out: list[Path] = []
    for pat in patterns:
        pat = str(pat)
        hits = []
        for base in (Path.cwd(), REPO_ROOT):
            full = pat if os.path.isabs(pat) else str(base / pat)
            hits = sorted(Path(p).resolve() for p in _glob.glob(os.path.expanduser(full), recursive=True)
                          if Path(p).is_file())
            if hits:
                break
        if not hits:
            raise CPConfigError("data.files", f"{pat!r} matches no file",
                                fix="give existing files or globs (relative to the working directory or the "
                                    "repository root)")
        out.extend(h for h in hits if h not in out)
    return out


def file_format(files: list[Path], fmt: str | None) -> str:
    """``data.format`` or the one format every file's extension names."""
    if fmt is not None:
        return fmt
    kinds = {_EXT.get(f.suffix.lower()) for f in files}
    if None in kinds or len(kinds) != 1:
        raise CPConfigError("data.format", f"cannot tell one format from the extensions of {[f.name for f in files][:4]}",
                            fix=f"set data.format to one of {list(FORMATS)} (or use .jsonl/.parquet/.txt files)")
    return kinds.pop()


def load_tokenizer(path: str):
    """``AutoTokenizer.from_pretrained(path, local_files_only=True)``; CPConfigError when it fails or
    has no EOS token."""
    from transformers import AutoTokenizer

    d = tokenizer_dir(path)
    try:
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - reported as a config error
        raise CPConfigError("data.tokenizer", f"AutoTokenizer cannot load {d}: {type(exc).__name__}: {exc}",
                            fix="save it with tokenizer.save_pretrained(dir)") from None
    if tok.eos_token_id is None:
        raise CPConfigError("data.tokenizer", f"the tokenizer in {d} has no eos_token (documents are separated "
                            "by EOS)", fix="set eos_token in its tokenizer_config.json")
    return tok


def tokenizer_dir(path: str) -> Path:
    """``data.tokenizer`` as an existing directory (CPConfigError otherwise)."""
    d = resolve_path(path)
    if not d.is_dir():
        raise CPConfigError("data.tokenizer", f"{path} is not a directory",
                            fix="point it at a local tokenizer directory (tokenizer.json + tokenizer_config.json)")
    return d


def _tokenizer_digest(d: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in d.iterdir() if p.is_file() and p.stat().st_size < (256 << 20)):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def store_key(files: list[Path], fmt: str, text_field: str, tokenizer: str) -> str:
    """Hash of everything the store's content depends on (module doc)."""
    h = hashlib.sha256(f"v{STORE_VERSION}|{fmt}|{text_field}".encode())
    for f in files:
        st = f.stat()
        h.update(f"|{f}|{st.st_size}|{st.st_mtime_ns}".encode())
    h.update(_tokenizer_digest(tokenizer_dir(tokenizer)).encode())
    return h.hexdigest()[:24]


# ----------------------------------------------------------------------------- the store
class TokenStore:
    """Memory-mapped documents: ``doc(i)`` -> int64 tensor; ``lengths`` -> int64 numpy [n_docs]."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta = json.loads((self.path / "meta.json").read_text())
        self.offsets = np.load(self.path / "offsets.npy")
        n = int(self.offsets[-1])
        self.tokens = (np.memmap(self.path / "tokens.bin", dtype=np.int32, mode="r", shape=(n,))
                       if n else np.zeros(0, dtype=np.int32))
        self.lengths = np.diff(self.offsets)
        self.eos_token_id = int(self.meta["eos_token_id"])
        self.vocab_size = int(self.meta["vocab_size"])
        self.max_token_id = int(self.meta["max_token_id"])

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[int(self.offsets[i]):int(self.offsets[i + 1])]


def build_token_store(files: list[Path], fmt: str, text_field: str, tokenizer: str, out: Path,
                      batch_size: int = 256) -> Path:
    """Tokenize every document of ``files`` into the store directory ``out`` (module doc)."""
    import datasets

    tok = load_tokenizer(tokenizer)
    kwargs = {"sample_by": "document"} if fmt == "text" else {}
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()   # the caller says what happens, in one line
    try:
        ds = datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train",
                                   cache_dir=str(out.parent / "hf_datasets"), **kwargs)
    except Exception as exc:  # noqa: BLE001
        raise CPConfigError("data.files", f"datasets cannot read {len(files)} {fmt} file(s) "
                            f"({files[0].name}...): {type(exc).__name__}: {exc}".replace("\n", " "),
                            fix="check the files and data.format") from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    field = "text" if fmt == "text" else text_field
    if field not in ds.column_names:
        raise CPConfigError("data.text_field", f"{field!r} is not a column of {files[0].name} "
                            f"(columns: {ds.column_names})", fix="name the column that holds the text")
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    offsets = [0]
    max_id = -1
    with open(tmp / "tokens.bin", "wb") as fh:
        for batch in ds.select_columns([field]).iter(batch_size=batch_size):
            texts = [t if isinstance(t, str) else "" for t in batch[field]]
            for ids in tok(texts, add_special_tokens=False)["input_ids"]:
                if not ids:
                    continue          # empty documents carry nothing
                arr = np.asarray(ids, dtype=np.int32)
                max_id = max(max_id, int(arr.max()))
                fh.write(arr.tobytes())
                offsets.append(offsets[-1] + arr.size)
    if len(offsets) < 2:
        raise CPConfigError("data.files", f"{len(files)} file(s) hold no non-empty document in {field!r}")
    np.save(tmp / "offsets.npy", np.asarray(offsets, dtype=np.int64))
    meta = {"version": STORE_VERSION, "files": [str(f) for f in files], "format": fmt, "text_field": field,
            "tokenizer": str(resolve_path(tokenizer)), "n_docs": len(offsets) - 1, "n_tokens": offsets[-1],
            "eos_token_id": int(tok.eos_token_id), "vocab_size": len(tok), "max_token_id": max(max_id, tok.eos_token_id)}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    if out.exists():      # another builder won the race with identical content
        import shutil

        shutil.rmtree(tmp)
    else:
        os.replace(tmp, out)
    return out


def open_token_store(cfg, *, is_builder: bool = True) -> TokenStore:
    """The store for the ``data`` section ``cfg``: built by ``is_builder`` (rank 0) when missing,
    agreed on every rank (module doc), then memory-mapped."""
    from ..distributed.preflight import agree_or_raise

    def locate():
        files = resolve_files(cfg.files)
        fmt = file_format(files, cfg.format)
        root = Path(os.path.expanduser(cfg.cache_dir or DEFAULT_CACHE))
        return files, fmt, root / store_key(files, fmt, cfg.text_field, cfg.tokenizer)

    files, fmt, path = agree_or_raise(locate, what="data files", same_error=True)

    def build():
        if is_builder and not (path / "meta.json").is_file():
            import time

            print(f"first run on these files: tokenizing {len(files)} {fmt} file(s) ({files[0].name}...) with "
                  f"{cfg.tokenizer} into the cache {path} (data.cache_dir; done once, reused while the files, "
                  f"text_field and tokenizer are unchanged)", flush=True)
            t0 = time.perf_counter()
            build_token_store(files, fmt, cfg.text_field, cfg.tokenizer, path)
            meta = json.loads((path / "meta.json").read_text())
            print(f"tokenized {meta['n_docs']:,} documents, {meta['n_tokens']:,} tokens in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)

    agree_or_raise(build, what="tokenizing data.files (rank 0)", same_error=True)
    return agree_or_raise(lambda: TokenStore(path), what="opening the token store", same_error=True)

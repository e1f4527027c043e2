"""The attention support matrix of docs/wrappers.md as data.

One :class:`Row` per architecture: its display name, attention implementation, one cell per
feature (window, softcap, sinks, ALiBi, MLA, packed, RoPE) and the parity cases that run it.
``tests/wrappers/test_attention_semantics.py`` reads everything from here:

* the parity tests run exactly ``parity_cases(method)`` (the rows' cases, in row order) — the
  "methods tested" column and the packed cell's qualifier are computed from the same cases, so
  a row cannot name a method or claim packed rows the tests do not run;
* the refusal tests iterate over :func:`refusals` and assert each one's message fragments;
* ``test_support_matrix_cells_match_the_models`` builds every row's models and checks each cell
  against the attention call the preflight probe records (window / softcap / sinks / Dv != D),
  the config (ALiBi) and the model's rotary module (RoPE): "exact" needs the feature present
  *and* parity cases for the arch, "—" needs it absent;
* ``test_support_matrix_in_docs_is_generated`` compares docs/wrappers.md's marked block with
  :func:`render_markdown`.

``python -m tests.wrappers.attention_matrix --write-docs`` rewrites that block; without an
argument it prints the table. Nothing here imports torch.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import textwrap
from typing import Optional, Union

# method -> (abbreviation, cp size); the rank side's tests/wrappers/_workers.METHODS must agree
METHODS = {"colossal": ("C", 2), "ulysses": ("U", 2), "head_tail": ("HT", 2), "hybrid": ("Hy", 4)}
METHOD_NAMES = {"colossal": "Colossal", "ulysses": "Ulysses", "head_tail": "Head-Tail", "hybrid": "Hybrid u=2"}
KINDS = ("plain", "padding", "packed", "packed_padding")     # tests/wrappers/_workers.attention_batch
PACKED_KINDS = ("packed", "packed_padding")
FEATURES = ("window", "softcap", "sinks", "alibi", "mla", "packed", "rope")
HEADERS = ("architecture", "attn impl", "window", "softcap", "sinks", "ALiBi", "MLA (Dv ≠ D)", "packed", "RoPE",
           "methods tested")

EXACT = "exact"            # the feature is in the model's attention call and its parity cases pass
ABSENT = "—"               # the architecture has no such input
UNTESTED = "not tested"    # the model takes it, no parity case runs it


@dataclasses.dataclass(frozen=True)
class Refused:
    """A refusal the tests provoke and whose message they assert.

    ``when``: ``"plan"`` — ``ShardingPlanner.plan`` raises ``CPConfigError`` for a model built
    by ``arch`` (test_refused_at_preflight_by_name); ``"forward"`` — the first forward through
    the wrapper raises ``ValueError`` for a packed batch
    (test_packed_positions_refused_where_the_model_ignores_them)."""

    reason: str                   # rendered as "refused (reason)"; "" -> "refused"
    arch: str                     # tests/wrappers/_workers.arch_config key of the refused model
    fragments: tuple              # substrings the error message must contain
    when: str = "plan"

    def render(self) -> str:
        return f"refused ({self.reason})" if self.reason else "refused"


Cell = Union[str, Refused]


@dataclasses.dataclass(frozen=True)
class Case:
    method: str
    arch: str
    kind: str
    S: int


def cases(arch: str, S: int, **kind_by_method: str) -> tuple:
    """``cases("mistral", 27, colossal="plain", ulysses="padding")`` -> (Case, ...)."""
    return tuple(Case(m, arch, k, S) for m, k in kind_by_method.items())


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    impl: str
    archs: dict                   # _workers.arch_config key -> label (qualifiers of a multi-model row)
    cases: tuple = ()             # parity cases (the rows' order is the run order)
    window: Cell = ABSENT
    softcap: Cell = ABSENT
    sinks: Cell = ABSENT
    alibi: Cell = ABSENT
    mla: Cell = ABSENT
    packed: Cell = ABSENT
    rope: Cell = EXACT
    refused: Optional[Refused] = None     # the whole architecture is refused (no parity case)

    def cell(self, feature: str) -> Cell:
        return getattr(self, feature)

    def methods_of(self, arch: str) -> list:
        got = {c.method for c in self.cases if c.arch == arch}
        return [m for m in METHODS if m in got]

    def packed_archs(self) -> list:
        return [a for a in self.archs if any(c.arch == a and c.kind in PACKED_KINDS for c in self.cases)]


W = dict(window=EXACT, packed=EXACT)        # a sliding-window decoder tested with packed rows
ROWS = (
    Row("Mistral", "sdpa", {"mistral": "Mistral"}, **W, cases=(
        cases("mistral", 27, colossal="plain", ulysses="padding", head_tail="packed")
        + cases("mistral", 32, colossal="packed_padding", ulysses="packed_padding", head_tail="packed_padding",
                hybrid="packed"))),
    Row("Mixtral (MoE)", "sdpa", {"mixtral": "Mixtral"}, **W, cases=cases(
        "mixtral", 32, colossal="padding", ulysses="packed", head_tail="packed_padding")),
    Row("Phi3", "sdpa", {"phi3": "Phi3"}, **W, cases=cases(
        "phi3", 27, colossal="packed", ulysses="packed_padding", head_tail="plain")),
    Row("Starcoder2", "sdpa", {"starcoder2": "Starcoder2"}, **W, cases=cases(
        "starcoder2", 32, colossal="packed_padding", ulysses="plain", head_tail="padding")),
    Row("Qwen2 `use_sliding_window` (window + full layers)", "sdpa", {"qwen2": "Qwen2"}, **W, cases=(
        cases("qwen2", 27, colossal="plain", ulysses="padding", head_tail="packed", hybrid="padding"))),
    Row("Gemma3 (window + full layers)", "sdpa", {"gemma3": "Gemma3"}, **W, cases=cases(
        "gemma3", 32, colossal="padding", ulysses="packed", head_tail="packed_padding")),
    Row("Cohere2 (window + full layers)", "sdpa", {"cohere2": "Cohere2"}, **W, cases=cases(
        "cohere2", 27, colossal="packed", ulysses="packed_padding", head_tail="plain")),
    Row("Gemma2", "eager (interface)", {"gemma2": "Gemma2"}, **W, softcap=EXACT, cases=(
        cases("gemma2", 32, colossal="packed_padding", ulysses="plain", head_tail="padding")
        + cases("gemma2", 27, hybrid="plain"))),
    Row("gpt-oss (MoE)", "eager (interface)", {"gpt_oss": "gpt-oss"}, window=EXACT, sinks=EXACT,
        packed=Refused("its mask ignores `position_ids`", "gpt_oss",
                       ("the model's own mask lets them see each other",), when="forward"),
        cases=(cases("gpt_oss", 27, colossal="plain", ulysses="padding", head_tail="padding")
               + cases("gpt_oss", 32, hybrid="padding"))),
    Row("DeepSeek-V3 (MLA, `v_head_dim` 12, qk 16)", "sdpa", {"deepseek_v3": "DeepSeek-V3"}, mla=EXACT,
        packed=EXACT, cases=cases("deepseek_v3", 27, colossal="packed", ulysses="packed", head_tail="packed")),
    Row("Llama (sdpa and eager)", "sdpa / eager", {"llama": "sdpa", "llama_eager": "eager"}, packed=EXACT, cases=(
        cases("llama", 32, colossal="packed", ulysses="packed", head_tail="packed")
        + cases("llama", 27, colossal="packed_padding", ulysses="packed_padding", head_tail="packed_padding")
        + cases("llama_eager", 27, colossal="packed"))),
    Row("Qwen3, MQA with 3 query heads (Ulysses/Hybrid: 2/1 query heads, the KV head replicated)", "sdpa",
        {"qwen3_mqa": "Qwen3"}, packed=EXACT, cases=cases(
            "qwen3_mqa", 27, colossal="padding", ulysses="packed_padding", head_tail="packed",
            hybrid="packed_padding")),
    Row("Falcon (`nn.Dropout(p=0)`), SDPA called directly", "sdpa", {"falcon": "Falcon"}, packed=UNTESTED,
        alibi=Refused("`alibi=True`", "falcon_alibi", ("transformer.h.0.self_attention", "uses ALiBi")),
        cases=cases("falcon", 27, colossal="padding")),
    Row("Persimmon (`nn.Dropout(p=0)`)", "sdpa", {"persimmon": "Persimmon"}, packed=UNTESTED,
        cases=cases("persimmon", 32, colossal="plain")),
    Row("Phi, StableLM (partial rotary: the probe runs)", "sdpa", {"phi": "Phi", "stablelm": "StableLM"},
        packed=EXACT, cases=cases("phi", 32, colossal="packed_padding") + cases("stablelm", 27, colossal="padding")),
    Row("Bloom", "eager", {"bloom": "Bloom"}, rope=ABSENT,
        alibi=Refused("", "bloom", ("transformer.h.0.self_attention", "uses ALiBi"))),
    Row("GPT-2, default `attn_pdrop=0.1`", "sdpa", {"gpt2": "GPT-2"}, rope=ABSENT,
        refused=Refused("attention dropout", "gpt2", ("transformer.h.0.attn", "attn_dropout=Dropout(p=0.1",
                                                      "attention dropout > 0 is not supported"))),
)
del W


# ---------------------------------------------------------------------------- queries
def parity_cases(method: str) -> list:
    """[(arch, kind, S)] the parity test of ``method`` runs (one pool call), in row order."""
    return [(c.arch, c.kind, c.S) for row in ROWS for c in row.cases if c.method == method]


def parity_methods(cp: Optional[int] = None) -> list:
    """The methods some row has parity cases for (at ``cp`` if given), in METHODS order."""
    used = {c.method for row in ROWS for c in row.cases}
    return [m for m, (_, size) in METHODS.items() if m in used and (cp is None or size == cp)]


def refusals(when: Optional[str] = None) -> list:
    """[(row, feature or None for the whole row, Refused)] over every row."""
    out = []
    for row in ROWS:
        if row.refused is not None:
            out.append((row, None, row.refused))
        for f in FEATURES:
            cell = row.cell(f)
            if isinstance(cell, Refused):
                out.append((row, f, cell))
    return [r for r in out if when is None or r[2].when == when]


def no_packed_positions() -> set:
    """Archs whose packed cell is refused (their parity cases must not be packed)."""
    return {a for row in ROWS if isinstance(row.packed, Refused) for a in row.archs}


# ---------------------------------------------------------------------------- rendering
_ABSENT_TEXT = {"rope": "— (no RoPE)"}


def _cell_text(row: Row, feature: str) -> str:
    cell = row.cell(feature)
    if isinstance(cell, Refused):
        return cell.render()
    if cell == ABSENT:
        return _ABSENT_TEXT.get(feature, ABSENT)
    if cell == EXACT and feature == "packed" and len(row.archs) > 1:
        have = row.packed_archs()
        if have and len(have) < len(row.archs):
            return f"exact ({', '.join(row.archs[a] for a in have)})"
    return cell


def _methods_text(row: Row) -> str:
    if row.refused is not None:
        return row.refused.render()
    per_arch = {a: row.methods_of(a) for a in row.archs}
    if not any(per_arch.values()):
        return ABSENT
    abbrev = lambda ms: ", ".join(METHODS[m][0] for m in ms) or ABSENT   # noqa: E731
    if len({tuple(ms) for ms in per_arch.values()}) == 1:
        return abbrev(next(iter(per_arch.values())))
    return "; ".join(f"{row.archs[a]}: {abbrev(ms)}" for a, ms in per_arch.items())


def render_markdown() -> str:
    """The table and its legend (the block between the markers in docs/wrappers.md)."""
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for row in ROWS:
        cells = [row.name, row.impl, *(_cell_text(row, f) for f in FEATURES), _methods_text(row)]
        lines.append("| " + " | ".join(cells) + " |")
    legend = ", ".join(f"{METHODS[m][0]} = {METHOD_NAMES[m]}" for m in METHODS)
    text = (f"{legend}; cp 2 except Hy (cp 4). \"exact\": present in the model (checked) and "
            f"equal to CP=1 in the parity cases of `{_TEST}`; \"—\": the architecture has no such "
            "input; \"not tested\": the model takes it, no parity case runs it; \"refused\": refused with "
            "the message the tests assert. \"methods tested\" and the packed qualifier are computed from "
            "the parity cases the tests run.")
    lines += ["", *textwrap.wrap(text, 100, break_on_hyphens=False, break_long_words=False)]
    return "\n".join(lines) + "\n"


_TEST = "tests/wrappers/test_attention_semantics.py"
DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs",
                   "wrappers.md")
BEGIN = ("<!-- BEGIN ATTENTION SUPPORT MATRIX (generated by python -m tests.wrappers.attention_matrix "
         "--write-docs) -->")
END = "<!-- END ATTENTION SUPPORT MATRIX -->"


def split_doc(text: str) -> tuple:
    """-> (before and including BEGIN + newline, the block, END and after)."""
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"{DOC}: markers {BEGIN!r} ... {END!r} not found")
    i += len(BEGIN) + 1
    return text[:i], text[i:j], text[j:]


def write_docs(path: str = DOC) -> bool:
    """Rewrite the marked block; -> whether it changed."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head, block, tail = split_doc(text)
    new = render_markdown()
    if block == new:
        return False
    with open(path, "w", encoding="utf-8") as f:
        f.write(head + new + tail)
    return True


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-docs"]:
        print(f"{DOC}: {'rewritten' if write_docs() else 'already up to date'}")
    elif not sys.argv[1:]:
        sys.stdout.write(render_markdown())
    else:
        sys.exit("usage: python -m tests.wrappers.attention_matrix [--write-docs]")

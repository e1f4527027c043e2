"""The docs/wrappers.md tables generated from the catalogue rows (a test compares them)."""
from __future__ import annotations

from .rows import STYLES, CPMethod
from .rules import async_targets, attention_methods, entry_params, mixer_methods, offers

def _async_cell(m: CPMethod) -> str:
    """The matrix's async cell: the generic Target, then the adapters' named ones."""
    names = [t.rsplit(".", 1)[1] for t in async_targets(m)]
    if not names:
        return m.async_reason
    generic = [n for n in names if n.startswith("async_")]
    adapters = [n for n in names if not n.startswith("async_")]
    return "; ".join(f"`{n}`" for n in generic) + (
        f" + adapters {', '.join(f'`{n}`' for n in adapters)}" if adapters else "")


def entry_table_markdown() -> str:
    """The list of sync entry points docs/wrappers.md prints (regenerate it with this function)."""
    lines = ["| registry name | `_target_` function | method (strategy) | style | named params |",
             "|---|---|---|---|---|"]
    for m, o in offers("attention"):
        required, _ = entry_params(m)
        params = ", ".join(f"`{p}` (required)" for p in required) or (
            "— (degree = cp_size)" if m.degree == "cp" else "—")
        reg = f"`{o.registry_name}`" if o.registry_name else "— (Target only)"
        lines.append(f"| {reg} | `{o.entry}` | {m.name} (`{m.strategy}`) | {STYLES[o.style].description} | "
                     f"{params} |")
    return "\n".join(lines)


def support_matrix_markdown() -> str:
    """The support matrix docs/wrappers.md prints (regenerate it with this function)."""
    cols = list(STYLES.values())
    lines = ["| method (aliases) | batch policy | heads | degree | async | "
             + " | ".join(f"`{s.prefix}*`" for s in cols) + " |",
             "|---|---|---|---|---|" + "---|" * len(cols)]
    notes = []
    for m in attention_methods():
        cells = []
        by_style = {o.style: o for o in m.offers}
        for s in cols:
            o = by_style.get(s.name)
            if o is None or not o.entry:
                notes.append(f"{m.name} x `{s.prefix}*`: {o.reason if o else 'not offered'}")
                cells.append(f"— [{len(notes)}]")
            else:
                cells.append(f"`{o.registry_name}`" if o.registry_name else f"`{o.entry}`")
        name = m.name + (f" ({', '.join(m.aliases)})" if m.aliases else "")
        policy = f"{m.batch_policy} (S % {m.length_factor}*cp)" if m.length_factor > 1 else m.batch_policy
        asyn = _async_cell(m)
        lines.append(f"| {name} | {policy} | {m.head_doc} | {m.degree_doc} | {asyn} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.extend(f"[{i}] {n}" for i, n in enumerate(notes, 1))
    lines.append("")
    lines.append("Token-mixer methods (they run on the contiguous layout; batch policy all_gather, or the attention's "
                 "load_balance / balanced: next to the balanced split each mixer layer's input and output move "
                 "between the permuted and the contiguous layout, one all-to-all each way, 2 x its activation "
                 "bytes per layer forward and the same in backward):")
    lines.append("")
    for m in mixer_methods():
        o = m.offers[0]
        lines.append(f"* `{o.registry_name}` (`{o.module}.{o.entry}`): {m.title}; heads: {m.head_doc}")
    lines.append("")
    lines.append("EP + CP (`accelerator.ep_size`, docs/expert_parallel.md): expert parallelism splits the experts "
                 "modules a model declares (`ep_dispatch_experts`) and touches no attention or mixer, so by "
                 "construction it combines with every method above (the methods tested with it are listed there): "
                 + ", ".join(m.name for m in attention_methods() + mixer_methods())
                 + "; with FSDP2, HSDP and TP.")
    return "\n".join(lines)

"""A readable summary of a traced :class:`hidup.ir.Graph`.

The header gives the totals: node count, parameter nodes, parameter elements
``sum(numel(t) for t in tensors if t.is_param)`` (each tensor once, so tied weights count once),
total forward GFLOPs ``sum(node.flops) / 1e9`` (each node's all-``full`` cost, i.e. the whole
op on one device), and the ops replicated for lack of a rule.  The table has one row per node:
name, op/target, shape and dtype of its (first) output, number of signatures, forward GFLOPs and
the issuing module.  ``rich`` renders it when installed; otherwise (or with ``plain=True``) a plain
text table is produced.
"""

from __future__ import annotations

import io

from hidup.ir import Graph, Node

__all__ = ["describe"]

_COLUMNS = ("node", "op/target", "output", "#sig", "GFLOPs", "module")


def _row(graph: Graph, node: Node) -> tuple[str, ...]:
    if node.outputs:
        t = graph.tensors[node.outputs[0]]
        shape = f"{list(t.shape)} {t.dtype}" + (f" (+{len(node.outputs) - 1})" if len(node.outputs) > 1 else "")
    else:
        shape = "-"
    target = node.op if node.op in ("input", "output") else f"{node.op}/{node.target}"
    if node.fallback:
        target += " [replicated: no rule]"
    return (node.name, target, shape, str(len(node.signatures)), f"{node.flops / 1e9:.4g}", node.module)


def _count(n: int) -> str:
    """13,024 -> '13K', 9.8e9 -> '9.80B'."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def _header(graph: Graph) -> str:
    params = graph.params()
    numel = sum(t.numel for t in graph.tensors.values() if t.is_param)
    lines = [
        f"graph {graph.model or '<unnamed>'} for world size {graph.world_size} (fingerprint {graph.fingerprint()})",
        f"  nodes: {len(graph.nodes)}   param nodes: {len(params)}   parameters: {_count(numel)}   "
        f"forward: {graph.total_flops / 1e9:.4g} GFLOPs",
        f"  fallbacks (replicated, no rule): {len(graph.fallbacks)}"
        + (f" -- {', '.join(graph.fallbacks)}" if graph.fallbacks else ""),
    ]
    return "\n".join(lines)


def _plain(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [_COLUMNS, *rows]) for i in range(len(_COLUMNS))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(_COLUMNS), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows])


def _rich(rows: list[tuple[str, ...]]) -> str:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(show_lines=False, header_style="bold")
    for i, col in enumerate(_COLUMNS):
        table.add_column(col, justify="right" if i in (3, 4) else "left", overflow="fold")
    for r in rows:
        table.add_row(*(Text(c) for c in r))  # Text: no markup parsing of '[...]'
    buf = io.StringIO()
    Console(file=buf, width=160, force_terminal=False, color_system=None).print(table)
    return buf.getvalue().rstrip()


def describe(graph: Graph, max_rows: int | None = None, *, plain: bool = False) -> str:
    """The summary of ``graph`` as a string: totals, then a node table (first ``max_rows`` rows)."""
    if max_rows is not None and max_rows < 0:
        raise ValueError(f"describe: max_rows must be >= 0 or None, got {max_rows}")
    shown = graph.nodes if max_rows is None else graph.nodes[:max_rows]
    rows = [_row(graph, n) for n in shown]
    table = ""
    if not plain:
        try:
            table = _rich(rows)
        except ImportError:
            plain = True
    if plain:
        table = _plain(rows)
    more = len(graph.nodes) - len(shown)
    tail = f"\n... {more} more node(s)" if more else ""
    return f"{_header(graph)}\n{table}{tail}"


from hidup._callable import make_callable  # noqa: E402

make_callable(__name__, "describe")

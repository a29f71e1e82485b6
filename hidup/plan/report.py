"""The plan's report (``hidup show``): ``summary(plan, graph)`` renders totals, a per-layer table and,
for the heaviest nodes, the runner-up signature.  The plan itself and its JSON format are
:mod:`hidup.plan.record`.
"""

from __future__ import annotations

from hidup.ir import Graph, mesh_text
from hidup.plan.record import (
    Plan,
    layer_of,
    sent_share,
)

__all__ = ["summary"]


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def _mb(b: float) -> str:
    return f"{b / 2**20:.2f} MiB" if b < 2**30 else f"{b / 2**30:.2f} GiB"


def _span(labels: list[str]) -> str:
    """``layers.0 .. layers.7`` for a run, the names otherwise (at most four)."""
    if len(labels) > 4:
        return f"{labels[0]} .. {labels[-1]}"
    return ", ".join(labels)


LEGEND = (
    "how ops run: data = each rank runs the op on its part of the batch; tensor = on its part of a weight "
    "(split outputs or partial sums); expert = on its own experts; replicated = every rank runs the whole "
    "op; a+b = a over the mesh's first axis, b over the second",
    "forms in the lines below: full = the whole tensor on every rank; gather_d = split along dim d; "
    "reduce = partial sums that add up to it; replicate = a weight's copy on every rank",
)
OUTSIDE = "(outside the layers)"


def summary(plan: Plan, graph: Graph | None = None) -> str:
    """A readable report (no trace needed: the plan holds what it prints): totals; per layer the ops
    and how they run (the counts add up to the ops), how its weights are stored, the collectives it
    runs with the bytes each rank sends, and its time (identical consecutive layers on one row); the
    MoE layers' routed experts by name; a legend; and for the heaviest nodes the runner-up signature.
    ``graph``, when given, only tells call nodes from leaves exactly (without it a node that reads
    no tensor counts as a leaf)."""
    lines = _totals(plan) + [""]
    rows = _layer_rows(plan, graph)
    lines += _table(rows) + _named_ops(plan) + ["", *LEGEND]
    if plan.alternatives:
        lines += ["", "why (heaviest nodes; runner-up = best other signature with the rest of the plan fixed):"]
        for name, alt in plan.alternatives.items():
            chosen = plan.choices[name]
            if alt.get("runner_up"):
                why = f"runner-up {alt['runner_up_kind']} {alt['runner_up']} is +{_ms(alt['delta'])} per iteration"
            else:
                why = "no other signature is feasible"
            lines.append(f"  {name}: {chosen.kind} {chosen} costs {_ms(alt['time'])}; {why}")
    return "\n".join(lines)


# what a plan's memory records beside its parts and their total (hidup.search.memory, "The peak")
_BOUNDS = ("total", "transient", "prefetch", "peak", "peak_transient", "bound", "host")


def _peak_parts(m: dict) -> str:
    """What the peak holds besides the parts: its largest op's temporaries and the prefetched copies."""
    parts = [f"around its largest op up to {_mb(m['transient'])} of temporaries"] if m.get("transient") else []
    parts += [f"prefetched resharded weights up to {_mb(m['prefetch'])}"] if m.get("prefetch") else []
    return f" ({', '.join(parts)})" if parts else ""


def _totals(plan: Plan) -> list[str]:
    p, m = plan.predicted, plan.memory
    mesh = f" (a {mesh_text(plan.mesh_shape)} mesh)" if len(plan.mesh) > 1 else ""
    lines = [
        f"plan for {plan.model or '(unnamed model)'} on {plan.world_size} ranks{mesh}: profile {plan.profile}, "
        f"{plan.algorithm}, duplication {'on' if plan.duplication else 'off'}",
        f"predicted per iteration: {_ms(p['total'])} (forward {_ms(p['forward'])}, backward {_ms(p['backward'])}); "
        f"communication {_ms(p['comm'])}, exposed {_ms(p['exposed_comm'])}; each rank sends "
        f"{_mb(plan.sent_bytes())} per iteration",
        "memory per rank: "
        + _mb(m.get("total", 0.0))
        + " ("
        + ", ".join(f"{k} {_mb(v)}" for k, v in m.items() if k not in _BOUNDS)
        + ")"
        + (f"; at its peak up to {_mb(m['peak'])}" if m.get("peak") else "")
        + _peak_parts(m)
        + (f"; host memory {_mb(m['host'])} (the optimizer offloaded)" if m.get("host") else ""),
    ]
    if plan.recompute:
        lines.append(f"recomputed in the backward: {len(plan.recompute)} layers ({_span(plan.recompute)})")
    selective = getattr(plan, "recompute_selective", None)
    if selective:
        lines.append(
            f"recomputed selectively in the backward: {len(selective)} layers ({_span(selective)}); the outputs "
            "of their matmuls, attention and activation form changes kept"
        )
    if getattr(plan, "reshard", None):
        lines.append(
            f"resharded after forward: {len(plan.reshard)} parameters stored split, gathered again in the backward"
        )
    if getattr(plan, "reduce_dtype", "fp32") != "fp32":
        lines.append(
            f"gradients reduced in {plan.reduce_dtype}: each float32 weight's gradient cast to {plan.reduce_dtype} "
            "for its sum over ranks (under autocast) and back to float32"
        )
    zero = getattr(plan, "zero", None) or {}
    for stage, what in ((1, "Adam state"), (2, "gradient and Adam state")):
        names = sorted(n for n, s in zero.items() if s == stage)
        if names:
            lines.append(
                f"ZeRO-{stage}: {len(names)} replicated parameters keep their {what} split over the ranks "
                f"(1/{plan.world_size} of the rows each), the updated rows all-gathered after the optimizer"
            )
    if getattr(plan, "offload", "off") != "off":
        lines.append(offload_text(plan))
    return lines


def offload_text(plan: Plan) -> str:
    """The line that names the offload lever of ``plan`` and what it costs (:mod:`hidup.codegen.offload`)."""
    host = plan.memory.get("host", 0.0) / 2**30
    step = plan.predicted.get("optimizer", 0.0) * 1e3
    why = f" ({plan.options['offload_used']})" if plan.options.get("offload_used") else ""
    return (
        f"optimizer offloaded to the host{why}: Adam's moments and a float32 copy of the weights stepped "
        f"live in host memory ({host:.2f} GiB per rank), the gradients copied there, stepped by the CPU and "
        f"the weights copied back: {step:.1f} ms per step"
    )


def _is_op(plan: Plan, graph: Graph | None, name: str) -> bool:
    """Whether node ``name`` is an op (not a weight, an input, a constant or the output)."""
    if graph is not None:
        return graph.node(name).op == "call"
    sig = plan.choices[name]
    return sig.kind != "param" and bool(sig.inputs) and bool(sig.outputs)


def _stored(sig) -> str:
    """How a weight is stored: split when any mesh axis holds a slice of it."""
    return "split" if any(part.startswith("gather") for part in str(sig.outputs[0]).split("|")) else "replicated"


def _layer_rows(plan: Plan, graph: Graph | None) -> list[dict]:
    """One row per layer label in program order: ops, how they run, weights stored, collectives, time."""
    layers = dict(plan.layers)
    if graph is not None:
        for n in graph.nodes:
            layers.setdefault(n.name, layer_of(n.module))
    rows: dict[str, dict] = {}

    def row(name: str) -> dict:
        lab = layers.get(name, "") or OUTSIDE
        return rows.setdefault(lab, {"label": lab, "ops": 0, "kinds": {}, "weights": {}, "comm": {}, "time": 0.0})

    for name, sig in plan.choices.items():
        r = row(name)
        if sig.kind == "param":
            _add(r["weights"], _stored(sig), 1)
        elif _is_op(plan, graph, name):
            r["ops"] += 1
            _add(r["kinds"], sig.kind, 1)
        r["time"] += sum(plan.node_costs.get(name, [0.0]))
    for c in plan.conversions:
        for collective, sent in c.collectives(plan.group_size):
            _add(row(c.consumer)["comm"], collective.replace("_", "-"), sent)
    for name, (axis, moved) in plan.dispatch.items():  # the routed experts' token all-to-alls
        _add(row(name)["comm"], "all-to-all (tokens)", moved * sent_share("all_to_all", plan.group_size(axis)))
    return [r for r in rows.values() if r["ops"] or r["weights"] or r["comm"]]


def _add(counts: dict, key: str, amount: float) -> None:
    counts[key] = counts.get(key, 0) + amount


def _cells(r: dict) -> tuple[str, ...]:
    def listing(counts: dict, fmt) -> str:
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return ", ".join(f"{k} {fmt(v)}" for k, v in ranked) or "-"

    return (
        str(r["ops"]),
        listing(r["kinds"], str),
        listing(r["weights"], str),
        listing(r["comm"], _mb),
        _ms(r["time"]),
    )


def _table(rows: list[dict]) -> list[str]:
    """The per-layer table; consecutive layers with identical cells share one row."""
    groups: list[tuple[list[str], tuple[str, ...]]] = []
    for r in rows:
        cells = _cells(r)
        if groups and groups[-1][1] == cells and r["label"] != OUTSIDE and groups[-1][0][0] != OUTSIDE:
            groups[-1][0].append(r["label"])
        else:
            groups.append(([r["label"]], cells))
    head = ("layer", "ops", "how the ops run", "weights stored", "collectives (bytes each rank sends)", "time")
    body = [(_group_label(labels),) + cells for labels, cells in groups]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]

    def fmt(cols):
        return "  ".join(c.rjust(w) if i in (1, 5) else c.ljust(w) for i, (c, w) in enumerate(zip(cols, widths)))

    total_ops = sum(r["ops"] for r in rows)
    return [
        fmt(head).rstrip(),
        *(fmt(b).rstrip() for b in body),
        (
            f"({total_ops} ops; a row of several layers gives each layer's figures; time: compute plus communication "
            "charged to the layer, without overlap)"
        ),
    ]


def _group_label(labels: list[str]) -> str:
    return labels[0] if len(labels) == 1 else f"{labels[0]} .. {labels[-1]} ({len(labels)} layers, each)"


def _named_ops(plan: Plan) -> list[str]:
    """The routed-experts ops by name: how their experts are split and how tokens reach them."""
    how: dict[str, list[str]] = {}
    for name, sig in plan.choices.items():
        if not name.startswith("routed_experts"):
            continue
        factors = sig.axes or (sig,)
        if any(f.kind == "expert" for f in factors):
            dispatch = "all-to-all" if any(f.impl == "all_to_all" for f in factors) else "all-gather"
            axes = "" if sig.kind == "expert" else f" ({sig.kind} over the mesh's axes)"
            text = f"expert parallel{axes}, tokens reach the experts by {dispatch}"
        else:
            text = f"experts not split, the op runs {sig.kind}"
        how.setdefault(text, []).append(name)
    lines = [f"routed experts ({_span(names)}, {len(names)} ops): {text}" for text, names in how.items()]
    return ["", *lines] if lines else []

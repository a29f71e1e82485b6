"""The plan's report: ``summary(plan, graph)`` renders totals, a per-layer table and, for the heaviest
nodes, the runner-up signature.

:class:`Plan`, :class:`ConversionRecord`, :class:`PlanError`, :func:`model_record` and the JSON
format are defined by the search that makes them (:mod:`hidup.search.plan`, whose docstring describes
the format and its versions) and re-exported here: ``hidup.plan.Plan`` is the public name, and saved
plans load through either.
"""

from __future__ import annotations

from hidup.ir import Graph, mesh_text
from hidup.search.plan import (
    PLAN_VERSION,
    READABLE_VERSIONS,
    ConversionRecord,
    Plan,
    PlanError,
    layer_of,
    model_record,
)

__all__ = [
    "Plan",
    "ConversionRecord",
    "PlanError",
    "summary",
    "PLAN_VERSION",
    "READABLE_VERSIONS",
    "layer_of",
    "model_record",
]


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def _mb(b: float) -> str:
    return f"{b / 2**20:.2f} MiB" if b < 2**30 else f"{b / 2**30:.2f} GiB"


def _span(labels: list[str]) -> str:
    """``layers.0 .. layers.7`` for a run, the names otherwise (at most four)."""
    if len(labels) > 4:
        return f"{labels[0]} .. {labels[-1]}"
    return ", ".join(labels)


def summary(plan: Plan, graph: Graph | None = None) -> str:
    """A readable report: totals, then per layer the sharding kinds, communication volume and time,
    then for the heaviest nodes the runner-up signature and how much slower it would be."""
    layers = dict(plan.layers)
    if graph is not None:
        for n in graph.nodes:
            layers.setdefault(n.name, layer_of(n.module))
    p = plan.predicted
    m = plan.memory
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
        + ", ".join(f"{k} {_mb(v)}" for k, v in m.items() if k != "total")
        + ")",
    ]
    if plan.recompute:
        lines.append(f"recomputed in the backward: {len(plan.recompute)} layers ({_span(plan.recompute)})")
    if getattr(plan, "reshard", None):
        lines.append(
            f"resharded after forward: {len(plan.reshard)} parameters stored split, gathered again in the backward"
        )
    lines += [
        "",
    ]
    order: list[str] = []
    rows: dict[str, dict] = {}
    for name, sig in plan.choices.items():
        lab = layers.get(name, "") or "(top)"
        if lab not in rows:
            order.append(lab)
            rows[lab] = {"nodes": 0, "kinds": {}, "bytes": 0, "time": 0.0}
        r = rows[lab]
        r["nodes"] += 1
        if sig.kind not in ("param",) and (graph is None or graph.node(name).op == "call"):
            r["kinds"][sig.kind] = r["kinds"].get(sig.kind, 0) + 1
        r["time"] += sum(plan.node_costs.get(name, [0.0]))
    for c in plan.conversions:
        lab = layers.get(c.consumer, "") or "(top)"
        if lab in rows:
            rows[lab]["bytes"] += c.comm_bytes
    for name, (_, moved) in plan.dispatch.items():  # all-to-alls inside the routed experts
        lab = layers.get(name, "") or "(top)"
        if lab in rows:
            rows[lab]["bytes"] += moved
    kinds_of = {
        lab: ", ".join(f"{k} {v}" for k, v in sorted(rows[lab]["kinds"].items(), key=lambda kv: (-kv[1], kv[0]))) or "-"
        for lab in order
    }
    w = max([len("layer")] + [len(x) for x in order])
    wk = max([len("sharding")] + [len(x) for x in kinds_of.values()])
    lines.append(f"{'layer':<{w}}  {'nodes':>5}  {'sharding':<{wk}}  {'comm volume':>12}  {'time':>11}")
    for lab in order:
        r = rows[lab]
        lines.append(f"{lab:<{w}}  {r['nodes']:>5}  {kinds_of[lab]:<{wk}}  {_mb(r['bytes']):>12}  {_ms(r['time']):>11}")
    lines.append(
        f"(time: compute plus communication charged to the layer, without overlap; "
        f"{len(plan.stages)} stages, {len(plan.conversions)} conversions)"
    )
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

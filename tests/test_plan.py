"""Plans: JSON round trip, every refusal of Plan.check / Plan.load, and the summary."""

import json
from pathlib import Path

import pytest
import torch

import hidup
from hidup.ir import Graph
from hidup.plan import PLAN_VERSION, Plan, PlanError, summary
from hidup.search.memory import MEMORY_PARTS
from hidup.search.synthetic import layered_graph, random_graph


@pytest.fixture(scope="module")
def graph():
    return layered_graph(layers=3, nodes_per_layer=6, seed=2, shape=(256, 256))


@pytest.fixture(scope="module")
def plan(graph):
    return hidup.search(graph, "h200x4-socket")


def test_plan_fields(plan, graph):
    assert plan.version == PLAN_VERSION and plan.world_size == 4 and plan.profile == "h200x4-socket"
    assert plan.fingerprint == graph.fingerprint() and plan.model == graph.model and plan.algorithm == "dp"
    assert set(plan.choices) == {n.name for n in graph.nodes}
    assert sorted(x for s in plan.stages for x in s) == sorted(plan.choices)
    assert set(plan.predicted) == {"forward", "backward", "optimizer", "comm", "exposed_comm", "total"}
    assert plan.predicted["total"] == pytest.approx(
        plan.predicted["forward"] + plan.predicted["backward"] + plan.predicted["optimizer"]
    )
    assert 0 <= plan.predicted["exposed_comm"] <= plan.predicted["total"]
    # the total is the sum of the parts; the largest op's temporaries come on top of it at that op
    parts = {k: v for k, v in plan.memory.items() if k in MEMORY_PARTS}
    assert plan.memory["total"] == pytest.approx(sum(parts.values()))
    assert plan.memory["transient"] > 0 and plan.memory["peak"] >= plan.memory["total"]
    for c in plan.conversions:
        consumer = graph.node(c.consumer)
        assert consumer.inputs[c.input_index] == c.tensor
        assert plan.choices[c.consumer].inputs[c.input_index] == c.dst
        assert graph.tensors[c.tensor].producer == c.producer or c.producer in plan.choices
        assert c.bytes == graph.tensors[c.tensor].nbytes


def test_json_round_trip(plan, graph, tmp_path):
    path = plan.save(tmp_path / "plan.json")
    back = Plan.load(path)
    assert back.to_dict() == plan.to_dict()
    assert back.choices == plan.choices and back.conversions == plan.conversions
    back.check(graph)  # accepted


def test_refuses_other_world_size(plan, graph):
    g8 = Graph.from_dict({**graph.to_dict(), "world_size": 8})
    with pytest.raises(PlanError, match="world size: plan 4, graph 8"):
        plan.check(g8)


def test_the_structure_decides_not_the_model_name(plan, graph):
    """A plan names its model by the zoo name it was searched for, a traced graph by the module's class:
    the same structure under another name is accepted; another structure is refused, naming both."""
    renamed = Graph.from_dict({**graph.to_dict(), "model": "SomeClass"})
    plan.check(renamed)
    other = layered_graph(layers=4, nodes_per_layer=6, seed=2, shape=(256, 256))
    other.model = "something-else"
    with pytest.raises(PlanError, match="model: plan 'layered-3x6', graph 'something-else'"):
        plan.check(other)


def test_refuses_other_structure(plan):
    other = layered_graph(layers=4, nodes_per_layer=6, seed=2, shape=(256, 256))
    other.model = plan.model
    with pytest.raises(PlanError) as e:
        plan.check(other)
    msg = str(e.value)
    assert "graph fingerprint" in msg and "graph nodes without a choice: layers_3" in msg and "hidup search" in msg


def test_names_library_versions_that_moved(plan):
    """A plan records the versions it was traced with; a graph that differs under other versions is
    refused with the versions that moved; with the same versions the message does not blame them."""
    assert plan.versions["torch"] == torch.__version__
    old = Plan.from_dict({**plan.to_dict(), "versions": {"torch": "1.0.0", "transformers": "4.0.0"}})
    other = layered_graph(layers=4, nodes_per_layer=6, seed=2, shape=(256, 256))
    with pytest.raises(PlanError) as e:
        old.check(other)
    assert "torch 1.0.0 -> " + torch.__version__ in str(e.value) and "transformers 4.0.0 -> " in str(e.value)
    with pytest.raises(PlanError) as e:
        plan.check(other)
    assert "other library versions" not in str(e.value)


def test_refuses_changed_shapes(plan, graph):
    d = graph.to_dict()
    d["tensors"][0]["shape"] = [512, 256]
    with pytest.raises(PlanError, match="fingerprint"):
        plan.check(Graph.from_dict(d))


def test_refuses_a_signature_the_node_does_not_have(plan, graph):
    bad = Plan.from_dict(plan.to_dict())
    name = next(n.name for n in graph.nodes if n.op == "call" and len(n.signatures) > 1)
    other = next(s for s in random_graph(0, calls=1).nodes[-2].signatures)
    bad.choices[name] = other
    with pytest.raises(PlanError, match=f"no valid signature for node {name}"):
        bad.check(graph)


def test_load_refusals(plan, tmp_path):
    with pytest.raises(PlanError, match="no plan file"):
        Plan.load(tmp_path / "missing.json")
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(tmp_path / "junk.json")
    d = plan.to_dict()
    d["version"] = PLAN_VERSION + 1
    (tmp_path / "new.json").write_text(json.dumps(d))
    with pytest.raises(PlanError, match=f"version {PLAN_VERSION + 1}"):
        Plan.load(tmp_path / "new.json")
    d = plan.to_dict()
    del d["choices"]
    (tmp_path / "cut.json").write_text(json.dumps(d))
    with pytest.raises(PlanError, match="missing field 'choices'"):
        Plan.load(tmp_path / "cut.json")


def test_summary(plan, graph):
    text = summary(plan, graph)
    assert "layers.0" in text and "layers.2" in text and "h200x4-socket" in text
    assert "predicted per iteration" in text and "memory per rank" in text
    assert "why" in text and "runner-up" in text
    heavy = next(iter(plan.alternatives))
    assert heavy in text and plan.alternatives[heavy]["delta"] >= -1e-12
    assert summary(Plan.from_dict(plan.to_dict())).count("\n") > 5  # works without the graph


def test_runner_up_delta_is_exact(graph):
    import hidup.profiler as P
    from hidup.search.problem import Problem
    from hidup.search.schedule import evaluate

    plan = hidup.search(graph, "h200x4-socket", duplication=False)
    pr = Problem(graph, P.load("h200x4-socket").launched(True))  # what search prices by default
    ks = [pr.sigs[i].index(plan.choices[n.name]) for i, n in enumerate(pr.order)]
    for name, alt in plan.alternatives.items():
        if not alt["runner_up"]:
            continue
        i = pr.pos_of[name]
        k = next(k for k, s in enumerate(pr.sigs[i]) if str(s) == alt["runner_up"] and s.kind == alt["runner_up_kind"])
        ks2 = list(ks)
        ks2[i] = k
        assert evaluate(pr, ks2, False).total - plan.predicted["total"] == pytest.approx(alt["delta"])
        assert alt["delta"] >= -1e-12  # the DP's optimum: no single change is faster


def _table_rows(text: str) -> list[tuple[str, int, dict[str, int]]]:
    """(label, ops, how-the-ops-run counts) of each row of the summary's per-layer table."""
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("layer "))
    starts = [lines[head].index(c) for c in ("ops", "how the ops run", "weights stored")]
    rows = []
    for line in lines[head + 1 :]:
        if line.startswith("(") and line[1].isdigit():  # the footnote
            break
        ops = int(line[: starts[0] + 3].split()[-1])
        kinds = dict(kv.rsplit(" ", 1) for kv in line[starts[1] : starts[2]].strip().split(", "))
        rows.append((line[: starts[0]].strip(), ops, {k: int(v) for k, v in kinds.items()}))
    return rows


def test_summary_counts_add_up(plan, graph):
    """Each row's how-the-ops-run counts add up to its ops, the rows (times their layers) to the
    footnote's total, which is the graph's call nodes."""
    text = summary(plan, graph)
    rows = _table_rows(text)
    assert rows and all(sum(kinds.values()) == ops for _, ops, kinds in rows)
    total = sum(ops * (int(label.split("(")[1].split()[0]) if "layers, each" in label else 1) for label, ops, _ in rows)
    assert f"({total} ops;" in text and total == sum(1 for n in graph.nodes if n.op == "call")
    assert summary(plan) == text  # the plan alone says the same


def test_summary_names_the_routed_experts_and_their_dispatch():
    """A Mixtral plan with all-to-all dispatch: the routed-experts ops named, how tokens reach them,
    and every collective of its layers named with its bytes, the token all-to-all among them."""
    path = Path(__file__).parent.parent / "exp/records/moe/rank-plans-h200/mixtral-w4-expert-all-to-all.json"
    text = summary(Plan.load(path))
    assert "routed experts (routed_experts, routed_experts_1, routed_experts_2, routed_experts_3, 4 ops): " in text
    assert "expert parallel, tokens reach the experts by all-to-all" in text
    assert "all-to-all (tokens)" in text and "(4 layers, each)" in text
    layer_row = next(line for line in text.splitlines() if "(4 layers, each)" in line)
    assert "all-reduce" in layer_row and "all-gather" in layer_row and "MiB" in layer_row

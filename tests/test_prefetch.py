"""Prefetched weight gathers (:mod:`hidup.codegen.prefetch`): the order they are issued in, exact values,
and their price (:mod:`hidup.search.problem`, "Prefetched gathers").

* Order: in an FSDP-style rank program of the zoo GPT (every weight stored split), the gather of each
  weight of layer ``l`` is issued (``hidup_prefetch``) before the first op of layer ``l - 1`` and waited
  for (``hidup_prefetch_wait``) after its last op, right before its consumer; with ``prefetch=False``
  the program has no such node.  Recomputed layers keep their gathers in their region.
* Backward: the resharded copies of unit ``u - 1`` are made again as soon as the backward makes the
  first of unit ``u``, each once.
* Parity: on two gloo ranks the program with prefetch gives exactly (``==``) the loss and gradients of
  the program without it, and those of one device to float64 rounding: duplication off, on (copies in
  sequence, in test_reshard.py's runs, which prefetch by default) and on the two-copy stage schedule,
  with resharding, with a recomputed layer, and under
  ``torch.compile`` (``aot_eager``).
* Price: with prefetch the DP, exhaustive enumeration, the ILP and the evaluation agree on repeated
  layers (each prices a gather through ``Problem.forward_charge``); an FSDP-style GPT plan is priced
  lower with prefetch than without, by no more than its forward gathers' communication and its
  backward reduce-scatters, which prefetch moves, each whole, from the backward's blocking
  collectives to those that overlap it (``Problem.scatters_async``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hidup.models as M
import hidup.profiler
from dist_util import run_distributed
from hidup.codegen.compiled import LAYER
from hidup.codegen.prefetch import hidup_prefetch, hidup_prefetch_wait
from hidup.codegen.program import build_rank_program
from hidup.codegen.rewrite import CompileOptions, trace_module
from hidup.frontend.trace import trace
from hidup.ir import prefetch_units
from hidup.search import dp, forced, ilp, price
from hidup.search.brute import brute_force
from hidup.search.problem import Problem
from hidup.search.schedule import evaluate
from hidup.search.synthetic import layered_graph

PROFILE = "h200x4-nvlink"
SMALL = dict(layers=3, d_model=32, heads=4, ffn=64, seq_len=8, batch_per_gpu=4, vocab=64)
PARITY = dict(SMALL, layers=2)  # the programs run on two ranks
TOL = 4 * 2 * SMALL["batch_per_gpu"] * SMALL["seq_len"] * torch.finfo(torch.float64).eps
# (duplication, streams, reshard, recomputed layers, torch.compile backend)
JOBS = [
    (False, False, False, (), False),
    (True, True, False, (), False),
    (False, False, True, (), False),
    (True, True, True, (), False),
    (False, False, False, ("trunk.layers.1",), False),
    (False, False, True, (), "aot_eager"),
]


def _program(prefetch: bool, recompute=()):
    model, inputs = M.build("gpt", world_size=2, dtype=torch.float64, **SMALL)
    graph = trace(model, inputs, world_size=2)
    plan = forced(graph, hidup.profiler.load(PROFILE), "fsdp", duplication=False)
    traced = trace_module(model, tuple(inputs), 2)
    options = CompileOptions(prefetch=prefetch, recompute=list(recompute))
    return build_rank_program(traced, plan, 0, 2, None, options).gm


def test_units_are_runs_of_one_label():
    assert prefetch_units(["", "", "l.0", "l.0", "l.1", "", ""]) == [0, 0, 1, 1, 2, 3, 3]
    assert prefetch_units([]) == []


def test_gathers_are_issued_one_layer_ahead():
    gm = _program(True)
    nodes = list(gm.graph.nodes)
    where = {n: i for i, n in enumerate(nodes)}
    ops = [n for n in nodes if n.op == "call_function" and n.target not in (hidup_prefetch, hidup_prefetch_wait)]
    span = {}
    for n in ops:
        label = n.meta.get(LAYER, "")
        first, last = span.get(label, (where[n], where[n]))
        span[label] = (min(first, where[n]), max(last, where[n]))
    starts = [n for n in nodes if n.target is hidup_prefetch]
    assert starts, "an FSDP-style plan prefetches its weights"
    checked = 0
    for start in starts:
        (wait,) = start.users
        consumer_layer = wait.meta[LAYER]
        assert where[start] < where[wait]
        if consumer_layer.startswith("trunk.layers.") and consumer_layer != "trunk.layers.0":
            previous = f"trunk.layers.{int(consumer_layer.rsplit('.', 1)[1]) - 1}"
            # issued before the previous layer's first op, waited for after its last one
            assert where[start] < span[previous][0] < span[previous][1] < where[wait], (start, wait)
            checked += 1
    assert checked == 2 * 16  # layers 1 and 2: sixteen stored-split weights and biases each
    assert not any(n.target in (hidup_prefetch, hidup_prefetch_wait) for n in _program(False).graph.nodes)


def test_recomputed_layer_keeps_its_gathers():
    gm = _program(True, recompute=("trunk.layers.1",))
    prefetched = {n.args[0].target for n in gm.graph.nodes if n.target is hidup_prefetch}
    assert any("layers__2" in t for t in prefetched)
    assert not any("layers__1" in t for t in prefetched)


def _rank_parity(rank, world):
    import torch._dynamo

    from hidup.codegen import compile as hidup_compile
    from hidup.codegen import reshard as R
    from hidup.codegen.params import full_grad_dict

    warnings.simplefilter("ignore")
    model, inputs = M.build("gpt", world_size=world, dtype=torch.float64, **PARITY)
    graph = trace(model, inputs, world_size=world)
    out = {}
    # each copy the backward makes again, in order: (its unit, the unit of the copy being unpacked then)
    made: list = []
    unpacking = [None]
    convert, unpack = R._Recipe._convert, R._Packed.unpack

    def logged(self):
        made.append((self.unit, unpacking[0]))
        return convert(self)

    def unpacked(self):
        unpacking[0] = self.recipe.unit
        return unpack(self)

    R._Recipe._convert, R._Packed.unpack = logged, unpacked
    for job in JOBS:
        dup, streams, reshard, layers, backend = job
        plan = forced(graph, hidup.profiler.load(PROFILE), "fsdp", duplication=dup)
        runs = {}
        for prefetch in (False, True):
            torch._dynamo.reset()
            model, inputs = M.build("gpt", world_size=world, dtype=torch.float64, **PARITY)
            module = hidup_compile(
                model,
                plan,
                rank,
                world,
                inputs,
                duplication=dup,
                streams=streams,
                reshard=reshard,
                recompute=list(layers),
                compile=backend,
                prefetch=prefetch,
            )
            loss = module(*inputs)
            made.clear()
            loss.backward()
            issued = sum(n.target is hidup_prefetch for m in module.modules() for n in _graph_nodes(m))
            runs[prefetch] = (float(module.global_loss(loss)), full_grad_dict(module), issued, module.duplication)
            runs[prefetch, "remade"] = list(made)
        ref, ref_inputs = M.build("gpt", world_size=world, dtype=torch.float64, **PARITY)
        ref_loss = ref(*ref_inputs)
        ref_loss.backward()
        grads = dict(ref.named_parameters())
        off, on = runs[False], runs[True]
        out[job] = {
            "loss": (off[0], on[0], float(ref_loss)),
            "grad_vs_off": max(float((on[1][k] - off[1][k]).abs().max()) for k in off[1]),
            "grad_vs_ref": max(float((on[1][k] - grads[k].grad).abs().max()) for k in on[1]),
            "issued": (off[2], on[2]),
            "duplication": on[3],
            "remade": (runs[False, "remade"], runs[True, "remade"]),
        }
    R._Recipe._convert, R._Packed.unpack = convert, unpack
    return out


def _graph_nodes(module) -> list:
    graph = getattr(module, "graph", None)
    return list(graph.nodes) if isinstance(graph, torch.fx.Graph) else []


_RESULTS: dict = {}


def _results() -> dict:
    if not _RESULTS:
        _RESULTS.update(run_distributed(_rank_parity, 2, timeout=600)[0])
    return _RESULTS


@pytest.mark.parametrize("job", JOBS, ids=lambda j: f"dup{int(j[0])}-st{int(j[1])}-rs{int(j[2])}-rc{len(j[3])}-{j[4]}")
def test_prefetched_program_is_exact(job):
    r = _results()[job]
    off, on, ref = r["loss"]
    assert r["duplication"] == job[0]
    assert r["issued"][0] == 0 and r["issued"][1] > 0, r["issued"]
    assert on == off, r["loss"]
    assert r["grad_vs_off"] == 0.0, r["grad_vs_off"]
    assert abs(on - ref) <= TOL * abs(ref), r["loss"]
    assert r["grad_vs_ref"] <= TOL, r["grad_vs_ref"]
    off_made, on_made = r["remade"]
    assert len(on_made) == len(off_made), r["remade"]  # each copy made again once either way
    # resharded, eager, one copy (two copies on the CPU share one group, whose forward sessions interleave:
    # some copies are then made at their own unpack): the backward makes the previous unit's copies ahead
    if job[2] and not job[4] and not job[0]:
        assert {u for u, _ in off_made} == {-1}, off_made
        top = max(u for u, _ in on_made)
        assert len({u for u, _ in on_made}) >= 3, on_made  # the head, and the two layers
        # the last unit's copies are made when its backward unpacks them, every other unit's while the
        # backward of the unit after it unpacks (ahead: when it unpacks its first copy)
        assert all(at == (top if u == top else u + 1) for u, at in on_made), on_made


# ------------------------------------------------------------------------------------------------ price


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1e-12)


@pytest.mark.parametrize("seed,reshard", [(0, False), (1, False), (1, True)])
def test_dp_ilp_and_evaluation_agree_with_prefetch(seed, reshard):
    g = layered_graph(layers=3, nodes_per_layer=2, sigs=(2, 3), seed=seed, flops_scale=1e11)
    profile = hidup.profiler.load("h200x4-socket")
    on, off = Problem(g, profile, reshard=reshard), Problem(g, profile, reshard=reshard, prefetch=False)
    assert any(any(w) for w in on.windows) and not any(off.windows)
    assert any(any(w) for w in on.back_windows) == reshard and not any(off.back_windows)
    exact = dp.Beam(max_states=None, max_points=None)
    ks, v = dp.solve(on, False, beam=exact)
    _, v_off = dp.solve(off, False, beam=exact)
    assert _close(brute_force(on, False)[1], v)
    assert _close(evaluate(on, ks, False).objective, v)
    assert _close(evaluate(on, ilp.solve(on), False).objective, v)
    assert v <= v_off * (1 + 1e-12)


def test_repeated_layers_reuse_tables_only_where_windows_agree():
    """The first layer's gathers overlap the embedding, the others' a layer: the DP's reused tables of
    repeated layers (hidup.search.segments) tell them apart, and price what evaluate does."""
    model, inputs = M.build("gpt", world_size=4, device="meta", **dict(SMALL, layers=4))
    graph = trace(model, inputs, world_size=4)
    for prefetch, layers in ((False, 4), (True, 3)):
        problem = Problem(graph, hidup.profiler.load("h200x4-socket"), prefetch=prefetch)
        ks, v = dp.solve(problem, False, beam=dp.Beam(reuse_blocks=True))
        _, plain = dp.solve(problem, False, beam=dp.Beam(reuse_blocks=False))
        assert [o.label for o in problem.occurrences] == [f"trunk.layers.{j}" for j in range(4 - layers, 4)]
        assert _close(evaluate(problem, ks, False).objective, v) and _close(v, plain)


def test_fsdp_plan_is_priced_lower_by_at_most_its_gathers():
    model, inputs = M.build("gpt", world_size=4, layers=3, d_model=256, heads=4, ffn=1024, seq_len=128, vocab=1024)
    graph = trace(model, inputs, world_size=4)
    profile = hidup.profiler.load(PROFILE)
    plan = forced(graph, profile, "fsdp", duplication=False, prefetch=False)
    off, on = price(graph, profile, plan, prefetch=False)[False], price(graph, profile, plan)[False]
    problem = Problem(graph, profile, prefetch=False)
    gathers = sum(
        c.fwd - c.fwd_copies
        for s in off.steps
        for tid, _, a, f in s.convs
        if graph.tensors[tid].is_param
        for c in [problem.conversion(tid, a, f)]
    )
    assert gathers > 0
    # the reduce-scatters of the prefetched gathers (every unit's but the first) overlap the backward: the
    # same seconds as without prefetch, moved from the blocking to the asynchronous part, nothing else
    on_problem = Problem(graph, profile)
    scatters = [
        sum(
            problem.conversion(tid, a, f).bwd_block
            for tid, inp, a, f in s.convs
            if on_problem.scatters_async(i, inp, a, problem.conversion(tid, a, f))
        )
        for i, s in enumerate(off.steps)
    ]
    assert sum(scatters) > 0 and any(s.bwd_block > 0 for s, x in zip(off.steps, scatters) if not x)
    for s_off, s_on, x in zip(off.steps, on.steps, scatters):
        assert (s_on.bwd, s_on.bwd_compute) == (s_off.bwd, s_off.bwd_compute)
        assert _close(s_on.bwd_async, s_off.bwd_async + x) and _close(s_on.bwd_block + x, s_off.bwd_block)
    assert off.total - gathers - sum(scatters) <= on.total < off.total
    assert off.backward - sum(scatters) <= on.backward < off.backward and on.compute == off.compute
    # resharded, the backward's second gathers are made ahead too: at most those gathers saved there
    plan.reshard = sorted(n.name for n in graph.nodes if n.op == "param" and plan.choices[n.name].outputs[0].is_gather)
    off_r, on_r = price(graph, profile, plan, prefetch=False)[False], price(graph, profile, plan)[False]
    assert off_r.backward - gathers <= on_r.backward < off_r.backward
    assert on_r.forward == on.forward
    # the search that prices prefetch records it, and predicts what price() gives
    priced = forced(graph, profile, "fsdp", duplication=False)
    assert priced.options["prefetch"] is True
    assert _close(priced.predicted["total"], price(graph, profile, priced)[False].total)


def test_memory_counts_three_units_of_prefetched_resharded_weights():
    model, inputs = M.build("gpt", world_size=2, **SMALL)
    graph = trace(model, inputs, world_size=2)
    profile = hidup.profiler.load(PROFILE)

    def size(*prefixes) -> int:
        return sum(
            graph.tensors[n.outputs[0]].numel * 4
            for n in graph.nodes
            if n.op == "param" and n.name.startswith(prefixes)
        )

    layer, first, last = size("trunk_layers_1_"), size("tok_", "pos"), size("trunk_norm_", "decoder_")
    on = forced(graph, profile, "fsdp", duplication=False, reshard="on", recompute="off")
    off = forced(graph, profile, "fsdp", duplication=False, reshard="on", recompute="off", prefetch=False)
    kept = forced(graph, profile, "fsdp", duplication=False, reshard="off", recompute="off")
    assert on.reshard and layer > 0
    # the largest three neighbouring units (embedding, three layers, head): the three layers
    expected = max(first + 2 * layer, 3 * layer, 2 * layer + last)
    assert expected == 3 * layer and on.memory["prefetch"] == expected, (on.memory["prefetch"], layer, first, last)
    assert off.memory["prefetch"] == 0.0 and kept.memory["prefetch"] == 0.0


def test_cli_prefetch_flag(tmp_path, capsys):
    """``hidup search --prefetch off`` records it in the plan (which the program then follows); a bad
    value is one argparse message, exit 2."""
    import json

    from test_cli_errors import TINY, one_message, run_main

    warnings.simplefilter("ignore")
    out = tmp_path / "plan.json"
    argv = ["search", *TINY, "--world", "2", "--prefetch", "off", "--out", str(out), "--quiet"]
    code, _, err = run_main(argv, capsys)
    assert code == 0, err
    assert json.loads(out.read_text())["options"]["prefetch"] is False
    code, _, err = run_main(["search", *TINY, "--world", "2", "--prefetch", "maybe", "--out", str(out)], capsys)
    assert code == 2
    one_message(err, "--prefetch", "invalid choice: 'maybe'")

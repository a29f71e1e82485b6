"""Prefetched weight gathers in a compiled program (:mod:`hidup.codegen.prefetch`, :mod:`hidup.codegen.compiled`)
and their price (:mod:`hidup.search.problem`, "Prefetched gathers").

* The condition: a prefetched form change runs as one asynchronous all-gather under compilation when
  its only collective is an all-gather (:func:`hidup.ir.async_gather_link`); the program's prefetches
  carry that link, a resharded parameter's none; a gather whose wait lies in another compiled graph
  (a bucket segment, a duplication stage, past a graph break) runs in place (``confine_links``); a
  graph that issues such gathers is compiled with inductor's ``sink_waits`` pass.
* The compiled graph: on two gloo ranks (float64) an FSDP-style MLP compiled through AOTAutograd has,
  in the forward graph inductor receives, every weight's ``all_gather_into_tensor`` issued before the
  compute of the previous unit and its ``wait_tensor`` after that compute, right before its matmul;
  loss and gradients equal the eager program's exactly.
* The backward: each such gather's gradient is reduce-scattered as torch's functional collective and
  waited for apart (inductor's ``sink_waits`` moves the wait), bit for bit the eager sums.
* The price: priced ``compiled`` an FSDP-style plan's gathers get a window (the previous unit's
  compiled compute), saving at most their communication, and their reduce-scatters overlap the
  backward; a resharded plan's get neither (its forward and backward as without prefetch), nor does
  an all-to-all or a two-collective layout change.
"""

from __future__ import annotations

import warnings

import torch
import torch._inductor.config

import hidup.models as M
import hidup.profiler
from dist_util import run_distributed
from hidup.codegen.compiled import SINK_WAITS, _issues_async
from hidup.codegen.prefetch import LINK, confine_links, hidup_prefetch
from hidup.codegen.program import build_rank_program
from hidup.codegen.rewrite import CompileOptions, trace_module
from hidup.frontend.trace import trace
from hidup.ir import FULL, Layout, MeshConversion, MeshStep, async_gather_link, conversion, gather
from hidup.search import forced, price
from hidup.search.problem import Problem, _async_gather

PROFILE = "h200x4-nvlink"
MLP = dict(layers=2, d_model=16, ffn=32, batch_per_gpu=4)


def test_async_link_is_the_only_collective_when_it_gathers():
    assert async_gather_link(["all_gather"]) == 0
    assert async_gather_link(["slice", "all_gather", "identity"]) == 1
    assert async_gather_link(["all_to_all"]) is None
    assert async_gather_link(["all_gather", "all_gather"]) is None  # a two-collective layout change
    assert async_gather_link(["identity", "slice"]) is None
    gathers = conversion(gather(0), FULL)
    assert _async_gather(gathers) and not _async_gather(conversion(gather(0), gather(1)))
    a, b, c = Layout((gather(0), gather(1))), Layout((FULL, gather(1))), Layout((FULL, FULL))
    step0, step1 = MeshStep(0, gathers, a, b), MeshStep(1, conversion(gather(1), FULL), b, c)
    assert _async_gather(MeshConversion(a, b, (step0,))) and not _async_gather(MeshConversion(a, c, (step0, step1)))


def _program(name: str, reshard: bool, **config):
    model, inputs = M.build(name, world_size=2, dtype=torch.float64, **config)
    graph = trace(model, inputs, world_size=2)
    plan = forced(graph, hidup.profiler.load(PROFILE), "fsdp", duplication=False)
    traced = trace_module(model, tuple(inputs), 2)
    return build_rank_program(traced, plan, 0, 2, None, CompileOptions(prefetch=True, reshard=reshard)).gm


def test_prefetches_carry_their_link_and_stay_in_their_graph():
    gm = _program("mlp", False, **MLP)
    starts = [n for n in gm.graph.nodes if n.target is hidup_prefetch]
    assert starts and all(n.kwargs["link"][:3] == (0, None, "gather_0") for n in starts)
    assert all(w.kwargs == n.kwargs for n in starts for w in n.users)
    # one graph per layer: every gather issued in the layer before its own crosses into the next graph
    layer = {n: n.meta.get("layer", "") for n in gm.graph.nodes}
    assert confine_links(gm, lambda n: layer[n]) == len(starts)  # each issued where it is waited for
    assert all(w.kwargs == n.kwargs == {"link": n.meta[LINK], "at_use": True} for n in starts for w in n.users)
    assert confine_links(gm, lambda n: 0) == 0  # one graph again: every link back
    assert all(n.kwargs == {"link": n.meta[LINK]} for n in starts)
    assert "link = " in gm.code
    # inductor sinks the waits of a graph that has such gathers, with options this torch has
    assert _issues_async(gm) and all(hasattr(torch._inductor.config, k) for k in SINK_WAITS)
    # resharded, the chain stays put under compilation: no link
    resharded = _program("mlp", True, **MLP)
    starts = [n for n in resharded.graph.nodes if n.target is hidup_prefetch]
    assert starts and all(not n.kwargs for n in starts) and not _issues_async(resharded)


_FORWARD_GRAPHS: list = []
_BACKWARD_GRAPHS: list = []


def _capture(gm, example_inputs):
    """A torch.compile backend: AOTAutograd, keeping the forward and backward ATen graphs (what inductor
    lowers)."""
    from torch._dynamo.backends.common import aot_autograd

    def keep(graphs):
        def compiler(g, _):
            graphs.append(g.graph)
            return g

        return compiler

    return aot_autograd(fw_compiler=keep(_FORWARD_GRAPHS), bw_compiler=keep(_BACKWARD_GRAPHS))(gm, example_inputs)


def _rank_compiled(rank, world):
    import torch._dynamo

    from hidup.codegen import compile as hidup_compile
    from hidup.codegen.params import full_grad_dict

    warnings.simplefilter("ignore")
    torch._dynamo.register_backend(name="hidup_forward_capture")(_capture)
    model, inputs = M.build("mlp", world_size=world, dtype=torch.float64, **MLP)
    plan = forced(trace(model, inputs, world_size=world), hidup.profiler.load(PROFILE), "fsdp", duplication=False)
    runs = []
    # eagerly; compiled; compiled with every gather issued where it is waited for (as in graphs apart)
    for backend, at_use in ((False, False), ("hidup_forward_capture", False), ("hidup_forward_capture", True)):
        model, inputs = M.build("mlp", world_size=world, dtype=torch.float64, **MLP)
        module = hidup_compile(model, plan, rank, world, inputs, duplication=False, compile=backend, prefetch=True)
        if at_use:
            confine_links(module.gm, lambda n: n.meta.get("layer", ""))
        loss = module(*inputs)
        loss.backward()
        runs.append((float(module.global_loss(loss)), full_grad_dict(module)))
        issued = sum(n.target is hidup_prefetch for n in module.gm.graph.nodes)
    eager = runs[0]
    spans = [_spans(g) for g in _FORWARD_GRAPHS]
    scatters = [[str(n.target) for n in g.nodes if "_c10d_functional" in str(n.target)] for g in _BACKWARD_GRAPHS]
    return {
        "loss": [(eager[0], run[0]) for run in runs[1:]],
        "grad": [max(float((eager[1][k] - run[1][k]).abs().max()) for k in eager[1]) for run in runs[1:]],
        "issued": issued,
        "spans": spans,
        "scatters": scatters,
    }


def _spans(graph) -> list:
    """Per all-gather of a forward graph: the ops between its issue and its wait, and the op after the wait."""
    order = [n for n in graph.nodes if n.op == "call_function"]
    spans = []
    for i, n in enumerate(order):
        if "all_gather_into_tensor" in str(n.target):
            (wait,) = [u for u in n.users if "wait_tensor" in str(u.target)]
            j = order.index(wait)
            after = next(str(m.target) for m in order[j + 1 :] if "wait_tensor" not in str(m.target))
            spans.append(([str(m.target) for m in order[i + 1 : j]], after))
    return spans


def test_compiled_gathers_are_waited_after_the_compute_they_overlap():
    r = run_distributed(_rank_compiled, 2, timeout=300)[0]
    assert all(a == b for a, b in r["loss"]) and r["grad"] == [0.0, 0.0], (r["loss"], r["grad"])
    spans, at_use = r["spans"]
    assert len(spans) == len(at_use) == r["issued"] > 0
    assert all(not ops for ops, _ in at_use)  # issued where waited for: nothing between
    # hidden.l's weight and bias are gathered while the previous unit (an activation, or the input's
    # slice) computes, and waited right before their matmul
    assert all(after in ("aten.addmm.default", "aten.mm.default", "aten.t.default") for _, after in spans), spans
    overlapped = [ops for ops, _ in spans if any(op.startswith("aten.gelu") for op in ops)]
    assert len(overlapped) >= len(spans) - 2, spans  # all but the first layer's (its unit before: the input)
    # the backward reduce-scatters each prefetched weight's gradient as a functional collective, waited
    # for apart (inductor sinks the wait): one issue and one wait per gather, bit for bit the eager sums
    issue, wait = "_c10d_functional.reduce_scatter_tensor.default", "_c10d_functional.wait_tensor.default"
    assert r["scatters"] == [[issue, wait] * r["issued"]] * 2, r["scatters"]


def test_compiled_price_gives_the_gathers_their_window():
    model, inputs = M.build("gpt", world_size=4, layers=3, d_model=256, heads=4, ffn=1024, seq_len=128, vocab=1024)
    graph = trace(model, inputs, world_size=4)
    profile = hidup.profiler.load(PROFILE)
    plan = forced(graph, profile, "fsdp", duplication=False, prefetch=False)
    off, on = (price(graph, profile, plan, prefetch=p, compiled=True)[False] for p in (False, True))
    problem = Problem(graph, profile.launched(False, True), prefetch=False)
    gathers = sum(
        c.fwd - c.fwd_copies
        for s in off.steps
        for tid, _, a, f in s.convs
        if graph.tensors[tid].is_param
        for c in [problem.conversion(tid, a, f)]
    )
    assert gathers > 0 and off.forward - gathers <= on.forward < off.forward
    # their reduce-scatters, issued asynchronously too, overlap the backward
    assert on.backward < off.backward and on.compute == off.compute
    # resharded: compiled, the gathers stay where they were, forward and backward
    plan.reshard = sorted(n.name for n in graph.nodes if n.op == "param" and plan.choices[n.name].outputs[0].is_gather)
    off_r, on_r = (price(graph, profile, plan, prefetch=p, compiled=True)[False] for p in (False, True))
    assert on_r.total == off_r.total and on_r.forward == off_r.forward

"""Reshard after forward (FSDP2 style): exact results, the memory it saves, its price and the search's choice.

* Parity: on two gloo ranks, FSDP-style plans (every weight stored split, gathered for its use) of the
  zoo GPT, of a ``transformers`` Llama and of a model reading a weight through a view op, with every
  stored-split parameter resharded, give exactly the loss and gradients of the same plan without
  resharding, and those of one device (float64; the Llama's loss is float32) -- duplication off and on
  (the copies in sequence and on the two-copy stage schedule), with some layers recomputed too, and
  under ``torch.compile`` (``aot_eager``).  The programs do reshard: their ops run in
  :class:`~hidup.codegen.reshard.ReshardCall`, no converted copy is alive after the forward, and the
  backward makes copies again (unpacked handles).
* On a 2x2 mesh (4 gloo ranks) an FSDP-on-axis-0 plan reshards and matches the plain plan exactly,
  eagerly (duplication off and on) and compiled.
* Memory: the bytes autograd keeps (``saved_tensors_hooks`` around rank 0's forward on torch's fake
  process group; compiled, the bytes AOTAutograd saves) drop by the gathered weights' bytes and equal
  the memory model's count to the byte, in float64 and under bf16 autocast; the fake-tensor peak
  (``hidup peak``) sees the drop; the hooks hand what they do not pack to the hooks around them.
* Search: the gathered copies a backward keeps are in the search's memory; resharding drops them and
  repeats the gathers in the backward (DP and ILP); ``reshard="auto"`` reshards only under a budget that
  needs it, within the ILP's one time limit; ``hidup search --reshard`` works, a bad value fails
  clearly, and ``hidup verify`` runs the plan it writes; ``show``/``train``/``verify`` say it reshards.
"""

from __future__ import annotations

import gc
import json
import warnings

import pytest
import torch

import hidup.models as M
import hidup.profiler
import thirdparty
from dist_util import run_distributed
from hidup.codegen import CompileError
from hidup.frontend.trace import trace
from hidup.plan import Plan, summary
from hidup.search import SearchError, forced, price, search
from hidup.search.memory import MemoryModel
from hidup.search.problem import Problem
from test_memory import _saved_bytes

PROFILE = "h200x4-nvlink"
SMALL = dict(layers=2, d_model=32, heads=4, ffn=64, seq_len=8, batch_per_gpu=4, vocab=64)
# (model, duplication, streams, recomputed layers)
JOBS = [
    ("gpt", False, False, ()),
    ("gpt", True, False, ()),
    ("gpt", True, True, ()),
    ("gpt", False, False, ("trunk.layers.1",)),
    ("gpt", True, True, ("trunk.layers.0",)),
    ("llama", False, False, ()),
    ("llama", True, False, ()),
    ("viewed", False, False, ()),
]


class Viewed(torch.nn.Module):
    """Weights read through a view the traced graph keeps as a node of its own (``x @ w.t()``): the op
    that saves the view of the gathered copy runs resharded too."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
        self.w = torch.nn.Parameter(torch.randn(16, 8, dtype=torch.float64))
        self.v = torch.nn.Parameter(torch.randn(16, 4, dtype=torch.float64))

    def forward(self, x, y):
        h = torch.tanh(torch.tanh(x @ self.a) @ self.w.t())
        return ((h @ self.v) - y).pow(2).sum()


def _build(name: str, world: int):
    if name == "viewed":
        model = Viewed()
        torch.manual_seed(1)
        return model, (torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64))
    if name in thirdparty.NAMES:
        return thirdparty.build(name)
    return M.build(name, world_size=world, dtype=torch.float64, **SMALL)


def _stored_split(graph, plan) -> list[str]:
    return [n.name for n in graph.nodes if n.op == "param" and plan.choices[n.name].outputs[0].is_gather]


def _run(module, inputs, counter: list) -> tuple:
    from hidup.codegen import reshard as R

    loss = module(*inputs)
    gc.collect()  # reference cycles aside (a collective's first fallback on gloo leaves one once)
    alive = R.registered()
    before = len(counter)
    loss.backward()
    return loss, alive, len(counter) - before


def _rank_parity(rank, world):
    from hidup.codegen import compile as hidup_compile
    from hidup.codegen import reshard as R
    from hidup.codegen.params import full_grad_dict

    warnings.simplefilter("ignore")
    unpacked: list = []
    unpack = R._Packed.unpack

    def counted(self):
        unpacked.append(1)
        return unpack(self)

    R._Packed.unpack = counted
    graphs, out = {}, {}
    for job in JOBS:
        name, dup, streams, layers = job
        if name not in graphs:
            graphs[name] = trace(*_build(name, world), world_size=world)
        graph = graphs[name]
        plan = forced(graph, hidup.profiler.load(PROFILE), "fsdp", duplication=dup)
        runs = {}
        for reshard in (False, True):
            model, inputs = _build(name, world)
            module = hidup_compile(
                model,
                plan,
                rank,
                world,
                inputs,
                duplication=dup,
                streams=streams,
                recompute=list(layers),
                reshard=reshard,
            )
            loss, alive, remade = _run(module, inputs, unpacked)
            runs[reshard] = (
                float(module.global_loss(loss)),
                full_grad_dict(module),
                sum(isinstance(m, R.ReshardCall) for m in module.modules()),
                alive,
                remade,
                module.duplication,
            )
        ref, ref_inputs = _build(name, world)
        ref_loss = ref(*ref_inputs)
        ref_loss.backward()
        scale = max(float(p.grad.abs().max()) for p in ref.parameters())
        plain, again = runs[False], runs[True]
        out[job] = {
            "loss": (plain[0], again[0], float(ref_loss)),
            "grad_vs_plain": max(float((again[1][k] - plain[1][k]).abs().max()) for k in plain[1]),
            "grad_vs_ref": max(
                float((again[1][k] - dict(ref.named_parameters())[k].grad).abs().max())
                / max(float(dict(ref.named_parameters())[k].grad.abs().max()), 1e-2 * scale)
                for k in again[1]
            ),
            "calls": (plain[2], again[2]),
            "alive": again[3],
            "remade": (plain[4], again[4]),
            "duplication": again[5],
            "stored_split": len(_stored_split(graph, plan)),
        }
    # under torch.compile (aot_eager): the same values as the eager resharded program, and the bytes the
    # forward packs for the backward drop as they do eagerly (the partitioner gathers again instead)
    import torch._dynamo

    compiled = {}
    for dup in (False, True):
        plan = forced(graphs["gpt"], hidup.profiler.load(PROFILE), "fsdp", duplication=dup)
        res = {}
        for backend in (False, "aot_eager"):
            torch._dynamo.reset()
            for reshard in (False, True):
                model, inputs = _build("gpt", world)
                module = hidup_compile(
                    model, plan, rank, world, inputs, duplication=dup, streams=dup, reshard=reshard, compile=backend
                )
                saved = _saved_bytes(module, inputs, autocast=False)  # a forward of its own, not timed
                loss = module(*inputs)
                loss.backward()
                res[backend, reshard] = (float(module.global_loss(loss)), full_grad_dict(module), saved)
        eager, comp = res[False, True], res["aot_eager", True]
        compiled[dup] = (
            abs(eager[0] - comp[0]),
            max(float((eager[1][k] - comp[1][k]).abs().max()) for k in eager[1]),
            {key: v[2] for key, v in res.items()},
        )
    R._Packed.unpack = unpack
    return {"parity": out, "compiled": compiled}


_RESULTS: dict = {}


def _results() -> dict:
    if not _RESULTS:
        _RESULTS.update(run_distributed(_rank_parity, 2, timeout=900)[0])
    return _RESULTS


def _tol(name: str) -> float:
    return thirdparty.sum_tolerance(name, 2 * SMALL["batch_per_gpu"] * SMALL["seq_len"])


@pytest.mark.parametrize("job", JOBS, ids=["-".join(str(x) for x in j[:3]) + f"-rc{len(j[3])}" for j in JOBS])
def test_resharded_program_is_exact(job):
    r = _results()["parity"][job]
    name, dup = job[0], job[1]
    plain_loss, loss, ref = r["loss"]
    assert r["duplication"] == dup
    assert r["stored_split"] > 0
    # the plain program has no resharded op; the resharded one does, and after its forward no
    # converted copy is alive (each was freed after its use), while its backward made copies again
    assert r["calls"][0] == 0 and r["calls"][1] > 0, r["calls"]
    assert r["alive"] == 0, r["alive"]
    assert r["remade"][0] == 0 and r["remade"][1] > 0, r["remade"]
    # the same ops on the same values: exactly the plain plan's results
    assert loss == plain_loss, r["loss"]
    assert r["grad_vs_plain"] == 0.0, r["grad_vs_plain"]
    assert abs(loss - ref) <= _tol(name) * abs(ref), r["loss"]
    assert r["grad_vs_ref"] <= _tol(name), r["grad_vs_ref"]


@pytest.mark.parametrize("dup", [False, True])
def test_resharded_program_compiles(dup):
    """Under torch.compile the resharded conversions are checkpoint regions that must be recomputed: the
    values are the eager program's, and what the compiled forward saves drops as the eager one's does."""
    loss_diff, grad_diff, saved = _results()["compiled"][dup]
    assert loss_diff <= _tol("gpt") and grad_diff <= _tol("gpt"), (loss_diff, grad_diff)
    eager_drop = saved[False, False] - saved[False, True]
    assert eager_drop > 0, saved
    assert saved["aot_eager", False] - saved["aot_eager", True] == eager_drop, saved


# ------------------------------------------------------------------------------------------------ mesh


def _rank_mesh(rank, world):
    import torch._dynamo

    from hidup.codegen import compile as hidup_compile
    from hidup.codegen import reshard as R
    from hidup.codegen.params import full_grad_dict

    warnings.simplefilter("ignore")
    model, inputs = M.build("gpt", world_size=world, dtype=torch.float64, **SMALL)
    graph = trace(model, inputs, world_size=world, mesh=(2, 2))
    out = {}
    # (duplication, torch.compile backend): eager with duplication off and on, aot_eager without
    for dup, backend in ((False, False), (True, False), (False, "aot_eager")):
        plan = forced(graph, hidup.profiler.load(PROFILE), ("fsdp", "data"), duplication=dup)
        torch._dynamo.reset()
        runs = {}
        for reshard in (False, True):
            model, inputs = M.build("gpt", world_size=world, dtype=torch.float64, **SMALL)
            module = hidup_compile(model, plan, rank, world, inputs, duplication=dup, reshard=reshard, compile=backend)
            saved = _saved_bytes(module, inputs, autocast=False)
            loss = module(*inputs)
            gc.collect()
            alive = R.registered()
            loss.backward()
            calls = sum(isinstance(m, R.ReshardCall) for m in module.modules())
            runs[reshard] = (float(module.global_loss(loss)), full_grad_dict(module), calls, alive, saved)
        plain, again = runs[False], runs[True]
        out[dup, backend] = (
            plain[0],
            again[0],
            max(float((again[1][k] - plain[1][k]).abs().max()) for k in plain[1]),
            again[2],
            again[3],
            plain[4] - again[4],
        )
    return out


def test_mesh_plan_reshards_exactly():
    """FSDP on axis 0 of a 2x2 mesh (weights stored split there, gathered on the axis-0 groups), data
    parallel on axis 1: resharded, the same loss and gradients as the plain plan on every rank, and the
    backward keeps less; under torch.compile (aot_eager) the same values as eager and the same saving."""
    for rank, res in enumerate(run_distributed(_rank_mesh, 4, timeout=900, pg_timeout=120)):
        eager_drop = res[False, False][5]
        assert eager_drop > 0, (rank, res)
        for (dup, backend), (plain, loss, grad_diff, calls, alive, drop) in res.items():
            assert calls > 0 and alive == 0, (rank, dup, calls, alive)
            # each duplicated copy gathers (and keeps, unless resharded) its own copies
            assert drop == eager_drop * (2 if dup else 1), (rank, dup, backend, drop, eager_drop)
            if backend:
                assert abs(loss - plain) <= _tol("gpt") * abs(plain) and grad_diff <= _tol("gpt"), (rank, loss, plain)
            else:
                assert loss == plain and grad_diff == 0.0, (rank, dup, plain, loss, grad_diff)


# ------------------------------------------------------------------------------------------------ memory


@pytest.fixture
def fake_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("layers", [(), ("trunk.layers.0",)])
def test_memory_model_counts_what_is_kept(fake_group, layers):
    """What autograd keeps with reshard on is what the memory model counts, to the byte; it is less than
    without, by the gathered weights the backward kept (float64: every matmul and norm keeps its weight)."""
    from hidup.codegen import compile as hidup_compile

    warnings.simplefilter("ignore")
    model, inputs = M.build("gpt", world_size=2, dtype=torch.float64, **SMALL)
    graph = trace(model, inputs, world_size=2)
    plan = forced(graph, hidup.profiler.load(PROFILE), "fsdp", duplication=False)
    split = _stored_split(graph, plan)
    measured = {}
    for reshard in (False, True):
        model, inputs = M.build("gpt", world_size=2, dtype=torch.float64, **SMALL)
        module = hidup_compile(model, plan, 0, 2, inputs, duplication=False, recompute=list(layers), reshard=reshard)
        measured[reshard] = _saved_bytes(module, inputs, autocast=False)
    plain = MemoryModel(graph, recompute=frozenset(layers)).plan_activation_parts(plan.choices)
    resh = MemoryModel(graph, recompute=frozenset(layers), reshard=frozenset(split)).plan_activation_parts(plan.choices)
    assert plain["kept"] + plain["layer_inputs"] == measured[False], (plain, measured)
    assert resh["kept"] + resh["layer_inputs"] == measured[True], (resh, measured)
    # a recomputed layer's backward runs its region again, gathered copies included, resharded or not
    assert resh["recomputed"] == plain["recomputed"], (resh, plain)
    # the saving is the gathered weights the backward kept outside the recomputed layers: every linear's
    # weight (the embeddings' gathered copies are not saved: a lookup and an add keep no weight) and every
    # layer norm's weight and bias, whole (float64)
    recomputed = tuple(label.replace(".", "_") + "_" for label in layers)

    def kept(name: str, shape) -> bool:
        if name.startswith(recomputed):
            return False
        return ("_ln" in name or "norm" in name) or (len(shape) == 2 and name not in ("tok_weight", "pos"))

    weights = sum(
        graph.tensors[n.outputs[0]].nbytes
        for n in graph.nodes
        if n.name in split and kept(n.name, graph.tensors[n.outputs[0]].shape)
    )
    assert measured[False] - measured[True] == weights, (measured, weights)


def test_memory_model_counts_what_is_kept_under_autocast(fake_group):
    """bf16 autocast: a linear keeps its bf16 cast of the weight (an activation of its node, resharded or
    not), a layer norm the gathered float32 weight and bias, which resharding drops; counted to the byte."""
    from hidup.codegen import compile as hidup_compile

    warnings.simplefilter("ignore")
    model, inputs = M.build("gpt", world_size=2, **SMALL)
    graph = trace(model, inputs, world_size=2)
    plan = forced(graph, hidup.profiler.load(PROFILE), "fsdp", duplication=False, precision="bf16")
    split = _stored_split(graph, plan)
    measured = {}
    for reshard in (False, True):
        model, inputs = M.build("gpt", world_size=2, **SMALL)
        module = hidup_compile(model, plan, 0, 2, inputs, duplication=False, reshard=reshard)
        measured[reshard] = _saved_bytes(module, inputs, autocast=True)
    assert MemoryModel(graph, precision="bf16").plan_activations(plan.choices) == measured[False]
    resh = MemoryModel(graph, precision="bf16", reshard=frozenset(split)).plan_activations(plan.choices)
    assert resh == measured[True], (resh, measured)
    norms = sum(
        graph.tensors[n.outputs[0]].nbytes
        for n in graph.nodes
        if n.name in split and ("norm" in n.name or "_ln" in n.name)
    )
    assert measured[False] - measured[True] == norms, (measured, norms)


def test_a_copy_saved_through_a_view_is_not_kept(fake_group):
    """``x @ w.t()``: the matmul saves a view of w's gathered copy; resharded, neither is kept (the
    gathered copies of w and v are what the backward no longer holds; a's is never saved: its matmul
    reads the model input, which needs no gradient)."""
    from hidup.codegen import compile as hidup_compile
    from hidup.codegen.reshard import ReshardCall

    warnings.simplefilter("ignore")
    graph = trace(*_build("viewed", 2), world_size=2)
    plan = forced(graph, hidup.profiler.load(PROFILE), "fsdp", duplication=False)
    assert set(_stored_split(graph, plan)) == {"a", "w", "v"}
    measured = {}
    for reshard in (False, True):
        model, inputs = _build("viewed", 2)
        module = hidup_compile(model, plan, 0, 2, inputs, duplication=False, reshard=reshard)
        measured[reshard] = _saved_bytes(module, inputs, autocast=False)
    assert sum(isinstance(m, ReshardCall) for m in module.modules()) == 4  # a's, w's view, w's, v's readers
    assert measured[False] - measured[True] == (16 * 8 + 16 * 4) * 8, measured
    resh = MemoryModel(graph, reshard=frozenset({"a", "w", "v"})).plan_activations(plan.choices)
    assert resh == measured[True]


def test_hooks_pack_only_registered_unmodified_copies(fake_group):
    """A resharded op packs a handle for a saved view of a registered copy and hands everything else to
    the hooks around it; a copy written in place since it was made is kept as it is."""
    from hidup.codegen import collectives
    from hidup.codegen.reshard import ReshardCall, register
    from hidup.ir import FULL, gather

    shard = torch.nn.Parameter(torch.randn(4, 8))
    x = torch.randn(3, 8, requires_grad=True)
    seen = []

    def outer(t):
        seen.append(tuple(t.shape))
        return t

    for written in (False, True):
        full = register(collectives.all_gather(shard, 0), shard, gather(0), FULL, None)
        if written:
            full.mul_(1.0)
        seen.clear()
        with torch.autograd.graph.saved_tensors_hooks(outer, lambda t: t):
            y = ReshardCall(torch.mm)(x, full.t())
        # mm keeps both operands: x always reaches the outer hooks, the copy only once written in place
        assert sorted(seen) == ([(3, 8), (8, 8)] if written else [(3, 8)]), (written, seen)
        y.sum().backward()
        assert shard.grad is not None and shard.grad.shape == (4, 8)


def test_peak_sees_the_saving():
    """The fake-tensor peak of ``hidup peak`` runs the real program, resharding included: lower."""
    from hidup.frontend.trace import forward_inputs
    from hidup.runtime.peak import predict_peak

    warnings.simplefilter("ignore")
    cfg = dict(SMALL, d_model=64, ffn=256, batch_per_gpu=1, seq_len=4)
    model, inputs = M.build("gpt", world_size=2, **cfg)
    graph = trace(model, inputs, world_size=2)
    plan = forced(graph, hidup.profiler.load(PROFILE), "fsdp", duplication=False)
    peaks = {}
    for prefetch in (False, True):  # the program follows the plan's option (hidup.codegen.prefetch)
        plan.options["prefetch"] = prefetch
        for reshard in (False, True):
            plan.reshard = _stored_split(graph, plan) if reshard else []
            model, inputs = M.build("gpt", world_size=2, device="meta", **cfg)
            peaks[prefetch, reshard] = predict_peak(model, forward_inputs(model, inputs), plan, 0, "fp32", False)
    gathered = sum(graph.tensors[n.outputs[0]].nbytes for n in graph.nodes if n.name in plan.reshard)
    drop = peaks[False, False].total - peaks[False, True].total
    assert drop > 0.25 * gathered, (peaks, gathered)
    # prefetched, the rank holds two neighbouring layers' resharded copies at a time (forward and
    # backward), where it held one weight's: no more than the memory model's prefetch term above the plain
    # peak (on two layers that takes back what resharding saves; on a deep model it is three of many)
    extra = MemoryModel(graph).plan_prefetched(plan.choices, frozenset(plan.reshard))
    assert 0 < extra < gathered
    assert 0 < peaks[True, True].total - peaks[False, True].total <= extra, (peaks, extra)


# ------------------------------------------------------------------------------------------------ search


@pytest.fixture(scope="module")
def gpt_graph():
    warnings.simplefilter("ignore")
    model, inputs = M.build(
        "gpt", world_size=4, layers=4, d_model=64, heads=4, ffn=256, seq_len=64, batch_per_gpu=8, vocab=64
    )
    return trace(model, inputs, world_size=4)


def test_search_prices_resharding(gpt_graph):
    """The FSDP-style plan's memory holds the gathered weights its backward keeps (the memory model's
    whole-plan count of them); resharded, they are gone and each gather runs again in the backward."""
    profile = hidup.profiler.load(PROFILE)
    off = forced(gpt_graph, profile, "fsdp", duplication=False, reshard="off")
    split = _stored_split(gpt_graph, off)
    assert off.reshard == [] and split
    plain = MemoryModel(gpt_graph).plan_activations(off.choices)
    assert off.memory["activations"] == pytest.approx(plain, rel=1e-12)  # gathered copies included
    on = Plan.from_dict(json.loads(json.dumps(off.to_dict())))
    on.reshard = split
    assert Plan.from_dict(on.to_dict()).reshard == split and "reshard" not in off.to_dict()
    before, after = price(gpt_graph, profile, off)[False], price(gpt_graph, profile, on)[False]
    assert before.total == pytest.approx(off.predicted["total"], rel=1e-12)
    resh = MemoryModel(gpt_graph, reshard=frozenset(split)).plan_activations(off.choices)
    assert resh < plain
    assert after.memory["activations"] == pytest.approx(resh, rel=1e-12)
    assert after.memory["total"] == pytest.approx(before.memory["total"] - (plain - resh), rel=1e-12)
    # every gathered weight's forward collective runs again in its consumer's backward (blocking without
    # prefetch; with it, behind the next layer's backward: tests/test_prefetch.py); the forward as it was
    problem = Problem(gpt_graph, profile.launched(True, False))
    tids = {t for n in gpt_graph.nodes if n.name in split for t in n.outputs}
    blocking = (
        price(gpt_graph, profile, off, prefetch=False)[False],
        price(gpt_graph, profile, on, prefetch=False)[False],
    )
    for b, a in zip(*(ev.steps for ev in blocking)):
        extra = sum(problem.conversion(t, src, dst).fwd for t, _, src, dst in b.convs if t in tids)
        assert (a.fwd, a.bwd) == pytest.approx((b.fwd, b.bwd + extra), rel=1e-12, abs=1e-15)
    assert after.forward == pytest.approx(before.forward, rel=1e-12)
    assert after.backward > before.backward
    searched = forced(gpt_graph, profile, "fsdp", duplication=False, reshard="on")
    assert searched.reshard and set(searched.reshard) <= set(_stored_split(gpt_graph, searched))
    assert price(gpt_graph, profile, searched)[False].total == pytest.approx(searched.predicted["total"], rel=1e-12)
    assert "resharded after forward: %d parameters" % len(searched.reshard) in summary(searched, gpt_graph)


def test_search_reshards_only_under_a_budget_that_needs_it(gpt_graph):
    profile = hidup.profiler.load(PROFILE)
    # without prefetch, whose resharded copies in flight the budget's terms bound by a ceiling over every plan
    kw = dict(duplication=False, prefetch=False)
    off = forced(gpt_graph, profile, "fsdp", reshard="off", recompute="off", **kw)
    on = forced(gpt_graph, profile, "fsdp", reshard="on", recompute="off", **kw)
    assert on.memory["total"] < off.memory["total"]
    assert forced(gpt_graph, profile, "fsdp", **kw).reshard == []  # auto without a budget
    roomy = forced(gpt_graph, profile, "fsdp", memory_budget=off.memory["bound"], **kw)
    assert roomy.reshard == [] and roomy.recompute == []
    # the resharded plan fits by the search's terms (the sum with the transients' bound), the plain one misses
    # by its peak bound
    budget = (on.memory["bound"] + off.memory["peak"]) / 2
    assert on.memory["bound"] <= budget < off.memory["peak"]
    fit = forced(gpt_graph, profile, "fsdp", memory_budget=budget, **kw)
    assert fit.memory["peak"] <= budget
    assert fit.options["reshard_requested"] == "auto"
    # auto keeps the faster of the plans that fit: recomputing layers without resharding, or resharding
    recomputing = forced(gpt_graph, profile, "fsdp", memory_budget=budget, reshard="off", **kw)
    resharding = forced(gpt_graph, profile, "fsdp", memory_budget=budget, reshard="on", **kw)
    assert recomputing.recompute and not recomputing.reshard and resharding.reshard
    assert fit.predicted["total"] == min(recomputing.predicted["total"], resharding.predicted["total"])
    assert bool(fit.reshard) == (resharding.predicted["total"] < recomputing.predicted["total"])
    with pytest.raises(ValueError, match="reshard must be one of auto, on, off"):
        search(gpt_graph, profile, reshard="always")


def test_where_the_budget_is_met_by_its_price_a_plan_that_recomputes_is_priced_again_with_resharding(
    monkeypatch,
):
    """``reshard="auto"`` on a mesh where the budget is met by its price (a beam search on a large graph): a plan
    that fits by recomputing is not searched again with resharding on; its choices are priced with
    resharding and fewer recomputed layers, and the faster plan that fits is kept.  Resharding changes
    nothing inside a recomputed layer, so the per-node memory terms (no kept copy counted) that say how
    few layers may be recomputed are a bound: with fewer, the resharded plan does not fit."""
    from hidup.search import api, dp
    from hidup.search.api import _layer_order, _least, _whole, plan_indices
    from hidup.search.schedule import evaluate

    warnings.simplefilter("ignore")
    model, inputs = M.build(
        "gpt", world_size=4, layers=4, d_model=64, heads=4, ffn=256, seq_len=64, batch_per_gpu=8, vocab=64
    )
    gpt_graph = trace(model, inputs, mesh=(2, 2))
    profile = hidup.profiler.load(PROFILE)
    monkeypatch.setattr(dp, "PRICE_MIN_POSITIONS", 1)
    free = search(gpt_graph, profile, duplication=False)
    searched = []
    run = api._search_mesh

    def counted(graph, profile, opts, *args):
        searched.append(opts.reshard)
        return run(graph, profile, opts, *args)

    monkeypatch.setattr(api, "_search_mesh", counted)
    checked = 0
    for share in (0.6, 0.75, 0.9):
        budget = share * free.memory["bound"]  # the search's terms: the sum with the transients' bound
        searched.clear()
        plan = search(gpt_graph, profile, duplication=False, memory_budget=budget)
        assert searched == ["off"]
        off = search(gpt_graph, profile, duplication=False, memory_budget=budget, reshard="off")
        assert plan.memory["peak"] <= budget and plan.predicted["total"] <= off.predicted["total"]
        assert plan.options["reshard_requested"] == "auto"
        if not off.recompute:
            continue
        layers = sorted(off.recompute, key=_layer_order)
        opts = api.SearchOptions(duplication=False, memory_budget=budget, precision="fp32")
        least = _least(opts, api.Models(gpt_graph), off.choices, _whole(layers), len(layers))
        for k in range(least):
            problem = Problem(gpt_graph, profile.launched(True, False), recompute=frozenset(layers[:k]), reshard=True)
            ev = evaluate(problem, plan_indices(problem, off), False)
            assert ev.memory["bound"] > budget
            checked += 1
    assert checked


def test_cli_reshard_flag(tmp_path, capsys):
    """``hidup search --memory GB --reshard on`` under a budget the resharded plan meets writes a plan that
    reshards (and ``show`` says so); a bad ``--reshard`` value is one argparse message, exit 2.  (Under
    that budget ``auto`` finds a plan as lean by the search's terms without resharding, with its peak
    bound: the choice of ``auto`` is tested above.)"""
    from hidup.runtime.options import DEFAULT_PROFILE
    from test_cli_errors import TINY, one_message, run_cli, run_main

    warnings.simplefilter("ignore")
    model, inputs = M.build(
        "gpt", world_size=2, layers=1, d_model=32, heads=4, ffn=64, seq_len=8, batch_per_gpu=2, vocab=64
    )
    graph = trace(model, inputs, world_size=2)
    profile = hidup.profiler.load(DEFAULT_PROFILE)
    # without prefetch: on one layer its resharded copies in flight are all the weights
    lean = forced(graph, profile, "fsdp", reshard="on", recompute="off", prefetch=False)
    kept = forced(graph, profile, "fsdp", reshard="off", recompute="on", prefetch=False)
    assert lean.memory["bound"] < kept.memory["bound"]  # the search's terms: the sum with the transients' bound
    out = tmp_path / "plan.json"
    budget = f"{lean.memory['bound'] * 1.001 / 1e9:.9f}"
    argv = ["search", *TINY, "--world", "2", "--memory", budget, "--prefetch", "off", "--reshard", "on"]
    code, stdout, err = run_main([*argv, "--out", str(out)], capsys)
    assert code == 0, err
    plan = json.loads(out.read_text())
    assert plan["reshard"] and plan["options"]["reshard_requested"] == "on", plan["options"]
    assert plan["memory"]["peak"] <= float(budget) * 1e9
    assert "resharded after forward" in stdout
    code, stdout, _ = run_main(["show", str(out)], capsys)
    assert code == 0 and f"resharded after forward: {len(plan['reshard'])} parameters" in stdout
    # the saved plan runs on two gloo ranks and matches one device, and says that it reshards
    done = run_cli(["verify", "--plan", str(out), "--world", "2", "--steps", "2"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "OK: the plan matches the single-device model" in done.stdout
    assert f"{len(plan['reshard'])} parameters resharded" in done.stdout
    code, _, err = run_main(["search", *TINY, "--world", "2", "--reshard", "always", "--out", str(out)], capsys)
    assert code == 2
    one_message(err, "--reshard", "invalid choice: 'always'")


def test_bad_parameter_names_fail_clearly():
    from hidup.codegen import compile as hidup_compile

    warnings.simplefilter("ignore")
    model, inputs = M.build("gpt", world_size=1, **dict(SMALL, batch_per_gpu=2))
    plan = search(trace(model, inputs, world_size=1), hidup.profiler.load(PROFILE))
    plan.reshard = ["no_such_weight"]
    with pytest.raises(CompileError, match="reshard names parameters the model does not have: no_such_weight"):
        hidup_compile(model, plan, 0, 1, inputs)


def test_ilp_prices_resharding_and_shares_its_time_limit(gpt_graph, monkeypatch):
    """The ILP optimizes with the resharded gathers repeated in its objective (its plan is priced like
    the DP's); under a budget ``reshard="auto"`` may search a second time, within the one time limit."""
    pytest.importorskip("mip")
    from hidup.search import api

    profile = hidup.profiler.load(PROFILE)
    on = forced(gpt_graph, profile, "fsdp", algorithm="ilp", duplication=False, reshard="on", recompute="off")
    dp_on = forced(gpt_graph, profile, "fsdp", duplication=False, reshard="on", recompute="off")
    assert on.reshard and dp_on.reshard
    assert abs(on.predicted["total"] - dp_on.predicted["total"]) <= 0.02 * dp_on.predicted["total"]
    budget = 0.95 * search(gpt_graph, profile, reshard="off", recompute="off").memory["total"]
    calls = []
    real = api.ilp.optimize
    monkeypatch.setattr(api.ilp, "optimize", lambda *a, **k: calls.append(1) or real(*a, **k))
    try:
        search(gpt_graph, profile, algorithm="ilp", memory_budget=budget, time_limit=1e-9)
    except SearchError as e:
        assert "time limit" in str(e)
    assert len(calls) == 1  # the limit is spent: neither recomputation nor resharding searches again


def test_train_says_when_a_plan_reshards():
    from hidup.runtime.train import _recompute_text

    plan = Plan.from_dict(
        {**json.loads(json.dumps(_tiny_plan().to_dict())), "reshard": ["a", "b"], "recompute": ["trunk.layers.0"]}
    )
    assert _recompute_text(plan) == ", 1 layers recomputed in the backward, 2 parameters resharded after forward"
    plan.reshard = []
    assert "resharded" not in _recompute_text(plan)


def _tiny_plan() -> Plan:
    warnings.simplefilter("ignore")
    model, inputs = M.build("gpt", world_size=1, **dict(SMALL, batch_per_gpu=2))
    return search(trace(model, inputs, world_size=1), hidup.profiler.load(PROFILE))

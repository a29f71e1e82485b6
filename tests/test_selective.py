"""Selective recomputation: exact results, the ops it runs again, the memory it keeps, and the search's
choice of it (``codegen/recompute.py``, "Selective recomputation").

* Parity: on two gloo ranks, a zoo GPT with dropout 0.1 everywhere, every repeated layer recomputed
  selectively, gives the single device's loss and gradients (float64, the reference under
  :func:`hidup.rules.random.single_device`) to rounding: tensor (duplication on: its activations'
  form changes inside the regions are saved), FSDP-style (weights stored split, gathered again in the
  backward; duplication off), and the tensor plan under ``torch.compile`` (``aot_eager``: AOTAutograd
  partitions by the policy).
* What runs again: in the backward of a selective program the matmuls run exactly as often as without
  recomputation (their outputs are saved) and no activation form change runs; the whole-layer program
  runs the matmuls again.
* Memory: what the regions' policy saves (torch's selective-checkpoint storage) is exactly the memory
  model's ``selective`` part, what autograd keeps outside is ``kept + layer_inputs``; on a stack of
  layers, selective keeps less than none and more than whole.
* Search and plan: ``recompute="selective"`` recomputes every layer selectively; under a budget that
  selective recomputation meets, ``"auto"`` picks it, faster than whole layers; under a tighter budget
  a mix; the plan's JSON round-trips, an older plan loads, ``hidup show`` says so.
"""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hidup.models as M
import hidup.profiler
from dist_util import run_distributed
from hidup.codegen import CompileError
from hidup.frontend.trace import trace
from hidup.plan import Plan, summary
from hidup.rules import random as R
from hidup.search import forced, price, search
from hidup.search.api import repeated_layers
from hidup.search.memory import MemoryModel
from test_memory import _saved_bytes

PROFILE = "h200x4-nvlink"
SMALL = dict(layers=2, d_model=32, heads=4, ffn=64, seq_len=8, batch_per_gpu=4, vocab=64)
SEED = 3
# (plan style, duplication, torch.compile backend or False)
JOBS = [("tensor", True, False), ("fsdp", False, False), ("tensor", False, "aot_eager")]


def _build(world: int, dropout: float = 0.1):
    return M.build("gpt", world_size=world, dtype=torch.float64, dropout=dropout, **SMALL)


def _plan(graph, style: str, dup: bool):
    return forced(graph, hidup.profiler.load(PROFILE), style, duplication=dup)


def _rank_parity(rank, world):
    import torch._dynamo

    from hidup.codegen import compile as hidup_compile
    from hidup.codegen.params import full_grad_dict
    from hidup.codegen.recompute import Recomputed

    warnings.simplefilter("ignore")
    graph = trace(*_build(world), world_size=world)
    layers = sorted(repeated_layers(graph))
    out = {}
    for style, dup, backend in JOBS:
        torch._dynamo.reset()
        plan = _plan(graph, style, dup)
        model, inputs = _build(world)
        module = hidup_compile(
            model, plan, rank, world, inputs, duplication=dup, seed=SEED, recompute_selective=layers, compile=backend
        )
        loss = module(*inputs)
        loss.backward()
        loss, grads = float(module.global_loss(loss)), full_grad_dict(module)
        regions = [m for m in module.modules() if isinstance(m, Recomputed)]
        if rank:
            continue
        ref, ref_inputs = _build(world)
        with R.single_device(SEED, 0):
            ref_loss = ref(*ref_inputs)
        ref_loss.backward()
        out[(style, dup, backend)] = {
            "loss": loss,
            "ref": float(ref_loss),
            "no_dropout": float(_build(world, dropout=0.0)[0](*ref_inputs)),
            "vs_ref": max(float((grads[n] - p.grad).abs().max()) for n, p in ref.named_parameters()),
            "regions": (sum(m.selective for m in regions), len(regions)),
            "duplication": module.duplication,
            "kinds": sorted({s.kind for s in plan.choices.values()}),
        }
    return out


_RESULTS: dict = {}


def _results() -> dict:
    if not _RESULTS:
        _RESULTS.update(run_distributed(_rank_parity, 2, timeout=900)[0])
    return _RESULTS


@pytest.mark.parametrize("job", JOBS, ids=["-".join(map(str, j)) for j in JOBS])
def test_selective_program_is_exact(job):
    r = _results()[job]
    selective_regions, regions = r["regions"]
    assert selective_regions == regions >= 2, r["regions"]
    assert r["duplication"] == job[1]
    assert r["ref"] != r["no_dropout"], "the dropout drew nothing"
    # float64 throughout: the selective program matches the single device to rounding
    assert r["loss"] == pytest.approx(r["ref"], rel=1e-12), (r["loss"], r["ref"])
    assert r["vs_ref"] <= 1e-12, r["vs_ref"]
    assert (job[0] if job[0] != "fsdp" else "param") in r["kinds"], r["kinds"]


# ------------------------------------------------------------------------------------------------ what runs again


class _Ops(TorchDispatchMode):
    """Counts the ops that run (an op selective checkpointing returns from its storage does not)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.name()] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def fake_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _compiled(style: str, whole=(), selective=()):
    from hidup.codegen import compile as hidup_compile

    model, inputs = _build(2, dropout=0.0)
    graph = trace(model, inputs, world_size=2)
    plan = _plan(graph, style, False)
    module = hidup_compile(
        model, plan, 0, 2, inputs, duplication=False, recompute=list(whole), recompute_selective=list(selective)
    )
    return graph, plan, module, inputs


def _backward_ops(module, inputs) -> Counter:
    loss = module(*inputs)
    with _Ops() as ops:
        loss.backward()
    return ops.counts


def test_selective_backward_runs_no_matmul_and_no_collective_again(fake_group):
    warnings.simplefilter("ignore")
    layers = sorted(repeated_layers(_compiled("tensor")[0]))
    plain = _backward_ops(*_compiled("tensor")[2:])
    sel = _backward_ops(*_compiled("tensor", selective=layers)[2:])
    whole = _backward_ops(*_compiled("tensor", whole=layers)[2:])
    matmuls = ("aten::mm", "aten::addmm")
    assert sum(sel[m] for m in matmuls) == sum(plain[m] for m in matmuls) > 0, (sel, plain)
    assert sum(whole[m] for m in matmuls) > sum(plain[m] for m in matmuls)
    assert sel["hidup::convert_kept"] == 0 and plain["hidup::convert_kept"] == 0
    assert sel["aten::native_layer_norm"] > plain["aten::native_layer_norm"] == 0  # the norms run again
    # the attention kernel's outputs are saved; its backward runs once per layer either way
    attention = [k for k in sel if k.startswith("aten::_scaled_dot_product") and "backward" not in k]
    assert not attention, attention


# ------------------------------------------------------------------------------------------------ memory


@pytest.mark.parametrize("style", ["data", "tensor", "fsdp"])
def test_memory_model_counts_what_selective_recomputation_keeps(fake_group, monkeypatch, style):
    """torch's selective-checkpoint storage holds exactly the model's ``selective`` part (matmul and
    attention outputs, the tensor plan's activation form changes; the FSDP-style plan's gathered
    weights are not kept), autograd outside the regions exactly ``kept + layer_inputs``."""
    import hidup.codegen.recompute as recompute

    warnings.simplefilter("ignore")
    storages = []
    make = recompute._SELECTIVE_CONTEXT

    def recording():
        forward, again = make()
        storages.append(forward.storage)
        return forward, again

    monkeypatch.setattr(recompute, "_SELECTIVE_CONTEXT", recording)
    graph = _compiled(style)[0]
    layers = repeated_layers(graph)
    _, plan, module, inputs = _compiled(style, selective=sorted(layers))
    outside = _saved_bytes(module, inputs, autocast=False)
    kept = {}
    for storage in storages:
        for entries in storage.values():
            for leaf in torch.utils._pytree.tree_leaves(list(entries.values())):
                value = getattr(leaf, "val", None)
                if isinstance(value, torch.Tensor):
                    kept[value.untyped_storage()._cdata] = value.untyped_storage().nbytes()
    parts = MemoryModel(graph, selective=layers).plan_activation_parts(plan.choices)
    assert parts["kept"] + parts["layer_inputs"] == outside, (parts, outside)
    assert parts["selective"] == sum(kept.values()) > 0, (parts, kept)


# ------------------------------------------------------------------------------------------------ search


@pytest.fixture(scope="module")
def wide_graph():
    """A GPT whose matmuls dominate a layer's forward: selective recomputation is cheap there."""
    warnings.simplefilter("ignore")
    model, inputs = M.build(
        "gpt", world_size=2, layers=4, d_model=128, heads=4, ffn=512, seq_len=256, batch_per_gpu=8, vocab=64
    )
    return trace(model, inputs, world_size=2)


def test_search_picks_selective_recomputation_where_it_fits(wide_graph):
    profile = hidup.profiler.load(PROFILE)
    kw = dict(duplication=False, compiled=True)
    layers = [f"trunk.layers.{i}" for i in range(4)]
    off = search(wide_graph, profile, recompute="off", **kw)
    on = search(wide_graph, profile, recompute="on", **kw)
    sel = search(wide_graph, profile, recompute="selective", **kw)
    assert sel.recompute == [] and sel.recompute_selective == layers
    assert on.memory["activations"] < sel.memory["activations"] < off.memory["activations"]
    # the same choices counted three ways: selective keeps less than none and more than whole layers
    counts = [
        MemoryModel(wide_graph, **kw).plan_activations(off.choices)
        for kw in ({}, {"selective": frozenset(layers)}, {"recompute": frozenset(layers)})
    ]
    assert counts[0] > counts[1] > counts[2], counts
    assert off.predicted["total"] < sel.predicted["total"] < on.predicted["total"]

    # budgets on the search's terms (plan.memory["bound"]: the sum with the transients' bound)
    fit = search(wide_graph, profile, memory_budget=sel.memory["bound"], **kw)  # selective meets it
    assert fit.recompute_selective and not fit.recompute, (fit.recompute, fit.recompute_selective)
    assert fit.memory["bound"] <= sel.memory["bound"] and fit.memory["peak"] <= sel.memory["bound"]
    assert fit.predicted["total"] <= sel.predicted["total"] < on.predicted["total"]

    budget = 0.85 * off.memory["bound"]  # more than every layer recomputed selectively saves
    mixed = search(wide_graph, profile, memory_budget=budget, **kw)
    assert mixed.memory["peak"] <= budget
    assert mixed.recompute and mixed.recompute_selective, (mixed.recompute, mixed.recompute_selective)
    assert not set(mixed.recompute) & set(mixed.recompute_selective)
    assert mixed.predicted["total"] < on.predicted["total"]

    again = Plan.from_dict(mixed.to_dict())
    assert (again.recompute, again.recompute_selective) == (mixed.recompute, mixed.recompute_selective)
    priced = price(wide_graph, profile, mixed, compiled=True)[mixed.duplication]
    assert priced.total == pytest.approx(mixed.predicted["total"], rel=1e-12)
    assert priced.memory["total"] == pytest.approx(mixed.memory["total"], rel=1e-12)
    text = summary(mixed, wide_graph)
    assert f"recomputed selectively in the backward: {len(mixed.recompute_selective)} layers" in text


def test_older_plans_load_and_bad_lists_fail_clearly(wide_graph, fake_group):
    profile = hidup.profiler.load(PROFILE)
    plan = search(wide_graph, profile, recompute="off", duplication=False)
    d = plan.to_dict()
    assert "recompute_selective" not in d  # a plan that recomputes nothing selectively writes what it did
    assert Plan.from_dict(d).recompute_selective == []
    with pytest.raises(ValueError, match="recompute must be one of auto, on, selective, off"):
        search(wide_graph, profile, recompute="sometimes")
    from hidup.codegen import compile as hidup_compile

    model, inputs = _build(2, dropout=0.0)
    graph = trace(model, inputs, world_size=2)
    small = _plan(graph, "data", False)
    small.recompute, small.recompute_selective = ["trunk.layers.0"], ["trunk.layers.0"]
    with pytest.raises(CompileError, match="layers recomputed both whole and selectively: trunk.layers.0"):
        hidup_compile(model, small, 0, 2, inputs, duplication=False)
    small.recompute, small.recompute_selective = [], ["blocks.3"]
    with pytest.raises(CompileError, match="recompute_selective names layers the model does not have: blocks.3"):
        hidup_compile(model, small, 0, 2, inputs, duplication=False)

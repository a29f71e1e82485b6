"""ZeRO-1 and ZeRO-2 (``plan.zero``, :mod:`hidup.codegen.zero`): exact training, checkpoints, the plan record.

* Parity: on two gloo ranks, the zoo GPT (float64) under a data plan (every weight replicated) and a
  tensor plan (the norms and embeddings replicated), ZeRO stage 0, 1 and 2, duplication off and on:
  three Adam steps give the single device's losses, gradients (the whole gradient, gathered from the
  ranks' rows under ZeRO-2) and updated weights, and exactly those of the same plan without ZeRO.  The
  optimizer holds only the rows (its moments are ``1/N`` of the parameters'), and under ZeRO-2 no
  whole gradient is left after the backward.
* Checkpoints: a ZeRO-2 run saved after two steps resumes into ZeRO-2, into a plan without ZeRO and
  into ZeRO-1 (and a plain checkpoint into ZeRO-2), each continuing exactly as the uninterrupted run.
* The plan record: ``zero`` survives a JSON round trip, a file without it loads with none, a bad
  entry fails with one message; ``hidup show`` prints it; a parameter whose rows the world does not
  divide stays unsplit; a mesh plan with ZeRO is refused by name.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import hidup.models as M
import hidup.profiler
from dist_util import adam_reference, max_diff, run_distributed
from hidup.codegen import CompileError
from hidup.codegen.zero import zero_stages
from hidup.frontend.trace import trace
from hidup.ir import zero_splits
from hidup.plan import Plan, PlanError, summary
from hidup.search import forced

PROFILE = "h200x4-nvlink"
SMALL = dict(layers=1, d_model=16, heads=2, ffn=32, seq_len=4, batch_per_gpu=2, vocab=32)
STEPS, LR = 3, 1e-2
# (plan style, ZeRO stage, duplication)
JOBS = [(style, stage, dup) for style in ("data",) for stage in (0, 1, 2) for dup in (False, True)] + [
    ("tensor", 0, False),
    ("tensor", 2, False),
]


def _build(world: int):
    return M.build("gpt", world_size=world, dtype=torch.float64, **SMALL)


def _steps(module, inputs, opt, zero_module=True) -> dict:
    """``STEPS`` Adam steps of a compiled module: losses, whole gradients per step, final weights."""
    from hidup.codegen.params import full_grad_dict, full_state_dict

    losses, grads, whole_grads_left = [], [], []
    for _ in range(STEPS):
        loss = module(*inputs)
        loss.backward()
        losses.append(float(module.global_loss(loss)))
        whole_grads_left.append(sum(z.param.grad is not None for z in module.zero.slices.values()))
        grads.append(full_grad_dict(module))
        opt.step()
        opt.zero_grad(set_to_none=True)
        module.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads, "weights": full_state_dict(module), "left": whole_grads_left}


def _compiled(plan, rank, world, stage, dup):
    from hidup.codegen import compile as hidup_compile

    model, inputs = _build(world)
    module = hidup_compile(model, plan, rank, world, inputs, duplication=dup, zero=stage)
    opt = module.bind_optimizer(torch.optim.Adam(module.optimizer_parameters(), lr=LR))
    return module, inputs, opt


def _state_numel(opt) -> int:
    return sum(v.numel() for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)


def _rank_parity(rank, world):
    warnings.simplefilter("ignore")
    graph = trace(*_build(world), world_size=world)
    out = {}
    for job in JOBS:
        style, stage, dup = job
        plan = forced(graph, hidup.profiler.load(PROFILE), style, duplication=dup)
        module, inputs, opt = _compiled(plan, rank, world, stage, dup)
        run = _steps(module, inputs, opt)
        run["split"] = {path: z.stage for path, z in module.zero.slices.items()}
        run["state"] = _state_numel(opt)
        run["params"] = sum(p.numel() for p in module.parameters())
        run["duplication"] = module.duplication
        out[job] = run
    out["checkpoints"] = _rank_checkpoints(rank, world, graph)
    return out


def _rank_checkpoints(rank, world, graph):
    """Resume a two-step run from its checkpoint under another ZeRO stage; the third step's loss and
    the final weights, with those of the uninterrupted runs."""
    import tempfile

    from hidup.codegen.params import full_state_dict
    from hidup.runtime import checkpoint

    plan = forced(graph, hidup.profiler.load(PROFILE), "data", duplication=False)
    folder = tempfile.mkdtemp() if rank == 0 else None
    box = [folder]
    torch.distributed.broadcast_object_list(box, src=0)
    folder = box[0]
    out = {}
    for saved in (2, 0):
        module, inputs, opt = _compiled(plan, rank, world, saved, False)
        for _ in range(2):
            module(*inputs).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            module.zero_grad(set_to_none=True)
        checkpoint.save(f"{folder}/ck{saved}", module, opt, step=2)
        for resumed in (2, 0, 1) if saved == 2 else (2,):
            again, inputs, opt2 = _compiled(plan, rank, world, resumed, False)
            checkpoint.load(f"{folder}/ck{saved}", again, opt2)
            loss = again(*inputs)
            loss.backward()
            opt2.step()
            out[saved, resumed] = (float(again.global_loss(loss)), full_state_dict(again))
    return out


def _reference() -> dict:
    """The single device's ``STEPS`` Adam steps."""
    return adam_reference(*_build(2), STEPS, LR)


_RESULTS: dict = {}


def _results() -> tuple[dict, dict]:
    if not _RESULTS:
        _RESULTS["ranks"] = run_distributed(_rank_parity, 2, timeout=600)
        _RESULTS["ref"] = _reference()
    return _RESULTS["ranks"][0], _RESULTS["ref"]


@pytest.mark.parametrize("job", JOBS, ids=[f"{s}-zero{z}-dup{int(d)}" for s, z, d in JOBS])
def test_zero_trains_exactly(job):
    rank0, ref = _results()
    run, plain = rank0[job], rank0[(job[0], 0, job[2])]
    style, stage, dup = job
    assert run["duplication"] == dup
    # which parameters are split: every replicated one under the data plan (all rows divide by 2)
    if stage:
        assert run["split"] and set(run["split"].values()) == {stage}, run["split"]
        # the optimizer's moments cover this rank's rows only
        assert run["state"] < plain["state"], (run["state"], plain["state"])
    else:
        assert run["split"] == {}
    if style == "data" and stage:
        assert run["state"] * 2 == plain["state"], (run["state"], plain["state"])
    # ZeRO-2 leaves no whole gradient after the backward; ZeRO-1 keeps the all-reduced one
    assert all(n == 0 for n in run["left"]) if stage != 1 else all(n > 0 for n in run["left"]), run["left"]
    # exactly the plan without ZeRO: losses, gradients at every step, weights after the last
    assert run["losses"] == plain["losses"]
    for g, p in zip(run["grads"], plain["grads"]):
        assert set(g) == set(p) and max_diff(g, p) == 0.0
    assert max_diff(run["weights"], plain["weights"]) == 0.0
    # and the single device's, to rounding
    for a, b in zip(run["losses"], ref["losses"]):
        assert abs(a - b) <= 1e-12 * abs(b)
    for g, r in zip(run["grads"], ref["grads"]):
        assert max_diff(g, r) <= 1e-12
    # (Adam divides by the root of the second moment: a gradient's rounding moves a weight by more)
    assert max_diff(run["weights"], ref["weights"]) <= 1e-9


@pytest.mark.parametrize("saved,resumed", [(2, 2), (2, 0), (2, 1), (0, 2)])
def test_checkpoint_resumes_across_zero_stages(saved, resumed):
    rank0, _ = _results()
    ck = rank0["checkpoints"]
    loss, weights = ck[saved, resumed]
    # the uninterrupted run's third step (every stage trains exactly as the plan without ZeRO)
    plain = rank0[("data", 0, False)]
    assert loss == plain["losses"][2]
    assert max_diff(weights, plain["weights"]) == 0.0


# ------------------------------------------------------------------------------------------------ plans
@pytest.fixture(scope="module")
def gpt_plan():
    graph = trace(*_build(2), world_size=2)
    return graph, forced(graph, hidup.profiler.load(PROFILE), "data", duplication=False)


def test_plan_record_round_trip(gpt_plan, tmp_path):
    graph, plan = gpt_plan
    params = [n.name for n in graph.nodes if n.op == "param"]
    plan.zero = {params[0]: 2, params[1]: 1}
    again = Plan.load(plan.save(tmp_path / "p.json"))
    assert again.zero == plan.zero
    text = summary(again, graph)
    assert "ZeRO-2: 1 replicated parameters" in text and "ZeRO-1: 1 replicated parameters" in text
    d = json.loads((tmp_path / "p.json").read_text())
    del d["zero"]  # a file written before ZeRO
    assert Plan.from_dict(d).zero == {}
    d["zero"] = {params[0]: 3}
    with pytest.raises(PlanError, match="'zero' must map parameter names to a ZeRO stage"):
        Plan.from_dict(d)
    plan.zero = {}


def test_rows_the_world_does_not_divide_stay_unsplit():
    assert zero_splits((6, 4), 2) and zero_splits((6,), 3)
    assert not zero_splits((5, 4), 2) and not zero_splits((), 2) and not zero_splits((4, 4), 1)
    assert zero_stages({"a": 2, "b": 1, "c": 2}, {"a": (4, 3), "b": (3, 4)}, 2) == {"a": 2}


def test_bad_zero_requests_fail_clearly(gpt_plan):
    from hidup.codegen import compile as hidup_compile

    graph, plan = gpt_plan
    model, inputs = _build(1)
    with pytest.raises(CompileError, match="zero names parameters the model does not have: nope"):
        hidup_compile(
            model, forced(trace(model, inputs), hidup.profiler.load(PROFILE), "data"), 0, 1, inputs, zero={"nope": 1}
        )
    with pytest.raises(CompileError, match="zero='x': give 0, 1 or 2"):
        hidup_compile(model, forced(trace(model, inputs), hidup.profiler.load(PROFILE), "data"), 0, 1, inputs, zero="x")


# ------------------------------------------------------------------------------- memory, cost and search
@pytest.fixture(scope="module")
def world4():
    """A small GPT traced for 4 ranks (on meta: no weights) and its data plans with ZeRO off, 1 and 2."""
    model, inputs = M.build(
        "gpt",
        world_size=4,
        device="meta",
        layers=2,
        d_model=64,
        heads=4,
        ffn=128,
        seq_len=16,
        batch_per_gpu=4,
        vocab=256,
    )
    graph = trace(model, inputs, world_size=4)
    profile = hidup.profiler.load(PROFILE)
    plans = {
        z: forced(graph, profile, "data", duplication=False, zero=z, recompute="off", reshard="off")
        for z in ("off", "1", "2")
    }
    return graph, profile, plans


def _param_bytes(graph) -> float:
    from hidup.search.memory import MemoryModel

    nbytes = MemoryModel(graph).nbytes
    return sum(nbytes[t] for n in graph.nodes if n.op == "param" for t in n.outputs if graph.tensors[t].requires_grad)


def test_memory_model_counts_the_rows(world4):
    graph, _, plans = world4
    off, one, two = plans["off"].memory, plans["1"].memory, plans["2"].memory
    b, n = _param_bytes(graph), 4
    params = [x.name for x in graph.nodes if x.op == "param" and graph.tensors[x.outputs[0]].requires_grad]
    # every weight of this model has rows 4 divides: all split, at the plan's stage
    assert plans["off"].zero == {} and plans["1"].zero == dict.fromkeys(params, 1)
    assert plans["2"].zero == dict.fromkeys(params, 2)
    assert off["params"] == one["params"] == two["params"] == pytest.approx(b)
    assert off["grads"] == one["grads"] == pytest.approx(b) and two["grads"] == pytest.approx(b / n)
    assert off["optimizer"] == pytest.approx(2 * b) and one["optimizer"] == two["optimizer"] == pytest.approx(2 * b / n)
    assert off["activations"] == one["activations"] == two["activations"]
    # saved per rank: ZeRO-1 3/4 of Adam's state, ZeRO-2 also 3/4 of the gradients
    assert off["total"] - one["total"] == pytest.approx(2 * b * (1 - 1 / n))
    assert off["total"] - two["total"] == pytest.approx(3 * b * (1 - 1 / n))


def test_cost_model_prices_the_collectives_and_the_step(world4):
    from hidup.search.cost import CostModel

    graph, profile, plans = world4
    off, one, two = (plans[z].predicted for z in ("off", "1", "2"))
    launched = profile.launched(True, False)
    b, n = _param_bytes(graph), 4
    # the optimizer steps a quarter of the bytes
    assert off["optimizer"] == pytest.approx(launched.optimizer_time(b))
    assert one["optimizer"] == two["optimizer"] == pytest.approx(launched.optimizer_time(b / n))
    # after it, each split weight's rows are all-gathered, exposed
    cost = CostModel(graph, launched, zero=2)
    gathers = sum(
        cost.zero_share("all_gather", cost.nbytes[t]) for x in graph.nodes if x.op == "param" for t in x.outputs
    )
    assert "zero_gather" not in off and one["zero_gather"] == two["zero_gather"] == pytest.approx(gathers)
    # ZeRO-1 all-reduces as before; ZeRO-2 reduce-scatters instead, overlapped with the backward
    assert one["backward"] == off["backward"] and one["comm"] == off["comm"]
    assert two["backward"] != off["backward"]
    for p in (one, two):
        assert p["total"] == pytest.approx(p["forward"] + p["backward"] + p["optimizer"] + p["zero_gather"])
        assert p["total"] > off["total"]  # ZeRO never pays without a budget
    # the record prices again to the same numbers
    from hidup.search import price

    assert price(graph, profile, plans["2"])[False].total == pytest.approx(two["total"], rel=1e-12)


def test_search_uses_zero_only_under_a_budget_that_needs_it(world4):
    graph, profile, plans = world4
    free = forced(graph, profile, "data", duplication=False, recompute="off", reshard="off")
    assert free.zero == {} and free.options["zero_requested"] == "auto"
    # ZeRO-2's plan fits by the search's terms (the sum with the transients' bound), the plain one misses by its
    # peak bound
    budget = (plans["2"].memory["bound"] + plans["off"].memory["peak"]) / 2
    assert plans["2"].memory["bound"] <= budget < plans["off"].memory["peak"]
    fit = forced(graph, profile, "data", duplication=False, recompute="off", reshard="off", memory_budget=budget)
    assert fit.memory["peak"] <= budget and set(fit.zero.values()) == {2}
    assert fit.predicted["total"] == pytest.approx(plans["2"].predicted["total"])
    # beside recomputation, auto keeps the faster plan that fits: one that recomputes layers, or ZeRO-2's
    rec = forced(graph, profile, "data", duplication=False, recompute="on", reshard="off", zero="off")
    # (on this model a budget the recomputed plan meets by the search's terms is met by the plain plan's peak
    # bound: auto then keeps the plain plan, no slower than either lever)
    budget = (rec.memory["bound"] + plans["off"].memory["bound"]) / 2
    both = forced(graph, profile, "data", duplication=False, memory_budget=budget)
    recomputing = forced(graph, profile, "data", duplication=False, memory_budget=budget, zero="off")
    zeroing = forced(graph, profile, "data", duplication=False, memory_budget=budget, zero="2")
    assert not zeroing.recompute and zeroing.zero
    assert both.memory["peak"] <= budget and recomputing.memory["peak"] <= budget
    assert both.predicted["total"] <= min(recomputing.predicted["total"], zeroing.predicted["total"])
    with pytest.raises(ValueError, match="zero must be one of auto, off, 1, 2"):
        forced(graph, profile, "data", zero="3")


def test_cli_zero_flags(tmp_path, capsys):
    """``hidup search --zero 2`` writes a plan whose weights ZeRO splits, ``show`` says so, ``train`` runs it
    on two gloo ranks with the loss of ``--zero off``; a bad value is one argparse message, exit 2."""
    from test_cli_errors import TINY, one_message, run_main

    warnings.simplefilter("ignore")
    out = tmp_path / "plan.json"
    code, stdout, err = run_main(["search", *TINY, "--world", "2", "--zero", "2", "--out", str(out)], capsys)
    assert code == 0, err
    plan = json.loads(out.read_text())
    assert plan["zero"] and set(plan["zero"].values()) == {2} and "ZeRO-2:" in stdout
    losses = {}
    for zero in ("auto", "off"):
        result = tmp_path / f"{zero}.json"
        argv = ["train", "--plan", str(out), "--world", "2", "--iterations", "2", "--zero", zero, "--json", str(result)]
        code, stdout, err = run_main(argv, capsys)
        assert code == 0, err
        done = json.loads(result.read_text())
        assert done["zero"] == ([2] if zero == "auto" else []), done["zero"]
        losses[zero] = done["losses"]
    assert losses["auto"] == losses["off"]
    code, _, err = run_main(["search", *TINY, "--world", "2", "--zero", "3", "--out", str(out)], capsys)
    assert code == 2
    one_message(err, "--zero", "invalid choice: '3'")


def test_a_mesh_plan_with_zero_is_refused_by_name():
    from types import SimpleNamespace

    from hidup.codegen.program import _zero_request
    from hidup.search import SearchError, search

    warnings.simplefilter("ignore")
    traced = SimpleNamespace(graph=SimpleNamespace(mesh=(2, 2)))
    with pytest.raises(CompileError, match="ZeRO splits a replicated parameter over the ranks of one axis"):
        _zero_request(traced, None, 2, {"w"})
    assert _zero_request(traced, None, 0, {"w"}) == {}
    model, inputs = M.build("gpt", world_size=4, device="meta", **SMALL)
    graph = trace(model, inputs, world_size=4, mesh=(2, 2))
    with pytest.raises(SearchError, match="zero=2: ZeRO splits replicated weights over the ranks of one axis"):
        search(graph, hidup.profiler.load(PROFILE), zero="2")

"""Optimizer offload (``plan.offload``, :mod:`hidup.codegen.offload`): exact training, checkpoints, the price.

* Parity: on two gloo ranks, the zoo GPT (float64) under a data plan, the optimizer offloaded to the
  host alone, with duplication, and with ZeRO-2 and every layer recomputed together: three Adam steps
  give the single device's losses, gradients and updated weights, and without duplication exactly those
  of the same plan without offload.  The optimizer holds only host copies (under ZeRO, of the rows).
* Checkpoints: an offloaded run saved after two steps resumes without offload and with it (the host
  copies made the loaded weights), each continuing exactly as the uninterrupted run.
* The plan record, the memory and cost models, the search (offload only when nothing else fits, and a
  line saying so), the profile's fields (and a document without them), and the command line.
"""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch

import hidup.models as M
import hidup.profiler
from dist_util import adam_reference, max_diff, run_distributed
from hidup.codegen import CompileError
from hidup.frontend.trace import trace
from hidup.plan import Plan, PlanError, summary
from hidup.search import SearchError, forced, search
from hidup.search.api import repeated_layers

PROFILE = "h200x4-nvlink"
SMALL = dict(layers=1, d_model=16, heads=2, ffn=32, seq_len=4, batch_per_gpu=2, vocab=32)
STEPS, LR = 3, 1e-2
# (offload, duplication, ZeRO stage, recompute every layer)
PLAIN = ("off", False, 0, False)
OFFLOADED = [("optimizer", False, 0, False), ("optimizer", True, 0, False), ("optimizer", False, 2, True)]
JOBS = [PLAIN, *OFFLOADED]


def _build(world: int):
    return M.build("gpt", world_size=world, dtype=torch.float64, **SMALL)


def _compiled(plan, rank, world, job, layers):
    from hidup.codegen import compile as hidup_compile

    offload, dup, zero, recompute = job
    model, inputs = _build(world)
    module = hidup_compile(
        model,
        plan,
        rank,
        world,
        inputs,
        duplication=dup,
        zero=zero,
        offload=offload,
        recompute=layers if recompute else [],
    )
    opt = module.bind_optimizer(torch.optim.Adam(module.optimizer_parameters(), lr=LR))
    return module, inputs, opt


def _steps(module, inputs, opt, steps=STEPS) -> dict:
    from hidup.codegen.params import full_grad_dict, full_state_dict

    losses, grads = [], []
    for _ in range(steps):
        loss = module(*inputs)
        loss.backward()
        losses.append(float(module.global_loss(loss)))
        grads.append(full_grad_dict(module))
        opt.step()
        opt.zero_grad(set_to_none=True)
        module.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads, "weights": full_state_dict(module)}


def _rank_parity(rank, world):
    warnings.simplefilter("ignore")
    graph = trace(*_build(world), world_size=world)
    layers = sorted(repeated_layers(graph))
    plan = forced(graph, hidup.profiler.load(PROFILE), "data", duplication=False)
    out = {}
    for job in JOBS:
        module, inputs, opt = _compiled(plan, rank, world, job, layers)
        run = _steps(module, inputs, opt)
        held = [p for g in opt.param_groups for p in g["params"]]
        run["host"] = all(p.device.type == "cpu" for p in held) and (
            module.offload is None or {id(p) for p in held} <= {id(c.host) for c in module.offload.copies}
        )
        run["offloaded"] = module.offload is not None
        run["held"] = sum(p.numel() for p in held)
        run["params"] = sum(p.numel() for p in module.parameters())
        run["duplication"] = module.duplication
        out[job] = run
    out["checkpoints"] = _rank_checkpoints(rank, world, plan, layers)
    return out


def _rank_checkpoints(rank, world, plan, layers):
    """A run with the optimizer offloaded, saved after two steps, resumed without offload and with it; the
    third step's loss and the final weights of each."""
    import tempfile

    from hidup.codegen.params import full_state_dict
    from hidup.runtime import checkpoint

    folder = [tempfile.mkdtemp() if rank == 0 else None]
    torch.distributed.broadcast_object_list(folder, src=0)
    module, inputs, opt = _compiled(plan, rank, world, OFFLOADED[0], layers)
    _steps(module, inputs, opt, steps=2)
    checkpoint.save(f"{folder[0]}/ck", module, opt, step=2)
    out = {}
    for resumed in ("off", "optimizer"):
        again, inputs, opt2 = _compiled(plan, rank, world, (resumed, False, 0, False), layers)
        checkpoint.load(f"{folder[0]}/ck", again, opt2)
        run = _steps(again, inputs, opt2, steps=1)
        out[resumed] = (run["losses"][0], full_state_dict(again))
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


@pytest.mark.parametrize("job", OFFLOADED, ids=["offload", "offload-dup", "offload-zero2-recompute"])
def test_offload_trains_exactly(job):
    rank0, ref = _results()
    run, plain = rank0[job], rank0[PLAIN]
    assert run["offloaded"] and run["host"] and run["duplication"] == job[1]
    # the host copies are the weights, or under ZeRO-2 this rank's half of their rows
    assert run["held"] == (run["params"] // 2 if job[2] else run["params"])
    if not job[1]:  # exactly the plan without offload (ZeRO and recomputation are exact too): losses,
        # gradients at every step, weights after the last; duplication sums two halves in another order
        assert run["losses"] == plain["losses"]
        for g, p in zip(run["grads"], plain["grads"]):
            assert set(g) == set(p) and max_diff(g, p) == 0.0
        assert max_diff(run["weights"], plain["weights"]) == 0.0
    # and the single device's, to rounding
    for a, b in zip(run["losses"], ref["losses"]):
        assert abs(a - b) <= 1e-12 * abs(b)
    for g, r in zip(run["grads"], ref["grads"]):
        assert max_diff(g, r) <= 1e-12
    assert max_diff(run["weights"], ref["weights"]) <= 1e-9


@pytest.mark.parametrize("resumed", ["off", "optimizer"])
def test_checkpoint_of_an_offloaded_run_resumes_with_and_without_offload(resumed):
    rank0, _ = _results()
    loss, weights = rank0["checkpoints"][resumed]
    plain = rank0[PLAIN]  # the uninterrupted run's third step
    assert loss == plain["losses"][2]
    assert max_diff(weights, plain["weights"]) == 0.0


# ------------------------------------------------------------------------------- memory, cost and search
@pytest.fixture(scope="module")
def world4():
    """A small GPT traced for 4 ranks (on meta) and its data plans with the optimizer on the device and
    offloaded, ZeRO off and 2."""
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
    fixed = dict(duplication=False, recompute="off", reshard="off")
    plans = {
        (o, z): forced(graph, profile, "data", offload=o, zero=z, **fixed)
        for o in ("off", "optimizer")
        for z in ("off", "2")
    }
    return graph, profile, plans


def test_memory_and_price_of_the_offloaded_step(world4):
    from hidup.search import price

    graph, profile, plans = world4
    off, on, on2 = plans["off", "off"], plans["optimizer", "off"], plans["optimizer", "2"]
    b = off.memory["grads"]  # every weight's bytes (all trainable, replicated, float32)
    assert on.offload == "optimizer" and off.offload == "off"
    # the device holds no optimizer state; the host holds the state, a copy of the weights and their gradients
    assert on.memory["optimizer"] == 0.0 and off.memory["optimizer"] == pytest.approx(2 * b)
    assert off.memory["total"] - on.memory["total"] == pytest.approx(2 * b)
    assert on.memory["host"] == pytest.approx(4 * b) and "host" not in off.memory
    # the step: gradients to the host, the CPU's Adam, weights back
    assert on.predicted["optimizer"] == pytest.approx(
        b * (2 / profile.host_bandwidth + profile.host_optimizer_s_per_byte)
    )
    assert on.predicted["optimizer"] == pytest.approx(profile.offload_time(b)) and profile.offload_time(b) > 0
    assert on.predicted["total"] - on.predicted["optimizer"] == pytest.approx(
        off.predicted["total"] - off.predicted["optimizer"]
    )
    # with ZeRO-2 each rank steps (and moves) its quarter of the rows
    assert on2.predicted["optimizer"] == pytest.approx(profile.offload_time(b / 4))
    assert on2.memory["host"] == pytest.approx(b) and on2.memory["optimizer"] == 0.0
    # the record prices again to the same numbers
    assert price(graph, profile, on)[False].total == pytest.approx(on.predicted["total"], rel=1e-12)


def test_search_offloads_only_when_nothing_else_fits(world4):
    graph, profile, plans = world4
    free = search(graph, profile, duplication=False)
    assert free.offload == "off" and free.options["offload_requested"] == "auto"
    # the least memory a plan on the device needs, every other lever used (the search's message says it)
    with pytest.raises(SearchError) as caught:
        search(graph, profile, duplication=False, offload="off", memory_budget=1.0)
    least = float(re.search(r"the least memory any plan needs is (\S+) bytes", str(caught.value)).group(1))
    budget = 0.98 * least
    fit = search(graph, profile, duplication=False, memory_budget=budget)
    assert fit.offload == "optimizer" and fit.memory["peak"] <= budget
    assert "no plan fits the memory budget" in fit.options["offload_used"]
    text = summary(fit, graph)
    assert "optimizer offloaded to the host (no plan fits the memory budget" in text
    # a budget the device meets: no offload (the least is by each node's leanest signature, which no one
    # plan may reach with its kept copies: room for the DP's beam)
    roomy = search(graph, profile, duplication=False, memory_budget=1.1 * least)
    assert roomy.offload == "off"
    with pytest.raises(ValueError, match="offload must be one of auto, off, optimizer"):
        search(graph, profile, offload="master")


def test_plan_record_round_trip(world4, tmp_path):
    _, _, plans = world4
    plan = plans["optimizer", "off"]
    again = Plan.load(plan.save(tmp_path / "p.json"))
    assert again.offload == "optimizer"
    d = json.loads((tmp_path / "p.json").read_text())
    del d["offload"]  # a file written before offload
    assert Plan.from_dict(d).offload == "off"
    d["offload"] = "gpu"
    with pytest.raises(PlanError, match="'offload' must be one of off, optimizer"):
        Plan.from_dict(d)


def test_profile_fields_and_their_default():
    from hidup.profiler.profile import DEFAULT_HOST_BANDWIDTH, DEFAULT_HOST_OPTIMIZER_S_PER_BYTE, Profile

    builtin = hidup.profiler.load(PROFILE)
    assert builtin.host_bandwidth == 50e9 and builtin.host_optimizer_s_per_byte == 0.25e-9
    d = builtin.to_dict()
    assert Profile.from_dict(d).offload_time(1e9) == builtin.offload_time(1e9)
    del d["host_bandwidth"], d["host_optimizer_s_per_byte"]  # a profile written before them
    old = Profile.from_dict(d)
    assert old.offload_time(1e9) == pytest.approx(
        1e9 * (2 / DEFAULT_HOST_BANDWIDTH + DEFAULT_HOST_OPTIMIZER_S_PER_BYTE)
    )
    d["host_bandwidth"] = -1
    with pytest.raises(hidup.profiler.ProfileError, match="host_bandwidth"):
        Profile.from_dict(d)


def test_bad_offload_requests_fail_clearly():
    from hidup.codegen import compile as hidup_compile

    model, inputs = _build(1)
    plan = forced(trace(model, inputs), hidup.profiler.load(PROFILE), "data")
    with pytest.raises(CompileError, match="offload='gpu': give 'off' or one of 'optimizer'"):
        hidup_compile(model, plan, 0, 1, inputs, offload="gpu")


def test_cli_offload_flags(tmp_path, capsys):
    """``hidup search --offload optimizer`` writes a plan that offloads and ``show`` says so; ``train`` runs
    it (one rank) with the optimizer on the host; a bad value is one argparse message, exit 2; ``--cuda-graphs
    on`` with offload is refused with one message."""
    from hidup.runtime.train import TrainOptions, _capturable
    from test_cli_errors import TINY, one_message, run_main

    warnings.simplefilter("ignore")
    out = tmp_path / "plan.json"
    code, stdout, err = run_main(["search", *TINY, "--world", "1", "--offload", "optimizer", "--out", str(out)], capsys)
    assert code == 0, err
    assert json.loads(out.read_text())["offload"] == "optimizer" and "optimizer offloaded to the host" in stdout
    result = tmp_path / "run.json"
    argv = ["train", "--plan", str(out), "--world", "1", "--iterations", "1", "--warmup", "0", "--json", str(result)]
    code, stdout, err = run_main(argv, capsys)
    assert code == 0, err
    assert json.loads(result.read_text())["offload"] == "optimizer"
    code, _, err = run_main(["search", *TINY, "--world", "1", "--offload", "all", "--out", str(out)], capsys)
    assert code == 2
    one_message(err, "--offload", "invalid choice: 'all'")
    plan = Plan.load(out)
    with pytest.raises(SystemExit, match="--cuda-graphs on: with the optimizer offloaded to the host"):
        _capturable(TrainOptions(cuda_graphs="on"), plan)
    assert not _capturable(TrainOptions(cuda_graphs="auto"), plan)
    assert _capturable(TrainOptions(cuda_graphs="auto", offload="off"), plan) or plan.choices


def test_peak_of_an_offloaded_plan_holds_no_optimizer_state():
    """``hidup peak`` of a plan whose optimizer is offloaded: the device holds no Adam state, and the
    memory model leaves it out too."""
    from hidup.frontend.trace import forward_inputs
    from hidup.runtime.peak import predict_peak

    warnings.simplefilter("ignore")
    graph = trace(*M.build("gpt", world_size=2, device="meta", **SMALL), world_size=2)
    fixed = dict(duplication=False, zero="off", recompute="off", reshard="off")
    plan = forced(graph, hidup.profiler.load(PROFILE), "data", offload="optimizer", **fixed)
    model, inputs = M.build("gpt", world_size=2, device="meta", **SMALL)
    peak = predict_peak(model, forward_inputs(model, inputs), plan, 0)
    assert peak.parts["optimizer"] == 0 and peak.parts["grads"] > 0
    # the weights and their gradients, both whole on the rank, as the memory model counts them
    assert peak.parts["params"] == plan.memory["params"] and plan.memory["optimizer"] == 0

"""Gradients reduced in bf16 (``reduce_dtype="bf16"``, :mod:`hidup.precision`).

* on 2 gloo ranks under CPU bf16 autocast, every float32 gradient of the zoo GPT equals a reference
  summed the same way from the ranks' partial gradients ``g_r`` (a data-parallel step's under
  ``no_sync``), ``float32(bf16(bf16(g_0) + bf16(g_1)))``, bit for bit -- through the bucketed
  all-reduces of a data-parallel plan, ZeRO-2's reduce-scatters, and the adjoint reduce-scatters of an
  FSDP-style plan's gathered weights (resharded after the forward or not), eagerly, and compiled
  (``aot_eager``) for the latter -- and lies
  within ``N eps sum_r |g_r|`` (:func:`hidup.precision.reduce_error_bound`) of their float32 sum
  ``g_0 + g_1`` (what the float32 reduction of two terms gives); the loss is that of the float32 plan;
* a program that reduces in bf16 run without autocast gives the float32 program's gradients bit for bit;
* the cost model prices those collectives at half the bytes, the plan's recorded bytes halve, and the
  option is refused without bf16 autocast; the plan records it and reads back (old files: fp32).
"""

from __future__ import annotations

import functools
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import hidup
import hidup.profiler
from dist_util import run_distributed
from hidup.plan import Plan
from hidup.precision import ReduceDtypeError, reduce_error_bound, reduce_low_params
from hidup.search import forced

SMALL = dict(layers=1, d_model=32, heads=4, ffn=64, seq_len=8, batch_per_gpu=2, vocab=64)
PROFILE = "paper-v100-9.7gbps"


@functools.cache
def _graph(world: int = 2):
    model, inputs = hidup.models.build("gpt", world_size=world, seed=0, **SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hidup.trace(model, inputs, world_size=world)


def _plan(style: str, reduce_dtype: str = "fp32", precision: str = "bf16", profile: str = PROFILE):
    profile = hidup.profiler.load(profile)
    return forced(_graph(), profile, style, precision=precision, duplication=False, reduce_dtype=reduce_dtype)


def _step(rank: int, world: int, plan, autocast: bool, **options) -> tuple[float, dict]:
    """(global loss, every parameter's full gradient) of one step of the zoo GPT under ``plan``."""
    from hidup import compile
    from hidup.codegen.params import full_grad_dict

    model, inputs = hidup.models.build("gpt", world_size=world, seed=0, **SMALL)
    module = compile(model, plan, rank, world, inputs, duplication=False, **options)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = module(*inputs)
    loss.backward()
    return float(module.global_loss(loss)), {k: v.clone() for k, v in full_grad_dict(module).items()}


def _partials(rank: int, world: int, plan) -> dict:
    """Every rank's partial gradients (a data-parallel plan's, before their sum), stacked."""
    import torch.distributed as dist

    from hidup import compile

    model, inputs = hidup.models.build("gpt", world_size=world, seed=0, **SMALL)
    module = compile(model, plan, rank, world, inputs, duplication=False)
    with module.no_sync(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = module(*inputs)
        loss.backward()
    out = {"loss": float(module.global_loss(loss))}
    for _, t, shard in hidup.codegen.params.iter_shards(module):
        if not shard.is_buffer and t.grad is not None:
            parts = [torch.empty_like(t.grad) for _ in range(world)]
            dist.all_gather(parts, t.grad.contiguous())
            out[shard.logical_name] = torch.stack(parts)
    return out


def _compare(got: dict, partials: dict) -> dict:
    """Names whose bf16-reduced gradient differs from the reference, those outside the bound of the
    float32 sum, and those that differ from the float32 sum at all (some must: the cast ran)."""
    differ, outside, moved = [], [], []
    for name, g in got.items():
        parts = partials[name]  # [ranks, *shape]
        ref = parts.to(torch.bfloat16).sum(0, dtype=torch.bfloat16).float()  # two terms: one rounding
        if not torch.equal(g, ref):
            differ.append(name)
        fp32 = parts.sum(0)
        if not bool(((g - fp32).abs() <= reduce_error_bound(len(parts), 1.0) * parts.abs().sum(0)).all()):
            outside.append(name)
        if not torch.equal(g, fp32):
            moved.append(name)
    return {"differ": differ, "outside": outside, "moved": moved, "dtypes": {str(g.dtype) for g in got.values()}}


def _rank(rank: int, world: int, plans: dict, backend) -> dict:
    partials = _partials(rank, world, plans["data"])
    runs = {"data": ("data", 0, None), "data-zero2": ("data", 2, None), "fsdp": ("fsdp", 0, None)}
    runs["fsdp-reshard"] = ("fsdp", 0, True)
    if backend is not None:
        runs = {k: v for k, v in runs.items() if k.startswith("fsdp")}
    out = {}
    for what, (style, zero, reshard) in runs.items():
        options = dict(zero=zero, reshard=reshard, compile=backend, reduce_dtype="bf16")
        loss, bf16 = _step(rank, world, plans[style], True, **options)
        out[what] = {**_compare(bf16, partials), "same_loss": loss == partials["loss"]}
    if backend is None:  # no autocast: the program reduces in float32, as one that never casts
        out["plain"] = {k: _step(rank, world, plans["data"], False, reduce_dtype=k)[1] for k in ("fp32", "bf16")}
    return out


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_bf16_reduction_is_the_reference_sum_and_within_the_bound(backend):
    plans = {style: _plan(style) for style in ("data", "fsdp")}
    for rank, result in enumerate(run_distributed(_rank, 2, plans, backend, timeout=300)):
        plain = result.pop("plain", None)
        for what, r in result.items():
            assert not r["differ"], f"rank {rank}, {what}: not the bf16 sum of the partials: {r['differ'][:5]}"
            assert not r["outside"], f"rank {rank}, {what}: outside N eps sum|g_r|: {r['outside'][:5]}"
            assert r["moved"], f"rank {rank}, {what}: no gradient was reduced in bf16"
            assert r["dtypes"] == {"torch.float32"}
            assert r["same_loss"] or what.startswith("fsdp"), f"rank {rank}, {what}: not the float32 run's loss"
        if plain is not None:
            differ = [k for k in plain["fp32"] if not torch.equal(plain["fp32"][k], plain["bf16"][k])]
            assert not differ, f"rank {rank}: without autocast, gradients differ: {differ[:5]}"


def test_the_cost_model_prices_the_reductions_at_half_the_bytes():
    from hidup.ir import FULL, REPLICATE, gather
    from hidup.search.cost import CostModel

    graph = _graph()
    profile = hidup.profiler.load(PROFILE)
    fp32 = CostModel(graph, profile, precision="bf16")
    bf16 = CostModel(graph, profile, precision="bf16", reduce_dtype="bf16")
    weight = next(t for t in sorted(reduce_low_params(graph)) if len(graph.tensors[t].shape) == 2)
    nbytes = fp32.nbytes[weight]
    for model, share in ((fp32, 1.0), (bf16, 0.5)):
        gathered = model.conversion(weight, gather(0), FULL)
        assert gathered.bwd - gathered.bwd_copies == pytest.approx(model.comm("reduce_scatter", nbytes * share))
        synced = model.conversion(weight, REPLICATE, FULL)
        assert synced.bwd - synced.bwd_copies == pytest.approx(model.grad_sync(nbytes, share=share))
        assert model.reduce_share(weight, "reduce_scatter") == share
    nvlink = hidup.profiler.load("h200x4-nvlink")  # a profile with a memory bandwidth: the casts cost time
    casts = CostModel(graph, nvlink, precision="bf16", reduce_dtype="bf16").conversion(weight, REPLICATE, FULL)
    plain = CostModel(graph, nvlink, precision="bf16").conversion(weight, REPLICATE, FULL)
    membw, o = nvlink.memory_bandwidth, nvlink.op_overhead
    assert casts.bwd_copies - plain.bwd_copies == pytest.approx(2 * o + 3 * nbytes / membw)  # down and back up
    assert bf16.reduce_share(weight, "all_gather") == 1.0  # a gather sums nothing
    a, b = _plan("data"), _plan("data", "bf16")
    assert a.choices == b.choices and b.sent_bytes() == pytest.approx(a.sent_bytes() / 2)
    syncs = [(x, y) for x, y in zip(a.conversions, b.conversions) if x.backward == "grad_sync"]
    assert syncs and all(x.wire[1] == 2 * y.wire[1] and x.wire[0] == y.wire[0] for x, y in syncs)
    # ZeRO-2: the reduce-scatter half of the sync in bf16, the all-gather of the updated rows in float32
    profile = hidup.profiler.load(PROFILE)
    z32, z16 = (
        forced(_graph(), profile, "data", precision="bf16", duplication=False, zero="2", reduce_dtype=r)
        for r in ("fp32", "bf16")
    )
    assert z32.zero and z32.choices == z16.choices and z16.sent_bytes() == pytest.approx(0.75 * z32.sent_bytes())


def test_refused_without_bf16_autocast():
    for precision in ("fp32", "tf32", "fp16"):
        with pytest.raises(ReduceDtypeError, match="needs bf16 autocast"):
            _plan("data", "bf16", precision=precision)
    with pytest.raises(ReduceDtypeError, match="one of fp32, bf16"):
        _plan("data", "fp16")


def test_the_plan_records_it_and_reads_back(tmp_path):
    plan = _plan("fsdp", "bf16")
    path = plan.save(tmp_path / "plan.json")
    data = json.loads(path.read_text())
    assert data["reduce_dtype"] == "bf16" and data["options"]["reduce_dtype"] == "bf16"
    again = Plan.load(path)
    assert again.reduce_dtype == "bf16" and again.sent_bytes() == plan.sent_bytes()
    assert "gradients reduced in bf16" in hidup.show(again)
    del data["reduce_dtype"]  # a plan written before the option
    path.write_text(json.dumps(data))
    assert Plan.load(path).reduce_dtype == "fp32"
    assert "reduce_dtype" not in _plan("data").to_dict()
    data["reduce_dtype"] = "fp8"
    path.write_text(json.dumps(data))
    with pytest.raises(hidup.plan.PlanError, match="reduce_dtype"):
        Plan.load(path)


def test_the_command_line_refuses_it_without_bf16_before_tracing_and_records_it(tmp_path, capsys, monkeypatch):
    from hidup.cli import main
    from hidup.runtime import options

    tiny = ["--model", "gpt", "--world", "2", "--layers", "1", "--d-model", "32", "--heads", "4", "--ffn", "64"]
    tiny += ["--seq-len", "8", "--batch-per-gpu", "2", "--vocab", "64", "--no-duplication", "--quiet"]
    traced = []
    real = options.build_graph
    monkeypatch.setattr("hidup.cli.app.build_graph", lambda *a, **k: traced.append(1) or real(*a, **k))
    with pytest.raises(SystemExit, match="needs bf16 autocast.*Fix: add --precision bf16"):  # one message
        main(["search", *tiny, "--reduce-dtype", "bf16", "--out", str(tmp_path / "p.json")])
    assert not traced
    out = tmp_path / "bf16.json"
    assert main(["search", *tiny, "--precision", "bf16", "--reduce-dtype", "bf16", "--out", str(out)]) == 0
    assert Plan.load(out).reduce_dtype == "bf16" and traced
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    assert "gradients reduced in bf16" in capsys.readouterr().out

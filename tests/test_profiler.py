"""Machine profiler (device rates, collectives, profile JSON) and the training baselines, on CPU/gloo."""

from __future__ import annotations

import json
import math
import os
import sys
import warnings

import pytest
import torch

import hidup.profiler
from dist_util import run_distributed
from hidup.cli.profile_flags import parse_sizes
from hidup.codegen.timing import time_call
from hidup.profiler.measure.comm import _elements, fit_alpha, monotone
from hidup.profiler.measure.device import canonical_dtype, matmul_rate, memory_bandwidth, tf32
from hidup.profiler.measure.machine import comm_tables, profile_machine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------- device


def test_matmul_rate_positive_and_consistent():
    r = matmul_rate("cpu", "fp32", (32, 64), budget_s=0.05)
    assert r.rate > 0 and set(r.per_size) == {32, 64}
    assert r.rate == max(r.per_size.values())
    # 2 n^3 / t: the rate of one size is the FLOP count over the median time of that matmul
    a = torch.randn(64, 64)
    t = time_call(lambda: a @ a, "cpu", budget_s=0.05)
    assert 0 < t < 1.0


def test_dtype_names_and_tf32_flag_restored():
    assert canonical_dtype("bfloat16") == "bf16" and canonical_dtype("tf32") == "tf32"
    with pytest.raises(ValueError, match="unknown compute dtype"):
        canonical_dtype("fp8")
    before = torch.backends.cuda.matmul.allow_tf32
    with tf32(not before):
        assert torch.backends.cuda.matmul.allow_tf32 == (not before)
    assert torch.backends.cuda.matmul.allow_tf32 == before
    assert matmul_rate("cpu", "bf16", (32,), budget_s=0.02).rate > 0
    assert memory_bandwidth("cpu", 1 << 20, budget_s=0.02) > 0


def test_kernel_seconds_replays_short_kernels_many_to_a_graph_and_falls_back_where_none_captures(monkeypatch):
    """On a GPU a matmul is timed as reps calls in one CUDA graph, reps spanning KERNEL_SPAN_S at
    FAST_FLOPS (1 to 64); where the graph does not capture, and on a CPU, it is timed call by call."""
    import hidup.profiler.measure.device as device

    asked = []

    def graph_time(fn, dev, budget_s, reps):
        asked.append(reps)
        return None if reps == 1 else 1e-6  # the largest "does not capture": timed eagerly instead

    monkeypatch.setattr(device, "graph_time", graph_time)
    monkeypatch.setattr(device, "time_call", lambda fn, dev, **kw: 2e-3)
    cuda = torch.device("cuda")
    tiny, mid, huge = 2.0 * 128**3, device.KERNEL_SPAN_S * device.FAST_FLOPS / 10, 2.0 * 16384**3
    assert [device.matmul_reps(f) for f in (tiny, mid, huge)] == [64, 10, 1]
    assert device.kernel_seconds(lambda: None, cuda, 0.01, device.matmul_reps(tiny)) == 1e-6
    assert device.kernel_seconds(lambda: None, cuda, 0.01, device.matmul_reps(mid)) == 1e-6
    assert device.kernel_seconds(lambda: None, cuda, 0.01, device.matmul_reps(huge)) == 2e-3
    assert asked == [64, 10, 1]
    assert device.kernel_seconds(lambda: None, torch.device("cpu"), 0.01, 64) == 2e-3 and len(asked) == 3


def test_the_fused_adam_step_is_timed_per_parameter_byte_and_kept_by_the_profile(tmp_path):
    from hidup.profiler.measure.device import adam_seconds_per_byte

    small, large = (adam_seconds_per_byte("cpu", n, budget_s=0.05) for n in (1 << 20, 8 << 20))
    assert 0 < small and 0 < large < 1e-8  # far above 100 MB/s on any CPU
    prof = profile_machine(None, dtypes=("fp32",), progress=False, quick=True, merge="h200x4-nvlink",
                           matmul_sizes=(32,), budget_s=0.01, out=tmp_path / "p.json")  # fmt: skip
    assert prof.optimizer_s_per_byte > 0 and "fused Adam" in prof.notes
    assert prof.optimizer_time(4e6) == prof.optimizer_s_per_byte * 4e6
    # the offloaded optimizer: the CPU's Adam is measured; no host copy without a GPU (the default prices it)
    assert 0 < prof.host_optimizer_s_per_byte < 1e-7 and prof.host_bandwidth == 0


# ---------------------------------------------------------------------------------------- fitting


def test_fit_alpha_recovers_latency():
    alpha, beta = 2e-5, 1e9
    sizes = [4096, 16384, 65536, 1 << 20]
    times = [alpha + s / beta for s in sizes]
    assert fit_alpha(sizes, times) == pytest.approx(alpha, rel=1e-9)
    # noise cannot push alpha below 0 or above the fastest observation
    assert fit_alpha([1, 2, 3], [3e-5, 1e-5, 2e-5]) <= 1e-5
    assert fit_alpha([1000, 2000], [1e-3, 3e-3]) == 0.0
    with pytest.raises(ValueError):
        fit_alpha([1], [])


def test_monotone_and_tables_reproduce_measured_times():
    assert monotone([3.0, 1.0, 2.0, 5.0]) == [1.0, 1.0, 2.0, 5.0]

    class Curve:
        op, group_size, alpha = "all_reduce", 2, 1e-5
        sizes = [4096, 65536, 1 << 20]
        seconds = [1.2e-5, 4e-5, 5e-4]

    tab = comm_tables([Curve()])["all_reduce"][2]
    for s, t in zip(Curve.sizes, Curve.seconds):
        assert tab.time(s) == pytest.approx(t, rel=1e-9)


def test_logical_sizes_split_evenly():
    assert _elements(4096, 2, "all_reduce", 4) == 1024
    assert _elements(4100, 4, "all_gather", 4) % 4 == 0
    assert _elements(4, 3, "all_to_all", 4) == 9  # at least one element per (source, destination)


def test_parse_sizes():
    assert parse_sizes("4K..32K") == [4096, 8192, 16384, 32768]
    assert parse_sizes("1M, 4096,1M") == [4096, 1 << 20]
    with pytest.raises(ValueError, match="cannot read size"):
        parse_sizes("4X")


# ------------------------------------------------------------------------------------- collectives

SIZES = [4096, 16384, 65536]


def _profile_rank(rank, world, out):
    prof = profile_machine(
        world,
        sizes=SIZES,
        dtypes=("fp32",),
        progress=False,
        out=out if rank == 0 else None,
        matmul_sizes=(32, 64),
        budget_s=0.02,
        name="test-cpu",
    )
    return prof.to_dict()


def test_comm_profile_validates_and_loads(world2):
    out = world2[0]["profile_path"]
    dicts = [r["profile"] for r in world2]
    assert dicts[0] == dicts[1], "every rank must return the same profile"
    prof = hidup.profiler.load(str(out))
    assert prof.name == "test-cpu" and prof.world_sizes == [2] and prof.source == "measured"
    for c in hidup.profiler.COLLECTIVES:  # two copies' collectives at once, measured and loaded back
        assert 1.0 <= prof.pair_speedup(c, 2, SIZES[1]) <= 2.0 and len(prof.concurrency[c][2][1]) == len(SIZES)
    assert all(prof.rate(d) > 0 for d in ("fp32", "tf32", "bf16", "fp16"))
    raw = json.loads(out.with_name("prof.raw.json").read_text())
    # the copies around collectives: a layout change, and a transpose of the innermost dim
    assert prof.layout_bandwidth == raw["layout_bandwidth"] > 0
    assert prof.transpose_bandwidth == raw["transpose_bandwidth"] > 0
    curves = {(c["op"], c["group_size"]): c for c in raw["collectives"]}
    for c in hidup.profiler.COLLECTIVES:
        tab = prof.collectives[c][2]
        assert tab.sizes == [float(s) for s in SIZES] and tab.alpha >= 0
        curve = curves[(c, 2)]
        assert curve["seconds"] == monotone(curve["raw_seconds"])
        for s, t in zip(curve["sizes"], curve["seconds"]):
            # the profile's alpha + S / algbw(S) gives back the measured time
            assert prof.comm_time(c, 2, s) == pytest.approx(t, rel=2e-3)
            assert t > 0 and math.isfinite(t)


def test_pair_speedup_is_measured_in_turns_so_that_drift_cancels(monkeypatch):
    """The network slows 5% per sample taken.  Sampling the single and the paired call in turns
    keeps the drift out of their ratio (two concurrent calls 1.6x faster than two in a row)."""
    from hidup.profiler.measure import comm

    clock = {"samples": 0}
    order = []

    class DriftingTimer:
        def __init__(self, device):
            pass

        def sync(self):
            pass

        def measure(self, fn, k):
            clock["samples"] += 1
            return k * fn() * (1.0 + 0.05 * clock["samples"])

    def single():
        order.append("s")
        return 1.0

    def pair():
        order.append("p")
        return 2.0 / 1.6

    monkeypatch.setattr(comm, "Timer", DriftingTimer)
    monkeypatch.setattr(comm, "_barrier", lambda device: None)
    monkeypatch.setattr(comm, "max_over_ranks", lambda values, group, device: list(values))
    monkeypatch.setattr(comm, "collective_call", lambda *a, **k: single)
    monkeypatch.setattr(comm, "_pair_call", lambda *a, **k: pair)
    t, t_pair = comm.time_collective(
        "all_reduce",
        4096,
        comm.Communicator(None, 2, pair_with=object()),
        "cpu",
        sampling=comm.Sampling(sample_s=0.0, budget_s=0.0, min_samples=8),
    )
    timed = order[4:]  # after the warm-up and trial calls of each
    assert timed == ["s", "p", "p", "s"] * 4
    assert 2 * t / t_pair == pytest.approx(1.6, rel=0.03)
    # measured one after the other (8 singles, then 8 pairs), the same drift would read as about 1.21
    with pytest.raises(ValueError, match="every rank"):
        comm.time_collective("all_reduce", 4096, comm.Communicator(None, 2, member=False, pair_with=object()), "cpu")


def _rounds_rank(rank, world):
    from hidup.profiler.measure.comm import profile_collectives

    curves = profile_collectives("cpu", sizes=[4096, 65536], ops=("all_reduce",), budget_s=0.005, rounds=3)
    return [c.to_dict() for c in curves]


def test_collective_rounds_keep_each_points_median(world2):
    res = [r["rounds"] for r in world2]
    assert res[0] == res[1]
    (curve,) = res[0]
    assert [len(r) for r in curve["round_seconds"]] == [3, 3]
    for t, passes in zip(curve["raw_seconds"], curve["round_seconds"]):
        assert t == sorted(passes)[1]
    assert len(curve["pair_seconds"]) == 2 and all(p > 0 for p in curve["pair_seconds"])


def _subgroup_rank(rank, world):
    from hidup.profiler.measure.comm import profile_collectives

    curves = profile_collectives("cpu", sizes=[4096, 65536], ops=("all_reduce", "all_to_all"), budget_s=0.01)
    return [(c.op, c.group_size, c.sizes, c.seconds, c.pair_speedup) for c in curves]


def test_world4_measures_world_and_pairs():
    res = run_distributed(_subgroup_rank, 4, timeout=90)
    assert all(r == res[0] for r in res)
    assert {(op, g) for op, g, *_ in res[0]} == {
        ("all_reduce", 4),
        ("all_to_all", 4),
        ("all_reduce", 2),
        ("all_to_all", 2),
    }
    for _op, g, sizes, secs, pairs in res[0]:
        assert sizes[0] >= 4096 and all(s > 0 for s in secs)
        # two communicators at once are timed for the whole world only (what duplication uses)
        assert (len(pairs) == len(sizes)) if g == 4 else not pairs
        assert all(0 < k < 10 for k in pairs)


def test_single_process_needs_collectives_from_somewhere():
    with pytest.raises(ValueError, match="merge="):
        profile_machine(1, dtypes=("fp32",), progress=False, matmul_sizes=(32,), budget_s=0.01)


# ---------------------------------------------------------------------------------------- baselines

TINY = dict(layers=2, d_model=16, heads=2, ffn=32, seq_len=4, batch_per_gpu=2, vocab=32, experts_per_gpu=2)
LR, STEPS = 1e-3, 2


def _harness():
    from exp.baselines import harness

    return harness


CASES = [("ddp", "bert-sgmoe"), ("fsdp", "bert-sgmoe"), ("expert", "bert-sgmoe"), ("expert", "vit-switch")]


def _world2_rank(rank, world, out_path):
    """The world-2 profile, the collective rounds, every distributed baseline case and the program
    checks, in one process group (one spawn)."""
    h = _harness()
    out = {"profile": _profile_rank(rank, world, out_path), "profile_path": out_path}
    out["rounds"] = _rounds_rank(rank, world)
    for baseline, model in CASES:
        spec = h.RunSpec(baseline, model, world, dict(TINY), warmup=0, iters=STEPS, lr=LR)
        out[(baseline, model)] = h.run_rank(rank, world, torch.device("cpu"), spec)
    out["program"] = _program_rank(rank, world)
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "prof.json"
    return run_distributed(_world2_rank, 2, out, timeout=400)


def _reference_losses(model_name, world, batch_share=None):
    """Single-device Adam on the global batch (or on rank 0's share)."""
    import hidup.models

    model, inputs = hidup.models.build(model_name, world_size=world, **TINY)
    if batch_share is not None:
        inputs = tuple(t[:batch_share] for t in inputs)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(*inputs)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("baseline,model", CASES)
def test_baseline_matches_single_device(world2, baseline, model):
    ref = _reference_losses(model, 2)
    for rank_results in world2:
        r = rank_results[(baseline, model)]
        assert r["baseline"] == baseline and r["world"] == 2 and r["backend"] == "gloo"
        assert len(r["losses"]) == STEPS and r["iter_time_s"] > 0 and r["tokens_per_s"] > 0
        for got, want in zip(r["losses"], ref):
            assert got == pytest.approx(want, rel=1e-5), (baseline, r["losses"], ref)


def test_single_baseline_is_one_share():
    h = _harness()
    spec = h.RunSpec("single", "bert-sgmoe", 2, dict(TINY), warmup=0, iters=STEPS, lr=LR)
    r = h.run_rank(0, 1, torch.device("cpu"), spec)
    assert r["gpus_used"] == 1 and r["backend"] == "none"
    ref = _reference_losses("bert-sgmoe", 2, batch_share=TINY["batch_per_gpu"])
    assert r["losses"] == pytest.approx(ref, rel=1e-5)
    assert r["samples_per_s"] == pytest.approx(TINY["batch_per_gpu"] / r["iter_time_s"])


def test_expert_baseline_rejects_dense_models():
    h = _harness()
    import hidup.models
    from exp.baselines import expert

    model, _ = hidup.models.build("gpt", world_size=2, **{k: v for k, v in TINY.items() if k != "experts_per_gpu"})
    with pytest.raises(ValueError, match="MoE layers"):
        expert.prepare(model, 0, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown baseline"):
        h.RunSpec("zero3")


# ------------------------------------------------------------------------------------------ op times


def test_op_times_are_keyed_as_the_cost_model_reads_them():
    import hidup.models
    from hidup.frontend.trace import trace_module
    from hidup.profiler.measure.ops import node_signatures, time_ops
    from hidup.profiler.profile import op_dtype, op_key

    model, inputs = hidup.models.build(
        "gpt", world_size=2, device="meta", layers=1, d_model=16, heads=2, ffn=32, seq_len=4, batch_per_gpu=2, vocab=32
    )
    traced = trace_module(model, inputs, 2)
    graph = traced.graph
    # one sharded signature per call node where there is one (the last listed), else all-full
    plan = {n.name: n.signatures[-1] for n in graph.nodes if n.op == "call"}
    assert node_signatures(graph, plan) == list(plan.items())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every op runs on synthetic inputs (the embedding's integer ids too)
        ops = time_ops(traced, plan, budget_s=0.002, total_s=30)
    assert any(k.startswith("embedding(") for k in ops)
    assert ops and all(f > 0 and b >= 0 and math.isfinite(f + b) for f, b in ops.values())
    prof = hidup.profiler.load("paper-v100-9.7gbps").with_ops(ops)
    hits = 0
    for name, sig in plan.items():
        node = graph.node(name)
        shapes = [f.local_shape(graph.tensors[t].shape, 2) for t, f in zip(node.inputs, sig.inputs)]
        dtype = op_dtype(graph.tensors[node.outputs[0]].dtype)
        if op_key(node.target, shapes, dtype) in ops:
            assert prof.op_time(node.target, shapes, dtype) == ops[op_key(node.target, shapes, dtype)]
            hits += 1
    assert hits >= len(plan) // 2, f"only {hits} of {len(plan)} nodes were timed"
    assert any(k.startswith("linear(") for k in ops)
    # measured keys are cached: a second call re-measures none (fresh timings would differ)
    again = time_ops(traced, plan, cache=dict(ops), budget_s=0.002, total_s=30)
    assert again == ops


def test_single_process_merge_times_several_models_for_other_worlds(tmp_path):
    """``--merge P --ops-model a,b --ops-worlds N``: one process adds the models' op times for N ranks
    and both single-device checks to P's collectives (how a profile is re-calibrated on a new host)."""
    import subprocess

    root = ROOT
    tiny = "layers=1,d_model=16,heads=2,ffn=32,seq_len=4,batch_per_gpu=4,vocab=32,experts_per_gpu=1"
    out = tmp_path / "p.json"
    cmd = [
        sys.executable,
        os.path.join(root, "exp", "profiler.py"),
        "--merge",
        "h200x4-nvlink",
        "--quick",
        "--budget",
        "0.01",
        "--matmul-sizes",
        "64",
        "--dtypes",
        "fp32",
        "--no-progress",
        "--ops-model",
        "gpt,bert-switch",
        "--ops-worlds",
        "2",
        "--ops-precisions",
        "fp32",
        "--ops-overrides",
        tiny,
        "--ops-seconds",
        "10",
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    prof = hidup.profiler.load(out)
    assert "gpt fp32 x2" in prof.notes and "bert-switch fp32 x2" in prof.notes and "two-copy check" in prof.notes
    assert prof.collectives == hidup.profiler.load("h200x4-nvlink").collectives
    assert prof.ops and prof.ops_timing == "eager"
    from exp import profiler as profiler_script

    with pytest.raises(SystemExit, match="--ops-worlds 'two'"):
        profiler_script.main(cmd[2:-2] + ["--ops-worlds", "two", "--out", str(out)])


def test_fit_program_scale_finds_the_factor_and_says_when_it_cannot():
    from hidup.profiler.measure.calibrate import fit_program_scale

    def predict(k):  # 2 ms of communication nothing hides, 8 ms of compute
        return 2e-3 + 8e-3 * k

    k, coverage = fit_program_scale(predict, 12e-3)
    assert k == pytest.approx(1.25, rel=1e-6) and coverage == pytest.approx(0.8)
    assert fit_program_scale(predict, 1e-3)[0] is None  # faster than the communication alone
    assert fit_program_scale(predict, 1.0)[0] is None  # beyond the factor range
    assert fit_program_scale(lambda k: 5e-3 + max(0.0, 4e-3 * k - 5e-3), 5e-3)[1] == 0.0  # compute hidden


TINY_MOE = dict(layers=1, d_model=16, heads=2, ffn=32, seq_len=4, batch_per_gpu=4, vocab=32, experts_per_gpu=1)


def _program_rank(rank, world):
    import hidup.profiler.measure.calibrate as calibrate
    from hidup.profiler.measure.calibrate import program_checks

    # this machine's own rates and gloo tables, so that predictions land near the measured times
    prof = profile_machine(
        world,
        sizes=[4096, 65536, 1 << 20],
        dtypes=("fp32",),
        progress=False,
        matmul_sizes=(64, 128),
        budget_s=0.02,
        name="test-cpu",
    )
    models = [("bert-switch", TINY_MOE)]
    checks = program_checks(prof, models, ("fp32",), torch.device("cpu"), trials=3, warmup=1)
    # the same plans "measured" at 1.1 times what compute contributes: each factor must come out 1.1
    want = {c["factor"]: c["predicted_s"] * (1 + 0.1 * c["coverage"]) for c in checks}
    real = calibrate.time_modes
    calibrate.time_modes = lambda *a, **k: {"off_s": want["dist_scale"], "on_s": want["dist_dup_scale"]}
    try:
        exact = program_checks(prof, models, ("fp32",), torch.device("cpu"))
    finally:
        calibrate.time_modes = real
    return [{k: v for k, v in c.items() if k != "plan"} for c in checks], exact


def test_program_checks_time_both_modes_on_the_ranks_and_fit_the_cost_model(world2):
    """On 2 gloo ranks: the searched plan of a small MoE model, both modes timed, the ranks agreeing;
    a time the cost model would give at factor 1.1 is fitted back to 1.1 in each mode."""
    (checks, exact), (checks1, _) = (r["program"] for r in world2)
    assert [(c["factor"], c["measured_s"]) for c in checks] == [(c["factor"], c["measured_s"]) for c in checks1]
    assert [c["factor"] for c in checks] == ["dist_scale", "dist_dup_scale"]
    for c in checks:
        assert c["measured_s"] > 0 and c["predicted_s"] > 0 and not c["cuda_graphs"] and c["world"] == 2
        assert ("scale" in c) != ("error" in c)
    for c in exact:
        assert c["coverage"] > 0 and c["scale"] == pytest.approx(1.1, rel=1e-6), c["factor"]


def test_program_factors_average_the_usable_checks():
    from hidup.profiler.measure.calibrate import apply_program_checks

    def check(factor, scale, coverage=0.9):
        return {
            "model": "m",
            "precision": "tf32",
            "world": 4,
            "cuda_graphs": True,
            "factor": factor,
            "measured_s": 1e-2,
            "predicted_s": 1e-2,
            "coverage": coverage,
            "scale": scale,
        }

    prof = hidup.profiler.load("h200x4-nvlink")
    out = apply_program_checks(
        prof,
        [
            check("dist_scale", 1.21),
            check("dist_scale", 1.0),
            check("dist_scale", 3.0),  # outside [0.5, 2]: reported, not used
            check("dist_dup_scale", 0.8, coverage=0.2),  # bound by communication
            {k: v for k, v in check("dist_dup_scale", 0.9).items() if k != "scale"} | {"error": "out of reach"},
        ],
    )
    assert out.corrections.dist_scale.value == pytest.approx(1.1) and out.corrections.dist_dup_scale.value == 1.0
    assert prof.corrections.identity  # a copy
    assert "inside the distributed program (x4, CUDA graphs): dist_scale 1.100, dist_dup_scale 1.000" in out.notes
    assert "out of reach" in out.notes and "20% of it compute -> 0.800" in out.notes


def test_calibrating_plans_needs_ranks_and_passes_are_counted(monkeypatch):
    from exp import profiler as profiler_script

    for var in ("CPN", "NODERANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit, match="--calibrate-plans times plans on the ranks"):
        profiler_script.main(["--merge", "h200x4-nvlink", "--calibrate-plans", "gpt"])
    with pytest.raises(SystemExit, match=r"unknown model\(s\) nope"):
        profiler_script.main(["--calibrate-plans", "nope"])
    with pytest.raises(SystemExit, match="--comm-rounds 0: give at least one pass"):
        profiler_script.main(["--comm-rounds", "0"])

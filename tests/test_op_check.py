"""exp/op_check.py: a plan's opaque custom ops (the MoE gating) timed and kept in a profile copy, and the
cost model pricing those ops at their measured times in a compiled program."""

import json
import subprocess
import sys

import pytest
import torch

import hidup
import hidup.models
import hidup.profiler
from exp.op_check import is_opaque, opaque_choices, time_opaque_ops, with_ops
from hidup.search import forced
from hidup.search.api import plan_indices
from hidup.search.problem import Problem

ARGS = {"layers": 2, "d_model": 64, "heads": 4, "ffn": 128, "seq_len": 16, "batch_per_gpu": 8}
MODEL = {"model": "bert-switch", "args": ARGS}  # two layers: the second is the MoE one


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    model, inputs = hidup.models.build(MODEL["model"], world_size=2, device="meta", **MODEL["args"])
    graph = hidup.trace(model, inputs, world_size=2)
    profile = hidup.profiler.load("h200x4-nvlink")
    plan = forced(graph, profile, "data", duplication=False, progress=False, model_source=MODEL)
    path = tmp_path_factory.mktemp("plans") / "switch-data.json"
    plan.save(path)
    return str(path)


def test_opaque_ops_are_custom_ops_outside_aten():
    assert is_opaque(torch.ops.hidup.moe_gating.default)
    assert not is_opaque(torch.ops.aten.mm.default)
    assert not is_opaque(torch.nn.functional.linear)
    assert not is_opaque("add")


def test_the_plans_gating_is_timed_and_priced_at_its_measured_time(plan_file):
    traced, plan, choices = opaque_choices(plan_file, None)
    assert [name for name, _ in choices] == ["moe_gating"]
    assert choices[0][1].kind == "data"  # the gating runs on the rank's slice of the batch
    profile = hidup.profiler.load("h200x4-nvlink")
    timed = time_opaque_ops([plan_file], profile, ["fp32"], None, timing_device="cpu")
    (key,) = timed
    assert key == "moe_gating(8x16x4)fp32"  # 8 groups (sequences) a rank, 16 tokens, 2 experts a GPU
    forward, backward = timed[key]
    assert forward > 0 and backward >= 0  # backward: forward + backward less forward, 0 at worst under load
    # stand-in times far above the roofline price, so that the measured price is unmistakable
    stand_in = {key: (2e-3, 5e-3)}
    measured_profile = with_ops(profile, stand_in, " test")
    assert measured_profile.ops_timing == "graph" and measured_profile.ops[key] == (2e-3, 5e-3)
    for prof, expect in ((profile, None), (measured_profile, (2e-3, 5e-3))):
        problem = Problem(traced.graph, prof.launched(True, True), "fp32")
        ks = plan_indices(problem, plan)
        i = next(i for i, n in enumerate(problem.order) if n.name == "moe_gating")
        fwd, bwd = problem.cost.device_compute(problem.order[i], problem.sigs[i][ks[i]])
        if expect is None:
            assert fwd + bwd < 1e-3  # priced by its bytes: microseconds
        else:
            assert (fwd, bwd) == pytest.approx(expect)


def test_op_check_needs_a_gpu_and_says_so(plan_file, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    out = subprocess.run(
        [sys.executable, "exp/op_check.py", plan_file, "--profile", "h200x4-nvlink", "--out", str(tmp_path / "p.json")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr and "Traceback" not in out.stderr
    missing = str(tmp_path / "none.json")
    out = subprocess.run(
        [sys.executable, "exp/op_check.py", missing, "--profile", "h200x4-nvlink", "--out", str(tmp_path / "p.json")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and f"no plan file {missing}" in out.stderr and "Traceback" not in out.stderr


def test_op_check_keeps_the_profile_otherwise_unchanged():
    profile = hidup.profiler.load("h200x4-nvlink")
    out = with_ops(profile, {"moe_gating(8x16x4)fp32": (1e-4, 2e-4)}, " note")
    before, after = profile.to_dict(), json.loads(json.dumps(out.to_dict()))
    assert after.pop("ops") == {"moe_gating(8x16x4)fp32": {"forward": 1e-4, "backward": 2e-4}}
    assert after.pop("ops_timing") == "graph" and after.pop("notes").endswith(" note")
    for key in ("ops", "ops_timing", "notes"):
        before.pop(key, None)
    assert after == json.loads(json.dumps(before))


def test_rank_predict_takes_the_measured_gating_and_the_modes_asked_for(plan_file, tmp_path, capsys):
    from exp import rank_predict

    run = {"what": "rank", "status": "ok", "step_ms_median": 5.0}
    bench = {
        "config": {"plan": plan_file, "model": MODEL["model"], "model_args": ARGS, "world": 2},
        "runs": [{**run, "mode": mode, "precision": "tf32"} for mode in ("cuda-graph", "compile+graph")],
    }
    runs = tmp_path / "rank-switch-data.json"
    runs.write_text(json.dumps(bench))
    profile = hidup.profiler.load("h200x4-nvlink")
    measured = tmp_path / "ops.json"
    measured.write_text(json.dumps(with_ops(profile, {"moe_gating(8x16x4)tf32": (1e-3, 2e-3)}, "").to_dict()))
    predicted = {}
    for name, prof in (("bytes", "h200x4-nvlink"), ("measured", str(measured))):
        out = tmp_path / f"{name}.json"
        argv = ["predict", str(runs), "--profile", prof, "--modes", "compile+graph", "--out", str(out)]
        assert rank_predict.main(argv) == 0
        rows = json.loads(out.read_text())["rows"]
        assert [r["mode"] for r in rows] == ["compile+graph"]
        predicted[name] = rows[0]["predicted_ms"]
    assert predicted["measured"] - predicted["bytes"] == pytest.approx(3.0, abs=0.05)  # the gating's 1 + 2 ms
    capsys.readouterr()
    assert rank_predict.main(["predict", str(runs), "--profile", "h200x4-nvlink", "--modes", "eager"]) == 2
    assert "no finished rank run of modes eager" in capsys.readouterr().err

"""``hidup bench-rank`` on the CPU: one rank of a world-2 plan under torch's fake process group, eager
and compiled (``aot_eager`` stands in for inductor, whose CPU compile takes about a minute), against the
single-device share; and its refusals of bad input (one message, non-zero exit, no traceback)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hidup.cli import main

TINY = [
    "--layers",
    "2",
    "--d-model",
    "32",
    "--heads",
    "4",
    "--ffn",
    "64",
    "--seq-len",
    "8",
    "--batch-per-gpu",
    "2",
    "--vocab",
    "64",
]
FAST = ["--steps", "2", "--rounds", "2", "--warmup", "1", "--backend", "aot_eager", "--device", "cpu"]


def test_bench_rank_cpu_writes_json(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert (
        main(
            [
                "search",
                "--model",
                "bert-sgmoe",
                "--world",
                "2",
                *TINY,
                "--profile",
                "h200x4-nvlink",
                "--out",
                str(plan),
                "--quiet",
            ]
        )
        == 0
    )
    out = tmp_path / "rank.json"
    argv = ["bench-rank", "--plan", str(plan), "--rank", "1", "--torch-modes", "compile", *FAST, "--out", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    cfg, runs = data["config"], data["runs"]
    assert (cfg["model"], cfg["world"], cfg["rank"], cfg["backend"]) == ("bert-sgmoe", 2, 1, "aot_eager")
    assert 0 < cfg["rank_params"] <= cfg["model_params"], "the rank stores at most the whole model"
    got = {(r["what"], r["mode"], r["precision"]) for r in runs}
    want = {("rank", "eager"), ("rank", "compile"), ("torch", "compile"), ("share", "compile")}
    assert got == {(what, mode, "fp32") for what, mode in want}
    for r in runs:
        assert r["status"] == "ok", r
        assert len(r["rounds_ms"]) == 2 and all(t > 0 for t in r["rounds_ms"])
        assert r["step_ms_best"] == min(r["rounds_ms"]) and r["step_ms_best"] <= r["step_ms_median"]
        assert (r["compile_s"] is not None) == r["mode"].startswith("compile")
    text = capsys.readouterr().out
    assert "rank eager" in text and "torch compile" in text and "share compile" in text  # the table's header


def test_bench_rank_times_the_share_with_each_experts_implementation(tmp_path):
    """``--share-experts``: one share row per named ``transformers`` experts implementation, each in its
    own mode, the rank measured against both in the same run (a tiny Mixtral, the world-2 rank 0)."""
    pytest.importorskip("transformers")
    sizes = ["layers=1", "hidden=32", "heads=4", "kv_heads=2", "ffn=32", "vocab=64", "seq=8", "batch=2"]
    model = ["--model", "exp.rank_models:mixtral", "--world", "2", "--profile", "h200x4-nvlink"]
    model += [a for kv in sizes for a in ("--model-arg", kv)] + ["--model-arg", "implementation=eager"]
    out = tmp_path / "rank.json"
    argv = ["bench-rank", *model, "--modes", "eager", "--share-experts", "eager=eager,hidup_grouped", *FAST]
    assert main([*argv, "--share-modes", "compile", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    got = {(r["what"], r["mode"]) for r in runs}
    assert got == {("rank", "eager"), ("share:eager", "eager"), ("share:hidup_grouped", "compile")}
    assert all(r["status"] == "ok" for r in runs), runs
    config = json.loads(out.read_text())["config"]
    for key in ("expert_load", "expert_load_after"):  # the routers' spread over rank 0's experts
        (layer,) = config[key].values()
        assert layer["world_max"] >= 1.0 and layer["world_max"] >= layer["world"] >= 0.0
        assert 0.0 <= layer["mirrored"] <= 2.0  # world 2: at most every pair on rank 0's block


def test_block_loads_count_pairs_per_block_against_a_balanced_share():
    """``load_r = N P_r / P``: 4 experts in 2 blocks, pairs (0,1), (0,2), (3,0): block 0 draws 4 of 6."""
    from hidup.runtime.expert_load import _block_loads

    index = torch.tensor([[0, 1], [0, 2], [3, 0]])
    assert _block_loads(index, experts=4, world=2) == pytest.approx([4 / 3, 2 / 3])
    assert _block_loads(index, experts=4, world=1) == [1.0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "mlp", "--world", "2", "--rank", "2"], "--rank 2 is outside the plan's world of 2 ranks"),
        (["--plan", "no/such/plan.json"], "no plan file at no/such/plan.json"),
        (["--model", "mlp", "--world", "2", "--modes", "cuda-graph"], "capture CUDA graphs"),
        (["--model", "mlp", "--world", "2", "--modes", "fast"], "--modes 'fast': choose from"),
        (["--model", "mlp", "--world", "2", "--torch-modes", "compile+graph"], "capture CUDA graphs"),
        (["--model", "mlp", "--world", "2", "--share-experts", "grouped_mm"], "has no transformers experts module"),
    ],
)
def test_bench_rank_refuses_bad_input(argv, message):
    with pytest.raises(SystemExit) as e:
        main(["bench-rank", *argv, "--device", "cpu"])
    assert isinstance(e.value.code, str) and e.value.code.startswith("hidup bench-rank: error:")
    assert message in e.value.code


def test_bench_rank_bad_rank_from_the_shell():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hidup.cli",
            "bench-rank",
            "--model",
            "mlp",
            "--world",
            "2",
            "--rank",
            "5",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "--rank 5 is outside" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr

"""The benchmark driver with `transformers` models by factory: throughput from the inputs, the
hand-written expert baseline skipped with its reason, the loss form the baselines read, and
``--search-only`` writing each plan with predictions priced as the runs will execute it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hidup.models
from exp import benchrun
from exp.bench import work_shape
from exp.benchsearch import _stale, job_name

ROOT = Path(__file__).resolve().parent.parent
TINY_LLAMA = dict(layers=1, hidden=32, heads=2, kv_heads=1, ffn=64, vocab=64, seq=8, batch=2)

pytest.importorskip("transformers")


def _llama(world: int):
    return hidup.models.build("exp.rank_models:llama", world_size=world, device="meta", **TINY_LLAMA)


def test_work_shape_of_a_factory_reads_its_inputs():
    model, inputs = _llama(2)
    shape = work_shape(model, inputs, 2)
    assert (shape.groups_per_gpu, shape.tokens_per_group) == (2, 8)
    assert shape.num_parameters == sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="multiple of 3"):
        work_shape(model, inputs, 3)


def test_work_shape_of_a_zoo_model_reads_its_config():
    model, inputs = hidup.models.build("vit-sgmoe", world_size=2, device="meta", layers=1)
    shape = work_shape(model, inputs, 2)
    assert shape.tokens_per_group is None and shape.groups_per_gpu == model.config.batch_per_gpu


def test_expert_baseline_says_why_it_skips_a_factory_model():
    model, _ = _llama(2)
    why = benchrun.applicable("expert", model)
    assert why is not None and "zoo" in why and "CausalLMStep" in why
    assert benchrun.applicable("ddp", model) is None
    dense, _ = hidup.models.build("gpt", world_size=2, device="meta", layers=1)
    assert "dense" in benchrun.applicable("expert", dense)


def test_causal_lm_step_is_a_mean_over_sequences():
    from exp.baselines.baseline_util import loss_form_of

    model, _ = _llama(2)
    assert loss_form_of(model).kind == "mean"


def test_job_names_are_file_names():
    assert job_name("exp.rank_models:llama", 2, "bf16", {}) == "exp.rank_models-llama-w2-bf16"


def test_a_cached_plan_is_reused_only_for_the_same_job():
    job = {"overrides": {}, "perturb": None, "compiled": True}
    old = {"status": "ok", "profile": {"sha256": "p"}, "job": dict(job, code="c")}
    assert _stale(old, job, "p", "c") == ""
    assert "profile" in _stale(old, job, "q", "c")
    assert "code" in _stale(old, job, "p", "d")
    assert "pricing" in _stale(old, dict(job, compiled=False), "p", "c")
    assert _stale(None, job, "p", "c") == "no result"
    unstated = {"status": "ok", "profile": {"sha256": "p"}, "job": {"overrides": {}, "code": "c"}}
    assert "pricing" in _stale(unstated, job, "p", "c")  # a plan from before jobs stated it is searched again


def test_search_only_writes_plans_with_compiled_predictions(tmp_path):
    out = tmp_path / "bench"
    args = ["--network", "nvlink", "--worlds", "2", "--models", "gpt", "--precisions", "bf16", "--methods",
            "ddp", "fsdp", "expert", "hidup-auto", "--profile", "h200x4-nvlink", "--out", str(out), "--search-only",
            "--layers", "1",
            "--d-model", "32", "--heads", "2", "--ffn", "64", "--seq-len", "8", "--batch-per-gpu", "2",
            "--vocab", "64"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(ROOT / "exp" / "bench.py"), *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (plan_file,) = (out / "plans" / "nvlink").glob("gpt-w2-bf16-*.json")
    doc = json.loads(plan_file.read_text())
    assert doc["status"] == "ok" and doc["job"]["compiled"] is True and doc["job"]["precision"] == "bf16"
    assert set(doc["predicted"]) == {"hidup", "hidup-nodup", "hidup-eager", "hidup-nodup-eager"}
    assert doc["predicted"]["hidup-nodup"] < doc["predicted"]["hidup-nodup-eager"]
    assert plan_file.stem in proc.stdout and "ms" in proc.stdout
    registered = json.loads((out / "nvlink-registered.json").read_text())  # the small file a commit keeps
    mine = registered["plans"][plan_file.stem]
    assert mine["predicted"] == doc["predicted"] and mine["identity"] == doc["identity"]
    for method, parts in mine["predicted_parts"].items():  # the terms a trace is compared with, summing to the total
        assert parts["total"] == doc["predicted"][method] and 0 <= parts["exposed_comm"] <= parts["comm"]
    assert set(mine["styles_predicted"]) == {"ddp", "fsdp"}  # a dense GPT admits no expert style
    assert mine["styles_predicted"]["ddp"]["total"] > 0 and "ddp (data style)" in proc.stdout
    assert registered["code"] == doc["job"]["code"]
    assert not torch.cuda.is_initialized()

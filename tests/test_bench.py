"""The benchmark drivers on a CPU: bench and noise smoke runs at world 2 on a tiny model, the rounds
of --repeats, the results files and the progress watchdog (the time breakdown: test_breakdown.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

import hidup.profiler
from exp import benchreport
from exp.report import write_section

ROOT = Path(__file__).resolve().parent.parent

TINY = [
    "--layers",
    "2",
    "--d-model",
    "32",
    "--heads",
    "2",
    "--ffn",
    "64",
    "--seq-len",
    "8",
    "--batch-per-gpu",
    "4",
    "--vocab",
    "64",
]


# the bench matrix the end-to-end runs below share: world 2 over sockets, BERT-SGMoE in tf32
SOCKETS_W2 = ["--network", "sockets", "--worlds", "2", "--models", "bert-sgmoe", "--precisions", "tf32"]


def _run(script: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "exp" / script)] + args, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


# ------------------------------------------------------------------------------------ bench
@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One bench invocation with every method, both baseline variants and the measured op times: the
    smoke checks read it, and its profile is the ``--ops-from`` source of another network's run."""
    tmp = tmp_path_factory.mktemp("smoke")
    out, docs = tmp / "bench", tmp / "docs"
    proc = _run(
        "bench.py",
        [
            *SOCKETS_W2,
            "--out",
            str(out),
            "--docs",
            str(docs),
            "--warmup",
            "1",
            "--iters",
            "2",
            "--profile-budget",
            "0.02",
            "--time-budget",
            "1000",
            "--breakdown",
            "--variants",
            "eager",
            "graph",
            "--methods",
            "single",
            "single-dup",
            "ddp",
            "fsdp",
            "expert",
            "hidup",
            "hidup-nodup",
            "hidup-auto",
        ]
        + TINY,
        timeout=1200,
    )
    return out, docs, proc


def test_bench_smoke_world2(smoke):
    out, docs, proc = smoke
    doc = json.loads((out / "sockets.json").read_text())
    runs = {r["method"]: r for r in doc["runs"]}
    assert set(runs) == {"single", "single-dup", "ddp", "fsdp", "expert", "hidup", "hidup-nodup", "hidup-auto"}
    for method, r in runs.items():
        assert r["status"] == "ok", (method, r.get("error"))
        assert r["precision"] == "tf32" and r["precision_run"] == "fp32"  # CPU runs tf32 as fp32
        assert r["iter_time_s"] > 0 and r["iters"] >= 1 and r["unit"] == "tok/s"
        assert r["throughput"] == pytest.approx(r["global_batch"] * 8 / r["iter_time_s"])
        assert r["breakdown"]["source"] == "cpu" and Path(r["breakdown"]["trace"]).is_file()
        assert r["iter_time_s"] == min(r["window_times_s"]) and len(r["window_times_s"]) == 3  # --best-of 3
        assert r["warmup"] == 1 and len(r["losses"]) == 1 + 3 * r["iters"]
    for method in ("single", "ddp", "fsdp", "expert"):  # the tuned baselines: each variant recorded
        r = runs[method]
        assert r["variant"] == "eager" and r["variants"]["eager"]["status"] == "ok", method
        assert r["variants"]["graph"]["status"] == "skipped" and "CUDA graphs" in r["variants"]["graph"]["error"]
        assert r["optimizer"] == "Adam(fused=True)" and "graph skipped" in benchreport._note(r)
    assert runs["ddp"]["info"]["static_graph"] and runs["ddp"]["info"]["gradient_as_bucket_view"]
    assert "variant" not in runs["hidup"] and benchreport.variant_of(runs["hidup"]) == "eager"  # hidup's step mode
    assert runs["single"]["scaling_efficiency"] == pytest.approx(1.0)
    floor = runs["single"]["iter_time_s"]
    assert runs["ddp"]["scaling_efficiency"] == pytest.approx(floor / runs["ddp"]["iter_time_s"])
    # same weights, same batch: every distributed method starts from the same global loss
    ref = runs["ddp"]["loss_first"]
    for m in ("fsdp", "expert", "hidup", "hidup-nodup", "hidup-auto"):
        assert runs[m]["loss_first"] == pytest.approx(ref, rel=1e-4), m
    assert runs["single"]["loss_first"] < ref  # one rank's share of the batch
    assert runs["single-dup"]["loss_first"] == pytest.approx(runs["single"]["loss_first"], rel=1e-4)  # two halves
    auto = runs["hidup-auto"]
    assert set(auto["info"]["duplication_trial"]) == {"on_s", "off_s"} and "by trial" in benchreport._note(auto)
    assert auto["predicted_s"] == runs["hidup" if auto["info"]["duplication"] else "hidup-nodup"]["predicted_s"]
    for m in ("hidup", "hidup-nodup"):
        assert runs[m]["predicted_s"] > 0 and runs[m]["search_s"] >= 0
        assert runs[m]["profile"]["name"] == "sockets-measured"  # searched with the profile measured here
    assert runs["hidup"]["info"]["duplication"] is True and runs["hidup-nodup"]["info"]["duplication"] is False
    assert (out / "sockets-profile.json").is_file()
    prof = hidup.profiler.load(out / "sockets-profile.json")  # with the model's op times, both ranks' shares
    assert prof.ops_timing == "eager" and prof.optimizer_s_per_byte > 0 and "in-context check" in prof.notes
    assert "two-copy check" in prof.notes
    assert len(prof.ops) > 20 and all(k.endswith(("tf32", "int64")) for k in prof.ops), sorted(prof.ops)[:5]
    inv = doc["latest"]
    assert inv["env"]["NCCL_P2P_DISABLE"] == "1" and inv["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert inv["command"].startswith("python exp/bench.py --network sockets")
    md = (docs / "benchmarks.md").read_text()
    assert "<!-- begin bench-sockets -->" in md and inv["command"] in md and "Time breakdown" in md
    assert "(vs eager baselines)" in md  # no compiled variant was tried: the comparison says so
    assert "w2/bert-sgmoe/tf32/hidup" in proc.stdout  # the compact table / progress reach stdout


# the resumed invocation and the rounds of --repeats run the same matrix: one invocation with rounds is
# the earlier run that --resume completes
RESUMED = [
    *SOCKETS_W2,
    "--warmup",
    "1",
    "--iters",
    "2",
    "--profile-budget",
    "0.02",
    "--ops-seconds",
    "0",
    "--comm-rounds",
    "1",
    "--variants",
    "eager",
    "--best-of",
    "1",
] + TINY
ROUNDS = ("single", "ddp", "hidup", "hidup-nodup")
RESUMED_METHOD = "hidup-nodup-eager"  # the run --resume adds: the same plan, not captured


@pytest.fixture(scope="module")
def rounds(tmp_path_factory):
    """``--repeats 2`` over the floor, a baseline and the searched plan in both modes (read, never written,
    by the tests)."""
    tmp = tmp_path_factory.mktemp("rounds")
    out, docs = tmp / "bench", tmp / "docs"
    proc = _run(
        "bench.py",
        RESUMED
        + ["--out", str(out), "--docs", str(docs), "--time-budget", "1000", "--repeats", "2", "--methods", *ROUNDS],
        timeout=1200,
    )
    return out, docs, proc


def test_bench_repeats_runs_rounds_and_reports_their_median(rounds):
    out, docs, proc = rounds
    # a round starts only when the one before it is done
    order = [line.split()[2].rstrip(":") for line in proc.stdout.splitlines() if line.startswith("[bench sockets] w2")]
    assert sorted(order[: len(ROUNDS)]) == [f"w2/bert-sgmoe/tf32/{m}#0" for m in sorted(ROUNDS)]
    assert sorted(order[len(ROUNDS) :]) == [f"w2/bert-sgmoe/tf32/{m}#1" for m in sorted(ROUNDS)]
    doc = json.loads((out / "sockets.json").read_text())
    assert doc["latest"]["runs"] == [f"w2/bert-sgmoe/tf32/{m}" for m in sorted(ROUNDS)]
    assert len(doc["runs"]) == len(ROUNDS)
    for r in doc["runs"]:
        times = [x["iter_time_s"] for x in r["rounds"]]
        assert r["status"] == "ok" and [x["round"] for x in r["rounds"]] == [0, 1] and "id" not in r
        assert r["iter_time_s"] == pytest.approx(sum(times) / 2)  # the median of two rounds
        assert r["round_spread"] == pytest.approx(max(times) / min(times))
        assert r["throughput"] == pytest.approx(r["global_batch"] * 8 / r["iter_time_s"])
    md = (docs / "benchmarks.md").read_text()
    assert "median of 2 rounds" in md and "The searched plan against the fastest baseline" in md
    assert "over 2 rounds" in md


def test_bench_resume_runs_only_what_is_missing(rounds, tmp_path):
    out, docs = tmp_path / "bench", tmp_path / "docs"
    shutil.copytree(rounds[0], out)  # the earlier invocation's results, profile and plans
    first = {r["method"]: r for r in json.loads((out / "sockets.json").read_text())["runs"]}
    assert all(first[m]["status"] == "ok" for m in ROUNDS)
    profile_before = (out / "sockets-profile.json").read_bytes()
    common = RESUMED + ["--out", str(out), "--docs", str(docs)]

    proc = _run(
        "bench.py",
        common + ["--methods", *ROUNDS, RESUMED_METHOD, "--time-budget", "1000", "--resume"],
        timeout=1200,
    )
    assert f"{len(ROUNDS)} runs already recorded as ok" in proc.stdout and "1 to run" in proc.stdout
    doc = json.loads((out / "sockets.json").read_text())
    runs = {r["method"]: r for r in doc["runs"]}
    assert doc["latest"]["runs"] == [f"w2/bert-sgmoe/tf32/{RESUMED_METHOD}"]  # only the missing run ran
    resumed = runs[RESUMED_METHOD]
    assert resumed["status"] == "ok" and resumed["profile"]["name"] == "sockets-measured"
    assert runs["single"]["date"] == first["single"]["date"]  # kept as recorded
    assert runs["ddp"] == first["ddp"]
    assert resumed["scaling_efficiency"] == pytest.approx(
        first["single"]["iter_time_s"] / resumed["iter_time_s"]
    )  # against the earlier floor
    assert (out / "sockets-profile.json").read_bytes() == profile_before  # reused, not measured again

    # an invocation that reaches no run (no time) leaves the recorded results as they were
    _run(
        "bench.py",
        common + ["--methods", "single", "--time-budget", "0", "--profile", str(out / "sockets-profile.json")],
        timeout=1200,
    )
    runs = {r["method"]: r for r in json.loads((out / "sockets.json").read_text())["runs"]}
    assert runs["single"]["status"] == "ok" and runs["single"]["date"] == first["single"]["date"]


def test_bench_rejects_zero_rounds(tmp_path):
    from exp import bench

    for flag in ("--repeats", "--comm-rounds", "--best-of"):
        with mock.patch.dict(os.environ), pytest.raises(SystemExit, match="each must be at least 1") as exc:
            bench.main([flag, "0", "--out", str(tmp_path)])
        assert flag in str(exc.value)


def test_merge_rounds_and_the_speedup_table():
    from exp.benchplan import merge_rounds

    def rec(method, rnd, t, status="ok", **kw):
        key = f"w4/m/tf32/{method}"
        return {
            "key": key,
            "id": f"{key}#{rnd}",
            "round": rnd,
            "world": 4,
            "model": "m",
            "precision": "tf32",
            "method": method,
            "status": status,
            "iter_time_s": t if status == "ok" else None,
            "peak_memory_bytes": 10 * (rnd + 1),
            "throughput": 100 / t if t else None,
            "iters": 5,
            **kw,
        }

    plan = {"plan_duplication": True, "predicted_s": 2.0}
    records = [
        rec("expert", 0, 6.0),
        rec("expert", 1, 9.0),
        rec("expert", 2, 3.0, "failed", error="boom"),
        rec("ddp", 0, 8.0),
        rec("ddp", 1, 8.0),
        rec("ddp", 2, 8.0),
        rec("hidup", 0, 2.0, **plan),
        rec("hidup", 1, 4.0, **plan),
        rec("hidup", 2, 3.0, **plan),
        rec("hidup-nodup", 0, 3.0, **plan),
        rec("hidup-nodup", 1, 5.0, **plan),
        rec("hidup-nodup", 2, 3.3, **plan),
        rec("fsdp", 0, None, "failed", error="first"),
        rec("fsdp", 1, None, "failed", error="second"),
    ]
    merged = merge_rounds({r["id"]: r for r in records})
    expert = merged["w4/m/tf32/expert"]
    assert expert["iter_time_s"] == 7.5 and expert["round_spread"] == 1.5  # the failed round is left out
    assert [x["status"] for x in expert["rounds"]] == ["ok", "ok", "failed"]
    assert expert["peak_memory_bytes"] == 20 and expert["throughput"] == pytest.approx(100 / 7.5)
    assert merged["w4/m/tf32/hidup"]["iter_time_s"] == 3.0
    assert merged["w4/m/tf32/fsdp"]["status"] == "failed" and merged["w4/m/tf32/fsdp"]["error"] == "first"
    single = merge_rounds({"k": dict(rec("ddp", 0, 1.0), id="w4/m/tf32/ddp")})["w4/m/tf32/ddp"]
    assert "rounds" not in single and "id" not in single and "round" not in single

    rows = benchreport.speedup_rows(list(merged.values()))
    assert len(rows) == 1
    world, model, prec, best, searched, speedup, dup, eff, pred = rows[0]
    # records from before the variants: eager baselines timed with a sync per step, labelled as such
    assert best == "7500.00 expert eager (per-step sync)"  # the failed round does not make expert faster
    assert searched == "3000.00 dup"
    # expert / hidup per round: 6/2, 9/4 (round 2 failed for expert); nodup / on: 3/2, 5/4, 3.3/3
    assert speedup == "2.50x (2.25-3.00 over 2 rounds) (vs eager baselines)"
    assert dup == "1.10x (1.10-1.50 over 3 rounds)"
    assert pred == "1.50" and eff is None

    # tuned baselines: the fastest variant of any baseline is the reference, named with its variant
    def tuned(method, t, variants):
        fastest = min((v for v in variants if variants[v]), key=variants.get)
        return dict(
            rec(method, 0, t),
            id=f"w4/m/tf32/{method}",
            variant=fastest,
            variants={
                v: {"status": "ok", "iter_time_s": x} if x else {"status": "failed", "error": "e"}
                for v, x in variants.items()
            },
        )

    runs = [
        tuned("ddp", 4.0, {"eager": 6.0, "compile": 4.0, "graph": None}),
        tuned("expert", 5.0, {"eager": 5.0, "compile": None}),
        dict(rec("hidup", 0, 2.0, **plan), id="x"),
    ]
    merged = merge_rounds({r["id"]: r for r in runs})
    [row] = benchreport.speedup_rows(list(merged.values()))
    assert row[3] == "4000.00 ddp compile" and row[5] == "2.00x"  # no label: every baseline tried compiling
    ddp = merged["w4/m/tf32/ddp"]
    assert benchreport.bench_rows([ddp])[0][4] == "compile"
    assert "eager 6000.00 ms, graph failed" in benchreport._note(ddp)
    eager_only = dict(
        merged["w4/m/tf32/expert"],
        variants={
            "eager": {"status": "ok", "iter_time_s": 5.0},
            "compile": {"status": "skipped", "error": "not asked"},
        },
    )
    [row] = benchreport.speedup_rows([merged["w4/m/tf32/hidup"], eager_only])
    assert row[5] == "2.50x (vs eager baselines)"


def test_bench_ops_from_carries_the_op_times_and_measures_the_network(smoke, tmp_path):
    """The smoke run's profile (sockets, with the model's op times) carried into a run on another network."""
    source = smoke[0] / "sockets-profile.json"
    carried = hidup.profiler.load(source)
    assert len(carried.ops) > 20
    common = [
        "--worlds",
        "2",
        "--models",
        "bert-sgmoe",
        "--precisions",
        "tf32",
        "--methods",
        "single",
        "--variants",
        "eager",
        "--best-of",
        "1",
        "--warmup",
        "1",
        "--iters",
        "1",
        "--profile-budget",
        "0.02",
        "--comm-rounds",
        "1",
        "--time-budget",
        "1000",
    ] + TINY
    second = tmp_path / "b"
    _run(
        "bench.py",
        common
        + ["--network", "nvlink", "--out", str(second), "--docs", str(tmp_path / "docs-b"), "--ops-from", str(source)],
        timeout=1200,
    )
    prof = hidup.profiler.load(second / "nvlink-profile.json")
    assert prof.name == "nvlink-measured" and prof.collectives  # the network measured anew
    assert prof.ops == carried.ops  # every op time carried over, none timed again

    from exp import bench

    bad = tmp_path / "no-ops.json"
    hidup.profiler.save(hidup.profiler.load("h200x4-nvlink"), bad)
    with mock.patch.dict(os.environ), pytest.raises(SystemExit, match="no per-op times") as exc:
        bench.main(["--ops-from", str(bad), "--out", str(tmp_path / "c")] + common)
    assert "--ops-from" in str(exc.value) and not (tmp_path / "c").exists()


def test_bench_merges_reruns_and_keeps_other_sections(tmp_path):
    docs = tmp_path / "benchmarks.md"
    write_section(docs, "bench-nvlink", "NVLINK TABLE", title="Benchmarks")
    write_section(docs, "bench-sockets", "SOCKETS v1")
    write_section(docs, "bench-sockets", "SOCKETS v2")
    text = docs.read_text()
    assert text.startswith("# Benchmarks") and "NVLINK TABLE" in text and "SOCKETS v2" in text
    assert "SOCKETS v1" not in text and text.count("<!-- begin bench-sockets -->") == 1


def test_figure_reads_each_networks_merged_results_only(tmp_path):
    def run(method, eff, status="ok"):
        return {
            "key": f"w2/m/tf32/{method}",
            "world": 2,
            "model": "m",
            "precision": "tf32",
            "method": method,
            "status": status,
            "scaling_efficiency": eff,
        }

    merged = {"network": "nvlink", "runs": [run("single", 1.0), run("ddp", 0.8), run("hidup", 1.1)]}
    copy = {"network": "nvlink", "runs": [run("ddp", None, "skipped"), run("hidup", None, "skipped")]}
    (tmp_path / "nvlink.json").write_text(json.dumps(merged))
    (tmp_path / "nvlink-run1.json").write_text(json.dumps(copy))  # sorts first; must not shadow nvlink.json
    (tmp_path / "nvlink-profile.json").write_text(json.dumps({"name": "p"}))
    assert benchreport.figure_panels(tmp_path) == {
        ("nvlink", 2): {"graphed": False, "groups": {("m", "tf32"): {"ddp": 0.8, "hidup": 1.1}}}
    }


def test_read_partial_skips_a_cut_line(tmp_path):
    from exp.bench import read_partial

    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"event": "start", "key": "a"})
        + "\n"
        + json.dumps({"event": "result", "record": {"key": "a", "status": "ok"}})
        + "\n"
        + json.dumps({"event": "start", "key": "b"})
        + "\n"
        + json.dumps({"event": "variant", "key": "b", "variant": "eager", "summary": {"status": "ok"}})
        + "\n"
        + '{"event": "res'
    )
    records, started, variants = read_partial(path)
    assert list(records) == ["a"] and started == ["a", "b"] and variants == {"b": {"eager": {"status": "ok"}}}


def test_a_crash_keeps_the_variants_that_ran():
    """The group failing in a baseline's CUDA-graph variant (FSDP2 under capture, say) keeps the variants
    that finished before it: the run reports the fastest of them and records the crash on the one that
    was running."""
    from exp.bench import crashed_record

    cfg = {
        "network": "nvlink",
        "variants": ["eager", "compile", "graph", "compile-graph"],
        "overrides": {k.lstrip("-").replace("-", "_"): int(v) for k, v in zip(TINY[::2], TINY[1::2])},
    }
    run = {
        "key": "w2/bert-sgmoe/tf32/fsdp",
        "id": "w2/bert-sgmoe/tf32/fsdp",
        "world": 2,
        "model": "bert-sgmoe",
        "precision": "tf32",
        "method": "fsdp",
    }
    done = {
        "eager": {"status": "ok", "iter_time_s": 0.02, "iters": 5},
        "compile": {"status": "ok", "iter_time_s": 0.01, "iters": 5},
    }
    rec = crashed_record(run, "the process group failed during this run: boom", done, cfg, 2)
    assert rec["status"] == "ok" and rec["variant"] == "compile" and rec["iter_time_s"] == 0.01 and "error" not in rec
    assert rec["variants"]["graph"] == {"status": "failed", "error": "the process group failed during this run: boom"}
    assert "compile-graph" not in rec["variants"] and rec["global_batch"] == 2 * 4
    assert rec["throughput"] == pytest.approx(8 * 8 / 0.01) and rec["unit"] == "tok/s"
    lost = crashed_record(run, "boom", {}, cfg, 2)
    assert lost["status"] == "failed" and lost["error"] == "boom" and "variants" not in lost
    only_failed = crashed_record(run, "boom", {"eager": {"status": "failed", "error": "oom"}}, cfg, 2)
    assert only_failed["status"] == "failed" and only_failed["variants"]["compile"]["error"] == "boom"


# ------------------------------------------------------------------------------------ noise
def test_noise_predict_only(tmp_path):
    docs = tmp_path / "docs"
    _run(
        "noise.py",
        [
            "--predict-only",
            "--world",
            "2",
            "--seeds",
            "2",
            "--noise",
            "0.4",
            "--comm",
            "100",
            "--docs",
            str(docs),
            "--bench-out",
            str(tmp_path / "bench"),
            "--search-jobs",
            "0",
            "--time-budget",
            "1000",
        ]
        + TINY,
        timeout=1200,
    )
    res = json.loads((docs / "robustness.json").read_text())
    assert res["predict_only"] is True and res["world"] == 2
    assert [r["label"] for r in res["rows"]] == ["+100% communication", "40% random noise"]
    comm, noise = res["rows"]
    assert comm["plans"] == comm["searched"] == 1 and noise["plans"] == noise["searched"] == 2
    assert noise["distinct"] in (1, 2) and noise["measured"] == 0 and noise["mean_measured"] is None
    clean = res["clean"]
    assert clean["predicted_s"] > 0 and clean["measured_s"] is None
    for job in res["jobs"]:
        assert job["status"] == "ok"
        # the clean plan is the search's optimum under the clean cost model: no perturbed plan beats it
        assert job["relative_predicted"] >= 1.0 - 1e-9
        if job["kind"] == "clean":
            assert job["relative_predicted"] == pytest.approx(1.0) and job["flips"]["nodes"] == []
        if job["identity"] == clean["identity"]:
            assert job["flips"]["nodes"] == []
    assert noise["worst_predicted"] >= noise["mean_predicted"] >= 1.0 - 1e-9
    md = (docs / "robustness.md").read_text()
    assert "predicted only" in md and "40% random noise" in md and "Decisions that flipped" in md


def test_noise_measured_runs_pair_each_plan_with_the_clean_one(tmp_path):
    """The measured study on gloo ranks: every distinct perturbed plan is divided by the clean plan's
    runs right before and after it, a plan above --again-above is measured once more (here: all of
    them, time allowing) and counts with the mean, and the spread of the clean runs is reported."""
    docs = tmp_path / "docs"
    _run(
        "noise.py",
        [
            "--world",
            "2",
            "--seeds",
            "3",
            "--noise",
            "0.8",
            "--comm",
            "100",
            "--docs",
            str(docs),
            "--bench-out",
            str(tmp_path / "bench"),
            "--warmup",
            "1",
            "--iters",
            "2",
            "--time-budget",
            "1000",
            "--profile-budget",
            "0.02",
            "--comm-rounds",
            "1",
            "--again-above",
            "0.01",
        ]
        + TINY,
        timeout=1200,
    )
    res = json.loads((docs / "robustness.json").read_text())
    clean = res["clean"]
    assert clean["measured_s"] > 0 and clean["runs_s"][0] == clean["measured_s"]
    refs, again = set(), []
    for job in res["jobs"]:
        assert job["status"] == "ok" and job["measured_s"] > 0
        if job["identity"] == clean["identity"]:
            assert job["relative_measured"] == 1.0 and "reference_s" not in job
        else:
            assert 1 <= len(job["reference_s"]) <= 2 and set(job["reference_s"]) <= set(clean["runs_s"])
            runs = job["relative_runs"]
            assert runs[0] == pytest.approx(job["measured_s"] / (sum(job["reference_s"]) / len(job["reference_s"])))
            assert len(runs) in (1, 2) and job["relative_measured"] == pytest.approx(sum(runs) / len(runs))
            again.append(len(runs) == 2)
            refs.update(job["reference_s"])
    assert len(clean["runs_s"]) >= 1 + (len(refs) > 1)
    assert any(again), "no plan was measured a second time although every one is above --again-above"
    assert "right before and after" in (docs / "robustness.md").read_text() or not refs


def test_noise_perturbation_list():
    from argparse import Namespace

    from exp import noise

    perts = noise.perturbations(Namespace(comm=[-50, 100], noise=[0.2, 0.8], seeds=2, first_seed=0))
    assert [p["tag"] for p in perts] == [
        "clean",
        "comm-50",
        "comm+100",
        "noise0.2-s0",
        "noise0.8-s0",
        "noise0.2-s1",
        "noise0.8-s1",
    ]
    assert perts[1]["perturb"]["comm_scale"] == 0.5 and perts[2]["perturb"]["comm_scale"] == 2.0
    # completing a study that ran out of time: the same seeds' perturbations from --first-seed on
    rest = noise.perturbations(Namespace(comm=[], noise=[0.2, 0.8], seeds=2, first_seed=1))
    assert [p["tag"] for p in rest] == ["clean", "noise0.2-s1", "noise0.8-s1"] and rest[1:] == perts[5:]
    with pytest.raises(SystemExit, match="less than 100%"):
        noise.perturbations(Namespace(comm=[-100], noise=[], seeds=0, first_seed=0))


def test_a_failing_run_is_recorded_not_raised():
    import torch

    import hidup.models
    from exp import benchrun

    model, inputs = hidup.models.build(
        "bert-sgmoe", world_size=2, layers=2, d_model=32, heads=2, ffn=64, seq_len=8, batch_per_gpu=4, vocab=64
    )
    out = benchrun.execute(
        "hidup", model, inputs, 0, 2, torch.device("cpu"), "fp32", warmup=1, iters=1, cap_s=5.0, plan=None
    )
    assert out["status"] == "failed" and "needs a plan" in out["error"] and out["error"].startswith("rank 0")
    ok = benchrun.execute(
        "single",
        model,
        inputs,
        0,
        2,
        torch.device("cpu"),
        "fp32",
        warmup=1,
        iters=2,
        cap_s=None,
        variants=["eager"],
        best_of=2,
    )
    assert ok["status"] == "ok" and ok["iters"] == 2 and len(ok["window_times_s"]) == 2 and ok["variant"] == "eager"
    capped = benchrun.execute(
        "single", model, inputs, 0, 2, torch.device("cpu"), "fp32", warmup=1, iters=5, cap_s=0.0, variants=["eager"]
    )
    assert capped["iters"] == 1 and capped["capped"]  # over the time cap: one timed step, flagged
    with pytest.raises(ValueError, match="unknown variant"):
        benchrun.execute(
            "ddp", model, inputs, 0, 2, torch.device("cpu"), "fp32", warmup=1, iters=1, cap_s=None, variants=["fast"]
        )
    assert benchrun.applicable(
        "expert",
        hidup.models.build("gpt", layers=1, d_model=32, heads=2, ffn=64, seq_len=8, batch_per_gpu=2, vocab=64)[0],
    )


def test_noise_combine_averages_each_plans_measurements_over_runs(tmp_path):
    """--combine: a plan's relative time is the mean of its paired measurements in every run (found by
    identity, whichever perturbation measured it); runs of another clean plan are refused."""
    from exp import noise

    def job(tag, label, ident, rel=None, runs=None, pred=1.0):
        j = {
            "tag": tag,
            "label": label,
            "kind": "clean" if tag == "clean" else "noise",
            "status": "ok",
            "identity": ident,
            "relative_predicted": pred,
            "flips": {"nodes": [], "kinds": {}, "duplication": None},
        }
        if runs is not None:
            j.update(relative_runs=runs, relative_measured=sum(runs) / len(runs), reference_s=[0.1])
        elif rel is not None:  # an older run: one measurement, no list
            j.update(relative_measured=rel, reference_s=[0.1, 0.1])
        return j

    a = {
        "clean": {"identity": "c"},
        "command": "a",
        "jobs": [
            job("clean", "clean", "c"),
            job("n0.8-s0", "80%", "p", rel=1.2, pred=1.1),
            job("n0.8-s1", "80%", "c"),
            job("n0.2-s0", "20%", "q"),
        ],
    }  # q: searched, not measured in this run
    b = {
        "clean": {"identity": "c"},
        "command": "b",
        "jobs": [
            job("clean", "clean", "c"),
            job("n0.2-s0", "20%", "q", runs=[1.0, 1.1]),
            job("n0.8-s1", "80%", "p", runs=[1.4]),
        ],
    }
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    res = noise.combine([pa, pb])
    seeds = {x["tag"]: x for x in res["seeds"]}
    assert seeds["n0.8-s0"]["relative_measured"] == pytest.approx((1.2 + 1.4) / 2)  # p measured in both runs
    assert seeds["n0.8-s1"]["relative_measured"] == 1.0  # the first run's plan for that seed is the clean one
    assert seeds["n0.2-s0"]["relative_measured"] == pytest.approx(1.05) and len(seeds["n0.2-s0"]["measured"]) == 2
    rows = {r["label"]: r for r in res["rows"]}
    assert rows["80%"]["mean_measured"] == pytest.approx(1.15) and rows["80%"]["worst_measured"] == pytest.approx(1.3)
    assert rows["80%"]["worst_predicted"] == 1.1 and rows["80%"]["measured"] == 2
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "robustness.md").write_text("# Robustness\n\nkept text\n")
    assert noise.main(["--combine", str(pa), str(pb), "--docs", str(docs)]) == 0
    md = (docs / "robustness.md").read_text()
    assert "kept text" in md and "<!-- begin combined -->" in md
    assert "[`a.json`](../a.json), [`b.json`](../b.json)" in md
    assert json.loads((docs / "robustness.json").read_text())["clean"] == "c"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(b, clean={"identity": "d"})))
    with pytest.raises(SystemExit, match="different clean plans"):
        noise.main(["--combine", str(pa), str(other), "--docs", str(docs)])


def test_stall_watch_fires_only_on_a_run_in_progress(tmp_path):
    import os
    import time

    from exp import bench

    partial = tmp_path / "progress.jsonl"
    watch = bench.stall_watch(partial, 60)
    assert watch() is None  # no file yet: the group is starting (profile, plans)
    partial.write_text(json.dumps({"event": "start", "key": "w2/m/tf32/hidup"}) + "\n")
    assert watch() is None  # started just now
    old = time.time() - 120
    os.utime(partial, (old, old))
    assert "w2/m/tf32/hidup made no progress for 60 s" in watch()
    with open(partial, "a") as f:
        f.write(json.dumps({"event": "result", "record": {"key": "w2/m/tf32/hidup"}}) + "\n")
    os.utime(partial, (old, old))
    assert watch() is None  # between runs: nothing in progress
    with open(partial, "a") as f:
        f.write(json.dumps({"event": "start", "key": "w2/m/tf32/ddp"}) + "\n")
        f.write(json.dumps({"event": "phase", "key": "w2/m/tf32/ddp", "phase": "capture"}) + "\n")
    assert watch() is None  # a phase began just now
    os.utime(partial, (old, old))
    assert "w2/m/tf32/ddp made no progress in phase 'capture' for 60 s" in watch()
    assert bench.stall_watch(partial, 0)() is None


def test_cached_plans_are_keyed_by_every_source_the_search_reads(tmp_path):
    import shutil

    from exp import benchsearch

    for part in ("hidup", "search", "profiler"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "exp").mkdir()
    shutil.copy(ROOT / "exp" / "benchsearch.py", tmp_path / "exp" / "benchsearch.py")
    before = benchsearch._digest_of(tmp_path)
    assert before == benchsearch.code_digest()  # the repository's own digest, from the same files
    changed_files = ("profiler/tables.py", "search/cost.py", "hidup/ir.py", "exp/benchsearch.py")
    for changed in changed_files:  # collective tables, cost model, IR, the result's fields
        f = tmp_path / changed
        text = f.read_text()
        f.write_text(text + "\n# changed\n")
        assert benchsearch._digest_of(tmp_path) != before, changed
        f.write_text(text)
    assert benchsearch._digest_of(tmp_path) == before

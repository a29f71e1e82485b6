"""The cost model's empirical corrections: kept apart from the physical terms, each with its
provenance, applied exactly once, loaded from older profiles as what they were, and held out."""

import json

import pytest

import hidup
import hidup.profiler as P
from hidup.frontend.trace import trace
from hidup.ir import FULL, gather
from hidup.profiler.corrections import Correction, CorrectionError, Corrections, Point, Provenance
from hidup.search import price, search
from hidup.search.cost import CostModel
from hidup.search.problem import Problem

TINY = dict(layers=1, d_model=16, heads=2, ffn=32, seq_len=4, batch_per_gpu=4, vocab=32)
TINY_MOE = dict(TINY, experts_per_gpu=1)


def _graph(name="gpt", world=2, **overrides):
    model, inputs = hidup.models.build(name, world_size=world, device="meta", **(overrides or TINY))
    return trace(model, inputs, world, half_batch=True)


def _fitted() -> Corrections:
    prov = Provenance(
        fitted_on=(
            Point("bert-sgmoe", "tf32", 27.63e-3, 25.49e-3, 0.89, 1.094),
            Point("bert-sgmoe", "bf16", 19.01e-3, 17.85e-3, 0.84, 1.077),
        ),
        held_out=(Point("vit-switch", "tf32", 20e-3, 21e-3, 0.9, 0.95),),
        device="NVIDIA H200",
        world=4,
        cuda_graphs=True,
        date="2026-11-21",
    )
    return Corrections(dist_scale=Correction(1.086, prov), dist_dup_scale=Correction(0.93, prov))


def test_corrections_round_trip_through_a_profile_file(tmp_path):
    prof = P.load("h200x4-nvlink").with_corrections(_fitted())
    back = P.load(P.save(prof, tmp_path / "p.json"))
    assert back.corrections == prof.corrections
    doc = json.loads((tmp_path / "p.json").read_text())
    entry = doc["corrections"]["dist_scale"]
    assert entry["value"] == 1.086 and "every call node of a plan without duplication" in entry["multiplies"]
    assert [p["model"] for p in entry["provenance"]["fitted_on"]] == ["bert-sgmoe", "bert-sgmoe"]
    assert "dist_scale" not in doc and "ops_scale" not in doc and "dup_scale" not in doc
    assert Corrections.from_dict(prof.corrections.to_dict()) == prof.corrections
    assert back.corrections.dist_scale.provenance.models == ("bert-sgmoe",)
    assert back.corrections.dist_scale.provenance.held_out_models == ("vit-switch",)
    assert back.corrections.dist_scale.provenance.held_out[0].error == pytest.approx(0.05)


def test_profiles_without_corrections_load_as_the_identity():
    for name in P.builtin_names():
        prof = P.load(name)
        assert prof.corrections == Corrections() and prof.corrections.identity
        assert not prof.corrections.in_sample("bert-sgmoe") and prof.corrections.calibration_models() == []
    doc = P.load("h200x4-nvlink").to_dict()
    del doc["corrections"]
    assert P.Profile.from_dict(doc).corrections.identity
    # an older document: the factors at the top level, nothing said about what they were fitted on
    legacy = P.Profile.from_dict(dict(doc, dist_scale=1.08, dist_dup_scale=1.0))
    assert legacy.corrections.dist_scale.value == 1.08 and legacy.corrections.dist_dup_scale.identity
    assert not legacy.corrections.dist_scale.provenance.recorded
    assert legacy.corrections.in_sample("any-model") and legacy.corrections.calibration_models() == ["?"]
    assert P.Profile.from_dict(dict(doc, dist_scale=1.0)).corrections == Corrections()
    with pytest.raises(P.ProfileError, match="corrections"):  # both spellings at once: ambiguous
        P.Profile.from_dict(dict(P.load("h200x4-nvlink").to_dict(), dist_scale=1.1))


def test_malformed_corrections_name_the_field():
    doc = P.load("h200x4-nvlink").with_corrections(_fitted()).to_dict()
    for path, value, match in (
        (("dist_scale", "value"), 0.0, "dist_scale.value"),
        (("dist_dup_scale", "provenance", "world"), "four", "dist_dup_scale.provenance.world"),
        (("dist_scale", "provenance", "fitted_on"), [{"model": 3}], "fitted_on\\[0\\]"),
    ):
        bad = json.loads(json.dumps(doc))
        node = bad["corrections"]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(P.ProfileError, match=match):
            P.Profile.from_dict(bad)
    bad = json.loads(json.dumps(doc))
    bad["corrections"]["ops_scale"] = {"value": 2.0}
    with pytest.raises(P.ProfileError, match="unknown correction"):
        P.Profile.from_dict(bad)
    with pytest.raises(CorrectionError, match="unknown correction"):
        Corrections.of(ops_scale=2.0)


def test_in_sample_names_the_calibration_models_only():
    c = _fitted()
    assert c.in_sample("bert-sgmoe") and not c.in_sample("vit-switch") and not c.in_sample("gpt")
    assert c.calibration_models() == ["bert-sgmoe"]
    by_hand = Corrections.of(dist_scale=1.2)  # set by hand: fitted on nothing
    assert not by_hand.identity and not by_hand.in_sample("bert-sgmoe") and by_hand.calibration_models() == []
    assert "fitted on bert-sgmoe" in c.describe() and "vit-switch tf32 +5.0%" in c.describe()
    assert Corrections().describe() == "none (identity)"


def test_each_correction_is_applied_exactly_once():
    """dist_scale = 2 doubles exactly the compute of every call node without duplication, and
    nothing else; dist_dup_scale = 2 doubles exactly each copy's compute, and nothing else."""
    g = _graph()
    base = P.load("h200x4-nvlink")
    plain = CostModel(g, base)
    one = CostModel(g, base.with_corrections(dist_scale=2.0))
    two = CostModel(g, base.with_corrections(dist_dup_scale=2.0))
    seen = 0
    for node in g.nodes:
        for sig in node.signatures:
            physical, copy = plain.device_compute(node, sig), plain.copy_device_compute(node, sig)
            assert plain.compute(node, sig) == physical and plain.copy_compute(node, sig) == copy
            assert one.device_compute(node, sig) == physical and one.copy_device_compute(node, sig) == copy
            assert one.compute(node, sig) == (2 * physical[0], 2 * physical[1])
            assert one.copy_compute(node, sig) == copy
            assert two.compute(node, sig) == physical
            assert two.copy_compute(node, sig) == (2 * copy[0], 2 * copy[1])
            assert one.fixed(node) == two.fixed(node) == plain.fixed(node)
            seen += physical[0] > 0
    assert seen
    compared = 0
    for tid, t in g.tensors.items():  # communication and memory copies stay physical
        if not t.shape or t.shape[0] % 2:
            continue
        compared += 1
        for src, dst in ((FULL, gather(0)), (gather(0), FULL)):
            assert one.conversion(tid, src, dst) == two.conversion(tid, src, dst) == plain.conversion(tid, src, dst)
    assert compared
    # the problem the DP solves reads the same corrected times
    pr, pr1 = Problem(g, base), Problem(g, base.with_corrections(dist_scale=2.0))
    for i in range(pr.n):
        for k in range(len(pr.sigs[i])):
            assert pr1.compute[i][k] == tuple(2 * x for x in pr.compute[i][k])
            assert pr1.compute_copy[i][k] == pr.compute_copy[i][k]


def test_deleted_factors_of_older_profiles_change_no_time():
    """A document with ops_scale = 2 and dup_scale = 2 (factors that measured about 1 and are gone)
    prices every node as the same document without them, and its notes say they were dropped."""
    g = _graph()
    doc = P.load("h200x4-nvlink").to_dict()
    old = P.Profile.from_dict(dict(doc, ops_scale=2.0, dup_scale=2.0))
    assert "dup_scale 2.000, ops_scale 2.000 not applied" in old.notes
    new, was = CostModel(g, P.Profile.from_dict(doc)), CostModel(g, old)
    for node in g.nodes:
        for sig in node.signatures:
            assert was.compute(node, sig) == new.compute(node, sig)
            assert was.copy_compute(node, sig) == new.copy_compute(node, sig)


def test_perturbation_draws_the_corrections_last_and_keeps_their_provenance():
    prof = P.load("h200x4-nvlink").with_ops({"linear(8x16,16x16)fp32": (1e-6, 2e-6)})
    fitted = prof.with_corrections(_fitted())
    a, b = fitted.perturb(0.3, seed=7), prof.perturb(0.3, seed=7)
    assert a.ops == b.ops and a.flops == b.flops and a.collectives == b.collectives
    assert a.corrections.dist_scale.provenance == fitted.corrections.dist_scale.provenance
    ratio = a.corrections.dist_scale.value / 1.086
    assert ratio == pytest.approx(b.corrections.dist_scale.value) and 0.7 <= ratio <= 1.3
    assert P.load("h200x4-nvlink").perturb(0.3, seed=7).corrections.identity  # no per-op times: not drawn


def test_the_search_explores_the_physical_time_and_the_corrections_pick_the_mode():
    g = _graph("bert-switch", **TINY_MOE)
    base = P.load("h200x4-nvlink")
    plain = search(g, base)
    for one, dup in ((1.5, 0.6), (0.6, 1.5)):
        prof = base.with_corrections(dist_scale=one, dist_dup_scale=dup)
        plan = search(g, prof)
        assert plan.choices == plain.choices
        priced = price(g, prof, plan)
        assert plan.duplication == (priced[True].total <= priced[False].total)


def _check(model, overrides, plan, factor, measured, scale=None):
    out = {
        "model": model,
        "overrides": overrides,
        "precision": "fp32",
        "world": 2,
        "cuda_graphs": False,
        "factor": factor,
        "measured_s": measured,
        "predicted_s": measured,
        "coverage": 0.9,
        "plan": plan.to_dict(),
    }
    if scale is not None:
        out["scale"] = scale
    return out


def test_program_corrections_are_fitted_on_calibration_models_and_checked_on_held_out_ones():
    from hidup.profiler.measure.calibrate import apply_program_checks, program_scales

    prof = P.load("h200x4-nvlink")
    fit_graph, held_graph = _graph(), _graph("bert-switch", **TINY_MOE)
    fit_plan, held_plan = search(fit_graph, prof), search(held_graph, prof)
    checks = [
        _check("gpt", TINY, fit_plan, "dist_scale", 1e-3, 1.21),
        _check("gpt", TINY, fit_plan, "dist_scale", 1e-3, 1.0),
        _check("gpt", TINY, fit_plan, "dist_dup_scale", 1e-3, 0.9),
        # held out: its own factor (0.5) must not enter the fit
        _check("bert-switch", TINY_MOE, held_plan, "dist_scale", 2e-3, 0.5),
        _check("bert-switch", TINY_MOE, held_plan, "dist_dup_scale", 3e-3, 0.5),
    ]
    out = apply_program_checks(prof, checks, held_out=["bert-switch"])
    c = out.corrections
    assert c.dist_scale.value == pytest.approx(1.1) and c.dist_dup_scale.value == pytest.approx(0.9)
    assert c.dist_scale.provenance.models == ("gpt",) == c.dist_dup_scale.provenance.models
    assert [p.scale for p in c.dist_scale.provenance.fitted_on] == [1.21, 1.0]
    assert c.in_sample("gpt") and not c.in_sample("bert-switch")
    # each held-out plan is priced with the fitted factors, in its own mode
    held = c.dist_scale.provenance.held_out
    assert [(p.model, p.measured_s) for p in held] == [("bert-switch", 2e-3)]
    no_dup = price(held_graph, out, held_plan, "fp32", False)[False]
    assert held[0].predicted_s == pytest.approx(no_dup.forward + no_dup.backward, rel=1e-12)
    dup = price(held_graph, out, held_plan, "fp32", False)[True]
    assert c.dist_dup_scale.provenance.held_out[0].predicted_s == pytest.approx(dup.forward + dup.backward, rel=1e-12)
    physical = price(held_graph, prof, held_plan, "fp32", False)[False]
    assert held[0].predicted_s != pytest.approx(physical.forward + physical.backward)
    assert "(held out)" in out.notes and prof.corrections.identity
    with pytest.raises(ValueError, match="gpt both calibrates and is held out"):
        program_scales(prof, [("gpt", TINY)], ("fp32",), None, held_out=[("gpt", TINY)])


def test_bench_report_marks_predictions_on_calibration_models_in_sample():
    from exp import benchreport

    def run(model, method, t, fitted):
        return {
            "world": 4,
            "model": model,
            "precision": "tf32",
            "method": method,
            "status": "ok",
            "iter_time_s": t,
            "predicted_s": 0.01 if method.startswith("hidup") else None,
            "plan_duplication": False,
            "variant": "graph",
            "profile": {"calibration_models": fitted} if method.startswith("hidup") else None,
        }

    runs = [
        run("bert-sgmoe", "hidup-nodup", 0.011, ["bert-sgmoe"]),  # calibrated on its own plans
        run("vit-switch", "hidup-nodup", 0.012, ["bert-sgmoe"]),  # held out
        run("gpt", "hidup-nodup", 0.013, ["?"]),  # an older profile: its calibration models unknown
        run("bert-sgmoe", "ddp", 0.02, None),
    ]
    cells = {r[1]: r[11] for r in benchreport.bench_rows(runs) if r[3] == "hidup-nodup"}
    assert cells == {"bert-sgmoe": "1.10 (in-sample)", "vit-switch": "1.20", "gpt": "1.30 (in-sample)"}
    [row] = benchreport.speedup_rows(runs)
    assert row[1] == "bert-sgmoe" and row[-1] == "1.10 (in-sample)"


def test_held_out_plans_need_calibration_plans_and_other_models():
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = str(Path(__file__).resolve().parent.parent / "exp" / "profiler.py")
    env = {k: v for k, v in os.environ.items() if k not in ("CPN", "NODERANK", "WORLD_SIZE")}
    alone = subprocess.run(
        [sys.executable, script, "--merge", "h200x4-nvlink", "--held-out-plans", "gpt"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert alone.returncode == 1 and "give --calibrate-plans too" in alone.stderr
    assert "Traceback" not in alone.stderr
    both = subprocess.run(
        [
            sys.executable,
            script,
            "--merge",
            "h200x4-nvlink",
            "--calibrate-plans",
            "gpt,bert-switch",
            "--held-out-plans",
            "gpt",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert both.returncode == 1 and "--held-out-plans gpt: also in --calibrate-plans" in both.stderr

"""The compiled rank program (:mod:`hidup.codegen.compiled`) keeps loss and gradient parity with the
single-device model at world 2 (gloo), duplication off and on (on: the two-stream stage schedule
run without streams, ``streams=True``, each stage compiled on its own).

CPU inductor compiles C++ and takes about a minute per program on two cores, so the parity runs use
torch.compile's ``aot_eager`` backend: the same dynamo capture, the same custom ops, fake kernels and
autograd formulas, and the same AOTAutograd forward/backward graphs that inductor lowers -- only the
final lowering to fused kernels differs.  One test runs real inductor on the smallest model.
Models in float64 (rounding far below the 1e-9 tolerance whatever kernels run).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from dist_util import run_distributed

PROFILE = "h200x4-nvlink"
SMALL = {
    "mlp": dict(layers=2, d_model=16, ffn=32, batch_per_gpu=4),
    "bert-sgmoe": dict(layers=2, d_model=32, heads=4, ffn=64, seq_len=8, batch_per_gpu=4, vocab=64),
    "gpt": dict(layers=1, d_model=32, heads=4, ffn=64, seq_len=8, batch_per_gpu=4, vocab=64),
}
TOL = 1e-9


def _plans(name: str, world: int) -> dict:
    import hidup
    from hidup.frontend.trace import trace_module
    from hidup.search import forced

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model, inputs = hidup.models.build(name, world_size=world, **SMALL[name])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = trace_module(model, inputs, world).graph
            style = "expert" if "moe" in name else "tensor"
            return {
                "nodup": forced(graph, PROFILE, style, duplication=False),
                "dup": forced(graph, PROFILE, style, duplication=True),
            }
    finally:
        torch.set_default_dtype(before)


def _errors(module, loss, ref, ref_grads) -> tuple[float, float]:
    """The relative error of the step's global loss, and of its gradients (relative to the largest)."""
    from hidup.codegen.params import full_grad_dict

    total = float(module.global_loss(loss))
    grads = full_grad_dict(module)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    grad_err = max(float((grads[n] - g).abs().max()) / scale for n, g in ref_grads.items())
    return abs(total - float(ref)) / abs(float(ref)), grad_err


def _rank(rank, world, jobs, backend, dups=("nodup", "dup")):
    import hidup
    from hidup.codegen import compiled

    torch.set_default_dtype(torch.float64)
    out = {}
    for name, plans in jobs:
        model, inputs = hidup.models.build(name, world_size=world, **SMALL[name])
        ref = model(*inputs)
        ref.backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        for key, plan in plans.items():
            if key not in dups:
                continue
            dup = key == "dup"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = hidup.compile(model, plan, rank, world, inputs, duplication=dup, streams=dup, compile=backend)
            errs, used = [], {"forward": set(), "backward": set()}
            phase = ["forward"]
            lookup = compiled.group_of

            # which process group each collective of the compiled graphs runs on
            def spy(key, used=used, phase=phase, lookup=lookup):
                used[phase[0]].add(int(key))
                return lookup(key)

            compiled.group_of = spy
            for _ in range(2):  # the second step runs the cached graphs
                module.zero_grad(set_to_none=True)
                phase[0] = "forward"
                loss = module(*inputs)
                phase[0] = "backward"
                loss.backward()
                errs.append(_errors(module, loss, ref, ref_grads))
            compiled.group_of = lookup
            groups = module.copy_groups if module.copy_groups else (module.group,)
            expected = {compiled.group_key(g) for g in groups}
            out[(name, key)] = {
                "errs": errs,
                "groups_ok": used["forward"] == used["backward"] == expected,
                "groups": (used, expected),
                "duplication": module.duplication,
                "backend": module.compile_backend,
                "stages": getattr(getattr(module, "runner", None), "num_stages", None),
                "compiled_stages": len(getattr(getattr(module, "runner", None), "compiled", {})),
            }
    return out


_CACHE: dict = {}


def _results(backend: str, names: tuple, dups: tuple = ("nodup", "dup")) -> list:
    key = (backend, names, dups)
    if key not in _CACHE:
        jobs = [(n, _plans(n, 2)) for n in names]
        _CACHE[key] = run_distributed(_rank, 2, jobs, backend, dups, timeout=600)
    return _CACHE[key]


@pytest.mark.parametrize("name", ("bert-sgmoe", "mlp"))
@pytest.mark.parametrize("dup", ("nodup", "dup"))
def test_compiled_parity_world2(name, dup):
    results = _results("aot_eager", (name,), (dup,))
    for rank, res in enumerate(results):
        r = res[(name, dup)]
        assert r["backend"] == "aot_eager"
        assert r["duplication"] == (dup == "dup"), f"{name} {dup}: duplication did not run as asked"
        assert r["groups_ok"], f"{name} {dup} rank {rank}: collectives ran on the wrong process groups {r['groups']}"
        if dup == "dup":
            assert r["stages"] > 1 and r["compiled_stages"] == r["stages"], (
                f"{name}: {r['compiled_stages']} of {r['stages']} stages compiled"
            )
        for step, (loss_err, grad_err) in enumerate(r["errs"]):
            where = f"{name} {dup} rank {rank} step {step}"
            assert loss_err < TOL, f"{where}: loss differs by {loss_err:.2e}"
            assert grad_err < TOL, f"{where}: gradients differ by {grad_err:.2e}"


@pytest.mark.skipif(bool(os.environ.get("HIDUP_QUICK_TESTS")), reason="CPU inductor compiles C++ (a minute cold)")
def test_inductor_parity_world2():
    results = _results("inductor", ("mlp",))
    for rank, res in enumerate(results):
        for key, r in res.items():
            assert r["backend"] == "inductor"
            for loss_err, grad_err in r["errs"]:
                assert loss_err < TOL and grad_err < TOL, f"{key} rank {rank}: {loss_err:.2e} {grad_err:.2e}"


def test_compile_option_errors():
    from hidup.codegen.compiled import backend_of

    assert backend_of(False) is None and backend_of("off") is None
    assert backend_of(True) == "inductor" and backend_of("aot_eager") == "aot_eager"
    with pytest.raises(ValueError, match="not a torch.compile backend"):
        backend_of("no-such-backend")


def test_convert_op_shapes_match_fake():
    """The custom op's fake kernel gives the shape its eager kernel produces, for every conversion."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hidup.codegen import compiled

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        x = torch.randn(8, 4, 12)
        pairs = [
            ("full", "gather_0"),
            ("gather_0", "full"),
            ("gather_1", "gather_2"),
            ("reduce", "gather_1"),
            ("full", "reduce"),
            ("reduce", "full"),
            ("gather_2", "reduce"),
        ]
        for src, dst in pairs:
            token = compiled._TOKENS[compiled.group_key(None)]
            y = torch.ops.hidup.convert(x, src, dst, 4, token)
            ones = torch.ones_like(y)
            g = torch.ops.hidup.convert_backward(ones, src, dst, 4, token)
            mode = FakeTensorMode()
            fake_x, fake_ones, fake_token = mode.from_tensor(x), mode.from_tensor(ones), mode.from_tensor(token)
            with mode:
                fy = torch.ops.hidup.convert(fake_x, src, dst, 4, fake_token)
                fg = torch.ops.hidup.convert_backward(fake_ones, src, dst, 4, fake_token)
            assert fy.shape == y.shape and y.is_contiguous(), (src, dst, y.shape, fy.shape)
            assert fg.shape == g.shape == x.shape, (src, dst, g.shape, fg.shape)
            assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    finally:
        dist.destroy_process_group()


def _rank_llama(rank, world, plan):
    """transformers Llama (float64, loss a float32 mean over a padded, data-dependent label count):
    duplicated copies need the copies' label counts added, which the compiled program reads at run
    time (:func:`hidup.codegen.program.hidup_copy_sum`, left eager inside the compiled program; the
    copies run one after the other, the staged schedule is the test above's)."""
    import thirdparty
    from hidup.codegen import compile
    from hidup.codegen.params import full_grad_dict

    warnings.simplefilter("ignore")
    model, inputs = thirdparty.build("llama")
    module = compile(model, plan, rank, world, inputs, duplication=True, streams=False, compile="aot_eager")
    loss = module(*inputs)
    loss.backward()
    total, grads = float(module.global_loss(loss)), full_grad_dict(module)
    ref, ref_inputs = thirdparty.build("llama")
    ref_loss = ref(*ref_inputs)
    ref_loss.backward()
    scale = max(float(p.grad.abs().max()) for p in ref.parameters())
    grad_err = max(
        float((grads[n] - p.grad).abs().max()) / max(float(p.grad.abs().max()), 1e-2 * scale)
        for n, p in ref.named_parameters()
    )
    return {
        "loss": total,
        "ref": float(ref_loss),
        "grad": grad_err,
        "duplication": module.duplication,
        "side_pass": module.side_pass is not None,
    }


def test_compiled_llama_masked_mean_duplicated():
    pytest.importorskip("transformers")
    import thirdparty
    from hidup.frontend.trace import trace
    from hidup.search import forced

    model, inputs = thirdparty.build("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = forced(trace(model, inputs, world_size=2), PROFILE, "data", duplication=True)
    tol = 4 * thirdparty.BATCH * thirdparty.SEQ * torch.finfo(thirdparty.LOSS_DTYPE["llama"]).eps
    for rank, r in enumerate(run_distributed(_rank_llama, 2, plan, timeout=600)):
        assert r["duplication"] and r["side_pass"], f"rank {rank}: duplication with label counts did not run"
        assert abs(r["loss"] - r["ref"]) <= tol * abs(r["ref"]), f"rank {rank}: loss {r['loss']} vs {r['ref']}"
        assert r["grad"] <= tol, f"rank {rank}: gradients differ by {r['grad']:.2e}"


@pytest.mark.skipif(bool(os.environ.get("HIDUP_QUICK_TESTS")), reason="CPU inductor compiles C++ (a minute cold)")
def test_train_compile_on_matches_eager(tmp_path):
    """``hidup train --compile on`` (inductor) on two gloo ranks: prints its compilation time and
    trains the same losses as ``--compile off`` (float32: the first loss to rounding, later ones
    within the drift three Adam steps allow)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    tiny = [
        "--model",
        "gpt",
        "--layers",
        "1",
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
        "--world",
        "2",
        "--iterations",
        "3",
        "--warmup",
        "0",
        "--profile",
        PROFILE,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    losses = {}
    for mode in ("off", "on"):
        out = tmp_path / f"{mode}.json"
        proc = subprocess.run(
            [sys.executable, "-m", "hidup", "train", *tiny, "--compile", mode, "--json", str(out)],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        result = json.loads(out.read_text())
        assert result["compile"] == (mode == "on")
        if mode == "on":
            assert "compiled the rank program with inductor in" in proc.stdout and result["compile_s"] > 0
        losses[mode] = result["losses"]
    assert losses["on"][0] == pytest.approx(losses["off"][0], rel=1e-5)
    assert losses["on"] == pytest.approx(losses["off"], rel=1e-3)


def test_choose_compile_keeps_the_faster_mode_and_no_gradient():
    """``choose_compile`` (``hidup train --compile auto``) on one process: it times eager and compiled
    steps, reports the compiling step's time, leaves the module in the mode it reports and no gradient;
    the compiled module then computes the eager loss."""
    import hidup
    from hidup.codegen.trial import choose_compile
    from hidup.frontend.trace import trace_module
    from hidup.search import forced

    model, inputs = hidup.models.build("mlp", world_size=1, **SMALL["mlp"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = forced(trace_module(model, inputs, 1).graph, PROFILE, "data", duplication=False)
    module = hidup.compile(model, plan, 0, 1, inputs)
    eager_loss = float(module(*inputs).detach())
    info = choose_compile(module, inputs, cuda_graphs=False, trials=2, warmup=1, backend="aot_eager")
    assert set(info["trial"]) == {"eager_s", "compiled_s"} and info["compile_s"] > 0
    assert module.compile_backend == ("aot_eager" if info["compile"] else None)
    assert info["compile"] == (info["trial"]["compiled_s"] * 1.02 < info["trial"]["eager_s"])
    assert all(p.grad is None for p in module.parameters())
    module.set_compile("aot_eager")
    assert float(module(*inputs).detach()) == pytest.approx(eager_loss, rel=1e-6)


def _rank_segmented(rank, world, plan):
    """A data-parallel GPT compiled with a gradient bucket per few parameters: the program is compiled
    in segments, and a bucket is launched while later parameters still wait for their gradients."""
    import hidup

    torch.set_default_dtype(torch.float64)
    model, inputs = hidup.models.build("gpt", world_size=world, **SMALL["gpt"])
    ref = model(*inputs)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = hidup.compile(model, plan, rank, world, inputs, duplication=False, compile="aot_eager", bucket_mb=0.01)
    bucketer = module.bucketer
    waiting = []  # at each bucket's launch: how many replicated parameters had no gradient yet
    launch = bucketer._launch

    def spy(bucket):
        waiting.append(sum(p.grad is None for b in bucketer.buckets for p in b.params))
        launch(bucket)

    bucketer._launch = spy
    errs = []
    for _ in range(2):
        module.zero_grad(set_to_none=True)
        loss = module(*inputs)
        loss.backward()
        errs.append(_errors(module, loss, ref, ref_grads))
    run = module._run[0]
    segments = sum(1 for n in getattr(run, "graph", torch.fx.Graph()).nodes if n.op == "call_module")
    return {"errs": errs, "segments": segments, "buckets": len(bucketer.buckets), "waiting": waiting}


def test_compiled_program_overlaps_gradient_buckets_with_the_backward():
    """Without duplication the compiled program is one graph per gradient bucket: the buckets of the
    last layers are all-reduced while the backward of the first layers still runs, and the loss and
    gradients are those of one device."""
    import hidup
    from hidup.frontend.trace import trace_module
    from hidup.search import forced

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model, inputs = hidup.models.build("gpt", world_size=2, **SMALL["gpt"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = forced(trace_module(model, inputs, 2).graph, PROFILE, "data", duplication=False)
    finally:
        torch.set_default_dtype(before)
    for rank, r in enumerate(run_distributed(_rank_segmented, 2, plan, timeout=600)):
        assert r["segments"] > 1 and r["buckets"] > 1, f"rank {rank}: {r['segments']} segments, {r['buckets']} buckets"
        assert r["waiting"][0] > 0, f"rank {rank}: the first bucket launched only after the whole backward"
        for step, (loss_err, grad_err) in enumerate(r["errs"]):
            assert loss_err < TOL and grad_err < TOL, f"rank {rank} step {step}: {loss_err:.2e} {grad_err:.2e}"


def test_segments_are_cut_at_layer_boundaries():
    """The compiled segments of a layered program start where a repeated layer starts, never inside
    one, and hold at least a bucket's parameters; without layers every parameter read may cut."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import hidup
    from hidup.codegen.compiled import LAYER, bucket_segments
    from hidup.frontend.trace import trace_module
    from hidup.ir import block_label
    from hidup.search import forced
    from hidup.search.problem import Problem
    from hidup.search.schedule import graph_ends

    model, inputs = hidup.models.build("gpt", world_size=2, **dict(SMALL["gpt"], layers=3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace_module(model, inputs, 2).graph
        plan = forced(graph, PROFILE, "data", duplication=False)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        gm = hidup.compile(model, plan, 0, 2, inputs, duplication=False).gm
    finally:
        dist.destroy_process_group()
    replicated = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    seg = bucket_segments(gm, replicated, 1e-6)  # a bucket per parameter: cut wherever allowed
    starts = [(prev, n) for prev, n in zip(calls, calls[1:]) if seg[n.name] != seg[prev.name]]
    layers = sorted({n.meta[LAYER] for n in calls if n.meta[LAYER]})
    assert len(layers) == 3 and len(starts) == 3, [n.name for _, n in starts]
    for prev, n in starts:
        assert n.meta[LAYER] and n.meta[LAYER] != prev.meta[LAYER], (prev.name, n.name)
    assert set(bucket_segments(gm, replicated, 1e6).values()) == {0}  # one bucket: one graph
    # the price's graphs are these: their backward ends at the first node of each layer
    problem = Problem(graph, hidup.profiler.load(PROFILE).launched(False, True))
    problem.cost.bucket_mb = 1e-6
    ends = graph_ends(problem, [problem.sigs[i].index(plan.choices[n.name]) for i, n in enumerate(problem.order)])
    assert sorted(block_label(problem.order[i].module) for i in ends) == sorted(n.meta[LAYER] for _, n in starts)
    for n in gm.graph.nodes:  # a program without layers: any first read of a parameter may start a segment
        n.meta[LAYER] = ""
    assert len(set(bucket_segments(gm, replicated, 1e-6).values())) > 3

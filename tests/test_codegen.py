"""End-to-end parity of compiled modules with the single-device model (gloo, world 2 and 4).

For zoo models x {searched plan, forced data, forced tensor, forced expert} x duplication {off, on}:
the loss and every gradient (gathered to the logical layout) equal the single-device model's, and
three optimizer steps stay in parity.  All configurations of one world run inside one spawned
process group; plans are searched once here and shipped to the ranks.

Tolerances (fp32): loss relative 1e-5; a gradient's max error relative to
``max(max|g_ref|, 0.01 * max over all parameters of max|g_ref|)``.  The second term covers
gradients that are exactly zero in exact arithmetic (attention key biases: softmax is invariant
to a per-query shift), whose fp32 values are rounding noise.  For the same reason Adam steps
(which normalize the gradient, turning rounding noise into steps of size lr) are compared on the
elements whose first gradient exceeds ``1e-3 * max over all parameters of max|g_ref|``.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_util import device, run_distributed

STYLES = ("search", "data", "tensor", "expert")
MODELS = {2: ("mlp", "gpt", "bert-sgmoe"), 4: ("bert-sgmoe",)}
# Every other zoo model and world (a few minutes on two cores; HIDUP_QUICK_TESTS=1 skips them).
FULL_MODELS = {
    2: ("bert-switch", "vit-sgmoe", "vit-switch", "bert-sgmoe-torch"),
    4: ("mlp", "gpt", "bert-switch", "vit-sgmoe", "vit-switch", "bert-sgmoe-torch"),
}
# the styles run with duplication on as well: at world 4 (four ranks on two cores) only the searched plan,
# since duplication's copies split the batch alike in every style, which world 2 and bert-sgmoe check
FULL_DUP_STYLES = {2: STYLES, 4: ("search",)}
PROFILE = "h200x4-nvlink"
STEPS = 3


@contextlib.contextmanager
def _float64():
    """Models and plans in float64: parity then holds to float64 rounding whatever CPU kernels run,
    so the tolerances below (1e-5) are far from any kernel-dependent rounding."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _overrides(name: str) -> dict:
    if name == "mlp":
        return dict(layers=2, d_model=16, ffn=32, batch_per_gpu=4)
    if name.startswith("vit"):
        return dict(layers=2, d_model=32, heads=4, ffn=64, seq_len=16, batch_per_gpu=2)
    return dict(layers=2, d_model=32, heads=4, ffn=64, seq_len=8, batch_per_gpu=4, vocab=64)


_PLANS: dict = {}


def _plans(name: str, world: int) -> dict:
    if (name, world) not in _PLANS:
        _PLANS[(name, world)] = _make_plans(name, world)
    return _PLANS[(name, world)]


@_float64()
def _make_plans(name: str, world: int, **changes) -> dict:
    import hidup
    from hidup.frontend.trace import trace_module
    from hidup.search import forced, search

    model, inputs = hidup.models.build(name, world_size=world, **{**_overrides(name), **changes})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace_module(model, inputs, world).graph
        plans = {"search": search(graph, PROFILE)}
        for style in STYLES[1:]:
            plans[style] = forced(graph, PROFILE, style, duplication=False)
    return plans


@_float64()
def _staged_plan(name: str, world: int):
    """A duplicated plan with several stages whatever the search prefers: expert parallelism (its
    all-to-alls open stages)."""
    import hidup
    from hidup.frontend.trace import trace_module
    from hidup.search import forced

    model, inputs = hidup.models.build(name, world_size=world, **_overrides(name))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return forced(trace_module(model, inputs, world).graph, PROFILE, "expert", duplication=True)


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), floor)


def _reference(model, inputs, optimizer_cls, **opt_kwargs):
    ref = copy.deepcopy(model)
    opt = optimizer_cls(ref.parameters(), **opt_kwargs)
    losses, grads = [], None
    for step in range(STEPS):
        loss = ref(*inputs)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return losses, grads, {k: v.clone() for k, v in ref.state_dict().items()}


def _optimizer(style: str, sgd_only: bool = False):
    if STYLES.index(style) % 2 and not sgd_only:
        return torch.optim.Adam, {"lr": 1e-2}
    return torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}


def _parity(rank, world, model, inputs, plan, dup, ref, opt_cls, opt_kwargs, **compile_kwargs):
    import hidup
    from hidup.codegen.params import full_grad_dict, full_state_dict

    ref_losses, ref_grads, ref_state = ref
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    module = hidup.compile(model, plan, rank, world, inputs, duplication=dup, **compile_kwargs)
    feed = inputs
    opt = opt_cls(module.parameters(), **opt_kwargs)
    losses, grad_err, worst = [], 0.0, ""
    for step in range(STEPS):
        loss = module(*feed)
        loss.backward()
        if step == 0:
            grads = full_grad_dict(module)
            for name, g in ref_grads.items():
                e = _rel(grads[name], g, 1e-2 * scale)
                if e > grad_err:
                    grad_err, worst = e, name
        losses.append(float(module.global_loss(loss)))
        opt.step()
        opt.zero_grad()
    state = full_state_dict(module)
    param_err = 0.0
    for n, v in ref_state.items():
        got = state[n]
        if opt_cls is torch.optim.Adam and n in ref_grads:  # Adam: skip rounding-noise gradients
            keep = ref_grads[n].abs() >= 1e-3 * scale
            got, v = got[keep], v[keep]
            if not v.numel():
                continue
        param_err = max(param_err, _rel(got, v, 1e-6))
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    return {"loss": loss_err, "grad": grad_err, "grad_worst": worst, "params": param_err}


def _rank_parity(rank, world, jobs, extras=None, sgd_only=False, dup_styles=STYLES):
    """Parity of every (model, plan) job, duplication off and, for the styles in ``dup_styles``, on.  A
    plan equal to an earlier style's of the same model (the forced expert plan of a model without
    experts is its data plan) takes that style's result instead of running again."""
    import hidup

    torch.set_default_dtype(torch.float64)  # this rank's process only (see _float64)

    out = {}
    for name, plans in jobs:
        model, inputs = hidup.models.build(name, world_size=world, device=device(), **_overrides(name))
        refs, seen = {}, {}
        for style, plan in plans.items():
            opt_cls, kw = _optimizer(style, sgd_only)
            if opt_cls not in refs:
                refs[opt_cls] = _reference(model, inputs, opt_cls, **kw)
            same = seen.setdefault((opt_cls, repr(plan.choices), repr(plan.conversions)), style)
            for dup in (False, True) if style in dup_styles else (False,):
                if (name, same, dup) in out:
                    out[(name, style, dup)] = out[(name, same, dup)]
                    continue
                out[(name, style, dup)] = _parity(rank, world, model, inputs, plan, dup, refs[opt_cls], opt_cls, kw)
    for key, (fn, args) in (extras or {}).items():
        out[key] = fn(rank, world, *args)
    return out


# ----------------------------------------------------------------------------------------------
# Beyond parity: local batches, physical sharding, shared parameters and bucketing, clipping,
# gradient accumulation, checkpoints across world sizes.  They run in the same process groups.


class Tied(nn.Module):
    """A weight used twice (``w`` and ``w.t()``) plus a head: exercises gradient accumulation of a
    parameter over several uses before its bucket is all-reduced."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.w = nn.Parameter(torch.randn(16, 16, generator=g) * 0.3)
        self.b = nn.Parameter(torch.randn(16, generator=g) * 0.1)
        self.head = nn.Linear(16, 4)

    def forward(self, x, y):
        h = F.gelu(F.linear(x, self.w, self.b))
        h = F.gelu(F.linear(h, self.w.t()))
        return F.cross_entropy(self.head(h), y, reduction="sum")


def _tied_inputs():
    g = torch.Generator().manual_seed(6)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


@_float64()
def _tied_plans(world):
    from hidup.frontend.trace import trace_module
    from hidup.search import forced, search

    torch.manual_seed(0)
    graph = trace_module(Tied(), _tied_inputs(), world).graph
    return {"search": search(graph, PROFILE), "data": forced(graph, PROFILE, "data", duplication=False)}


def _local_piece(x, form, rank, world):
    return x if form is None or not form.is_gather else x.chunk(world, form.dim)[rank].contiguous()


def _rank_local_and_memory(rank, world, plans):
    import hidup

    model, inputs = hidup.models.build("gpt", world_size=world, **_overrides("gpt"))
    ref = float(model(*inputs))
    out = {}
    for style, plan in plans.items():
        for dup in (False, True):
            m = hidup.compile(model, plan, rank, world, inputs, local_batch=True, duplication=dup)
            local = [_local_piece(x, m.input_forms[n], rank, world) for x, n in zip(inputs, m.input_names)]
            out[(style, dup)] = abs(float(m.global_loss(m(*local))) - ref) / abs(ref)
        stored = sum(p.numel() for p in m.parameters())
        logical = sum(p.numel() for p in model.parameters())
        shapes_ok = all(
            tuple(t.shape) == sh.form.local_shape(sh.logical_shape, world)
            for _, t, sh in __import__("hidup.codegen.params", fromlist=["x"]).iter_shards(m)
        )
        out[(style, "memory")] = (stored, logical, shapes_ok)
    try:
        m(*inputs)  # global inputs into a local-batch module
        out["wrong_shape"] = ""
    except ValueError as e:
        out["wrong_shape"] = str(e)
    return out


def _rank_staged(rank, world, plan):
    """Duplication with the CUDA schedule (stages in lockstep, one process group per copy) on CPU."""
    import torch.distributed as dist

    import hidup

    model, inputs = hidup.models.build("bert-sgmoe", world_size=world, **_overrides("bert-sgmoe"))
    ref = _reference(model, inputs, torch.optim.SGD, lr=1e-3, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = hidup.compile(model, plan, rank, world, inputs, duplication=True, streams=True)
    short = [str(w.message) for w in caught if "of the plan's" in str(w.message)]  # a stage count short of it
    padded = copy.copy(plan)
    padded.stages = list(plan.stages) + [[]]  # a stage no op lands in: the runner falls short, and says so
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hidup.compile(model, padded, rank, world, inputs, duplication=True, streams=True, copy_groups=m.copy_groups)
    short_padded = [str(w.message) for w in caught if "of the plan's" in str(w.message)]
    stages = m.runner.num_stages
    distinct = len({id(g) for g in m.copy_groups}) == 2 and dist.get_world_size(m.copy_groups[0]) == world
    r = _parity(
        rank, world, model, inputs, plan, True, ref, torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}, streams=True
    )
    # a second module on the first one's communicators: the same step, no new process groups
    again = hidup.compile(model, plan, rank, world, inputs, duplication=True, streams=True, copy_groups=m.copy_groups)
    reused = again.copy_groups == m.copy_groups
    r2 = _parity(
        rank,
        world,
        model,
        inputs,
        plan,
        True,
        ref,
        torch.optim.SGD,
        {"lr": 1e-3, "momentum": 0.9},
        streams=True,
        copy_groups=m.copy_groups,
    )
    try:
        hidup.compile(model, plan, rank, world, inputs, duplication=True, streams=True, copy_groups=m.copy_groups[:1])
        bad = ""
    except hidup.codegen.CompileError as e:
        bad = str(e)
    return {
        **r,
        "stages": stages,
        "plan_stages": len(plan.stages),
        "short_warning": short,
        "short_padded": short_padded,
        "groups": distinct,
        "reused": reused,
        "reused_parity": r2,
        "bad_groups": bad,
    }


def _rank_tied(rank, world, plans):
    import hidup
    from hidup.codegen.params import full_grad_dict

    torch.manual_seed(0)
    model, inputs = Tied(), _tied_inputs()
    ref = copy.deepcopy(model)
    ref(*inputs).backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
    ref_clipped = {n: p.grad.clone() for n, p in ref.named_parameters()}
    out = {}
    for style, plan in plans.items():
        m = hidup.compile(model, plan, rank, world, inputs, bucket_mb=1e-5)  # one bucket per parameter
        assert len(m.bucketer.buckets) == len(m.program.replicated)
        m(*inputs).backward()
        g = full_grad_dict(m)
        grads = max(_rel(g[n], r, 1e-6) for n, r in ref_grads.items())
        norm = float(hidup.clip_grad_norm_(m, 0.5))
        g = full_grad_dict(m)
        clipped = max(_rel(g[n], r, 1e-6) for n, r in ref_clipped.items())
        m.zero_grad()
        with m.no_sync():
            m(*inputs).backward()
        m(*inputs).backward()
        g = full_grad_dict(m)
        accumulated = max(_rel(g[n], 2 * r, 1e-6) for n, r in ref_grads.items())
        out[style] = {
            "grads": grads,
            "norm": abs(norm - ref_norm) / ref_norm,
            "clipped": clipped,
            "accumulated": accumulated,
            "buckets": len(m.bucketer.buckets),
        }
    return out


def _rank_ckpt_save(rank, world, plan, path):
    """Train gpt (its shapes do not depend on the world) two steps on world 2, save; the state and
    the next loss."""
    import hidup
    from hidup.runtime import checkpoint

    model, inputs = hidup.models.build("gpt", world_size=world, **_overrides("gpt"))
    m = hidup.compile(model, plan, rank, world, inputs)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(2):
        loss = m(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(m.global_loss(loss)))
    checkpoint.save(path, m, opt, step=2, loss_history=losses)
    state = hidup.full_state_dict(m)
    loss = m(*inputs)
    return state, float(m.global_loss(loss))


def _rank_ckpt_load(rank, world, plan, path):
    """Resume on world 4 under another plan, from a differently initialized model, on the same
    global batch (2 sequences per rank x 4 = 4 x 2): the loaded state and the next loss."""
    import hidup
    from hidup.runtime import checkpoint

    model, _ = hidup.models.build("gpt", world_size=world, seed=123, **{**_overrides("gpt"), "batch_per_gpu": 2})
    _, inputs = hidup.models.build("gpt", world_size=2, **_overrides("gpt"))
    m = hidup.compile(model, plan, rank, world, inputs)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    info = checkpoint.load(path, m, opt)
    state = hidup.full_state_dict(m)
    loss = m(*inputs)
    loss.backward()
    opt.step()  # the restored optimizer state must fit the new shards
    return info, float(m.global_loss(loss)), state


import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

_CKPT_DIR = tempfile.mkdtemp(prefix="hidup-ckpt-")
atexit.register(shutil.rmtree, _CKPT_DIR, True)


def _extras(world: int) -> dict:
    path = os.path.join(_CKPT_DIR, "step2.pt")
    if world == 2:
        gpt = _plans("gpt", 2)
        return {
            "local": (_rank_local_and_memory, ({"search": gpt["search"], "tensor": gpt["tensor"]},)),
            "tied": (_rank_tied, (_tied_plans(2),)),
            "staged": (_rank_staged, (_staged_plan("bert-sgmoe", 2),)),
            "ckpt_save": (_rank_ckpt_save, (gpt["search"], path)),
        }
    if world == 4:
        _results(2)  # writes the checkpoint
        plan = _make_plans("gpt", 4, batch_per_gpu=2)["tensor"]
        return {"ckpt_load": (_rank_ckpt_load, (plan, path))}
    return {}


_RESULTS: dict[int, dict] = {}


def _results(world: int) -> dict:
    if world not in _RESULTS:
        jobs = [(name, _plans(name, world)) for name in MODELS[world]]
        _RESULTS[world] = run_distributed(_rank_parity, world, jobs, _extras(world), timeout=240)
    return _RESULTS[world]


CASES = [(w, m, s, d) for w in MODELS for m in MODELS[w] for s in STYLES for d in (False, True)]
# world 4 of the extended set is nightly: test_parity runs the core models at world 4 on the same code path
FULL_CASES = [
    pytest.param(w, m, marks=pytest.mark.nightly if w == 4 else (), id=f"w{w}-{m}")
    for w in FULL_MODELS
    for m in FULL_MODELS[w]
]


@pytest.mark.parametrize(
    "world, name, style, dup", CASES, ids=[f"w{w}-{m}-{s}-{'dup' if d else 'nodup'}" for w, m, s, d in CASES]
)
def test_parity(world, name, style, dup):
    results = _results(world)
    for rank, res in enumerate(results):
        r = res[(name, style, dup)]
        where = f"{name} world {world} {style} plan duplication={dup} rank {rank}"
        assert r["loss"] < 1e-5, f"{where}: loss differs by {r['loss']:.2e} (relative)"
        assert r["grad"] < 1e-5, f"{where}: gradient of {r['grad_worst']} differs by {r['grad']:.2e}"
        assert r["params"] < 1e-5, f"{where}: parameters after {STEPS} steps differ by {r['params']:.2e}"


_FULL_RESULTS: dict[int, list] = {}


def _full_results(world: int) -> list:
    """Every other zoo model of ``world``, all in one process group (one spawn per world)."""
    if world not in _FULL_RESULTS:
        jobs = [(name, _plans(name, world)) for name in FULL_MODELS[world]]
        _FULL_RESULTS[world] = run_distributed(
            _rank_parity, world, jobs, None, False, FULL_DUP_STYLES[world], timeout=900
        )
    return _FULL_RESULTS[world]


@pytest.mark.skipif(bool(os.environ.get("HIDUP_QUICK_TESTS")), reason="HIDUP_QUICK_TESTS=1 keeps to the core models")
@pytest.mark.parametrize("world, name", FULL_CASES)
def test_parity_full(world, name):
    results = _full_results(world)
    for rank, res in enumerate(results):
        cases = {(style, dup): r for (model, style, dup), r in res.items() if model == name}
        # every plan with duplication off, and on for the FULL_DUP_STYLES
        want = {
            (style, dup)
            for style in _plans(name, world)
            for dup in (False, True)
            if not dup or style in FULL_DUP_STYLES[world]
        }
        assert set(cases) == want, sorted(cases)
        for (style, dup), r in cases.items():
            where = f"{name} world {world} {style} plan duplication={dup} rank {rank}"
            assert r["loss"] < 1e-5 and r["grad"] < 1e-5 and r["params"] < 1e-5, f"{where}: {r}"


# ----------------------------------------------------------------------------------------------
# Every zoo model's searched plan under the default profile (the plan `hidup search` and `hidup verify`
# use), with the duplication the search chose: it must compile and match one device.  One process
# group per world for all models.


def _searched_default(world: int) -> list:
    import hidup
    from hidup.frontend.trace import trace_module
    from hidup.runtime.options import DEFAULT_PROFILE
    from hidup.search import search

    jobs = []
    with _float64():
        for name in hidup.models.names():
            model, inputs = hidup.models.build(name, world_size=world, **_overrides(name))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                jobs.append((name, search(trace_module(model, inputs, world).graph, DEFAULT_PROFILE)))
    return jobs


def _rank_searched(rank, world, jobs):
    import hidup

    torch.set_default_dtype(torch.float64)
    out = {}
    for name, plan in jobs:
        model, inputs = hidup.models.build(name, world_size=world, device=device(), **_overrides(name))
        opt_cls, kw = _optimizer("search")
        ref = _reference(model, inputs, opt_cls, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a model whose copies cannot split runs one copy
            out[name] = _parity(rank, world, model, inputs, plan, None, ref, opt_cls, kw)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_searched_default_profile_plans_of_every_zoo_model_run(world):
    import hidup

    jobs = _searched_default(world)
    assert [name for name, _ in jobs] == hidup.models.names()
    results = run_distributed(_rank_searched, world, jobs, timeout=600)
    for rank, res in enumerate(results):
        for name, plan in jobs:
            r = res[name]
            where = f"{name} world {world} searched plan (duplication={plan.duplication}) rank {rank}"
            assert r["loss"] < 1e-5 and r["grad"] < 1e-5 and r["params"] < 1e-5, f"{where}: {r}"


def test_local_batch_mode():
    res = _results(2)
    for rank, r in enumerate(res):
        for key in (("search", False), ("search", True), ("tensor", False), ("tensor", True)):
            assert r["local"][key] < 1e-5, f"rank {rank} {key}: local-batch loss differs by {r['local'][key]:.2e}"
        assert "local piece" in r["local"]["wrong_shape"]


def test_parameters_are_physically_sharded():
    for rank, r in enumerate(_results(2)):
        stored, logical, shapes_ok = r["local"][("tensor", "memory")]
        assert shapes_ok
        assert stored < 0.75 * logical, f"rank {rank}: stores {stored} of {logical} parameter elements"


@pytest.mark.parametrize("style", ["search", "data"])
def test_shared_parameter_bucketing_clipping_accumulation(style):
    for rank, r in enumerate(_results(2)):
        t = r["tied"][style]
        assert t["grads"] < 1e-5, f"rank {rank}: gradients differ by {t['grads']:.2e}"
        assert t["norm"] < 1e-5 and t["clipped"] < 1e-5, f"rank {rank}: clipping differs: {t}"
        assert t["accumulated"] < 1e-5, f"rank {rank}: no_sync accumulation differs by {t['accumulated']:.2e}"


def test_staged_duplication_schedule():
    for rank, res in enumerate(_results(2)):
        r = res["staged"]
        assert r["stages"] > 1, "the expert plan should have several stages"
        # every stage of the plan is a stage of the runner: inputs and parameters (the labels are
        # traced first but filed under the loss's stage) must not pull the whole step into one
        assert r["stages"] == r["plan_stages"] and not r["short_warning"], r
        assert r["short_padded"] and f"{r['stages']} of the plan's {r['stages'] + 1} stages" in r["short_padded"][0]
        assert r["groups"], "each copy needs its own process group"
        assert r["loss"] < 1e-5 and r["grad"] < 1e-5 and r["params"] < 1e-5, f"rank {rank}: {r}"
        r2 = r["reused_parity"]
        assert r["reused"] and r2["loss"] < 1e-5 and r2["grad"] < 1e-5 and r2["params"] < 1e-5, f"rank {rank}: {r2}"
        assert "copy_groups must be two process groups" in r["bad_groups"]


def test_checkpoint_resumes_on_another_world_and_plan():
    saved = _results(2)
    loaded = _results(4)
    saved_state, next_loss = saved[0]["ckpt_save"]
    for rank, r in enumerate(loaded):
        info, loss, state = r["ckpt_load"]
        assert info["step"] == 2 and info["world_size"] == 2 and len(info["loss_history"]) == 2
        assert abs(loss - next_loss) / abs(next_loss) < 1e-5, f"rank {rank}: resumed loss {loss} vs {next_loss}"
        for name, value in saved_state.items():
            torch.testing.assert_close(
                state[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, rank=rank, name=name: f"rank {rank} {name}: {m}"
            )


def test_single_process_compile_and_errors():
    import hidup
    from hidup.codegen import CompileError
    from hidup.frontend.trace import trace_module
    from hidup.search import search

    model, inputs = hidup.models.build("gpt", world_size=1, **_overrides("gpt"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = search(trace_module(model, inputs, 1).graph, PROFILE, duplication=False)
    with torch.no_grad():
        ref = float(model(*inputs))
        for dup in (False, True):
            m = hidup.compile(model, plan, 0, 1, inputs, duplication=dup)
            assert abs(float(m(*inputs)) - ref) / abs(ref) < 1e-5
    with pytest.raises(CompileError, match="world size 2"):
        hidup.compile(model, _plans("gpt", 2)["search"], 0, 1, inputs)
    with pytest.raises(CompileError, match="initialized process group"):
        hidup.compile(model, _plans("gpt", 2)["search"], 0, 2, inputs)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_parity_nccl():
    """The same parity on GPUs: NCCL collectives and, with duplication, two copies on two CUDA
    streams with one process group each."""
    world = 4 if torch.cuda.device_count() >= 4 else 2
    names = ("gpt", "bert-sgmoe")
    jobs = [(name, _plans(name, world)) for name in names]
    # SGD only: GPU kernels round differently for the half/sharded shapes (~1e-6), and Adam would
    # turn that into parameter differences of ~lr * 1e-3 on small-gradient elements.
    results = run_distributed(_rank_parity, world, jobs, None, True, backend="nccl", timeout=600, pg_timeout=120)
    for rank, res in enumerate(results):
        for (name, style, dup), r in res.items():
            where = f"NCCL {name} world {world} {style} plan duplication={dup} rank {rank}"
            assert r["loss"] < 1e-5 and r["grad"] < 1e-5 and r["params"] < 1e-5, f"{where}: {r}"


def test_compile_options_are_typed_and_unknown_ones_named():
    import hidup
    from hidup.codegen import CompileOptions

    model, inputs = hidup.models.build("mlp", world_size=1, **_overrides("mlp"))
    plan = hidup.search(hidup.trace(model, inputs, world_size=1), "h200x4-nvlink")
    a = hidup.compile(model, plan, 0, 1, inputs, None, CompileOptions(duplication=False, bucket_mb=1.0))
    assert a.duplication is False
    with pytest.raises(TypeError, match="unknown option.*bucket\\b.*the options are"):
        hidup.compile(model, plan, 0, 1, inputs, bucket=1.0)

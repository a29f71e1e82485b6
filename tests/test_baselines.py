"""The tuned baselines on gloo at world 2: every baseline in every CPU variant (eager, and compiled
with the ``aot_eager`` backend, which runs the same dynamo + AOTAutograd path as inductor without
building C++ kernels) trains with the single-device loss, in float64; a mean loss over padded
tokens is weighted by each rank's count; a failing variant is recorded, a CUDA-graph variant is
recorded as skipped on a CPU, and the method reports its fastest variant that ran; the shared
timer times windows of steps between two syncs."""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_util import run_distributed
from exp.baselines import harness
from exp.baselines.baseline_util import LossForm

TINY = dict(layers=2, d_model=16, heads=2, ffn=32, seq_len=4, batch_per_gpu=2, vocab=32, experts_per_gpu=2)
LR = 1e-3
WARMUP, ITERS, BEST_OF = 1, 1, 2
STEPS = WARMUP + ITERS * BEST_OF  # every step's loss is recorded, warm-up included
CPU_VARIANTS = ("eager", "compile")
BASELINES = ("single", "ddp", "fsdp", "expert")
EPS = torch.finfo(torch.float64).eps
# The distributed step differs from the single-device one only in the order of floating-point sums
# (a gradient summed over ranks, a loss summed over shares): a relative error of at most ~log2(terms)
# eps per sum, a few sums deep per step.  Adam divides by sqrt(v) + 1e-8, so a gradient perturbed by
# a relative d moves the update by at most ~d; the loss after k steps moves by a relative ~k d.
# 2**10 eps per step bounds that with a wide margin and is still 1e-13 for STEPS steps, where any
# error in the math (a weight, a missed reduction) shows at 1e-3 or more.
REL_TOL = 2**10 * EPS * STEPS


class TokenMeanLM(nn.Module):
    """A tiny language model whose loss is the mean over the tokens whose label is not ignored
    (``F.cross_entropy(..., ignore_index=-100)``, as ``transformers`` models compute theirs)."""

    loss_form = LossForm("mean", count=lambda inputs: (inputs[1] != -100).sum())

    def __init__(self, vocab: int = 16, d: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([nn.Linear(d, d) for _ in range(2)])
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, labels):
        h = self.emb(ids)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten(), ignore_index=-100)


def token_mean_model():
    """(model, inputs) in float64: 4 sequences of 6 tokens; rank 0's two rows keep 3 labels, rank 1's 11."""
    g = torch.Generator().manual_seed(3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = TokenMeanLM().double()
    ids = torch.randint(0, 16, (4, 6), generator=g)
    labels = torch.randint(0, 16, (4, 6), generator=g)
    labels[0, 1:] = -100
    labels[1, :4] = -100
    labels[3, 5] = -100
    return model, (ids, labels)


def _reference(model, inputs, steps: int) -> list[float]:
    """Single-device fused Adam on ``inputs`` (the whole batch)."""
    import copy

    model = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=LR, fused=True)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(*inputs)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _zoo(world: int):
    import hidup.models

    return hidup.models.build("bert-sgmoe", world_size=world, dtype="float64", **TINY)


def _world2_rank(rank, world):
    """Every (baseline, CPU variant) on the zoo model, the mean-loss model under DDP and FSDP2, and
    one method through the bench's executor with a failing variant -- in one process group."""
    import copy

    from exp import benchrun
    from exp.baselines import harness
    from hidup.runtime.data import rank_share

    device = torch.device("cpu")
    out = {}
    model, inputs = _zoo(world)
    for baseline in BASELINES:
        for variant in CPU_VARIANTS:
            share = rank_share(inputs, 0 if baseline == "single" else rank, world)
            prepared = harness.prepare_variant(
                baseline, copy.deepcopy(model), rank, world, device, share, variant, "fp32", compile_backend="aot_eager"
            )
            stats = torch._dynamo.utils.counters["stats"]
            graphs = stats["unique_graphs"]
            res = harness.run_variant(
                prepared,
                share,
                "fp32",
                device,
                warmup=WARMUP,
                iters=ITERS,
                best_of=BEST_OF,
                lr=LR,
                coupled=baseline != "single",
            )
            out[(baseline, variant)] = dict(
                res,
                info=prepared.info,
                loss_scale=prepared.loss_scale,
                loss_weight=prepared.loss_weight,
                compiled_graphs=stats["unique_graphs"] - graphs,
            )
            torch._dynamo.reset()
    tmodel, tinputs = token_mean_model()
    for baseline in ("ddp", "fsdp"):
        share = rank_share(tinputs, rank, world)
        prepared = harness.prepare_variant(baseline, copy.deepcopy(tmodel), rank, world, device, share)
        res = harness.run_variant(prepared, share, "fp32", device, warmup=WARMUP, iters=ITERS, best_of=BEST_OF, lr=LR)
        out[("mean", baseline)] = dict(res, loss_weight=prepared.loss_weight, loss_scale=prepared.loss_scale)
    out["executed"] = benchrun.execute(
        "expert",
        model,
        inputs,
        rank,
        world,
        device,
        "fp32",
        warmup=WARMUP,
        iters=ITERS,
        cap_s=None,
        best_of=BEST_OF,
        compile_backend="no-such-backend",
    )
    return out


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_world2_rank, 2, timeout=400, pg_timeout=120)


@pytest.mark.parametrize("variant", CPU_VARIANTS)
@pytest.mark.parametrize("baseline", BASELINES)
def test_baseline_variant_trains_with_the_single_device_loss(world2, baseline, variant):
    model, inputs = _zoo(2)
    if baseline == "single":  # the floor: rank 0's share alone
        inputs = tuple(t[: TINY["batch_per_gpu"]] for t in inputs)
    ref = _reference(model, inputs, STEPS)
    for results in world2:
        r = results[(baseline, variant)]
        assert len(r["losses"]) == STEPS and r["setup_steps"] == 0
        for got, want in zip(r["losses"], ref):
            assert got == pytest.approx(want, rel=REL_TOL, abs=0), (baseline, variant, r["losses"], ref)
        assert r["optimizer"] == "Adam(fused=True)"
        assert r["iters"] == ITERS and len(r["window_times_s"]) == BEST_OF
        assert r["iter_time_s"] == min(r["window_times_s"]) > 0
        assert (r["info"]["compile"] is None) == (variant == "eager")  # compiled where the variant says
        assert (r["compiled_graphs"] > 0) == (variant == "compile"), r["compiled_graphs"]  # dynamo did compile
        assert r["loss_scale"] == {"ddp": 2.0, "fsdp": 2.0, "expert": 1.0, "single": 1.0}[baseline]
    if baseline != "single":  # one global loss, agreed by every rank
        assert world2[0][(baseline, variant)]["losses"] == world2[1][(baseline, variant)]["losses"]
    if baseline == "ddp":
        assert world2[0][(baseline, variant)]["info"]["static_graph"] is True
        assert world2[0][(baseline, variant)]["info"]["gradient_as_bucket_view"] is True


def test_ddp_and_fsdp_are_exact_for_a_mean_over_padded_tokens(world2):
    model, inputs = token_mean_model()
    ref = _reference(model, inputs, STEPS)
    counts = [int((inputs[1][2 * r : 2 * r + 2] != -100).sum()) for r in range(2)]
    assert counts == [3, 11]  # unequal shares: the mean of the ranks' means is not the global mean
    means = [model(*(t[2 * r : 2 * r + 2] for t in inputs)).item() for r in range(2)]
    assert abs(sum(means) / 2 - ref[0]) > 1e-3 * abs(ref[0])
    for baseline in ("ddp", "fsdp"):
        for rank, results in enumerate(world2):
            r = results[("mean", baseline)]
            assert r["loss_weight"] == pytest.approx(counts[rank] / sum(counts), rel=EPS)
            assert r["loss_scale"] == pytest.approx(2 * counts[rank] / sum(counts), rel=EPS)
            for got, want in zip(r["losses"], ref):
                assert got == pytest.approx(want, rel=REL_TOL, abs=0), (baseline, r["losses"], ref)


def test_a_failing_variant_is_recorded_and_the_best_that_ran_is_reported(world2):
    for results in world2:
        r = results["executed"]
        assert r["status"] == "ok" and r["variant"] == "eager"
        v = r["variants"]
        assert list(v) == ["eager", "compile", "graph", "compile-graph"]
        assert v["eager"]["status"] == "ok" and v["eager"]["iter_time_s"] == r["iter_time_s"]
        assert v["compile"]["status"] == "failed" and "no-such-backend" in v["compile"]["error"]
        for graphed in ("graph", "compile-graph"):
            assert v[graphed]["status"] == "skipped" and "CUDA graphs need a CUDA device" in v[graphed]["error"]
        assert r["info"]["variant"] == "eager" and r["loss_first"] == r["losses"][0]
        assert len(r["losses"]) == STEPS and len(r["window_times_s"]) == BEST_OF


def test_time_steps_counts_windows_between_two_syncs():
    from exp.baselines import timing

    calls = []

    def step():
        calls.append(1)
        return torch.tensor(float(len(calls)))

    out = timing.time_steps(step, torch.device("cpu"), warmup=2, iters=3, best_of=4)
    assert len(calls) == 2 + 3 * 4 and [t.item() for t in out["losses"]] == list(range(1, 15))
    assert out["iters"] == 3 and len(out["window_times_s"]) == 4 and not out["capped"]
    assert out["iter_time_s"] == min(out["window_times_s"]) and len(out["warmup_times_s"]) == 2
    calls.clear()
    capped = timing.time_steps(
        lambda: (calls.append(1), torch.zeros(()))[1], torch.device("cpu"), warmup=1, iters=50, best_of=2, cap_s=0.0
    )
    assert capped["iters"] == 1 and capped["capped"] and len(calls) == 1 + 2
    with pytest.raises(ValueError, match="best_of >= 1"):
        timing.time_steps(step, torch.device("cpu"), warmup=0, iters=1, best_of=0)


def test_adam_is_fused_where_torch_has_the_kernel():
    from exp.baselines import baseline_util

    opt, described = baseline_util.make_adam([nn.Parameter(torch.zeros(2, dtype=torch.float64))], 1e-3)
    assert described == "Adam(fused=True)" and opt.defaults["fused"]
    ints = [nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False), nn.Parameter(torch.zeros(2))]
    assert baseline_util.fused_unavailable(ints[1:]) is None
    import torch.optim.optimizer as topt

    real = topt._device_dtype_check_for_fused

    def no_kernel(p, cuda_unsupported=False):
        raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices")

    topt._device_dtype_check_for_fused = no_kernel
    try:
        with pytest.warns(UserWarning, match="fused Adam is unavailable"):
            opt, described = baseline_util.make_adam(ints, 1e-3)
        assert described.startswith("Adam (fused unavailable: `fused=True` requires") and not opt.defaults["fused"]
        with pytest.warns(UserWarning, match="fused Adam is unavailable"):
            opt, described = baseline_util.make_adam(ints, 1e-3, capturable=True)
        assert described.startswith("Adam(capturable=True) (fused unavailable") and opt.defaults["capturable"]
    finally:
        topt._device_dtype_check_for_fused = real


def test_loss_forms_are_declared_or_refused():
    import hidup.models
    from exp.baselines import baseline_util

    zoo, _ = hidup.models.build(
        "gpt", world_size=2, layers=1, d_model=16, heads=2, ffn=32, seq_len=4, batch_per_gpu=2, vocab=32
    )
    assert baseline_util.loss_form_of(zoo).kind == "sum"
    assert baseline_util.loss_form_of(TokenMeanLM()) is TokenMeanLM.loss_form
    plain = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="model.loss_form"):
        baseline_util.loss_form_of(plain)
    plain.loss_form = "mean"
    assert baseline_util.loss_form_of(plain) == LossForm("mean")
    share = (torch.zeros(3, 2),)
    assert baseline_util.loss_weight(LossForm("mean"), share, 1, torch.device("cpu")) == 1.0
    assert baseline_util.loss_weight(LossForm("sum"), share, 2, torch.device("cpu")) == 1.0
    with pytest.raises(ValueError, match="'sum' or 'mean'"):
        LossForm("median")
    assert not math.isnan(REL_TOL) and REL_TOL < 1e-12


def test_fake_world_runs_rank_zero_alone():
    """``--fake-world``: rank 0 of a world-4 baseline runs in this process on torch's fake process
    group; DDP's rank computes exactly what the single-device share computes (its forward is local),
    FSDP2's and the expert baseline's run with stand-in collectives."""
    from exp.baselines.harness import RunSpec, run

    spec = dict(world=4, overrides=TINY, warmup=1, iters=1)
    single = run(RunSpec("single", **spec))
    for baseline in ("ddp", "fsdp", "expert"):
        r = run(RunSpec(baseline, fake_world=True, **spec))
        assert r["backend"] == "fake" and r["world"] == 4 and "fake process group" in r["stand_ins"]
        assert r["iter_time_s"] > 0 and all(math.isfinite(x) for x in r["losses"])
        if baseline == "ddp":  # the share's loss, from the same ops in the same order
            assert r["losses"][0] == pytest.approx(single["losses"][0], rel=8 * torch.finfo(torch.float32).eps)


class _Recorded:
    """CPU stand-ins for the CUDA capture API that record what a captured step's body saw: whether
    every gradient was None as the capture began, and how often the optimizer stepped or zeroed
    inside it.  The body runs once, as a capture runs it."""

    def __init__(self, optimizer):
        self.optimizer, self.grads_none_at_start, self.steps, self.zeroes = optimizer, None, 0, 0
        self.inside = False

    @contextlib.contextmanager
    def graph(self, graph, capture_error_mode=None):
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.grads_none_at_start = all(p.grad is None for p in params)
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


def _tiny_step_parts():
    from exp.baselines.baseline_util import make_adam
    from exp.benchrun import Prepared

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)).double()

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = module

        def forward(self, x):
            return self.net(x).square().mean()

    loss = Loss()
    return loss, (torch.randn(3, 4, dtype=torch.float64),), Prepared(loss), make_adam


def test_captured_baseline_step_is_built_as_hidup_builds_its_own(monkeypatch):
    """One step construction for every method (harness.STEP_CONSTRUCTION): a baseline's captured
    step sets its gradients to None before the capture (autograd writes them fresh, as hidup's
    GraphedStep does), never zeroes them inside the graph, and steps its optimizer inside it."""
    from exp.baselines import harness

    loss, inputs, prep, make_adam = _tiny_step_parts()
    optimizer, _ = make_adam(loss.parameters(), LR)
    rec = _Recorded(optimizer)
    real_step, real_zero = optimizer.step, optimizer.zero_grad

    def step(*a, **k):
        rec.steps += rec.inside
        return real_step(*a, **k)

    def zero_grad(*a, **k):
        rec.zeroes += rec.inside
        return real_zero(*a, **k)

    monkeypatch.setattr(optimizer, "step", step)
    monkeypatch.setattr(optimizer, "zero_grad", zero_grad)
    fake_stream = type("S", (), {"wait_stream": lambda self, other: None})()
    monkeypatch.setattr(harness.CapturedStep, "require_cuda", staticmethod(lambda device: None))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake_stream)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: fake_stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", rec.graph)
    captured = harness.CapturedStep(prep, optimizer, inputs, "fp32", torch.device("cpu"))
    assert rec.grads_none_at_start and rec.steps == 1 and rec.zeroes == 0
    assert captured.construction() == harness.STEP_CONSTRUCTION
    assert all(p.grad is not None for p in loss.parameters())  # allocated by the captured backward


def test_hidup_methods_capture_their_optimizer_as_hidup_train_does(monkeypatch):
    """A hidup (or single-device) method's GraphedStep gets a capturable Adam, as `hidup train`
    captures it, and the run records the same step construction as a baseline's captured step."""
    from exp import benchrun
    from exp.baselines import harness

    loss, inputs, prep, _ = _tiny_step_parts()
    seen = {}

    class Graphed:
        mode, grads_at_capture, timings = "graph", "none", {}

        def __init__(self, module, examples, **kw):
            seen.update(kw)
            self.module, self.optimizer = module, kw["optimizer"]

        def __call__(self, *x):
            for p in self.module.parameters():
                p.grad = None
            out = self.module(*x)
            out.backward()
            self.optimizer.step()
            return out.detach()

    monkeypatch.setattr(benchrun, "GraphedStep", Graphed)
    prep.graph = True
    out = benchrun.timed_loop(prep, inputs, "fp32", torch.device("cpu"), warmup=1, iters=1, cap_s=None)
    assert seen["optimizer"] is prep.optimizer[0] and isinstance(seen["optimizer"], torch.optim.Adam)
    assert out["step_construction"] == harness.STEP_CONSTRUCTION
    assert out["loss_last"] < out["loss_first"]  # the captured optimizer stepped, once per call


def test_capture_builds_transformers_masks_as_the_warmup():
    """transformers materializes the causal mask it skips when it sees a stream capture; inside the
    harness's capture it takes the warm-up's path, and the library's own answer is back after."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    with mock.patch.object(torch.cuda, "is_current_stream_capturing", return_value=True):
        assert masking_utils.is_tracing(None)  # what a capture would see without the harness
        with harness.warmup_mask_path():
            assert not masking_utils.is_tracing(None)
        assert masking_utils.is_tracing(None)

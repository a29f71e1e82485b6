"""Random ops drawn as on one device (``hidup/rules/random.py``) and writes through views
(``hidup.frontend.export.written_through_views``).

* The counter-based values: any block of a tensor, at its offset, holds the whole tensor's values
  there; duplication's copies hold their rows of the whole step's tensor; the keep rate is ``1 - p``
  and the op, step and seed each give other values.  All of it is integer arithmetic, so these are
  exact equalities.
* The rules: dropout and attention with dropout, every signature on simulated ranks (one axis and a
  2 x 2 mesh) against the op on the whole tensor.
* The trace refuses a random op it cannot draw itself, naming it.
* Parity, float64 on gloo ranks, against the model under :func:`hidup.rules.random.single_device`:
  ``transformers`` T5 (dropout 0.1 everywhere, attention dropout inside torch's attention) and GPT-2
  (the same, plus embedding dropout), forced data and tensor plans and searched plans, duplication off
  and on, a recomputed layer; and DeepSeek-V3, whose attention writes its keys in place through views
  (``new_empty`` then ``copy_`` into slices), with its forced data, tensor and expert plans.  The
  ``transformers`` losses are computed in float32 (logits upcast), so losses carry float32 rounding
  (``thirdparty.sum_tolerance``); the gradients are float64 and must match to float64 rounding where no
  float32 loss feeds them, else to the loss's tolerance.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import thirdparty
from dist_util import run_distributed
from hidup.rules import random as R
from spmd import check_op
from test_mesh_rules import run_mesh


def _key(seed=5, step=7, copy=0):
    return R.make_key(seed, step, copy)


def test_any_block_holds_the_whole_tensors_values():
    x = torch.randn(6, 4, 10, dtype=torch.float64)
    whole = R.dropout(x, 0.3, True, op=2, rng_key=_key())
    assert 0 < int((whole == 0).sum()) < x.numel()
    for dim, parts in ((0, 3), (1, 2), (2, 5)):
        size = x.shape[dim] // parts
        for r in range(parts):
            offset = [0, 0, 0]
            offset[dim] = r * size
            block = R.dropout(
                x.narrow(dim, r * size, size), 0.3, True, shape=x.shape, offset=tuple(offset), op=2, rng_key=_key()
            )
            assert torch.equal(block, whole.narrow(dim, r * size, size))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_copy_holds_its_rows_of_the_whole_step(world):
    """Copy ``c`` of a step cut into ``world`` blocks holds rows ``b * 2h + c * h + j`` (h = rows per
    block and copy), :mod:`hidup.codegen.duplicate`; rank ``r`` of the copy holds block ``r``."""
    x = torch.randn(4 * world, 3, dtype=torch.float64)
    whole = R.dropout(x, 0.5, True, op=1, rng_key=_key())
    h = 2
    for c in (0, 1):
        rows = [b * 2 * h + c * h + j for b in range(world) for j in range(h)]
        copy = R.dropout(
            x[rows], 0.5, True, shape=(2 * world, 3), offset=(0, 0), copy_dim=0, blocks=world, op=1,
            rng_key=_key(copy=c),
        )  # fmt: skip
        assert torch.equal(copy, whole[rows])
        for r in range(world):  # one rank's piece of the copy
            piece = R.dropout(
                x[rows[r * h : (r + 1) * h]], 0.5, True, shape=(2 * world, 3), offset=(r * h, 0), copy_dim=0,
                blocks=world, op=1, rng_key=_key(copy=c),
            )  # fmt: skip
            assert torch.equal(piece, whole[rows[r * h : (r + 1) * h]])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_and_independent_streams(p):
    n = 1 << 20
    keep = R.uniform_bits((n,), rng_key=_key()) >= round(p * (1 << 24))
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(float(keep.double().mean()) - (1 - p)) < 6 * sigma
    for other in (R.uniform_bits((n,), op=1, rng_key=_key()), R.uniform_bits((n,), rng_key=_key(step=8)),
                  R.uniform_bits((n,), rng_key=_key(seed=6))):  # fmt: skip
        agree = float((keep == (other >= round(p * (1 << 24)))).double().mean())
        expected = p * p + (1 - p) * (1 - p)  # independent masks agree this often
        assert abs(agree - expected) < 6 * (expected * (1 - expected) / n) ** 0.5


def test_no_draw_without_training_or_rate():
    x = torch.randn(4, 4)
    assert R.dropout(x, 0.5, False) is x and R.dropout(x, 0.0, True) is x
    assert torch.equal(R.dropout(x, 1.0, True), torch.zeros_like(x))


def test_dropout_rule_on_simulated_ranks():
    x = torch.randn(4, 8, dtype=torch.float64)
    sigs = check_op(R.dropout, (x, 0.3))
    assert {str(s.inputs[0]) for s in sigs[2]} == {"full", "gather_0", "gather_1", "reduce"}
    from hidup import rules
    from spmd import make_context

    ctx, values, _ = make_context(F.dropout, (x,), {"p": 0.3, "training": True}, 2)  # runs as R.dropout
    assert rules.localize(ctx.with_tensors(values), sigs[2][1], 1).target is R.dropout
    run_mesh(R.dropout, (torch.randn(4, 4, 2, dtype=torch.float64), 0.4))


def test_attention_dropout_rule_on_simulated_ranks():
    q, k, v = (torch.randn(4, 4, 6, 8, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(1, 4, 6, 6, dtype=torch.float64)
    sigs = check_op(R.attention, (q, k, v, mask, 0.3))
    assert any(s.kind == "tensor" for s in sigs[2]) and any(s.kind == "data" for s in sigs[2])
    check_op(R.attention, (q, k, v), {"dropout_p": 0.3, "is_causal": True})
    run_mesh(R.attention, (q, k, v, None, 0.3))


def test_single_device_numbers_the_ops_as_they_run():
    x = torch.randn(4, 6, dtype=torch.float64)

    class Two(nn.Module):
        def forward(self, x):
            return F.dropout(F.dropout(x, 0.5, True), 0.2, self.training), F.dropout(x, 0.5, False)

    with R.single_device(3, 4) as mode:
        out, kept = Two()(x)
    assert mode.ops == 2 and kept is x
    first = R.dropout(x, 0.5, True, op=0, rng_key=R.make_key(3, 4))
    assert torch.equal(out, R.dropout(first, 0.2, True, op=1, rng_key=R.make_key(3, 4)))


class _Noisy(nn.Module):
    def __init__(self, noise):
        super().__init__()
        self.lin, self.noise = nn.Linear(4, 4), noise

    def forward(self, x):
        return self.noise(self.lin(x)).sum()


@pytest.mark.parametrize(
    "noise, op",
    [
        (lambda h: h + torch.rand_like(h), "rand_like"),
        (lambda h: h * torch.bernoulli(torch.full_like(h, 0.5)), "bernoulli"),
    ],
    ids=["rand_like", "bernoulli"],
)
def test_the_trace_refuses_random_ops_it_does_not_draw(noise, op):
    from hidup.frontend.trace import TraceFailure, trace

    with pytest.raises(TraceFailure, match=f"{op}.*draws random numbers.*Fix: replace it by F.dropout"):
        trace(_Noisy(noise), (torch.randn(4, 4),), world_size=2)


def test_writes_through_views_are_named():
    from hidup.frontend.export import export_step, written_through_views

    class Shift(nn.Module):
        def forward(self, ids, w):
            shifted = ids.new_zeros(ids.shape)
            shifted[:, 1:] = ids[:, :-1]
            shifted[:, 0] = 7
            fresh = torch.zeros_like(w)
            fresh.add_(w)  # a write on the tensor itself: made out-of-place, nothing to name
            return (shifted.to(w.dtype) * fresh).sum()

    gm = export_step(Shift(), [torch.randint(0, 9, (4, 6)), torch.randn(4, 6)], ["ids", "w"])
    named = {gm.graph.find_nodes(op="call_function", target=t)[0].target for t in (
        torch.ops.aten.new_zeros.default, torch.ops.aten.copy_.default, torch.ops.aten.slice.Tensor)}  # fmt: skip
    names = written_through_views(gm.graph)
    assert {n.target for n in gm.graph.nodes if n.name in names} >= named
    assert not any(n.target is torch.ops.aten.zeros_like.default for n in gm.graph.nodes if n.name in names)


def test_slices_filled_one_by_one_become_a_cat():
    """DeepSeek-V3's keys: ``new_empty``, then ``copy_`` into slices covering it, is a ``cat``."""
    from hidup.frontend.export import export_step, written_through_views

    class Keys(nn.Module):
        def forward(self, a, b):
            keys = a.new_empty(4, 2, 6, dtype=torch.float64)
            keys[..., :4] = a
            keys[..., 4:] = b  # broadcast over the second dim and cast, as copy_ does
            return (keys * keys).sum()

    a, b = torch.randn(4, 2, 4, dtype=torch.float64), torch.randn(4, 1, 2, dtype=torch.float32)
    gm = export_step(Keys(), [a, b], ["a", "b"])
    targets = {n.target for n in gm.graph.nodes}
    assert torch.ops.aten.cat.default in targets and torch.ops.aten.copy_.default not in targets
    assert not written_through_views(gm.graph)
    assert torch.equal(gm(a, b), Keys()(a, b))


# -- parity on gloo ranks ----------------------------------------------------------------------------

SEED = 3


def _plan(name: str, style: str, world: int, dup: bool):
    import hidup.profiler
    from hidup.frontend.trace import trace
    from hidup.ir import block_label
    from hidup.search import forced, search

    graph = trace(*thirdparty.build_with_dropout(name), world_size=world)
    profile = hidup.profiler.load("paper-v100-9.7gbps")
    plan = search(graph, profile, duplication=dup) if style == "searched" else forced(graph, profile, style)
    return plan, sorted({block_label(n.module) for n in graph.nodes} - {""})


def _rank_parity(rank, world, jobs):
    from hidup.codegen import compile
    from hidup.codegen.params import full_grad_dict

    warnings.simplefilter("ignore")
    out = []
    for name, style, dup, recompute in jobs:
        model, inputs = thirdparty.build_with_dropout(name)
        plan, layers = _plan(name, style, world, dup)
        module = compile(
            model, plan, rank, world, inputs, duplication=dup, seed=SEED, recompute=layers if recompute else None
        )
        losses = []
        for _ in range(2):  # two steps draw two steps' values (the gradients compared are the second's)
            module.zero_grad(set_to_none=True)
            loss = module(*inputs)
            loss.backward()
            losses.append(float(module.global_loss(loss)))
        grads = full_grad_dict(module)
        if rank:
            continue
        ref, ref_inputs = thirdparty.build_with_dropout(name)
        ref_losses = []
        for step in range(2):
            ref.zero_grad(set_to_none=True)
            with R.single_device(SEED, step):
                ref_loss = ref(*ref_inputs)
            ref_loss.backward()
            ref_losses.append(float(ref_loss))
        scale = max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
        worst = max(
            float((grads[n] - p.grad).abs().max()) / max(float(p.grad.abs().max()), 1e-2 * scale)
            for n, p in ref.named_parameters()
            if p.grad is not None
        )
        kinds = sorted({s.kind for s in plan.choices.values()})
        out.append(((name, style, dup, bool(recompute)), module.duplication, kinds, losses, ref_losses, worst))
    return out


# T5's decoder inputs are its labels shifted right by writes through views: that tensor runs whole,
# and duplication, which would need it cut by copies, stays off; DeepSeek-V3's group-limited routing
# (a scatter_ into the group mask) has no rule that follows the copies either
JOBS = {
    2: [
        ("t5", "data", False, None), ("t5", "tensor", True, None), ("gpt2", "data", True, None),
        ("gpt2", "tensor", False, None), ("gpt2", "searched", True, True),
        ("deepseek-v3", "data", False, None), ("deepseek-v3", "tensor", False, None),
        ("deepseek-v3", "expert", True, None),
    ],
    4: [("gpt2", "data", True, None), ("t5", "tensor", False, None), ("deepseek-v3", "expert", False, None)],
}  # fmt: skip
DUPLICATES = {"t5": False, "gpt2": True, "deepseek-v3": False}
_RESULTS: dict[int, dict] = {}


def _results(world: int) -> dict:
    if world not in _RESULTS:
        jobs = JOBS[world]
        rows = run_distributed(_rank_parity, world, jobs, timeout=1200, pg_timeout=600)[0]
        _RESULTS[world] = {row[0]: row[1:] for row in rows}
    return _RESULTS[world]


@pytest.mark.parametrize(
    "world, name, style, dup, recompute",
    [(w, *job) for w in JOBS for job in JOBS[w]],
    ids=[f"{w}-{n}-{s}-{'dup' if d else 'nodup'}{'-recompute' if r else ''}" for w in JOBS for n, s, d, r in JOBS[w]],
)
def test_dropout_and_view_writes_match_one_device(world, name, style, dup, recompute):
    ran_dup, kinds, losses, ref_losses, grad = _results(world)[(name, style, dup, bool(recompute))]
    where = f"{name} world {world} {style} plan, duplication {dup}"
    assert ran_dup == (dup and DUPLICATES[name]), f"{where}: ran with duplication {ran_dup}"
    if style != "searched":
        assert style in kinds, f"{where}: the plan uses {kinds}"
    tol = thirdparty.sum_tolerance("gpt2", 0)  # float32 losses of batch x sequence terms
    assert losses == pytest.approx(ref_losses, rel=tol), f"{where}: losses {losses} vs {ref_losses}"
    if name != "deepseek-v3":  # the others draw dropout: two steps on one batch differ
        assert losses[0] != losses[1], f"{where}: two steps drew the same values"
    assert grad <= tol, f"{where}: a gradient differs by {grad:.2e} (relative)"


# -- naming the first op that differs ----------------------------------------------------------------


class ShiftStep(nn.Module):
    """Labels shifted right as T5 shifts them (writes through views), embedded and scored."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, labels):
        shifted = labels.new_zeros(labels.shape)
        shifted[:, 1:] = labels[:, :-1]
        shifted[:, 0] = 3
        return F.cross_entropy(self.head(self.emb(shifted)).flatten(0, 1), labels.flatten())


def shift_factory():
    """``hidup.models.build("test_random:shift_factory")``."""
    return ShiftStep().double(), (torch.randint(0, 16, (4, 6)),)


def _verify_rank(rank, world, broken):
    import types

    import hidup.frontend.trace
    from hidup.runtime.verify import parity_report

    warnings.simplefilter("ignore")
    if broken:  # the bug this change fixed: pieces of a view written in place
        hidup.frontend.trace.written_through_views = lambda graph: set()
    ctx = types.SimpleNamespace(rank=rank, world_size=world, device=torch.device("cpu"))
    report = parity_report(ctx, "test_random:shift_factory", {}, style="data", duplication=False, locate=1e-9)
    return report.get("first_mismatch", "not run") if rank == 0 else None


def test_verify_names_the_first_op_that_differs():
    """With the fix undone the forced data plan is wrong, and the first op whose value differs is the
    embedding that reads the shifted labels; with it, nothing differs and nothing is located."""
    broken = run_distributed(_verify_rank, 2, True, timeout=300)[0]
    assert broken["node"] is not None and "embedding" in broken["target"], broken
    assert "test_random.py" in broken["source"], broken
    assert run_distributed(_verify_rank, 2, False, timeout=300)[0] == "not run"

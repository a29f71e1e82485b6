"""choose_duplication: both modes of a plan timed, the faster kept, the same on every rank, and the
kept module trains exactly like the single-device model (gloo, CPU)."""

from __future__ import annotations

import pytest

from dist_util import run_distributed

TINY = dict(layers=2, d_model=16, heads=2, ffn=32, seq_len=4, batch_per_gpu=2, vocab=32, experts_per_gpu=2)


def _rank(rank, world, name, overrides, margin):
    import hidup.models
    import hidup.profiler
    from hidup.codegen import choose_duplication
    from hidup.codegen.params import full_grad_dict
    from hidup.frontend.trace import trace
    from hidup.search import forced

    model, inputs = hidup.models.build(name, world_size=world, seed=0, **overrides)
    ref = hidup.models.build(name, world_size=world, seed=0, **overrides)[0]
    ref_loss = ref(*inputs)
    ref_loss.backward()
    plan = forced(trace(model, inputs, world, half_batch=True), hidup.profiler.load("h200x4-nvlink"), "expert")
    module, info = choose_duplication(
        model, plan, rank, world, inputs, cuda_graphs=False, trials=2, warmup=1, margin=margin
    )
    assert all(p.grad is None for p in module.parameters())  # the trial leaves no gradient behind
    loss = module(*inputs)
    loss.backward()
    grads = full_grad_dict(module)
    # relative to each gradient's scale, at least 1e-3 of the largest (an attention key bias has a zero
    # gradient up to rounding)
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    floor = 1e-3 * max(g.abs().max().item() for g in ref_grads.values())
    err = max((grads[n] - g).abs().max().item() / max(g.abs().max().item(), floor) for n, g in ref_grads.items())
    return {
        "info": info,
        "plan": plan.duplication,
        "module": module.duplication,
        "loss": float(module.global_loss(loss).detach()),
        "ref": float(ref_loss.detach()),
        "grad_err": err,
    }


@pytest.mark.parametrize("margin", [10.0, -0.99])
def test_both_modes_are_timed_and_every_rank_keeps_the_same(margin):
    out = run_distributed(_rank, 2, "bert-switch", TINY, margin)
    infos = [r["info"] for r in out]
    assert infos[0]["duplication"] == infos[1]["duplication"] == out[0]["module"] == out[1]["module"]
    assert infos[0]["trial"] == infos[1]["trial"] and set(infos[0]["trial"]) == {"on_s", "off_s"}
    assert all(t > 0 for t in infos[0]["trial"].values())
    planned = out[0]["plan"]
    # a large margin keeps the plan's mode; a margin of -99% makes the other mode win whatever was timed
    assert infos[0]["duplication"] == (planned if margin > 0 else not planned)
    assert ("plan says on" if planned else "plan says off") in infos[0]["reason"]
    for r in out:
        assert r["loss"] == pytest.approx(r["ref"], rel=1e-5) and r["grad_err"] < 1e-4


def test_a_batch_that_does_not_halve_runs_one_copy():
    out = run_distributed(_rank, 2, "bert-switch", dict(TINY, batch_per_gpu=1), -0.99)
    for r in out:
        assert r["info"]["duplication"] is False and r["module"] is False
        assert "cannot run this batch" in r["info"]["reason"] and set(r["info"]["trial"]) == {"off_s"}
        assert r["loss"] == pytest.approx(r["ref"], rel=1e-5) and r["grad_err"] < 1e-4

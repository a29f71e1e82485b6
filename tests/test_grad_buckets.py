"""The bucketed gradient all-reduce (codegen/grads.py) on two gloo ranks: large gradients summed in
place inside one coalesced call, small and strided ones packed into the flat buffer, a bucket's sum
over several groups in turn, accumulation across ``no_sync``, and repeated steps."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dist_util import run_distributed
from hidup.codegen import GradBucketer
from hidup.ir import GRAD_PACK_BYTES


def _params():
    g = torch.Generator().manual_seed(3)
    big = torch.nn.Parameter(torch.randn(GRAD_PACK_BYTES // 4, dtype=torch.float64, generator=g))  # 2 MiB
    other = torch.nn.Parameter(torch.randn(GRAD_PACK_BYTES // 8 + 5, dtype=torch.float64, generator=g))  # 1 MiB + 40 B
    small = torch.nn.Parameter(torch.randn(10, dtype=torch.float64, generator=g))
    strided = torch.nn.Parameter(torch.randn(600, 500, dtype=torch.float64, generator=g).t())  # not contiguous
    w = torch.randn(500, 600, dtype=torch.float64, generator=g)
    return [big, other, small, strided], w


def _loss(params, w, scale):
    big, other, small, strided = params
    return scale * (big.sum() + 2 * other.sum() + (small**2).sum() + (strided * w).sum())


def _rank(rank, world, mesh_like):
    params, w = _params()
    if mesh_like:  # a sum over the world, then over a one-rank group: the tuple path of a device mesh
        singles = [dist.new_group([r]) for r in range(world)]
        group = (None, singles[rank])
    else:
        group = None
    bucketer = GradBucketer(params, group, bucket_mb=3.0)
    scale = rank + 1.0
    total = sum(r + 1.0 for r in range(world))
    out = {"buckets": [[tuple(p.shape) for p in b.params] for b in bucketer.buckets]}
    for step in range(2):
        for p in params:
            p.grad = None
        _loss(params, w, scale).backward()
        big, other, small, strided = params
        out[f"step{step}"] = {
            "big": float((big.grad - total).abs().max()),
            "other": float((other.grad - 2 * total).abs().max()),
            "small": float((small.grad - 2 * total * small.detach()).abs().max()),
            "strided": float((strided.grad - total * w).abs().max()),
            "big_in_place": big.grad._base is None and other.grad._base is None,
            "small_packed": small.grad._base is not None,
            "strided_layout": strided.grad.stride() == strided.stride(),
        }
    for p in params:
        p.grad = None
    with bucketer.no_sync():
        _loss(params, w, scale).backward()
    _loss(params, w, scale).backward()  # accumulated locally twice, then summed once
    out["accumulated"] = float((params[0].grad - 2 * total).abs().max())
    bucketer.remove()
    return out


def _check(results):
    for out in results:
        assert out["buckets"] == results[0]["buckets"]
        assert len(out["buckets"]) >= 2  # the 3 MB buckets split the parameters
        for step in ("step0", "step1"):
            r = out[step]
            assert max(r["big"], r["other"], r["small"], r["strided"]) < 1e-9, r
            assert r["big_in_place"] and r["small_packed"] and r["strided_layout"], r
        assert out["accumulated"] < 1e-9


def test_large_gradients_are_summed_in_place_and_small_ones_packed():
    _check(run_distributed(_rank, 2, False))


def test_a_bucket_is_summed_over_each_group_of_a_mesh_in_turn():
    _check(run_distributed(_rank, 2, True))

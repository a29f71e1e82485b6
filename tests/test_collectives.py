"""Collectives and convert(): forward and backward on gloo ranks against the single-process
reference under the gradient convention of hidup.ir (full: partial gradients, gather: exact
local slice, reduce: exact everywhere)."""

from __future__ import annotations

import pytest
import torch

from dist_util import DistributedFailure, device, run_distributed
from hidup.ir import FULL, REDUCE, REPLICATE, Form, conversion, gather


def _forms(ndim):
    return [FULL, REDUCE, REPLICATE] + [gather(d) for d in range(ndim)]


def _shape(world):
    return (2 * world, world, 3 * world)


def _pieces(value: torch.Tensor, form: Form, world: int, seed: int) -> list[torch.Tensor]:
    """Per-rank pieces of ``value`` in ``form`` (reduce: random partials summing to ``value``)."""
    if form.is_gather:
        return list(value.chunk(world, form.dim))
    if form == REDUCE:
        g = torch.Generator().manual_seed(seed)
        parts = [torch.randn(value.shape, generator=g, dtype=value.dtype) for _ in range(world - 1)]
        return parts + [value - sum(parts)] if parts else [value]
    return [value.clone() for _ in range(world)]


def _grad_pieces(grad: torch.Tensor, form: Form, world: int, seed: int) -> list[torch.Tensor]:
    """Per-rank output gradients for ``form`` under the convention."""
    if form.is_gather:
        return list(grad.chunk(world, form.dim))
    if form == FULL:  # partial contributions
        return _pieces(grad, REDUCE, world, seed)
    return [grad.clone() for _ in range(world)]  # reduce: exact on every rank


def _assemble(pieces, form: Form) -> torch.Tensor:
    if form.is_gather:
        return torch.cat(pieces, form.dim)
    if form == REDUCE:
        return sum(pieces)
    for p in pieces[1:]:
        torch.testing.assert_close(p, pieces[0], rtol=0, atol=0)
    return pieces[0]


def _case_values(world, case):
    g = torch.Generator().manual_seed(1000 + case)
    shape = _shape(world)
    return (torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64))


def _pairs(world):
    forms = _forms(len(_shape(world)))
    return [(s, d) for s in forms for d in forms if conversion(s, d) is not None]


def _non_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Same values, non-contiguous memory."""
    return x.transpose(0, -1).contiguous().transpose(0, -1)


def _rank_convert_all(rank, world, fused):
    """For every pair of forms: this rank's output and input gradient of convert()."""
    from hidup.codegen import collectives

    if not fused:  # force the fallbacks built from all_gather / all_reduce
        backend = collectives._backend(None)
        for op in ("all_gather", "reduce_scatter", "all_to_all"):
            collectives._UNSUPPORTED.add((backend, op))
    out = []
    for case, (src, dst) in enumerate(_pairs(world)):
        x_val, g_val = _case_values(world, case)
        x = _non_contiguous(_pieces(x_val, src, world, case)[rank].to(device())).requires_grad_(True)
        y = collectives.convert(x, src, dst)
        y.backward(_non_contiguous(_grad_pieces(g_val, dst, world, 7 * case + 1)[rank].to(device())))
        out.append((str(src), str(dst), y.detach().cpu(), x.grad.cpu()))
    return out


def _check_convert_results(world, results):
    for case, (src, dst) in enumerate(_pairs(world)):
        x_val, g_val = _case_values(world, case)
        ys = [results[r][case][2] for r in range(world)]
        grads = [results[r][case][3] for r in range(world)]
        where = f"convert {src} -> {dst} on {world} ranks"
        for y in ys:
            assert y.is_contiguous() or y.dim() == 0, where
        torch.testing.assert_close(_assemble(ys, dst), x_val, msg=lambda m, where=where: f"{where}: forward\n{m}")
        grad_form = FULL if src == FULL else (REDUCE if src in (REDUCE, REPLICATE) else src)
        if grad_form == FULL:  # partial contributions: their sum is the gradient
            got = sum(grads)
        else:
            got = _assemble(grads, src if src.is_gather else FULL)
        torch.testing.assert_close(got, g_val, msg=lambda m, where=where: f"{where}: backward\n{m}")


def _named_cases(world):
    """(label, function of the local tensor, src form, dst form) for every named collective."""
    from hidup.codegen import collectives as C

    cases = []
    for d in range(len(_shape(world))):
        cases += [
            (f"all_gather({d})", lambda x, d=d: C.all_gather(x, d), gather(d), FULL),
            (f"reduce_scatter({d})", lambda x, d=d: C.reduce_scatter(x, d), REDUCE, gather(d)),
            (f"slice({d})", lambda x, d=d: C.slice(x, d), FULL, gather(d)),
            (f"zero_pad({d})", lambda x, d=d: C.zero_pad(x, d), gather(d), REDUCE),
        ]
        for e in range(len(_shape(world))):
            if e != d:
                cases.append((f"all_to_all({d}->{e})", lambda x, d=d, e=e: C.all_to_all(x, d, e), gather(d), gather(e)))
    cases += [
        ("all_reduce", C.all_reduce, REDUCE, FULL),
        ("keep_rank0", C.keep_rank0, FULL, REDUCE),
        ("replicate", C.replicate, REPLICATE, FULL),
    ]
    return cases


def _rank_named(rank, world):
    out = []
    for case, (_label, fn, src, dst) in enumerate(_named_cases(world)):
        x_val, g_val = _case_values(world, 500 + case)
        x = _non_contiguous(_pieces(x_val, src, world, case)[rank].to(device())).requires_grad_(True)
        y = fn(x)
        y.backward(_grad_pieces(g_val, dst, world, 3 * case + 2)[rank].to(device()))
        assert y.device == x.device
        out.append((y.detach().cpu(), x.grad.cpu()))
    return out


def _check(world, label, src, dst, x_val, g_val, ys, grads):
    where = f"{label} ({src} -> {dst}) on {world} ranks"
    if conversion(src, dst).forward not in ("identity", "keep_rank0"):  # those pass the input through
        for y in ys:
            assert y.is_contiguous(), f"{where}: output is not contiguous"
    torch.testing.assert_close(_assemble(ys, dst), x_val, msg=lambda m, where=where: f"{where}: forward\n{m}")
    if src == FULL:  # partial contributions: their sum is the gradient
        got = sum(grads)
    elif src.is_gather:
        got = torch.cat(grads, src.dim)
    else:  # reduce / replicate: exact and identical on every rank
        got = _assemble(grads, FULL)
    torch.testing.assert_close(got, g_val, msg=lambda m, where=where: f"{where}: backward\n{m}")


def _rank_all(rank, world):
    named = _rank_named(rank, world)
    fused = _rank_convert_all(rank, world, True)
    fallback = _rank_convert_all(rank, world, False)  # last: it disables the fused collectives
    return named, fused, fallback


def _rank_errors(rank, world):
    from hidup.codegen import collectives as C

    msgs = []
    for fn in (
        lambda: C.convert(torch.ones(4, 4), FULL, REPLICATE),
        lambda: C.slice(torch.ones(3, 4), 0),
        lambda: C.all_gather(torch.ones(2, 2), 5),
    ):
        try:
            fn()
            msgs.append("")
        except ValueError as e:
            msgs.append(str(e))
    return msgs


@pytest.fixture(scope="module", params=[2, 4])
def results(request):
    world = request.param
    return world, run_distributed(_rank_all, world)


def _check_named(world, res):
    for case, (label, _fn, src, dst) in enumerate(_named_cases(world)):
        x_val, g_val = _case_values(world, 500 + case)
        _check(world, label, src, dst, x_val, g_val, [r[0][case][0] for r in res], [r[0][case][1] for r in res])


def test_named_collectives(results):
    _check_named(*results)


@pytest.mark.parametrize("which", [1, 2], ids=["fused", "fallback"])
def test_convert_every_pair(results, which):
    _check_pairs(*results, which)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_nccl():
    world = min(torch.cuda.device_count(), 4)
    res = run_distributed(_rank_all, world, backend="nccl", timeout=300)
    _check_named(world, res)
    _check_pairs(world, res, 1)
    _check_pairs(world, res, 2)


def _check_pairs(world, res, which):
    pairs = _pairs(world)
    assert len(pairs) == 6 * 5 + 1  # every src to every non-replicate dst, plus replicate -> replicate
    for case, (src, dst) in enumerate(pairs):
        x_val, g_val = _case_values(world, case)
        ys = [r[which][case][2] for r in res]
        grads = [r[which][case][3] for r in res]
        _check(world, "convert", src, dst, x_val, g_val, ys, grads)


def test_errors_name_the_problem():
    msgs = run_distributed(_rank_errors, 2)[0]
    assert "replicate" in msgs[0]
    assert "does not divide" in msgs[1]
    assert "out of range" in msgs[2]


def test_single_process_is_identity():
    from hidup.codegen import collectives as C

    x = torch.randn(4, 6, requires_grad=True)
    for src, dst in _pairs(2):
        assert C.convert(x, src, dst) is x


def _rank_raise(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    import torch.distributed as dist

    dist.barrier()  # rank 0 waits for the dead rank: the failure must still surface quickly


def test_failure_is_reported_not_hung():
    with pytest.raises(DistributedFailure, match="boom on rank 1"):
        run_distributed(_rank_raise, 2, timeout=60, pg_timeout=10)


def test_fake_process_group_is_a_mirrored_world():
    """On torch's fake process group (``hidup bench-rank``) the raw collectives fill their outputs as
    if every rank held this rank's tensor, whatever the torch version's fake group writes: the
    all-gather tiles ``x``, the reduce-scatter keeps this rank's chunk, the all-to-all tiles the chunk
    every rank sends here; so data-dependent work (routing) is a real rank's, never stale memory's."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hidup.codegen.collectives import all_reduce_raw, all_to_all_raw, gather_raw, reduce_scatter_raw

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    world, rank = 4, 2
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        x = torch.arange(8 * 3, dtype=torch.float64).view(8, 3)
        assert torch.equal(gather_raw(x), x.repeat(world, 1))
        assert torch.equal(reduce_scatter_raw(x), x[4:6])
        assert torch.equal(all_to_all_raw(x), x[4:6].repeat(world, 1))
        assert torch.equal(all_reduce_raw(x), x)
    finally:
        dist.destroy_process_group()

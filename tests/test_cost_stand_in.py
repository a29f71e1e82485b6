"""The fake process group's copies that ``exp/rank_predict.py`` adds to the cost model's compute to
predict what ``hidup bench-rank`` measures (:func:`exp.rank_predict.stand_in_copies`)."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest

import hidup.profiler
from exp.rank_predict import cross_validated, fit_factors, scaled, stand_in_copies
from hidup.ir import FULL, REDUCE, Graph, Node, Signature, Tensor, gather
from hidup.search.cost import KERNEL_KINDS
from hidup.search.problem import Problem

BW, OVERHEAD = 1e12, 1e-6


def _profile():
    return dataclasses.replace(hidup.profiler.load("h200x4-nvlink"), memory_bandwidth=BW, op_overhead=OVERHEAD)


def _activation_graph(shape=(8, 16), world=4):
    """Input ``x``, its exp ``a`` (requires a gradient) read by a neg; every form allowed."""
    forms = [FULL, REDUCE] + [gather(d) for d in range(len(shape))]
    tensors = {
        0: Tensor(0, shape, "float32", "x"),
        1: Tensor(1, shape, "float32", "e", requires_grad=True),
        2: Tensor(2, shape, "float32", "f", requires_grad=True),
    }
    nodes = [
        Node("x", "input", "input", [], [0], [Signature((), (f,)) for f in forms]),
        Node("e", "call", "exp", [0], [1], [Signature((f,), (f,), 1.0) for f in forms]),
        Node("f", "call", "neg", [1], [2], [Signature((f,), (f,), 1.0) for f in forms]),
    ]
    return Graph(nodes, tensors, world)


def test_stand_in_copies_are_what_the_fake_process_group_copies():
    """On the fake process group (a mirrored world, :mod:`hidup.codegen.collectives`) an all-gather
    tiles its input into its output (reads B/N, writes B: one kernel), a reduce-scatter copies this
    rank's chunk (2B/N), an all-to-all tiles one chunk of its local B/N (B/N^2 read, B/N written), an
    all-reduce nothing."""
    world, nbytes = 4, 8 * 16 * 4
    problem = Problem(_activation_graph(world=world), _profile(), "fp32")

    def copies(src, dst):
        step = SimpleNamespace(convs=((1, 0, problem.forms.index(src), problem.forms.index(dst)),))
        return stand_in_copies(problem, [step])

    all_gather = (1 + 1 / world) * nbytes / BW + OVERHEAD
    reduce_scatter = 2 * nbytes / world / BW + OVERHEAD
    all_to_all = (1 / world + 1 / world**2) * nbytes / BW + OVERHEAD
    assert copies(gather(0), FULL) == pytest.approx(all_gather + reduce_scatter)  # backward reduce-scatters
    assert copies(REDUCE, gather(1)) == pytest.approx(reduce_scatter + all_gather)  # backward all-gathers
    assert copies(gather(0), gather(1)) == pytest.approx(2 * all_to_all)  # all-to-all both ways
    assert copies(REDUCE, FULL) == 0.0  # all-reduce in place
    assert copies(FULL, gather(0)) == 0.0  # a slice: no collective


def test_fit_schemes_scale_what_they_say():
    """``per-setting`` scales the whole physical prediction; ``compute`` leaves the memory copies as
    priced and scales the rest, so that a run whose excess lies outside its copies is fitted exactly."""

    def row(model, physical, copies, measured):
        kinds = {"copies": copies}
        return dict(model=model, mode="compile+graph", precision="tf32", physical_ms=physical,
                    physical_kinds_ms=kinds, measured_ms=measured)  # fmt: skip

    # compute 10 ms runs 1.2x slower than priced; copies 0 and 5 ms run as priced
    rows = [row("a", 10.0, 0.0, 12.0), row("b", 15.0, 5.0, 17.0)]
    factors = fit_factors(rows, "compute")
    assert factors["compile+graph/tf32"] == pytest.approx(1.2)
    assert [scaled(r, factors, "compute") for r in rows] == pytest.approx([12.0, 17.0])
    assert max(cross_validated(rows, "compute")) == pytest.approx(0.0, abs=1e-12)
    whole = fit_factors(rows, "per-setting")
    assert whole["compile+graph/tf32"] == pytest.approx(math.sqrt(1.2 * 17.0 / 15.0))
    assert scaled(rows[1], whole, "per-setting") == pytest.approx(15.0 * whole["compile+graph/tf32"])
    assert scaled(dict(rows[1], precision="bf16"), whole, "per-setting") is None  # no factor for that setting
    assert max(cross_validated(rows, "per-setting")) > 0.05


def test_kind_factors_scale_each_kernel_kind_and_leave_the_physical_kinds_as_priced():
    """``kinds``: one factor per kernel kind, from the runs with kernel times, one for the gaps between
    kernels; a kind named physical keeps factor 1, and a run without kernel times fits nothing."""

    def row(model, physical, measured, step):
        return dict(model=model, mode="compile+graph", precision="bf16", physical_kinds_ms=physical,
                    measured_kinds_ms=measured, measured_ms=step, physical_ms=sum(physical.values()))  # fmt: skip

    zero = dict.fromkeys(KERNEL_KINDS, 0.0)
    # matmuls as priced, Adam 1.25x; the step 0.5 ms longer than its kernels (10%)
    a = row("a", {**zero, "matmul": 3.0, "optimizer": 2.0}, {**zero, "matmul": 3.0, "optimizer": 2.5}, 6.05)
    b = row("b", {**zero, "matmul": 6.0, "optimizer": 4.0}, {**zero, "matmul": 6.0, "optimizer": 5.0}, 12.1)
    untraced = row("c", {**zero, "matmul": 1.0}, dict(zero), 5.0)
    factors = fit_factors([a, b, untraced], "kinds")
    assert factors["compile+graph/bf16/optimizer"] == pytest.approx(1.25)
    assert factors["compile+graph/bf16/matmul"] == pytest.approx(1.0)
    assert factors["compile+graph/bf16/gaps"] == pytest.approx(1.1)
    assert scaled(a, factors, "kinds") == pytest.approx(6.05)
    assert max(cross_validated([a, b], "kinds")) == pytest.approx(0.0, abs=1e-12)
    kept = fit_factors([a, b], "kinds", frozenset({"optimizer"}))
    assert "compile+graph/bf16/optimizer" not in kept  # priced as measured: factor 1
    assert scaled(a, kept, "kinds") == pytest.approx(kept["compile+graph/bf16/gaps"] * 5.0)
    assert kept["compile+graph/bf16/gaps"] == pytest.approx(1.21)

"""The routed experts' all-to-all token dispatcher (``hidup/rules/dispatch.py``).

* as one rank (no process group) it is the routed-experts math, forward and backward, float64;
* on 2 and 4 gloo ranks, each holding a quarter (half) of the tokens and of the experts, the rows it
  returns and the gradients of its tokens, routing weights and experts equal the slices of the single
  device's, float64, for routings that send every pair to one rank's experts, leave a rank with no
  pair to send or to receive, and are spread evenly;
* without values (meta tensors, as a memory record runs it) its split sizes are the balanced ones;
* on a 2x2 mesh, the rule's all-to-all factor names its mesh axis in the call the rank runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dist_util import run_distributed
from hidup.rules import dispatch
from hidup.rules.experts import routed_experts_math

D64 = torch.float64
TOKENS, HIDDEN, FFN, EXPERTS, K = 16, 5, 3, 8, 2


def _case(routing: str, seed: int = 0) -> list[torch.Tensor]:
    """(x, top_k_index, top_k_weights, gate_up_proj, down_proj) in float64 with a named routing."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, dtype=D64, generator=g)
    if routing == "spread":
        idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:K] for _ in range(TOKENS)])
    elif routing == "one_owner":  # every pair on experts 0 and 1: one rank receives everything
        idx = torch.tensor([[0, 1]] * TOKENS)
    elif routing == "last_owner":  # every pair on the last two experts; k = 2 slots of one token differ
        idx = torch.tensor([[EXPERTS - 1, EXPERTS - 2]] * TOKENS)
    else:  # "skewed": the first half of the tokens on expert 0, the rest spread
        idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:K] for _ in range(TOKENS)])
        idx[: TOKENS // 2, 0] = 0
        idx[: TOKENS // 2, 1] = 3
    w = torch.rand(TOKENS, K, dtype=D64, generator=g)
    gate_up = torch.randn(EXPERTS, 2 * FFN, HIDDEN, dtype=D64, generator=g)
    down = torch.randn(EXPERTS, HIDDEN, FFN, dtype=D64, generator=g)
    return [x, idx, w, gate_up, down]


def _leaves(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone().requires_grad_(t.is_floating_point()) for t in tensors]


def _reference(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(y, the output gradient used, gradients of x, w, gate_up, down) on one device."""
    leaves = _leaves(tensors)
    y = routed_experts_math(*leaves, 0, "silu")
    grad_y = torch.randn(y.shape, dtype=D64, generator=torch.Generator().manual_seed(7))
    y.backward(grad_y)
    return y.detach(), grad_y, [leaves[i].grad for i in (0, 2, 3, 4)]


@pytest.mark.parametrize("routing", ["spread", "one_owner", "skewed"])
def test_one_rank_is_the_math(routing):
    tensors = _case(routing)
    y, grad_y, grads = _reference(tensors)
    leaves = _leaves(tensors)
    got = dispatch.routed_experts_all_to_all(*leaves, "silu")
    got.backward(grad_y)
    torch.testing.assert_close(got, y, rtol=0, atol=1e-13)
    for a, b in zip([leaves[i].grad for i in (0, 2, 3, 4)], grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def _rank_dispatch(rank: int, world: int) -> dict:
    dispatch.use_group_resolver(lambda axis: None)  # the default group: every rank of the job
    worst = {}
    for routing in ("spread", "one_owner", "last_owner", "skewed"):
        tensors = _case(routing)
        y, grad_y, grads = _reference(tensors)
        piece = [t.chunk(world)[rank] for t in tensors]
        leaves = _leaves(piece)
        got = dispatch.routed_experts_all_to_all(*leaves, "silu")
        got.backward(grad_y.chunk(world)[rank])
        diffs = [float((got - y.chunk(world)[rank]).abs().max())]
        diffs += [float((leaves[i].grad - g.chunk(world)[rank]).abs().max()) for i, g in zip((0, 2, 3, 4), grads)]
        worst[routing] = max(diffs)
    return worst


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_reproduce_the_single_device(world):
    for rank, worst in enumerate(run_distributed(_rank_dispatch, world, timeout=120)):
        for routing, d in worst.items():
            assert d <= 1e-12, f"rank {rank} of {world}, routing {routing}: differs by {d:.2e}"


def test_without_values_the_split_is_balanced():
    """Meta tensors (no values to count): the rows each rank would send are spread evenly, shapes kept."""
    assert dispatch._balanced(10, 4) == [3, 3, 2, 2]
    with torch.device("meta"):
        x, gate_up, down = torch.empty(6, 4), torch.empty(2, 6, 4), torch.empty(2, 4, 3)
        idx, w = torch.zeros(6, 2, dtype=torch.long), torch.empty(6, 2)
    assert dispatch.routed_experts_all_to_all(x, idx, w, gate_up, down, "silu").shape == (6, 4)


def test_mesh_factor_names_its_axis():
    """A 2x2 mesh signature whose inner factor dispatches by all-to-all localizes to a call on axis 1."""
    pytest.importorskip("transformers")
    import warnings

    from hidup import rules
    from hidup.frontend.trace import trace_module
    from hidup.rules.mesh import localize_mesh
    from test_thirdparty_moe import build

    model, inputs = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace_module(model, inputs, world_size=4, mesh=(2, 2))
    node = next(n for n in traced.graph.nodes if n.target == "routed_experts")
    sig = next(s for s in node.signatures if s.axes[1].impl == "all_to_all" and s.axes[0].kind == "data")
    ctx = traced.contexts[node.name]
    call = localize_mesh(ctx, sig, (1, 0), (2, 2), rules.localize, list(range(len(node.inputs))))
    assert call.target is dispatch.routed_experts_all_to_all
    assert call.kwargs["mesh_axis"] == 1


def test_the_dispatcher_is_left_to_eager_python_under_torch_compile():
    """Inside a compiled step the dispatcher runs as eager Python (a graph break: its split sizes are
    read on the host), and the step's values and gradients are the single device's."""
    tensors = _case("skewed")
    y_ref, grad_y, grads_ref = _reference(tensors)

    def step(x, idx, w, gate_up, down):
        return dispatch.routed_experts_all_to_all(x * 1.0, idx, w, gate_up, down, "silu") * 1.0

    torch._dynamo.reset()
    assert torch._dynamo.explain(step)(*_leaves(tensors)).graph_break_count >= 1  # left to eager Python
    leaves = _leaves(tensors)
    torch._dynamo.reset()
    y = torch.compile(step, backend="aot_eager")(*leaves)
    y.backward(grad_y)
    assert torch.equal(y.detach(), y_ref)
    for got, want in zip([leaves[i].grad for i in (0, 2, 3, 4)], grads_ref):
        assert torch.equal(got, want)

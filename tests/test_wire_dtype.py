"""Weights gathered in autocast's dtype (``hidup/precision.py``, ``codegen.collectives.convert_cast``).

* which parameters qualify: those whose every use, through views, is a matmul (a GPT's attention and
  MLP weights), not a norm's weight, an embedding table or a bias added in float32;
* an FSDP-style plan of the zoo GPT on 2 gloo ranks under CPU bf16 autocast gives the same loss and
  the same float32 gradients, bit for bit, with the slices sent in bf16 as with them sent in float32
  (the consumer casts the gathered copy elementwise either way; the gradient is reduced in float32
  either way), eagerly and compiled (``aot_eager``); and the bf16 path did run;
* the cost model prices those gathers at 2 bytes an element forward and 4 backward.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import hidup
import hidup.profiler
from dist_util import run_distributed
from hidup.precision import wire_low_params
from hidup.search import forced

SMALL = dict(layers=2, d_model=32, heads=4, ffn=64, seq_len=8, batch_per_gpu=2, vocab=64)


def _graph_plan(world: int = 2):
    model, inputs = hidup.models.build("gpt", world_size=world, seed=0, **SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = hidup.trace(model, inputs, world_size=world)
        plan = forced(graph, hidup.profiler.load("paper-v100-9.7gbps"), "fsdp", precision="bf16", duplication=False)
    return model, inputs, graph, plan


def test_matmul_weights_qualify_norms_and_tables_do_not():
    _, _, graph, _ = _graph_plan()
    low = wire_low_params(graph)
    params = {graph.tensors[t].producer: t for t in graph.tensors if graph.tensors[t].is_param}
    names = {p for p, t in params.items() if t in low}
    assert {"trunk_layers_0_attn_k_weight", "trunk_layers_0_attn_o_weight", "decoder_weight"} <= names, names
    others = set(params) - names
    assert {"trunk_layers_0_ln1_weight", "tok_weight", "pos"} <= others, others  # a norm, the embedding tables


def _rank(rank: int, world: int, plan, backend) -> dict:
    import hidup.codegen.collectives as collectives
    import hidup.codegen.program as program
    from hidup import compile
    from hidup.codegen.params import full_grad_dict

    calls = []
    real = collectives.convert_cast

    def counting(x, src, dst, group, dtype, reduce_dtype=None):
        calls.append(dtype)
        return real(x, src, dst, group, dtype, reduce_dtype)

    collectives.convert_cast = counting
    out = {}
    try:
        for wire in ("bf16", "fp32"):
            if wire == "fp32":
                program.wire_low_params = lambda graph: frozenset()
            model, inputs = hidup.models.build("gpt", world_size=world, seed=0, **SMALL)
            module = compile(model, plan, rank, world, inputs, duplication=False, compile=backend)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = module(*inputs)
            loss.backward()
            out[wire] = (float(module.global_loss(loss)), {k: v.clone() for k, v in full_grad_dict(module).items()})
    finally:
        collectives.convert_cast = real
        program.wire_low_params = wire_low_params
    (loss_a, grads_a), (loss_b, grads_b) = out["bf16"], out["fp32"]
    differ = [k for k in grads_a if not torch.equal(grads_a[k], grads_b[k])]
    dtypes = {str(g.dtype) for g in grads_a.values()}
    return {"cast_calls": len(calls), "same_loss": loss_a == loss_b, "differ": differ, "dtypes": dtypes}


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_bf16_on_the_wire_is_bitwise_the_float32_wire(backend):
    """Eagerly (the cast's autograd function) and compiled (the custom op ``hidup::convert_cast``)."""
    _, _, _, plan = _graph_plan()
    for rank, r in enumerate(run_distributed(_rank, 2, plan, backend, timeout=300)):
        if backend is None:
            assert r["cast_calls"] > 0, f"rank {rank}: no weight was sent in bf16"
        assert r["same_loss"], f"rank {rank}: the loss differs"
        assert not r["differ"], f"rank {rank}: gradients differ: {r['differ'][:5]}"
        assert r["dtypes"] == {"torch.float32"}


def test_the_cost_model_prices_the_gathers_at_the_bytes_that_travel():
    from hidup.ir import FULL, gather
    from hidup.search.cost import CostModel

    _, _, graph, plan = _graph_plan()
    profile = hidup.profiler.load("paper-v100-9.7gbps")
    cm = CostModel(graph, profile, precision="bf16")
    low = sorted(wire_low_params(graph))
    other = next(t for t, x in graph.tensors.items() if x.is_param and t not in low and len(x.shape) == 2)
    for tid, share in ((low[0], 0.5), (other, 1.0)):
        nbytes = cm.nbytes[tid]
        c = cm.conversion(tid, gather(0), FULL)
        assert c.fwd - c.fwd_copies == pytest.approx(cm.comm("all_gather", nbytes * share))
        assert c.bwd - c.bwd_copies == pytest.approx(cm.comm("reduce_scatter", nbytes))
    assert CostModel(graph, profile, precision="fp32").wire_share(low[0]) == 1.0
    gathers = [c for c in plan.conversions if c.tensor in low and c.forward == "all_gather"]
    assert gathers and all(c.wire[0] * 2 == c.wire[1] for c in gathers)  # what the plan records

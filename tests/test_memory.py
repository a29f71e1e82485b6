"""The memory model's activations are the bytes autograd really keeps on a rank.

For a plan, rank 0's program runs on the CPU (torch's fake process group stands in for the other
rank) with ``saved_tensors_hooks`` recording every tensor packed for the backward; its storages,
deduplicated (a view is not new memory), minus those of the rank's parameters, buffers and inputs
(the parameter and input terms hold them), are what the backward keeps.  The memory model's
activation term of the same plan (:mod:`hidup.search.memory`, from :mod:`hidup.frontend.saved`) must equal that
sum to the byte: both count the same storages at the same dtypes and local shapes, so any difference
is a storage counted wrongly, not rounding.  In float64 and float32, and under bf16 autocast (whose
casts are storages of their own).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hidup
import hidup.profiler
from hidup.codegen import compile as hidup_compile
from hidup.frontend.saved import record_of, tensor_dtype
from hidup.frontend.trace import forward_inputs, trace_module
from hidup.search import forced
from hidup.search.memory import MemoryModel

sys.path.insert(0, str(Path(__file__).parent))
import thirdparty

WORLD = 2
PROFILE = hidup.profiler.load("h200x4-nvlink")
SMALL = dict(layers=2, d_model=32, heads=4, ffn=64, seq_len=8, batch_per_gpu=4, vocab=64)


@pytest.fixture(scope="module", autouse=True)
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield
    dist.destroy_process_group()


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _saved_bytes(module, inputs, autocast: bool) -> int:
    """Bytes of the distinct storages rank 0's forward packs for its backward, beyond its parameters,
    buffers and inputs."""
    held = {_key(p) for p in module.parameters()} | {_key(b) for b in module.buffers()}
    held |= {_key(v) for v in inputs if isinstance(v, torch.Tensor)}
    saved: dict[int, int] = {}
    keep = []

    def pack(t):
        keep.append(t)
        if _key(t) not in held:
            saved[_key(t)] = t.untyped_storage().nbytes()
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast, cache_enabled=False),
    ):
        module(*inputs)
    return sum(saved.values())


def _local_inputs(module, values: list) -> list:
    forms = iter(module.input_forms.values())
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            form = next(forms)
            if form is not None and form.is_gather:
                v = v.chunk(WORLD, form.dim)[0].contiguous()
        out.append(v)
    return out


def _check(model, inputs, style: str, precision: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace_module(model, inputs, WORLD).graph
        # fsdp: every op data parallel, every weight stored split and gathered for use
        plan = forced(graph, PROFILE, style, duplication=False, precision=precision)
        values = forward_inputs(model, inputs)
        module = hidup_compile(model, plan, 0, WORLD, values, duplication=False, local_batch=True)
    measured = _saved_bytes(module, _local_inputs(module, values), precision == "bf16")
    assert measured > 0
    model_of = MemoryModel(graph, precision=precision)
    assert model_of.plan_activations(plan.choices) == measured, (style, precision, measured)
    return graph, plan, model_of, measured


def _zoo(name: str, dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return hidup.models.build(name, world_size=WORLD, seed=0, **SMALL)
    finally:
        torch.set_default_dtype(before)


@pytest.mark.parametrize(
    "name,style",
    [
        ("gpt", "data"),
        ("bert-sgmoe", "data"),
        ("bert-sgmoe", "expert"),
        ("gpt", "tensor"),
        ("bert-sgmoe", "tensor"),
        ("mlp", "tensor"),
        ("gpt", "fsdp"),
    ],
)
@pytest.mark.parametrize("precision", ["fp64", "bf16"])
def test_zoo_activations_are_what_autograd_saves(name, style, precision):
    """The plan's activations, form changes followed, are the bytes saved; for the data, expert and
    FSDP-style plans the search's count is too (a storage saved across a form change is converted alike
    for every saver there).  FSDP-style: the backward keeps gathered weights (in float64 every one; under
    bf16 the norms', the matmuls keeping autocast's casts instead), copies the per-node terms cannot see:
    the search adds them where a parameter is converted for a consumer that keeps it."""
    model, inputs = _zoo(name, torch.float64 if precision == "fp64" else torch.float32)
    graph, plan, memory, measured = _check(model, inputs, style, "fp32" if precision == "fp64" else "bf16")
    stored_split = [n for n in graph.nodes if n.op == "param" and plan.choices[n.name].outputs[0].is_gather]
    if style in ("data", "expert", "fsdp"):
        assert plan.memory["activations"] == measured
    if style == "fsdp":  # a backward keeps gathered weights, copies the per-node sum cannot see
        assert stored_split
        per_node = sum(memory.activations(n, plan.choices[n.name]) for n in graph.nodes if n.name in plan.choices)
        assert per_node < measured


@pytest.mark.parametrize("precision", ["fp64", "bf16"])
def test_llama_activations_are_what_autograd_saves(precision):
    model, inputs = thirdparty.build("llama")
    if precision == "bf16":
        model = model.float()
    _check(model, inputs, "data", "fp32" if precision == "fp64" else "bf16")


def test_autocast_dtypes_and_communication_bytes():
    """Under bf16 autocast a linear's output is bfloat16, a norm's statistics and the parameters stay
    float32, and a form change of the linear's output is priced at 2 bytes per element."""
    from hidup.ir import FULL, gather
    from hidup.search.cost import CostModel

    model, inputs = _zoo("gpt", torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace_module(model, inputs, WORLD).graph
    linear = next(n for n in graph.nodes if n.target == "linear")
    out = linear.outputs[0]
    assert graph.tensors[out].dtype == "float32"
    assert tensor_dtype(graph, out, "bf16") == "bfloat16" and tensor_dtype(graph, out, "fp32") == "float32"
    weight = next(n for n in graph.nodes if n.op == "param").outputs[0]
    assert tensor_dtype(graph, weight, "bf16") == "float32"
    bf16, fp32 = CostModel(graph, PROFILE, "bf16"), CostModel(graph, PROFILE, "fp32")
    assert bf16.conversion_class(out)[1] * 2 == fp32.conversion_class(out)[1] == graph.tensors[out].nbytes
    assert bf16.conversion(out, gather(0), FULL).fwd < fp32.conversion(out, gather(0), FULL).fwd
    assert record_of(graph, "tf32") is record_of(graph, "fp32")

"""Tests of hidup.trace (torch.export + meta shape propagation + IR building) and hidup.describe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hidup
import hidup.frontend.trace  # the module must stay callable after import
from hidup.frontend.trace import FallbackWarning, Traced, TraceFailure, trace, trace_module
from hidup.ir import FULL, REDUCE, REPLICATE, Graph, gather

HERE = os.path.basename(__file__)


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        return fn(*args, **kwargs)


def _fallback_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, FallbackWarning)]


class MLPLoss(nn.Module):
    def __init__(self, d=8, h=16):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x))).sum()


def _opaque_prefix_max(x):
    """An op no rule knows about (``cummax``): it must be replicated with a warning."""
    return torch.cummax(x, dim=-1).values


def add_positions(h):
    return h + torch.arange(h.shape[1]).float().unsqueeze(-1)  # a factory without device


# ---------------------------------------------------------------------------------------------


def test_linear_gelu_linear_graph():
    t = _quiet(trace_module, MLPLoss(), (torch.randn(4, 8),), 2)
    assert isinstance(t, Traced) and isinstance(t.gm, torch.fx.GraphModule)
    g = t.graph
    ops = [(n.op, n.target) for n in g.nodes]
    assert ops == [("input", "input")] + [("param", "parameter")] * 4 + [
        ("call", "linear"),
        ("call", "gelu"),
        ("call", "linear"),
        ("call", "sum"),
        ("output", "output"),
    ]
    x, w1 = g.node("x"), g.node("fc1_weight")
    assert [str(s.outputs[0]) for s in x.signatures] == ["full", "gather_0", "gather_1"]
    assert [s.outputs for s in w1.signatures] == [(REPLICATE,), (gather(0),), (gather(1),)]
    assert w1.signatures[0].kind == "param" and g.tensors[w1.outputs[0]].is_param
    assert t.param_names == {
        "fc1_weight": "fc1.weight",
        "fc1_bias": "fc1.bias",
        "fc2_weight": "fc2.weight",
        "fc2_bias": "fc2.bias",
    }
    lin = g.node("linear")
    assert lin.inputs == [x.outputs[0], w1.outputs[0], g.node("fc1_bias").outputs[0]]
    assert lin.module == "fc1" and lin.source.endswith(f"{HERE}:{MLPLoss.forward.__code__.co_firstlineno + 1}")
    assert g.tensors[lin.outputs[0]].shape == (4, 16) and g.tensors[lin.outputs[0]].requires_grad
    assert any(
        all(f.kind in ("full", "replicate") for f in s.inputs) and s.outputs == (FULL,) and s.flops == lin.flops
        for s in lin.signatures
    )
    out = g.nodes[-1]
    assert [s.inputs for s in out.signatures] == [(REDUCE,), (FULL,)] and out.inputs == g.node("sum_1").outputs
    ctx = t.contexts["linear"]
    assert ctx.world == 2 and ctx.node_name == "linear" and ctx.target is torch.ops.aten.linear.default
    assert [m.shape for m in ctx.inputs] == [(4, 8), (16, 8), (16,)] and ctx.inputs[1].is_param
    assert not ctx.inputs[0].is_param and [m.shape for m in ctx.outputs] == [(4, 16)]
    assert t.tensor_ids["linear"] == lin.outputs and set(t.contexts) == {"linear", "gelu", "linear_1", "sum_1"}
    assert g.total_flops > 0 and g.node("linear").flops >= g.node("linear_1").flops > 0


def test_tuple_returning_op_aliases_getitem():
    class M(nn.Module):
        def forward(self, x):
            vals, idx = torch.topk(x, 2, dim=-1)
            a, b = x.chunk(2, dim=0)
            return vals.sum() + (idx.float().mean() + a.sum() * b.sum())

    t = _quiet(trace_module, M(), (torch.randn(4, 6),), 2)
    g = t.graph
    topk = g.node("topk")
    assert len(topk.outputs) == 2
    assert [g.tensors[i].dtype for i in topk.outputs] == ["float32", "int64"]
    assert [g.tensors[i].shape for i in topk.outputs] == [(4, 2), (4, 2)]
    assert t.tensor_ids["getitem"] == [topk.outputs[0]] and t.tensor_ids["getitem_1"] == [topk.outputs[1]]
    assert not any(n.target == "getitem" for n in g.nodes)  # aliases get no IR node
    chunk = g.node("chunk")
    assert [g.tensors[i].shape for i in chunk.outputs] == [(2, 6), (2, 6)]
    assert t.tensor_ids["getitem_3"] == [chunk.outputs[1]]


def test_size_in_view_is_folded():
    class M(nn.Module):
        def forward(self, x):
            b = x.size(0)
            return x.view(b, -1).sum(dim=1).sum()

    t = _quiet(trace_module, M(), (torch.randn(4, 2, 3),), 2)
    assert not any(n.target.startswith("size") for n in t.graph.nodes)  # export specialises sizes
    ctx = t.contexts["view"]
    assert ctx.args[1:] == ([4, -1],) and len(ctx.inputs) == 1
    assert t.graph.tensors[t.graph.node("view").outputs[0]].shape == (4, 6)


def test_op_without_rule_is_replicated_with_one_warning():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return _opaque_prefix_max(self.fc(x)).sum()

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        t = trace_module(M(), (torch.randn(2, 4),), 2)
    messages = _fallback_warnings(record)
    assert len(messages) == 1
    node = t.graph.node("cummax")
    assert "cummax" in messages[0] and f"{HERE}:" in messages[0]
    assert node.fallback and t.graph.fallbacks == ["cummax"]
    assert [str(s) for s in node.signatures] == ["(full) -> (full, full)"]
    assert node.flops == 16  # sum of output numels (values and indices)


def test_broken_rule_falls_back_and_bad_gathers_are_filtered(monkeypatch):
    def bad_rule(ctx):
        if ctx.node_name == "relu":
            raise RuntimeError("boom")
        n_in, n_out = len(ctx.inputs), len(ctx.outputs)
        return [
            hidup.ir.Signature((FULL,) * n_in, (FULL,) * n_out, 1.0),
            hidup.ir.Signature((gather(1),) * n_in, (gather(1),) * n_out, 0.5, "tensor"),
        ]

    import hidup.rules

    monkeypatch.setattr(hidup.rules, "signatures", bad_rule, raising=False)

    class M(nn.Module):
        def forward(self, x):
            return torch.relu(x * 2).sum()

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        g = trace(M(), (torch.randn(4, 3),), 2)  # dim 1 (size 3) is not divisible by 2
    assert g.fallbacks == ["relu"]
    assert "boom" in _fallback_warnings(record)[0]
    mul = g.node("mul")
    assert [str(s) for s in mul.signatures] == ["(full) -> (full)"] and not mul.fallback and mul.flops == 1.0


def test_shapes_dtypes_and_stock_attention_inlined():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight  # tied
            self.register_buffer("scale", torch.ones(8))

        def forward(self, ids):
            h = self.emb(ids).to(torch.bfloat16).float() * self.scale
            h = self.attn(h, h, h, need_weights=False)[0]
            return F.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        t = trace_module(M(), (torch.randint(0, 10, (4, 6)),), 2)
    g = t.graph
    assert not _fallback_warnings(record) and g.fallbacks == []
    assert g.tensors[g.node("ids").outputs[0]].dtype == "int64"
    assert "bfloat16" in {g.tensors[n.outputs[0]].dtype for n in g.nodes if n.target.startswith("to")}
    # nn.MultiheadAttention is no leaf: its ATen ops are nodes of its module, its parameters param nodes
    attn_ops = {n.target for n in g.nodes if n.op == "call" and n.module.startswith("attn")}
    assert {"linear", "scaled_dot_product_attention"} <= attn_ops
    names = {n for n, _ in M().attn.named_parameters()}
    assert {f"attn.{n}" for n in names} <= set(t.param_names.values())
    assert not any(isinstance(c.target, type) for c in t.contexts.values())
    tied = [n for n in g.params() if t.param_names[n.name] in ("emb.weight", "head.weight")]
    assert len(tied) == 1  # tied -> one node
    # named by the first name the model lists it under, whichever name export lifts (a plan made from
    # the model built on one device must name the same tensor as the model built on another)
    assert [n.name for n in tied] == ["emb_weight"] and t.param_names["emb_weight"] == "emb.weight"
    scale = g.node("scale")
    assert scale.target == "buffer" and [str(s.outputs[0]) for s in scale.signatures] == ["full", "gather_0"]
    assert not g.tensors[scale.outputs[0]].is_param
    assert g.tensors[g.nodes[-1].inputs[0]].shape == ()


def test_factory_tensors_inside_forward():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Embedding(6, 4)

        def forward(self, x):
            pos = self.pos(torch.arange(x.size(1)))
            return add_positions(x + pos).sum()

    t = _quiet(trace_module, M(), (torch.randn(2, 6, 4),), 2)
    arange = t.graph.node("arange")
    assert arange.inputs == [] and t.graph.tensors[arange.outputs[0]].dtype == "int64"
    assert [t.graph.tensors[n.outputs[0]].shape for n in t.graph.nodes if n.target == "add.Tensor"] == [(2, 6, 4)] * 2


def test_real_model_is_untouched_and_world_one_has_no_gathers():
    model = MLPLoss()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = _quiet(trace, model, torch.randn(3, 8))
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(len(n.signatures) == 1 for n in g.nodes if n.op in ("input", "param"))
    assert g.world_size == 1


def test_meta_and_real_models_trace_alike_and_fingerprint_is_stable():
    real = MLPLoss()
    with torch.device("meta"):
        meta = MLPLoss()
    g1 = _quiet(trace, real, (torch.randn(4, 8),), 4)
    g2 = _quiet(trace, real, (torch.randn(4, 8),), 4)
    g3 = _quiet(hidup.trace, meta, (torch.empty(4, 8, device="meta"),), 4)
    assert g1.fingerprint() == g2.fingerprint() == g3.fingerprint()
    assert g1.to_dict() == g3.to_dict()
    g4 = _quiet(trace, real, (torch.randn(4, 8),), 2)
    assert g4.fingerprint() != g1.fingerprint()


def test_to_dict_round_trip():
    g = _quiet(trace, MLPLoss(), (torch.randn(4, 8),), 2)
    back = Graph.from_dict(json.loads(g.to_json()))
    assert back.to_dict() == g.to_dict() and back.fingerprint() == g.fingerprint()
    back.validate()


def test_errors_are_clear():
    class ControlFlow(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(4, 4), Branchy())

        def forward(self, x):
            return self.inner(x).sum()

    # Python control flow is resolved for the example shape
    graph = _quiet(trace, ControlFlow(), (torch.randn(2, 4),), 2)
    assert [n.target for n in graph.nodes if n.op == "call"] == ["linear", "mul.Tensor", "sum"]

    class NotScalar(nn.Module):
        def forward(self, x):
            return x * 2

    with pytest.raises(TraceFailure, match="scalar loss"):
        _quiet(trace, NotScalar(), (torch.randn(2, 4),), 2)

    class DataDependent(nn.Module):
        def forward(self, x):
            return x[x > 0].sum()

    with pytest.raises(TraceFailure, match=r"node (getitem|index) .*meta"):
        _quiet(trace, DataDependent(), (torch.randn(2, 4),), 2)
    with pytest.raises(ValueError, match="world_size"):
        trace(MLPLoss(), (torch.randn(2, 8),), 0)


class Branchy(nn.Module):
    """Python control flow on a size: export resolves it for the example shape."""

    def forward(self, x):
        if x.size(-1) % 2 == 0:
            return x * 2
        return -x


def test_non_tensor_inputs_are_specialised():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 4), Branchy())

        def forward(self, x, double: bool = False, mask=None):
            y = self.block(x)
            if double:
                y = y * 2
            if mask is not None:
                y = y + mask
            return y.sum()

    t = _quiet(trace_module, M(), {"x": torch.randn(2, 4), "double": True}, 2)
    g = t.graph
    assert [n.name for n in g.nodes if n.op == "input"] == ["x"]
    assert [n.target for n in g.nodes if n.op == "call"] == ["linear", "mul.Tensor", "mul.Tensor", "sum"]
    assert g.node("mul").module == "block.1"
    t2 = _quiet(trace_module, M(), (torch.randn(2, 4), False, torch.ones(4)), 2)
    assert [n.name for n in t2.graph.nodes if n.op == "input"] == ["x", "mask"]
    assert [n.target for n in t2.graph.nodes if n.op == "call"] == ["linear", "mul.Tensor", "add.Tensor", "sum"]


@torch.library.custom_op("hidup_test::double_rows", mutates_args=())
def double_rows(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@double_rows.register_fake
def _(x):
    return torch.empty_like(x)


def test_custom_op_is_one_node_with_its_declared_rule():
    import hidup.rules

    class M(nn.Module):
        def forward(self, x):
            return double_rows(x).sum()

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        g = trace(M(), (torch.randn(2, 4),), 2)
    assert g.fallbacks == ["double_rows"] and "double_rows" in _fallback_warnings(record)[0]
    hidup.rules.declare_batch_op(double_rows)
    g = _quiet(trace, M(), (torch.randn(2, 4),), 2)
    node = g.node("double_rows")
    assert node.target == "double_rows" and not node.fallback
    assert [str(s) for s in node.signatures] == ["(full) -> (full)", "(gather_0) -> (gather_0)"]


def test_describe():
    g = _quiet(trace, MLPLoss(), (torch.randn(4, 8),), 2)
    text = hidup.describe(g)
    n_params = sum(p.numel() for p in MLPLoss().parameters())
    assert f"nodes: {len(g.nodes)}" in text and f"parameters: {n_params:,}" in text
    assert "param nodes: 4" in text and "GFLOPs" in text and "fc1_weight" in text and "[4, 16] float32" in text
    short = hidup.describe(g, max_rows=2, plain=True)
    assert "fc2_bias" not in short and f"... {len(g.nodes) - 2} more node(s)" in short
    assert short.splitlines()[3].split()[:2] == ["node", "op/target"]


# --------------------------------------------------------------------------------------------- zoo


def _small(name: str, world: int, **extra):
    # ViT's sequence is a square number of patches, so it gets 16 tokens instead of 8.
    seq = 16 if name.startswith("vit") else 8
    return hidup.models.build(
        name, world_size=world, layers=2, d_model=32, heads=4, ffn=64, seq_len=seq, batch_per_gpu=2, vocab=64, **extra
    )


ZOO = hidup.models.names() if hasattr(hidup.models, "names") else ["<zoo missing>"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ZOO)
def test_zoo_traces_without_fallbacks(name, world):
    model, inputs = _small(name, world)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        t = trace_module(model, inputs, world)
    assert t.graph.fallbacks == [], _fallback_warnings(record)
    assert not _fallback_warnings(record)
    assert all(n.signatures for n in t.graph.nodes) and t.graph.nodes[-1].op == "output"
    n_params = sum(p.numel() for p in model.parameters())
    assert sum(x.numel for x in t.graph.tensors.values() if x.is_param) == n_params
    assert set(t.param_names.values()) <= {n for n, _ in model.named_parameters()} | {
        n for n, _ in model.named_buffers()
    }
    # Some op is sharded along the batch for data parallelism.
    assert any(s.kind == "data" for n in t.graph.nodes if n.op == "call" for s in n.signatures)


@pytest.mark.parametrize("name", [n for n in ZOO if "moe" in n][:2])
def test_zoo_meta_build_traces_like_real_build(name):
    real = trace(*_small(name, 2), 2)
    meta = trace(*_small(name, 2, device="meta"), 2)
    assert real.fingerprint() == meta.fingerprint() and real.to_dict() == meta.to_dict()


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak RSS from /proc (Linux)")
def test_ten_billion_parameter_moe_traces_fast_and_small():
    script = textwrap.dedent("""
        import json, time, warnings
        import hidup
        def peak_rss_kib():
            # this process's own high-water mark: getrusage's ru_maxrss in a child started by fork
            # carries the parent's (pytest's) peak across exec
            with open("/proc/self/status") as status:
                return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
        t0 = time.process_time()  # CPU seconds: the bound holds on a loaded machine too
        model, inputs = hidup.models.build("bert-sgmoe", world_size=8, device="meta", layers=32,
                                           d_model=2048, heads=16, ffn=8192, experts_per_gpu=2)
        params = sum(p.numel() for p in model.parameters())
        warnings.simplefilter("ignore")
        g = hidup.trace(model, inputs, 8)
        print(json.dumps({"params": params, "seconds": time.process_time() - t0, "nodes": len(g.nodes),
                          "rss_kib": peak_rss_kib(),
                          "traced_params": sum(t.numel for t in g.tensors.values() if t.is_param)}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 9e9 <= r["params"] <= 12e9 and r["traced_params"] == r["params"]
    assert r["seconds"] < 30, r
    assert r["rss_kib"] < 2 * 1024 * 1024, r

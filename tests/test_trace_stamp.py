"""Stamped traces (:mod:`hidup.frontend.stamp`) equal whole-model traces, and train like them.

A model whose step runs a stack of identical blocks is exported with four of them and the rest
stamped out; everything downstream must see the graph a whole export gives.  ``assert_same_trace``
compares what search, plans, code generation, checkpoints and ``hidup show`` read: the fx graph
(names, ops, arguments, module paths and source lines, the tensors behind every ``get_attr``), the IR
(nodes, signatures and FLOPs, tensors, fingerprint) and the trace's side tables.  Models whose
blocks differ, or whose graph outside the stack depends on its length, fall back to the whole
export.  Parity: a stamped GPT trains on two gloo ranks in float64 exactly as on one device.
"""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hidup
import hidup.frontend.saved
import hidup.frontend.stamp
import hidup.frontend.trace
from hidup.frontend.trace import trace_module
from thirdparty import LMStep

LAYERS = 6
PROFILE = "h200x4-nvlink"


# ----------------------------------------------------------------------------------------------
# models


def _tokens(vocab: int = 96, batch: int = 8, seq: int = 16):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return ids, ids.clone()


def _transformers(name: str, layers: int = LAYERS, **extra):
    import transformers as T

    common = dict(
        num_hidden_layers=layers,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=96,
        max_position_embeddings=16,
        **extra,
    )
    if name == "llama":
        config, cls = T.LlamaConfig(**common), T.LlamaForCausalLM
    elif name == "mixtral":
        config, cls = T.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common), T.MixtralForCausalLM
    elif name == "qwen2":
        config, cls = T.Qwen2Config(**common), T.Qwen2ForCausalLM
    else:
        raise ValueError(name)
    torch.manual_seed(0)
    return LMStep(cls(config)), _tokens()


SIZE = dict(d_model=32, heads=4, ffn=64, seq_len=8, batch_per_gpu=2, vocab=64)


def _gpt(layers: int = LAYERS, world: int = 4):
    return hidup.models.build("gpt", world_size=world, layers=layers, **SIZE)


def _sgmoe():
    """Dense and MoE layers in turn: a stack of period 2, one block per pair of layers."""
    return hidup.models.build("bert-sgmoe", world_size=4, layers=2 * LAYERS, **SIZE)


BUILDERS = {
    "llama": lambda: _transformers("llama"),
    "mixtral": lambda: _transformers("mixtral"),
    "gpt": _gpt,
    "bert-sgmoe": _sgmoe,
}


class Block(nn.Module):
    def __init__(self, width: int, layer_idx: int, odd_scale: bool = False):
        super().__init__()
        self.up, self.down = nn.Linear(16, width), nn.Linear(width, 16)
        self.layer_idx, self.odd_scale = layer_idx, odd_scale

    def forward(self, x):
        y = self.down(torch.tanh(self.up(x)))
        if self.odd_scale and self.layer_idx % 2:  # per-layer behaviour in code, not in an attribute
            y = y * 0.5
        return x + y


class Stacked(nn.Module):
    """``layers`` residual blocks; ``widths`` per block, ``odd_scale`` halves odd blocks' updates,
    ``mean_over_layers`` divides the loss by the stack's length."""

    def __init__(self, widths, odd_scale=False, mean_over_layers=False):
        super().__init__()
        self.layers = nn.ModuleList(Block(w, i, odd_scale) for i, w in enumerate(widths))
        self.head = nn.Linear(16, 4)
        self.mean_over_layers = mean_over_layers

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        loss = F.cross_entropy(self.head(x), y)
        return loss / len(self.layers) if self.mean_over_layers else loss


def _stacked(**kwargs):
    torch.manual_seed(0)
    widths = kwargs.pop("widths", [32] * LAYERS)
    return Stacked(widths, **kwargs), (torch.randn(8, 16), torch.randint(0, 4, (8,)))


# ----------------------------------------------------------------------------------------------
# helpers


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _trace(model, inputs, mesh, stamp, monkeypatch):
    """trace_module with ``stamp_layers=stamp``; also returns what the stamped export gave."""
    seen = []
    real = hidup.frontend.stamp.export_stamped

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(hidup.frontend.trace, "export_stamped", spy)
    traced = _quiet(trace_module, model, inputs, 4, mesh=mesh, stamp_layers=stamp)
    return traced, (seen[0] if seen else None)


def _exported_once(monkeypatch):
    """Let ``hidup.trace`` export a model with a given set of blocks once (the fx graph does not depend
    on the mesh; the IR is built for each).  Entries keep the model and inputs alive, so ids stay unique."""
    memo: dict = {}
    real = hidup.frontend.trace._exported

    def exported(model, values):
        key = (id(model), tuple(map(id, model.parameters())), tuple(map(id, values)))
        if key not in memo:
            memo[key] = (model, values, real(model, values))
        return memo[key][2]

    monkeypatch.setattr(hidup.frontend.trace, "_exported", exported)


@pytest.fixture(scope="module")
def traces():
    """name -> (model, {mesh: (whole trace, stamped trace, what export_stamped gave)})."""
    made: dict = {}

    def get(name):
        if name not in made:
            model, inputs = BUILDERS[name]()
            with pytest.MonkeyPatch.context() as mp:
                _exported_once(mp)
                by_mesh = {}
                for mesh in (None, (2, 2)):
                    full, none = _trace(model, inputs, mesh, False, mp)
                    assert none is None
                    by_mesh[mesh] = (full, *_trace(model, inputs, mesh, True, mp))
            made[name] = (model, by_mesh)
        return made[name]

    return get


def assert_same_trace(
    model: nn.Module, full: hidup.frontend.trace.Traced, stamped: hidup.frontend.trace.Traced
) -> None:
    """Everything downstream reads is equal: fx graph, IR graph and the trace's tables."""
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    fx_full, fx_stamped = list(full.gm.graph.nodes), list(stamped.gm.graph.nodes)
    assert len(fx_full) == len(fx_stamped)
    for a, b in zip(fx_full, fx_stamped):
        assert (a.name, a.op, a.target) == (b.name, b.op, b.target), (a.name, b.name)
        assert a.meta.get("nn_module_stack") == b.meta.get("nn_module_stack"), a.name
        assert a.meta.get("stack_trace") == b.meta.get("stack_trace"), a.name
        if a.op == "get_attr":
            ta, tb = operator.attrgetter(a.target)(full.gm), operator.attrgetter(b.target)(stamped.gm)
            if a.target in state:
                assert ta is tb is state[a.target], a.target  # the model's own parameter or buffer
            else:  # a constant the code made: equal, and one per use as in the whole export
                assert type(ta) is type(tb) and ta.shape == tb.shape and ta.dtype == tb.dtype, a.target
                assert ta.device.type == "meta" or torch.equal(ta, tb), a.target
    assert full.gm.code == stamped.gm.code  # every argument, in the code the ranks run
    g, h = full.graph, stamped.graph
    assert g.to_dict() == h.to_dict()  # nodes, signatures, flops, modules, sources, tensors
    assert g.fingerprint() == h.fingerprint() and g.copy_reason == h.copy_reason and g.mesh == h.mesh
    assert full.param_names == stamped.param_names and full.tensor_ids == stamped.tensor_ids
    assert repr(full.constants) == repr(stamped.constants)
    assert full.contexts.keys() == stamped.contexts.keys()
    assert all(repr(full.contexts[k]) == repr(stamped.contexts[k]) for k in full.contexts)


# ----------------------------------------------------------------------------------------------
# equality and plans


@pytest.mark.parametrize("mesh", [None, (2, 2)], ids=["world4", "mesh2x2"])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_stamped_trace_is_the_whole_trace(name, mesh, traces):
    model, by_mesh = traces(name)
    full, stamped, made = by_mesh[mesh]
    assert made is not None, "the stack was not stamped"
    assert len(made.templates) >= (LAYERS - 4) * 10  # blocks 3 .. L-2 are copies
    assert made.stack.path.endswith("layers") and len(made.stack) == LAYERS
    assert made.stack.period == (2 if name == "bert-sgmoe" else 1)
    assert_same_trace(model, full, stamped)


# A search reads the graph and, through the fx graph, what autograd saves (hidup.frontend.saved).  Mixtral
# (routed experts) on world 4 (a 2x2 mesh search of it takes 12 s), the zoo GPT on the mesh.
@pytest.mark.parametrize("name, mesh", [("mixtral", None), ("gpt", (2, 2))], ids=["mixtral", "gpt-mesh2x2"])
def test_stamped_trace_searches_the_same_plan(name, mesh, traces):
    _, by_mesh = traces(name)
    full, stamped, _ = by_mesh[mesh]
    plan_full = _quiet(hidup.search, full.graph, PROFILE, duplication=False)
    plan_stamped = _quiet(hidup.search, stamped.graph, PROFILE, duplication=False)
    assert plan_full.to_dict() == plan_stamped.to_dict()
    assert hidup.show(plan_full, full.graph) == hidup.show(plan_stamped, stamped.graph)


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_saved_record_looks_up_identical_layers_once(name, traces, monkeypatch):
    """What autograd saves (:mod:`hidup.frontend.saved`), each local op's record looked up once for the ops of
    identical layers, equals the record looked up node by node, item for item and in order; and the
    stamped trace's record is the whole trace's."""
    _, by_mesh = traces(name)
    full, stamped, _ = by_mesh[(2, 2)]
    shared = stamped.graph.autograd_saved._run("bf16")
    real = hidup.frontend.saved._LocalOps._items

    def node_by_node(self, node, sig, arguments):
        self.of_node.clear()
        return real(self, node, sig, arguments)

    monkeypatch.setattr(hidup.frontend.saved._LocalOps, "_items", node_by_node)
    alone = stamped.graph.autograd_saved._run("bf16")
    assert sum(len(per_sig) for per_sig in alone.local.values()) > 10 * LAYERS
    assert repr(shared) == repr(alone)
    assert repr(full.graph.autograd_saved._run("bf16")) == repr(alone)


def test_default_stamps_deep_stacks_only(monkeypatch):
    shallow, made = _trace(*_stacked(), None, None, monkeypatch)
    assert made is None  # 6 blocks: below the automatic threshold
    deep_model, deep_inputs = _stacked(widths=[32] * hidup.frontend.stamp.AUTO_MIN_BLOCKS)
    deep, made = _trace(deep_model, deep_inputs, None, None, monkeypatch)
    assert made is not None
    full, _ = _trace(deep_model, deep_inputs, None, False, monkeypatch)
    assert_same_trace(deep_model, full, deep)


# ----------------------------------------------------------------------------------------------
# fallbacks


def _falls_back(model, inputs, monkeypatch, *, stack_found: bool):
    _exported_once(monkeypatch)
    full, _ = _trace(model, inputs, None, False, monkeypatch)
    stamped, made = _trace(model, inputs, None, True, monkeypatch)
    assert made is None
    assert (hidup.frontend.stamp.repeated_stack(model) is not None) == stack_found
    assert_same_trace(model, full, stamped)


def test_alternating_sliding_window_is_not_stamped(monkeypatch):
    # Layers alternate their sliding_window attribute: no period-1 stack, too few pairs for period 2.
    # (With more pairs the graph check refuses it too: each sliding layer reads its own tensor made
    # by the parent model, so the graph outside the stack grows with it.)
    types = ["sliding_attention", "full_attention"] * (LAYERS // 2)
    model, inputs = _transformers("qwen2", use_sliding_window=True, sliding_window=4, layer_types=types)
    _falls_back(model, inputs, monkeypatch, stack_found=False)


def test_one_wider_block_is_not_stamped(monkeypatch):
    _falls_back(*_stacked(widths=[32, 32, 32, 48, 32, 32]), monkeypatch, stack_found=False)


def test_per_layer_code_path_is_caught_by_the_graph_check(monkeypatch):
    # Attributes agree (layer_idx counts), but odd blocks run another op: block 5 differs from block 2.
    _falls_back(*_stacked(odd_scale=True), monkeypatch, stack_found=True)


def test_graph_depending_on_the_stack_length_is_caught(monkeypatch):
    _falls_back(*_stacked(mean_over_layers=True), monkeypatch, stack_found=True)


def test_hooks_and_shared_blocks_are_not_stamped():
    model, _ = _stacked()
    model.layers[2].up.register_forward_hook(lambda m, i, o: o * 2)
    assert hidup.frontend.stamp.repeated_stack(model) is None
    shared, _ = _stacked()
    shared.layers[4] = shared.layers[1]
    assert hidup.frontend.stamp.repeated_stack(shared) is None


def test_stamp_layers_must_be_a_bool_or_none():
    with pytest.raises(ValueError, match="stamp_layers"):
        trace_module(*_stacked(), 1, stamp_layers="yes")


# ----------------------------------------------------------------------------------------------
# training parity (gloo, world 2, float64)


def _rank_parity(rank, world, plans):
    import copy

    from hidup.codegen.params import full_grad_dict

    torch.set_default_dtype(torch.float64)
    used = []
    real = hidup.frontend.trace._stamped_trace

    def spy(*args, **kwargs):
        traced = real(*args, **kwargs)
        used.append(traced is not None)
        return traced

    hidup.frontend.trace._stamped_trace = spy
    model, inputs = _gpt(hidup.frontend.stamp.AUTO_MIN_BLOCKS, world=2)
    ref = copy.deepcopy(model)
    loss = ref(*inputs)
    loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    floor = 1e-2 * max(float(g.abs().max()) for g in ref_grads.values())  # as in test_codegen
    out = {}
    for style, plan in plans.items():
        module = hidup.compile(model, plan, rank, world, inputs, duplication=plan.duplication)
        got = module(*inputs)
        got.backward()
        grads = full_grad_dict(module)
        out[style] = {
            "loss": abs(float(module.global_loss(got.detach())) - float(loss.detach())) / abs(float(loss.detach())),
            "grad": max(
                float((grads[n] - g).abs().max()) / max(float(g.abs().max()), floor) for n, g in ref_grads.items()
            ),
            "params": sorted(grads) == sorted(ref_grads),
        }
    out["stamped"] = all(used) and len(used) >= len(plans)
    return out


def test_stamped_trace_trains_like_one_device():
    from dist_util import run_distributed
    from hidup.search import forced

    torch.set_default_dtype(torch.float64)
    try:
        model, inputs = _gpt(hidup.frontend.stamp.AUTO_MIN_BLOCKS, world=2)
        graph = _quiet(trace_module, model, inputs, 2).graph
        # tensor parallelism splits every block's weights: a copy wired to another block's tensors,
        # or to the wrong activations, changes the gradients
        plans = {"tensor": _quiet(forced, graph, PROFILE, "tensor", duplication=False)}
    finally:
        torch.set_default_dtype(torch.float32)
    results = run_distributed(_rank_parity, 2, plans, timeout=240)
    for rank in results:
        assert rank.pop("stamped"), "the ranks' programs were not built from a stamped trace"
        for style, r in rank.items():
            assert r["params"] and r["loss"] < 1e-9 and r["grad"] < 1e-9, (style, r)

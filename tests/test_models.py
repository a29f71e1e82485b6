"""The model zoo: builds, traces, meta builds, exact batch-split invariance, MoE gating properties."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import hidup.models as M
from hidup.models.moe import moe_gating

SMALL = dict(layers=2, d_model=32, heads=4, ffn=64, seq_len=8, batch_per_gpu=2, vocab=50)
# ViT's seq_len is the number of patches (a perfect square); 16 patches -> 16x16 images.
SMALL_VIT = dict(SMALL, seq_len=16)
MOE = ["bert-sgmoe", "bert-switch", "vit-sgmoe", "vit-switch", "bert-sgmoe-torch"]


def small(name: str) -> dict:
    return SMALL_VIT if name.startswith("vit") else SMALL


def export(model: nn.Module, inputs: tuple) -> torch.nn.Module:
    """The step as torch.export captures it (ATen ops, custom ops opaque), runnable."""
    return torch.export.export(model, inputs, strict=False).module()


def test_names():
    assert M.names() == ["bert-sgmoe", "bert-switch", "vit-sgmoe", "vit-switch", "gpt", "mlp", "bert-sgmoe-torch"]


def test_paper_defaults():
    c = M.config("bert-sgmoe", world_size=4)
    assert (c.layers, c.d_model, c.heads, c.ffn, c.experts_per_gpu, c.seq_len, c.batch_per_gpu, c.vocab, c.dropout) == (
        8,
        768,
        12,
        3072,
        2,
        128,
        32,
        30522,
        0.0,
    )
    assert c.num_experts == 8 and c.global_batch == 128 and c.top_k == 2
    assert c.capacity == math.ceil(2 * 1.25 * 128 / 8)  # top-2 doubles the 1.25 factor
    assert M.config("bert-switch", 4).capacity == math.ceil(1.25 * 128 / 8)
    v = M.config("vit-switch")
    assert v.seq_len == 64 and v.num_classes == 10 and v.image_size == 32 and v.tokens_per_group == 65
    assert M.config("gpt").top_k == 0 and M.config("mlp").top_k == 0


@pytest.mark.parametrize("name", M.names())
def test_forward_backward_trace(name):
    model, inputs = M.build(name, world_size=2, **small(name))
    assert inputs[0].shape[0] == 4  # global batch = batch_per_gpu * world_size
    loss = model(*inputs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no gradient for {pname}"
        assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient for {pname}"
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())

    gm = export(model, inputs)
    assert torch.equal(gm(*inputs), loss.detach())
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    # MoE gating is one opaque custom op; stock attention and encoder layers are inlined to ATen ops
    assert (torch.ops.hidup.moe_gating.default in targets) == (name in MOE)
    assert targets.count(torch.ops.hidup.moe_gating.default) == sum(isinstance(m, M.MoEFFN) for m in model.modules())
    assert not any(isinstance(t, type) and issubclass(t, nn.Module) for t in targets)
    assert M.count_parameters(model) == model.config.num_parameters()


@pytest.mark.parametrize("name", M.names())
def test_meta_build(name):
    model, inputs = M.build(name, world_size=2, device="meta", **small(name))
    assert all(p.is_meta for p in model.parameters())
    assert all(t.is_meta for t in inputs)
    loss = model(*inputs)
    assert loss.is_meta and loss.dim() == 0


@pytest.mark.parametrize("name", M.names())
def test_batch_split_invariance(name):
    """loss(full batch) == loss(first half) + loss(second half): per-group routing and capacity."""
    for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 1e-5)):
        model, inputs = M.build(name, world_size=2, dtype=dtype, **small(name))
        half = inputs[0].shape[0] // 2
        with torch.no_grad():
            full = model(*inputs)
            parts = model(*(t[:half] for t in inputs)) + model(*(t[half:] for t in inputs))
            singles = sum(model(*(t[i : i + 1] for t in inputs)) for i in range(2 * half))
        assert abs(full.item() - parts.item()) <= tol * max(1.0, abs(full.item())), (name, dtype)
        assert abs(full.item() - singles.item()) <= tol * max(1.0, abs(full.item())), (name, dtype)


def test_batch_split_gradients():
    model, inputs = M.build("bert-sgmoe", world_size=2, dtype=torch.float64, **SMALL)
    model(*inputs).backward()
    full = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for sl in (slice(0, 2), slice(2, 4)):
        model(*(t[sl] for t in inputs)).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, full[n], rtol=1e-9, atol=1e-10, msg=n)


@pytest.mark.parametrize("name", MOE)
def test_world_size_sets_experts(name):
    for world in (1, 2, 4):
        model, inputs = M.build(name, world_size=world, device="meta", **small(name))
        moes = [m for m in model.modules() if isinstance(m, M.MoEFFN)]
        assert len(moes) == 1  # layers=2: dense layer 0, MoE layer 1
        assert moes[0].num_experts == 2 * world and moes[0].w1.shape == (2 * world, 32, 64)
        assert moes[0].k == (2 if "sgmoe" in name else 1)
        assert inputs[0].shape[0] == 2 * world


def test_layers_alternate():
    model, _ = M.build("bert-switch", device="meta", **dict(SMALL, layers=5))
    kinds = [type(layer).__name__ for layer in model.trunk.layers]
    assert kinds == ["DenseBlock", "MoEBlock", "DenseBlock", "MoEBlock", "DenseBlock"]


def test_bad_overrides():
    with pytest.raises(ValueError, match="unknown override.*layerz.*valid overrides are:.*d_model"):
        M.build("gpt", layerz=2)
    with pytest.raises(ValueError, match="unknown model 'bert'.*bert-sgmoe"):
        M.build("bert")
    bad = [
        dict(layers=0),
        dict(layers=2.5),
        dict(layers=True),
        dict(d_model=30, heads=4),
        dict(capacity_factor=-1.0),
        dict(capacity_factor=float("nan")),
        dict(dropout=1.0),
        dict(aux_weight=-0.1),
        dict(batch_per_gpu="4"),
    ]
    for kw in bad:
        with pytest.raises(ValueError, match="bert-sgmoe"):
            M.config("bert-sgmoe", **kw)
    with pytest.raises(ValueError, match="perfect square"):
        M.config("vit-switch", seq_len=10)
    with pytest.raises(ValueError, match="world_size"):
        M.config("gpt", world_size=0)
    with pytest.raises(ValueError, match="top-2 routing needs at least 2 experts"):
        M.config("bert-sgmoe", world_size=1, experts_per_gpu=1)
    with pytest.raises(ValueError, match="dtype"):
        M.build("mlp", dtype="int64", **SMALL)
    with pytest.raises(ValueError, match="dtype"):
        M.build("mlp", dtype="float99", **SMALL)


def test_large_meta_build():
    start = time.process_time()  # CPU seconds: the bound holds on a loaded machine too
    model, inputs = M.build(
        "bert-sgmoe", world_size=8, device="meta", layers=48, d_model=4096, heads=32, ffn=16384, experts_per_gpu=2
    )
    elapsed = time.process_time() - start
    n = M.count_parameters(model)
    assert n == model.config.num_parameters() and n > 1e10
    assert elapsed < 10.0, f"meta build took {elapsed:.1f}s"
    assert inputs[0].shape == (256, 128) and inputs[0].is_meta


def test_seed_dtype_and_rng():
    state = torch.random.get_rng_state()
    a, xa = M.build("vit-sgmoe", **SMALL_VIT)
    b, xb = M.build("vit-sgmoe", **SMALL_VIT)
    c, _ = M.build("vit-sgmoe", seed=1, **SMALL_VIT)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert torch.equal(xa[0], xb[0])
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))
    m, x = M.build("bert-sgmoe", dtype="bfloat16", **SMALL)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters()) and x[0].dtype == torch.long
    assert torch.isfinite(m(*x).float())


def test_dropout_configurable():
    model, inputs = M.build("gpt", dropout=0.25, **SMALL)
    assert any(n.target is torch.ops.aten.dropout.default for n in export(model, inputs).graph.nodes)
    model.eval()
    with torch.no_grad():
        assert model(*inputs).item() == model(*inputs).item()
    model.train()
    with torch.no_grad():
        assert model(*inputs).item() != model(*inputs).item()


def test_gating_custom_op_has_its_batch_rule():
    import hidup.rules

    rule = hidup.rules.find_rule(torch.ops.hidup.moe_gating.default)
    assert rule is not None and rule.name == "hidup::moe_gating"


# ---- gating ------------------------------------------------------------------------------


def reference_gating(logits: torch.Tensor, k: int, capacity: int):
    """Loop-based GShard routing: first choices of all tokens, then second choices, per group."""
    G, S, E = logits.shape
    probs = torch.softmax(logits.double(), dim=-1)
    p32 = torch.softmax(logits.float(), dim=-1)  # the ordering the gate sees
    combine = torch.zeros(G, S, E, capacity, dtype=torch.float64)
    dispatch = torch.zeros(G, S, E, capacity, dtype=torch.float64)
    aux = torch.zeros(G, dtype=torch.float64)
    for g in range(G):
        order = [sorted(range(E), key=lambda e: -p32[g, s, e].item())[:k] for s in range(S)]
        used = [0] * E
        for i in range(k):
            for s in range(S):
                e = order[s][i]
                if used[e] < capacity:
                    w = probs[g, s, e].item()
                    if k > 1:
                        w /= sum(probs[g, s, f].item() for f in order[s])
                    dispatch[g, s, e, used[e]] = 1.0
                    combine[g, s, e, used[e]] = w
                    used[e] += 1
        first = torch.zeros(E, dtype=torch.float64)
        for s in range(S):
            first[order[s][0]] += 1.0 / S
        aux[g] = E * (first * probs[g].mean(dim=0)).sum()
    return combine, dispatch, aux


@st.composite
def gating_case(draw):
    G = draw(st.integers(1, 3))
    S = draw(st.integers(1, 10))
    E = draw(st.integers(1, 6))
    k = draw(st.integers(1, min(2, E)))
    capacity = draw(st.integers(1, S + 1))
    tie = draw(st.booleans())  # coarse values -> many exact ties
    values = st.integers(-2, 2) if tie else st.floats(-4, 4, allow_nan=False, width=32)
    data = draw(st.lists(values, min_size=G * S * E, max_size=G * S * E))
    return torch.tensor(data, dtype=torch.float32).view(G, S, E), k, capacity


@settings(max_examples=80, deadline=None)
@given(gating_case())
def test_gating_matches_reference(case):
    logits, k, capacity = case
    combine, dispatch, aux = moe_gating(logits, k, capacity)
    G, S, E = logits.shape
    assert combine.shape == dispatch.shape == (G, S, E, capacity) and aux.shape == (G,)
    rc, rd, ra = reference_gating(logits, k, capacity)
    assert torch.equal(dispatch.double(), rd)
    torch.testing.assert_close(combine.double(), rc, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux.double(), ra, rtol=1e-5, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(gating_case())
def test_gating_properties(case):
    logits, k, capacity = case
    combine, dispatch, aux = moe_gating(logits, k, capacity)
    G, S, E = logits.shape
    assert set(dispatch.unique().tolist()) <= {0.0, 1.0}
    # dropped tokens (and unused slots) carry zero combine weight
    assert torch.all(combine[dispatch == 0] == 0)
    # each slot of each expert of each group holds at most one token; slots fill from 0 upward
    per_slot = dispatch.sum(dim=1)  # [G,E,C]
    assert per_slot.max() <= 1
    used = per_slot.sum(dim=-1)  # [G,E]
    assert used.max() <= capacity
    filled = torch.arange(capacity).view(1, 1, -1) < used.unsqueeze(-1)
    assert torch.equal(per_slot.bool(), filled)
    # a token reaches at most k experts, each at most once
    assert dispatch.sum(dim=(2, 3)).max() <= k
    assert dispatch.sum(dim=3).max() <= 1
    token_weight = combine.sum(dim=(2, 3))
    kept_all = dispatch.sum(dim=(2, 3)) == k
    probs = torch.softmax(logits, dim=-1)
    if k > 1:  # gates normalized over the chosen k
        torch.testing.assert_close(token_weight[kept_all], torch.ones_like(token_weight[kept_all]))
    else:  # top-1 keeps the router probability of the chosen expert
        torch.testing.assert_close(token_weight[kept_all], probs.max(dim=-1).values[kept_all])
    if capacity >= S:  # nothing is dropped
        assert bool(kept_all.all())
    assert torch.isfinite(aux).all() and (aux >= 0).all()


def test_gating_top1_vs_top2_and_grad():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 4, requires_grad=True)
    c1, d1, _ = moe_gating(logits, 1, 6)
    c2, d2, aux = moe_gating(logits, 2, 6)
    assert torch.equal(d1.sum(dim=(2, 3)), torch.ones(2, 6))
    assert torch.equal(d2.sum(dim=(2, 3)), torch.full((2, 6), 2.0))
    # the top-1 expert is among the top-2 experts
    assert torch.all(d2.sum(-1)[d1.sum(-1) == 1] == 1)
    (c2.sum() * 0 + (c2 * torch.randn_like(c2)).sum() + aux.sum()).backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    # uniform router: balance loss is exactly 1
    _, _, aux_u = moe_gating(torch.zeros(3, 8, 4), 2, 8)
    torch.testing.assert_close(aux_u, torch.ones(3))


def test_gating_meta_dtype_and_errors():
    c, d, a = moe_gating(torch.empty(4, 16, 8, device="meta"), 2, 5)
    assert c.is_meta and c.shape == (4, 16, 8, 5) and a.shape == (4,)
    c, d, a = moe_gating(torch.randn(2, 4, 3).bfloat16(), 2, 3)
    assert c.dtype == d.dtype == a.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="logits must be"):
        moe_gating(torch.randn(4, 3), 1, 2)
    with pytest.raises(ValueError, match="k=3"):
        moe_gating(torch.randn(1, 4, 2), 3, 2)
    with pytest.raises(ValueError, match="capacity=0"):
        moe_gating(torch.randn(1, 4, 2), 1, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k, normalize", [(1, None), (2, None), (2, False)])
def test_gating_op_is_the_plain_function_bit_for_bit(k, normalize, dtype):
    """The custom op's forward and its registered backward give exactly what autograd of the plain
    routing function gives (the op only makes the routing one opaque node)."""
    from hidup.models.moe import _gating

    gen = torch.Generator().manual_seed(k)
    x = torch.randn(3, 10, 5, generator=gen, dtype=dtype)
    g_c, g_a = torch.randn(3, 10, 5, 4, generator=gen, dtype=dtype), torch.randn(3, generator=gen, dtype=dtype)
    grads = []
    for fn in (
        lambda t: moe_gating(t, k, 4, normalize),
        lambda t: _gating(t, k, 4, k > 1 if normalize is None else normalize),
    ):
        t = x.clone().requires_grad_(True)
        c, d, a = fn(t)
        torch.autograd.backward([c, a], [g_c, g_a])
        grads.append((c.detach(), d, a.detach(), t.grad))
    for got, want in zip(*grads):
        assert torch.equal(got, want)
    assert grads[0][3].abs().sum() > 0


def test_gating_op_registration():
    """torch.library.opcheck: schema, fake (meta) implementation and autograd registration agree."""
    x = torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(torch.ops.hidup.moe_gating.default, (x, 2, 3, True))

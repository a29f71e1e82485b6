"""Expert parallelism for ``transformers`` Mixture-of-Experts models (``hidup/rules/experts.py``).

* the custom op ``hidup::routed_experts`` equals the eager experts of ``transformers`` forward and
  backward, and every signature of its rule passes the simulated-SPMD test (forward + backward, N in
  {2, 4}, k = 1 and 2, routings that leave experts without a token), the all-to-all dispatcher's
  with the simulated ranks as threads exchanging rows;
* a small ``transformers`` Mixtral traces with no replicated fallback, its MoE as one op per layer;
* the forced expert plans (each token dispatcher) and the searched plan at world 2 and 4, duplication
  off and on, and the all-to-all dispatcher on the inner axis of a 2x2 mesh, reproduce
  the single-device loss (a mean over padded labels) and every gradient; all jobs of one world run in
  one spawned group of gloo ranks;
* the search shards the experts where they dominate the step;
* Qwen2-MoE (a shared expert), Qwen3-MoE (fine-grained) and OLMoE with the expert signature forced at
  world 2, duplication off and on, reproduce the single-device loss and gradients.

Tolerances: the model runs in float64, but its router computes softmax and top-k in float32 and the
loss upcasts logits to float32, so losses and gradients carry float32 rounding of sums over at most
``BATCH * SEQ`` terms (``TOL``), as in ``tests/test_thirdparty.py``; the routing itself is the same on
every rank (each rank routes its tokens with the same float32 ops on the same values).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from dist_util import run_distributed
from spmd import check_op, has_sig
from thirdparty import LMStep

T = pytest.importorskip("transformers")

from hidup.rules.experts import routed_experts_as_custom_op, routed_experts_math  # noqa: E402

D64 = torch.float64
VOCAB, SEQ, BATCH, PAD = 96, 16, 8, 3
TOL = 4 * BATCH * SEQ * torch.finfo(torch.float32).eps
OP = torch.ops.hidup.routed_experts.default


def mixtral_config(experts: int = 4, hidden: int = 64, ffn: int = 96, layers: int = 2, act: str = "silu", **kw):
    return T.MixtralConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=ffn,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        num_local_experts=experts,
        num_experts_per_tok=2,
        hidden_act=act,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        **kw,
    )


def build(experts: int = 4, seed: int = 0):
    """(Mixtral step in float64, (input_ids, labels)); labels padded as in ``tests/thirdparty.py``.

    The experts run transformers' eager loop (its grouped matmul has no float64 CPU kernel); hidup
    exports them as its own op either way."""
    torch.manual_seed(seed)
    model = LMStep(T.MixtralForCausalLM(mixtral_config(experts, experts_implementation="eager"))).double()
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[:, :PAD] = -100
    labels[0] = -100
    return model, (ids, labels)


# --------------------------------------------------------------------------------------------- the op


def _routing(tokens: int, k: int, experts: int, used: int, gen: torch.Generator):
    """Top-k indices drawn from the first ``used`` experts only (distinct per token), and weights."""
    scores = torch.rand(tokens, used, generator=gen)
    idx = scores.topk(k, dim=-1).indices
    w = torch.rand(tokens, k, generator=gen, dtype=D64)
    return idx, w


@pytest.mark.parametrize(
    "tokens,hidden,ffn,experts,k,used,act",
    [
        (8, 6, 5, 4, 2, 3, "silu"),  # expert 3 gets no token
        (8, 4, 3, 4, 1, 2, "gelu"),  # experts 2 and 3 get none; k = 1
        (16, 5, 4, 8, 2, 8, "relu"),
        (4, 3, 2, 4, 1, 1, "gelu_tanh"),  # every token on expert 0
    ],
)
def test_routed_experts_signatures(tokens, hidden, ffn, experts, k, used, act):
    gen = torch.Generator().manual_seed(tokens * 100 + experts * 10 + k)
    idx, w = _routing(tokens, k, experts, used, gen)
    x = torch.randn(tokens, hidden, dtype=D64, generator=gen)
    gate_up = nn.Parameter(torch.randn(experts, 2 * ffn, hidden, dtype=D64, generator=gen))
    down = nn.Parameter(torch.randn(experts, hidden, ffn, dtype=D64, generator=gen))
    res = check_op(OP, (x, idx, w, gate_up, down, 0, act))
    flops = 6.0 * tokens * k * hidden * ffn
    for n, sigs in res.items():
        assert has_sig(sigs, ["gather_0"] * 3 + ["full"] * 2, ["gather_0"], kind="data")
        assert has_sig(sigs, ["full"] * 3 + ["gather_0"] * 2, ["reduce"], kind="expert")
        a2a = [s for s in sigs if s.impl == "all_to_all"]  # checked on threads exchanging rows (tests/spmd.py)
        assert [(s.kind, [str(f) for f in s.inputs + s.outputs]) for s in a2a] == [("expert", ["gather_0"] * 6)]
        assert sorted(s.flops for s in sigs) == [flops / n] * 3 + [flops]


def test_routed_experts_float32_router_weights():
    """Mixtral's routing weights are float32 while its experts may be float64: the output keeps x's dtype."""
    gen = torch.Generator().manual_seed(3)
    idx, w = _routing(8, 2, 4, 3, gen)
    x = torch.randn(8, 4, dtype=D64, generator=gen)
    gate_up = nn.Parameter(torch.randn(4, 6, 4, dtype=D64, generator=gen))
    down = nn.Parameter(torch.randn(4, 4, 3, dtype=D64, generator=gen))
    res = check_op(OP, (x, idx, w.float(), gate_up, down, 0, "silu"))
    assert all(len(sigs) == 4 for sigs in res.values())  # full, data, expert by all-gather and by all-to-all
    assert OP(x, idx, w.float(), gate_up, down, 0, "silu").dtype == D64


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_op_equals_transformers_eager_experts(act):
    """Forward and every gradient of the op equal ``MixtralExperts`` run eagerly (the reference loop)."""
    config = mixtral_config(experts=8, hidden=16, ffn=12, act=act)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    experts = T.models.mixtral.modeling_mixtral.MixtralExperts(config).double()
    for p in experts.parameters():
        nn.init.normal_(p)
    gen = torch.Generator().manual_seed(1)
    idx, w = _routing(10, 2, 8, 6, gen)
    w = w.float().requires_grad_()
    x = torch.randn(10, 16, dtype=D64, generator=gen, requires_grad=True)
    gy = torch.randn(10, 16, dtype=D64, generator=gen)

    def run(fn):
        for t in (x, w, *experts.parameters()):
            t.grad = None
        y = fn()
        y.backward(gy)
        return [y.detach()] + [t.grad.clone() for t in (x, w, experts.gate_up_proj, experts.down_proj)]

    ref = run(lambda: experts(x, idx, w))
    with routed_experts_as_custom_op(experts) as switched:
        assert switched == 1
        got = run(lambda: experts(x, idx, w))
    assert config._experts_implementation == "eager"
    for a, b, what in zip(got, ref, ["y", "x", "w", "gate_up_proj", "down_proj"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m, what=what: f"{what}: {m}")
    again = routed_experts_math(
        x.detach(), idx, w.detach(), experts.gate_up_proj.detach(), experts.down_proj.detach(), 0, act
    )
    torch.testing.assert_close(again, ref[0])


def test_expert_offset_selects_a_slice_of_experts():
    """Two halves of the experts, each with its offset, sum to the whole op (the expert signature's math)."""
    gen = torch.Generator().manual_seed(5)
    idx, w = _routing(6, 2, 4, 4, gen)
    x = torch.randn(6, 3, dtype=D64, generator=gen)
    gate_up = torch.randn(4, 4, 3, dtype=D64, generator=gen)
    down = torch.randn(4, 3, 2, dtype=D64, generator=gen)
    whole = OP(x, idx, w, gate_up, down, 0, "silu")
    parts = OP(x, idx, w, gate_up[:2], down[:2], 0, "silu") + OP(x, idx, w, gate_up[2:], down[2:], 2, "silu")
    torch.testing.assert_close(parts, whole)
    assert not torch.equal(OP(x, idx, w, gate_up[2:], down[2:], 2, "silu"), torch.zeros_like(whole))


# --------------------------------------------------------------------------------------------- tracing


@pytest.mark.parametrize("world", [2, 4])
def test_mixtral_traces_every_op_with_a_rule(world):
    from hidup.frontend.trace import FallbackWarning, trace_module

    model, inputs = build()
    before = model.model.config._experts_implementation
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        graph = trace_module(model, inputs, world_size=world).graph
    assert graph.fallbacks == []
    assert model.model.config._experts_implementation == before  # restored after the export
    moe = [n for n in graph.nodes if n.target == "routed_experts"]
    assert len(moe) == 2
    for n in moe:
        assert {s.kind for s in n.signatures} == {"replicated", "data", "expert"}
    assert sum(1 for n in graph.nodes if n.target == "topk") == 2


def test_mixtral_on_a_mesh_offers_expert_times_data():
    """On a 2x2 mesh every product of the experts' one-axis signatures is offered: the local op of one
    axis is the op again, so the rule applies on the next axis (its kernel runs only in the ranks)."""
    from hidup.frontend.trace import trace_module

    model, inputs = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace_module(model, inputs, world_size=4, mesh=(2, 2)).graph
    moe = next(n for n in graph.nodes if n.target == "routed_experts")
    kinds = {s.kind for s in moe.signatures}
    assert {"data", "expert", "data+expert", "expert+data"} <= kinds, kinds


def test_unsupported_experts_layout_keeps_its_path():
    """An activation the op does not model (tanh) leaves the experts as they were: replicated, with a warning."""
    from hidup.frontend.trace import FallbackWarning, trace_module
    from hidup.rules.experts import UnmodelledExpertsWarning

    torch.manual_seed(0)
    model = LMStep(T.MixtralForCausalLM(mixtral_config(act="tanh"))).double()
    with pytest.warns(UnmodelledExpertsWarning) as said:
        with routed_experts_as_custom_op(model) as switched:
            assert switched == 0
    lines = [str(w.message) for w in said if w.category is UnmodelledExpertsWarning]
    assert len(lines) == 2 and "\n" not in lines[0]  # one line per MoE layer
    assert lines[0].startswith("hidup: experts module model.model.layers.0.mlp.experts runs replicated")
    assert "its activation" in lines[0] and "silu" in lines[0]
    ids = torch.randint(1, VOCAB, (BATCH, SEQ))
    with pytest.warns(FallbackWarning):
        graph = trace_module(model, (ids, ids), world_size=2).graph
    assert graph.fallbacks and not any(n.target == "routed_experts" for n in graph.nodes)


# --------------------------------------------------------------------------------------------- parity

STYLES = ("expert-all-gather", "expert-all-to-all", "searched")
JOBS = [(style, dup) for style in STYLES for dup in (False, True)]


def _plans(world: int) -> list:
    """(style, duplication, plan) of every job, searched once here (the ranks only compile)."""
    import hidup.profiler
    from hidup.frontend.trace import trace
    from hidup.search import forced, search

    profile = hidup.profiler.load("paper-v100-9.7gbps")
    model, inputs = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(model, inputs, world_size=world)
    moe = [n.name for n in graph.nodes if n.target == "routed_experts"]
    jobs = []
    for style, dup in JOBS:
        plan = search(graph, profile, duplication=dup) if style == "searched" else forced(graph, profile, style)
        jobs.append((style, dup, plan, sorted({(plan.choices[name].kind, plan.choices[name].impl) for name in moe})))
    return jobs


def _rank_parity(rank, world, jobs):
    from hidup.codegen import compile
    from hidup.codegen.params import full_grad_dict

    warnings.simplefilter("ignore")
    ref = None
    if rank == 0:
        ref, ref_inputs = build()
        ref_loss = ref(*ref_inputs)
        ref_loss.backward()
        scale = max(float(p.grad.abs().max()) for p in ref.parameters())
    results = []
    for style, dup, plan, moe_kinds in jobs:
        model, inputs = build()
        module = compile(model, plan, rank, world, inputs, duplication=dup)
        loss = module(*inputs)
        loss.backward()
        total = float(module.global_loss(loss))
        grads = full_grad_dict(module)
        if rank:
            continue
        worst, where = 0.0, ""
        for pname, p in ref.named_parameters():
            d = float((grads[pname] - p.grad).abs().max()) / max(float(p.grad.abs().max()), 1e-2 * scale)
            if d > worst:
                worst, where = d, pname
        results.append(
            {
                "job": (style, dup),
                "duplication": module.duplication,
                "moe_kinds": moe_kinds,
                "loss": total,
                "ref": float(ref_loss),
                "grad": worst,
                "where": where,
            }
        )
    return results


_RESULTS: dict[int, dict] = {}


def _results(world: int) -> dict:
    if world not in _RESULTS:
        _RESULTS[world] = {r["job"]: r for r in run_distributed(_rank_parity, world, _plans(world), timeout=900)[0]}
    return _RESULTS[world]


@pytest.mark.parametrize("dup", [False, True], ids=["nodup", "dup"])
@pytest.mark.parametrize("style", STYLES)
# world 4 is nightly: world 2 runs the same styles and dispatchers, and the world-4 MoE plans run in
# test_thirdparty_moe's mesh case and test_codegen
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.nightly)])
def test_mixtral_parity(world, style, dup):
    r = _results(world)[(style, dup)]
    where = f"Mixtral world {world} {style} plan, duplication {dup}"
    assert r["duplication"] == dup, f"{where}: ran with duplication {r['duplication']}"
    assert abs(r["loss"] - r["ref"]) <= TOL * abs(r["ref"]), f"{where}: loss {r['loss']} vs {r['ref']}"
    assert r["grad"] <= TOL, f"{where}: gradient of {r['where']} differs by {r['grad']:.2e} (relative)"
    dispatcher = {"expert-all-gather": "local_experts", "expert-all-to-all": "all_to_all"}.get(style)
    if dispatcher is not None:
        assert r["moe_kinds"] == [("expert", dispatcher)], f"{where}: the MoE ops run as {r['moe_kinds']}"


def _mesh_plans() -> list:
    """Jobs of a 2x2 mesh: tokens split on the outer axis, experts dispatched by all-to-all on the inner."""
    import hidup.profiler
    from hidup.frontend.trace import trace
    from hidup.search import forced

    profile = hidup.profiler.load("paper-v100-9.7gbps")
    model, inputs = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(model, inputs, world_size=4, mesh=(2, 2))
    moe = [n.name for n in graph.nodes if n.target == "routed_experts"]
    jobs = []
    for dup in (False, True):
        plan = forced(graph, profile, ("data", "expert-all-to-all"), duplication=dup)
        factors = sorted({tuple((f.kind, f.impl) for f in plan.choices[name].axes) for name in moe})
        jobs.append(("mesh", dup, plan, factors))
    return jobs


def test_mixtral_mesh_all_to_all_parity():
    """On a 2x2 mesh the inner axis's all-to-all dispatcher runs on its axis group, exactly."""
    results = run_distributed(_rank_parity, 4, _mesh_plans(), timeout=900)[0]
    for r in results:
        where = f"Mixtral 2x2 mesh, data x expert-all-to-all, duplication {r['job'][1]}"
        assert r["moe_kinds"] == [(("data", ""), ("expert", "all_to_all"))], f"{where}: {r['moe_kinds']}"
        assert abs(r["loss"] - r["ref"]) <= TOL * abs(r["ref"]), f"{where}: loss {r['loss']} vs {r['ref']}"
        assert r["grad"] <= TOL, f"{where}: gradient of {r['where']} differs by {r['grad']:.2e} (relative)"


# --------------------------------------------------------------------------------------------- search


def test_search_shards_experts_that_dominate():
    """Few tokens and wide experts: moving the tokens costs far less than all-reducing the experts'
    gradients, so the searched plan (no signature forced) picks the expert signature of each MoE op."""
    import hidup.profiler
    from hidup.frontend.trace import trace
    from hidup.search import search

    config = mixtral_config(experts=8, hidden=64, ffn=8192)
    with torch.device("meta"):
        model = LMStep(T.MixtralForCausalLM(config))
    ids = torch.randint(1, VOCAB, (4, SEQ), device="meta")
    graph = trace(model, (ids, ids), world_size=4)
    assert graph.fallbacks == []
    plan = search(graph, hidup.profiler.load("h200x4-nvlink"), duplication=False)
    moe = [n.name for n in graph.nodes if n.target == "routed_experts"]
    assert [plan.choices[name].kind for name in moe] == ["expert", "expert"]


# --------------------------------------------------------------------------------------------- other families

FAMILIES = {
    # shared expert beside 8 routed ones, top-2
    "qwen2_moe": lambda: T.Qwen2MoeForCausalLM(
        T.Qwen2MoeConfig(
            moe_intermediate_size=24, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
            **_family_sizes(),
        )
    ),
    # fine-grained: 16 narrow experts, top-4, normalized weights
    "qwen3_moe": lambda: T.Qwen3MoeForCausalLM(
        T.Qwen3MoeConfig(
            moe_intermediate_size=16, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, **_family_sizes()
        )
    ),
    "olmoe": lambda: T.OlmoeForCausalLM(T.OlmoeConfig(num_experts=8, num_experts_per_tok=2, **_family_sizes())),
}  # fmt: skip


def _family_sizes() -> dict:
    return dict(
        num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        experts_implementation="eager",
    )  # fmt: skip


def _build_family(name: str):
    torch.manual_seed(0)
    model = LMStep(FAMILIES[name]()).double()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[:, :PAD] = -100
    return model, (ids, labels)


def _family_plans(world: int) -> list:
    """(family, duplication, forced expert plan) of every family, duplication on and off."""
    import hidup.profiler
    from hidup.frontend.trace import trace
    from hidup.search import forced

    profile = hidup.profiler.load("h200x4-nvlink")
    jobs = []
    for name in FAMILIES:
        model, inputs = _build_family(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = trace(model, inputs, world_size=world)
        assert graph.fallbacks == [], f"{name}: {graph.fallbacks}"
        plan = forced(graph, profile, "expert")
        moe = [n.name for n in graph.nodes if n.target == "routed_experts"]
        assert moe and {plan.choices[m].kind for m in moe} == {"expert"}, name
        jobs += [(name, dup, plan) for dup in (False, True)]
    return jobs


def _family_parity(rank, world, jobs):
    from hidup.codegen import compile
    from hidup.codegen.params import full_grad_dict

    warnings.simplefilter("ignore")
    out = []
    for name, dup, plan in jobs:
        model, inputs = _build_family(name)
        module = compile(model, plan, rank, world, inputs, duplication=dup)
        loss = module(*inputs)
        loss.backward()
        total, grads = float(module.global_loss(loss)), full_grad_dict(module)
        if rank:
            continue
        ref, ref_inputs = _build_family(name)
        ref_loss = ref(*ref_inputs)
        ref_loss.backward()
        scale = max(float(p.grad.abs().max()) for p in ref.parameters())
        worst = max(
            float((grads[n] - p.grad).abs().max()) / max(float(p.grad.abs().max()), 1e-2 * scale)
            for n, p in ref.named_parameters()
        )
        out.append((name, dup, module.duplication, total, float(ref_loss), worst))
    return out


def test_moe_families_expert_plans_are_exact():
    """Qwen2-MoE (a shared expert), Qwen3-MoE (fine-grained, top-4) and OLMoE, each with its routed
    experts forced onto the expert signature at world 2, duplication off and on, give the
    single-device loss and every gradient."""
    results = run_distributed(_family_parity, 2, _family_plans(2), timeout=900)[0]
    assert len(results) == 2 * len(FAMILIES)
    for name, dup, ran_dup, loss, ref, grad in results:
        where = f"{name} expert plan, duplication {dup}"
        assert ran_dup == dup, f"{where}: ran with duplication {ran_dup}"
        assert abs(loss - ref) <= TOL * abs(ref), f"{where}: loss {loss} vs {ref}"
        assert grad <= TOL, f"{where}: a gradient differs by {grad:.2e} (relative)"

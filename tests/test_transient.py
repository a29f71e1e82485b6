"""The memory model's transients and peak bound (hidup.search.memory, "Transients", "The peak", "The
budget"): the bound a plan records (``plan.memory["peak"]``: the largest op's temporaries where the
activations and gradients live then) is never below the peak that running the rank program on fake
tensors finds (hidup.runtime.peak, exact to the byte against a real CPU run: tests/test_peak.py) and
within 10% of it; the sum alone falls short.  The search's budget constrains that bound, so it turns
down a plan whose transient overflows a budget its sum fits.

A GPT whose logits outweigh the rest (vocabulary 4000, 128 tokens per sequence) under data, tensor
(a row-parallel LM head: full-size partial logits) and FSDP-style plans, in float32 and under bf16
autocast (where the loss's log-softmax upcasts the logits and returns a float32 gradient)."""

from __future__ import annotations

import functools
import warnings

import pytest

import hidup
from hidup.cli import main
from hidup.frontend.trace import forward_inputs
from hidup.ir import REDUCE
from hidup.runtime.peak import predict_peak
from hidup.search import SearchError, forced
from hidup.search.memory import MemoryModel

CONFIG = dict(layers=1, d_model=64, heads=4, ffn=128, seq_len=128, batch_per_gpu=2, vocab=4000)
WORLD = 2


@functools.cache
def _graph():
    model, inputs = hidup.models.build("gpt", world_size=WORLD, device="meta", **CONFIG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hidup.trace(model, inputs, world_size=WORLD)


def _forced(style: str, precision: str = "fp32"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return forced(_graph(), "h200x4-nvlink", style, duplication=False, precision=precision)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("style", ["data", "tensor", "fsdp"])
def test_the_peak_bound_holds_the_fake_run_within_ten_percent(style, precision):
    plan = _forced(style, precision)
    model, inputs = hidup.models.build("gpt", world_size=WORLD, device="meta", **CONFIG)
    peak = predict_peak(model, forward_inputs(model, inputs), plan, 0, precision=precision).total
    memory = plan.memory
    assert memory["total"] < peak, "without transients the model falls short of the peak (the logits' gradients)"
    assert peak <= memory["peak"] <= 1.10 * peak, (memory, peak)


def test_a_row_parallel_head_counts_its_partial_logits():
    """The tensor plan's LM head sums full-size partial logits over the ranks: its transient holds them
    and their sum, the plan's peak bound is taken there, and the budget's term of that signature pays
    the excess over the floor that the data-parallel head does not."""
    graph, plan = _graph(), _forced("tensor")
    memory = MemoryModel(graph, 2.0, "fp32")
    head = max(
        (n for n in graph.nodes if n.op == "call" and REDUCE in plan.choices[n.name].outputs),
        key=lambda n: graph.tensors[n.outputs[0]].numel,
    )
    logits = graph.tensors[head.outputs[0]]
    assert logits.shape[-1] == CONFIG["vocab"]
    full = logits.numel * 4  # float32, whole on each rank
    # the partial logits and their sum, reduce-scattered over the batch for the loss
    assert memory.plan_transient_of(head, plan.choices) >= full * (1 + 1 / WORLD)
    assert plan.memory["peak_transient"] >= full
    data = _forced("data").choices[head.name]
    assert memory.bound(head, plan.choices[head.name]) - memory.bound(head, data) >= full
    assert memory.transient(head, data) < full  # a data-parallel head holds its rank's logits only


def test_the_search_turns_down_a_plan_whose_transient_overflows_the_budget():
    """A budget between the fastest plan's sum and its peak bound: the sum alone would call it fitting;
    the search returns another plan within the budget by its peak bound, or says none fits."""
    graph = _graph()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fastest = hidup.search(graph, "h200x4-nvlink", duplication=False)
        budget = (fastest.memory["total"] + fastest.memory["peak"]) / 2
        assert fastest.memory["total"] <= budget < fastest.memory["peak"]
        try:
            plan = hidup.search(graph, "h200x4-nvlink", duplication=False, memory_budget=budget)
        except SearchError as e:
            assert "memory budget" in str(e)
            return
    assert plan.memory["peak"] <= budget
    assert plan.choices != fastest.choices


def test_hidup_peak_runs_a_plan_of_a_meta_factory(tmp_path, capsys):
    """A scale job's model (`exp.scale_plans:step`: a `transformers` Llama-3-8B layer built on the meta
    device) searched as `exp/scale_plans.py` searches it: its plan records the factory, and `hidup peak`
    rebuilds the model from it and prints the fake run's peak beside the memory model's bound."""
    from exp.scale_plans import step

    args = dict(name="llama3-8b", layers=1, seq=8, batch=1)
    model, inputs = step(world_size=WORLD, **args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = hidup.trace(model, inputs, world_size=WORLD)
        plan = forced(graph, "h200x4-nvlink", "fsdp", duplication=False, model_source=("exp.scale_plans:step", args))
    path = tmp_path / "plan.json"
    plan.save(path)
    assert main(["peak", "--plan", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "predicted peak" in printed and "peak " in printed.split("total")[-1]

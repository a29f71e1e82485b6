"""The peak memory of a rank program, predicted on fake tensors (hidup.runtime.peak).

The prediction is a run of the real rank program on fake tensors under torch's MemTracker; these
tests pin what makes it a prediction of the real program:

* the fake run allocates exactly what a real run of the same program on real CPU tensors allocates
  (the same peak and parts, to the byte): faking changes no allocation;
* its parts are the rank's own: parameters are the bytes of the rank's stored pieces, Adam's state
  is two moments per piece and a step count, both following the plan's layout (data, tensor, a
  2x2 mesh);
* what the memory model leaves out is there: the gradient bucket of the all-reduce at the peak;
* ``hidup peak`` prints both, writes JSON, exits 1 when the peak does not fit ``--memory``, and turns
  a missing plan or a rank outside the plan into one message.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

import hidup
from hidup.cli import main
from hidup.codegen import compile as hidup_compile
from hidup.codegen.graphs import GraphedStep, fused_adam
from hidup.frontend.trace import forward_inputs
from hidup.runtime.options import ModelChoice
from hidup.runtime.peak import peak_parts, predict_peak, predicted_memory
from hidup.search import forced

SMALL = dict(layers=2, d_model=64, heads=4, ffn=128, seq_len=16, batch_per_gpu=4, vocab=256)
LONG = dict(SMALL, seq_len=64, vocab=64)  # activations above the weights: the peak is in the step's backward
WIDE_VOCAB = dict(SMALL, vocab=4200)  # an embedding above GRAD_PACK_BYTES: summed in place, beside a packed buffer


def _plan(style, world=2, mesh=None, config=SMALL):
    model, inputs = hidup.models.build("gpt", world_size=world, device="meta", **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = hidup.trace(model, inputs, world_size=world, mesh=mesh)
        return forced(graph, "h200x4-nvlink", style, duplication=False, model_source=("gpt", config))


def _nbytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _real_peak(plan, rank, world, steps=2, config=SMALL) -> dict:
    """The same steps on real CPU tensors (random weights), tracked the same way."""
    model, inputs = hidup.models.build("gpt", world_size=world, seed=0, **config)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            values = forward_inputs(model, inputs)
            module = hidup_compile(model, plan, rank, world, values, duplication=False)
            opt = fused_adam([p for p in module.parameters() if p.requires_grad], 1e-4, "cpu")
            step = GraphedStep(module, values, enabled=False, optimizer=opt)
            tracker = MemTracker()
            tracker.track_external(module, opt)
            with tracker:
                for _ in range(steps):
                    step(*values)
                    tracker.reset_mod_stats()
            peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        stored = [p for p in module.parameters()]
        return {
            "total": peak["Total"],
            **{name: peak.get(kind, 0) for name, kind in peak_parts().items()},
            "stored": stored,
        }
    finally:
        dist.destroy_process_group()


def _predicted(plan, rank, world, config=SMALL, **kw):
    model, inputs = hidup.models.build("gpt", world_size=world, device="meta", **config)
    return predict_peak(model, forward_inputs(model, inputs), plan, rank, **kw)


@pytest.mark.parametrize("style,config", [("data", SMALL), ("tensor", SMALL), ("data", WIDE_VOCAB)])
def test_fake_run_allocates_what_a_real_run_allocates(style, config):
    plan = _plan(style, config=config)
    real = _real_peak(plan, 1, 2, config=config)
    fake = _predicted(plan, 1, 2, config=config)
    assert fake.total == real["total"] > 0
    assert {k: fake.parts[k] for k in peak_parts()} == {k: float(real[k]) for k in peak_parts()}
    # the parameters at the peak are the rank's own pieces
    assert fake.parts["params"] == _nbytes(real["stored"])
    # Adam: two moments of every piece plus its step count (a float32 scalar)
    pieces = [p for p in real["stored"] if p.requires_grad]
    assert fake.parts["optimizer"] == 2 * _nbytes(pieces) + 4 * len(pieces)


def test_the_peak_holds_what_the_memory_model_leaves_out():
    plan = _plan("data")
    fake = _predicted(plan, 0, 2)

    modelled = predicted_memory(ModelChoice("gpt", SMALL, 2), plan, "fp32", quiet=True)
    assert modelled is not None
    # the parts the memory model counts exactly are the fake run's: the rank's stored weights, and at
    # the peak (here the optimizer step) its gradients and Adam's moments beside them, and the gradient
    # bucket the all-reduce sums into, which the memory model does not count
    assert fake.parts["params"] == modelled["params"] and fake.parts["grads"] == modelled["grads"]
    assert fake.parts["temporaries"] > 0
    assert fake.total > modelled["params"] + modelled["grads"] + modelled["optimizer"]


def test_tensor_plan_holds_a_fraction_of_the_weights_and_bf16_less_activation():
    data, tensor = _plan("data"), _plan("tensor")
    d, t = _predicted(data, 0, 2), _predicted(tensor, 0, 2)
    assert t.parts["params"] < d.parts["params"]
    long_data = _plan("data", config=LONG)
    full, low = _predicted(long_data, 0, 2, LONG), _predicted(long_data, 0, 2, LONG, precision="bf16")
    assert full.parts["activations"] > full.parts["params"]
    assert low.parts["activations"] < full.parts["activations"]  # autocast keeps bf16 copies
    assert low.precision == "bf16" and full.duplication is False


def test_a_mesh_plan_and_duplication_run():
    plan = _plan(("data", "tensor"), world=4, mesh=(2, 2))
    fake = _predicted(plan, 3, 4)
    flat = _predicted(_plan("data", world=4), 3, 4)
    assert 0 < fake.parts["params"] < flat.parts["params"]  # weights split on axis 1
    dup = _predicted(_plan("data"), 0, 2, duplication=True)
    assert dup.duplication is True and dup.total > 0


def test_cli_prints_both_figures_and_checks_a_budget(tmp_path, capsys):
    path = tmp_path / "plan.json"
    _plan("data").save(path)  # the plan names its model and configuration: no model flags needed
    out = tmp_path / "peak.json"
    args = ["peak", "--plan", str(path)]
    assert main([*args, "--out", str(out), "--memory", "1"]) == 0
    printed = capsys.readouterr().out
    assert "predicted peak" in printed and "temporaries" in printed and "memory model" in printed
    record = json.loads(out.read_text())
    assert record["predicted_peak"]["total"] > 0 and record["memory_model"]["total"] > 0
    assert record["predicted_peak"]["params"] == record["memory_model"]["params"]
    assert main([*args, "--memory", "1e-6"]) == 1 and "does not fit" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no plan file"):
        main(["peak", "--plan", str(tmp_path / "none.json")])
    with pytest.raises(SystemExit, match="--rank 5 is outside the plan's 2 ranks"):
        main([*args, "--rank", "5"])


def test_tied_weights_stay_one_tensor_in_the_fake_run():
    """GPT-2's head and embedding are one tensor: the fake run keeps them one, so the plan (which
    names the tensor once) fits the program traced from the faked model."""
    from tests.thirdparty import build

    model, inputs = build("gpt2")
    head = model.model.lm_head.weight
    assert head is model.model.transformer.wte.weight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = hidup.trace(model, inputs, world_size=2)
        plan = forced(graph, "h200x4-nvlink", "data", duplication=False)
    fresh, fresh_inputs = build("gpt2")
    peak = predict_peak(fresh, forward_inputs(fresh, fresh_inputs), plan, 1)
    assert fresh.model.lm_head.weight is fresh.model.transformer.wte.weight  # faked, still tied
    assert peak.total > 0 and peak.parts["params"] > 0


def _tiny_llama(device: str):
    import transformers

    from exp.rank_models import CausalLMStep

    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=128, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = CausalLMStep(transformers.LlamaForCausalLM(cfg))
    ids = torch.zeros(4, 32, dtype=torch.long, device=device)
    return model, (ids, ids.clone())


def test_a_model_planned_on_meta_traces_as_on_the_cpu_and_its_peak_runs():
    """A `transformers` Llama built on the meta device (a large model planned without weights) traces
    to the graph the CPU traces (on meta its constants and attention strides would differ), so the
    plan searched on it is the plan of the CPU model and `hidup peak` runs it."""
    graphs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for device in ("meta", "cpu"):
            model, inputs = _tiny_llama(device)
            graphs[device] = hidup.trace(model, inputs, world_size=2)
            assert all(p.device.type == device for p in model.parameters())  # the model is left as it was
        plan = forced(graphs["meta"], "h200x4-nvlink", "data", duplication=False)
    assert graphs["meta"].fingerprint() == graphs["cpu"].fingerprint()
    meta_model, meta_inputs = _tiny_llama("meta")
    peak = predict_peak(meta_model, forward_inputs(meta_model, meta_inputs), plan, 1)
    assert peak.total > 0 and peak.parts["params"] > 0

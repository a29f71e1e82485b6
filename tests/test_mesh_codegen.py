"""Plans on a 2x2 device mesh run, and match one device: gloo, 4 processes, float64.

For the zoo ``gpt`` (a summed loss), ``bert-sgmoe`` (summed, with MoE experts), a tiny
``transformers`` Llama (a mean over a data-dependent count of labels) and a small classifier with a
plain mean loss, each of

* ``search``: the plan searched for the mesh;
* ``data+tensor``: data parallel on axis 0, tensor parallel on axis 1 (weights stored split there),
  forced per axis (:func:`hidup.search.api.restrict_per_axis`);
* ``fsdp+data``: weights stored split on axis 0 and gathered for their use, data parallel on both;
* ``recompute``: the searched plan with every repeated layer recomputed in the backward;

is compiled on every rank (duplication off, and on for the GPT plans and a few others) and must
reproduce the single-device loss and gradients: each rank's gradient of its stored piece against
the reference gradient cut to that piece per the parameter's layout (axis 0's slice first, then
axis 1's of it), the gradients gathered to the logical layout (:func:`full_grad_dict`), and the loss
of a second step after one SGD step.  All checks run inside one spawned group of 4 gloo ranks.

Tolerances: the zoo models and the classifier run entirely in float64, so loss and gradients
match to float64 rounding (``1e-9`` relative, gradients relative to ``max(max|g|, 1e-2 * the largest
gradient)``); the ``transformers`` language-model loss is computed in float32 (logits upcast), so
it and its gradients carry float32 rounding, bounded as in ``tests/test_thirdparty.py``: a sum of at
most ``BATCH * SEQ`` terms, ``4 * BATCH * SEQ`` float32 epsilons.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thirdparty
from dist_util import run_distributed

MESH = (2, 2)
WORLD = 4
PROFILE = "h200x4-nvlink"
ZOO = dict(layers=2, d_model=32, heads=4, ffn=64, seq_len=8, batch_per_gpu=4, vocab=64)
STYLES = {"data+tensor": ("data", "tensor"), "fsdp+data": ("fsdp", "data")}
PLANS = ("search", "data+tensor", "fsdp+data", "recompute")
# (model, plan) pairs that also run with duplication on
DUPLICATED = {("gpt", p) for p in PLANS} | {("llama", "search"), ("mean", "search"), ("bert-sgmoe", "data+tensor")}
# (model, plan) -> duplication settings run under torch.compile (the aot_eager backend: dynamo's capture,
# the hidup::convert custom op and AOTAutograd, as tests/test_compiled.py explains); with duplication
# the copies run the two-stream stage schedule (without streams on the CPU), each stage compiled; recomputed
# layers under compilation are tests/test_recompute.py's (one axis: the regions do not depend on the mesh)
COMPILED = {("gpt", "data+tensor"): (False, True)}
# inputs given as each rank's local piece (local_batch=True): whole inputs (full|full) and inputs split
# over both axes, with duplication cutting the copies out of the pieces
LOCAL = {"mean": (("search", True), ("data+tensor", False), ("data+tensor", True))}
F64_TOL = 1e-9
LLAMA_TOL = 4 * thirdparty.BATCH * thirdparty.SEQ * torch.finfo(torch.float32).eps
LR = 0.1
SEARCH = dict(max_states=8)  # a narrow beam: the Llama's mesh search is minutes at the default width


class MeanClassifier(nn.Module):
    """Two linear layers and a cross-entropy averaged over the batch (``reduction="mean"``)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x, y):
        return F.cross_entropy(self.fc2(F.gelu(self.fc1(x))), y)


def _build(name: str):
    """(model, inputs) of ``name`` in float64 (the default dtype must be float64)."""
    import hidup

    if name == "llama":
        return thirdparty.build("llama")
    if name == "mean":
        g = torch.Generator().manual_seed(4)
        return MeanClassifier(), (torch.randn(16, 16, generator=g), torch.randint(0, 8, (16,), generator=g))
    return hidup.models.build(name, world_size=WORLD, **ZOO)


def _tol(name: str) -> float:
    return LLAMA_TOL if name == "llama" else F64_TOL


def _make_plans(name: str) -> dict:
    from hidup.frontend.trace import trace_module
    from hidup.search.api import forced, repeated_layers, search

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model, inputs = _build(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = trace_module(model, inputs, mesh=MESH).graph
            plans = {"search": search(graph, PROFILE, **SEARCH)}
            for label, styles in STYLES.items():
                plans[label] = forced(graph, PROFILE, styles, duplication=False, **SEARCH)
    finally:
        torch.set_default_dtype(before)
    layers = sorted(repeated_layers(graph))
    if layers:
        plans["recompute"] = dataclasses.replace(plans["search"], recompute=layers)
    _check_plan_shapes(name, graph, plans)
    return plans


def _check_plan_shapes(name: str, graph, plans: dict) -> None:
    """The forced plans really are what their names say (else the parity below proves less)."""
    for plan in plans.values():
        assert plan.mesh == list(MESH)
    params = [n for n in graph.nodes if n.op == "param" and graph.tensors[n.outputs[0]].requires_grad]
    stored = {label: [plans[label].choices[n.name].outputs[0] for n in params] for label in STYLES}
    # data on axis 0: nothing stored split there; tensor on axis 1: some weight stored split there
    assert all(not lay.forms[0].is_gather for lay in stored["data+tensor"])
    if name != "mean":
        assert any(lay.forms[1].is_gather for lay in stored["data+tensor"])
        kinds = {plans["data+tensor"].choices[n.name].axes[1].kind for n in graph.nodes if n.op == "call"}
        assert "tensor" in kinds or "expert" in kinds, kinds
    # fsdp on axis 0: weights stored split there, gathered (all-gather over axis 0) for their use
    assert sum(lay.forms[0].is_gather for lay in stored["fsdp+data"]) >= len(params) // 2
    steps = [s for c in plans["fsdp+data"].conversions for s in c.steps]
    assert any(s.axis == 0 and s.forward == "all_gather" for s in steps)


def _piece(full: torch.Tensor, layout, coords: tuple[int, ...]) -> torch.Tensor:
    """The piece of ``full`` that the rank at ``coords`` holds in ``layout``: axis 0's slice, then
    axis 1's slice of it (written out here, independently of hidup.codegen.params)."""
    for form, c, n in zip(layout.forms, coords, MESH):
        if form.is_gather:
            k = full.shape[form.dim] // n
            full = full.narrow(form.dim, c * k, k)
    return full


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), floor)


def _reference(model, inputs):
    ref = copy.deepcopy(model)
    loss = ref(*inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    with torch.no_grad():
        for p in ref.parameters():
            p -= LR * p.grad
        second = float(ref(*inputs))
    return float(loss.detach()), grads, second


def _parity(rank, model, inputs, plan, dup, ref, **options) -> dict:
    import hidup
    from hidup.codegen.grads import clip_grad_norm_
    from hidup.codegen.mesh import coordinates
    from hidup.codegen.params import full_grad_dict, iter_shards

    ref_loss, ref_grads, ref_second = ref
    ref_norm = float(torch.sqrt(sum(g.pow(2).sum() for g in ref_grads.values())))
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = hidup.compile(model, plan, rank, WORLD, inputs, duplication=dup, **options)
    assert module.duplication == dup and module.mesh_groups.mesh == MESH
    assert module.compile_backend == options.get("compile")
    coords = coordinates(rank, MESH)
    if options.get("local_batch"):  # each rank gives only its piece of every input
        forms = [module.input_forms[n] for n in module.input_names]
        inputs = tuple(x if form is None else _piece(x, form, coords).contiguous() for x, form in zip(inputs, forms))
    loss = module(*inputs)
    loss.backward()
    out = {"loss": abs(float(module.global_loss(loss)) - ref_loss) / abs(ref_loss)}
    piece_err = gathered_err = 0.0
    for _, t, shard in iter_shards(module):
        if shard.is_buffer or not t.requires_grad:
            continue
        want = _piece(ref_grads[shard.logical_name], shard.form, coords)
        assert tuple(t.shape) == tuple(want.shape) == shard.form.local_shape(shard.logical_shape, MESH)
        piece_err = max(piece_err, _rel(t.grad, want, 1e-2 * scale))
    for name, g in full_grad_dict(module).items():
        gathered_err = max(gathered_err, _rel(g, ref_grads[name], 1e-2 * scale))
    # the global norm counts each piece once however many ranks hold it (a huge bound: no clipping)
    out["norm"] = abs(float(clip_grad_norm_(module, 1e30)) - ref_norm) / ref_norm
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p -= LR * p.grad
        second = float(module.global_loss(module(*inputs)))
    out.update(piece=piece_err, gathered=gathered_err, second=abs(second - ref_second) / abs(ref_second))
    return out


def _rank_checkpoint(rank, model, inputs, plan, path) -> tuple:
    """Save the module of a mesh plan (weights split on axis 0): (where, its logical state), to
    compare with what the checkpoint loads into the plain model (tests/test_mesh_checkpoint.py
    checks resuming, resharding and what each rank writes)."""
    import hidup
    from hidup.runtime import checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = hidup.compile(model, plan, rank, WORLD, inputs)
    checkpoint.save(path, module, step=1)
    return path, hidup.full_state_dict(module)


def _rank_parity(rank, world, jobs, path=None):
    torch.set_default_dtype(torch.float64)
    out = {}
    for name, plans in jobs:
        model, inputs = _build(name)
        ref = _reference(model, inputs)
        for label, plan in plans.items():
            for dup in (False, True) if (name, label) in DUPLICATED else (False,):
                out[(name, label, dup)] = _parity(rank, model, inputs, plan, dup, ref)
            for dup in COMPILED.get((name, label), ()):
                options = dict(compile="aot_eager", streams=dup)  # with duplication: the staged schedule
                out[(name, label, dup, "compiled")] = _parity(rank, model, inputs, plan, dup, ref, **options)
        for label, dup in LOCAL.get(name, ()):  # inputs given as each rank's piece
            out[(name, label, dup, "local")] = _parity(rank, model, inputs, plans[label], dup, ref, local_batch=True)
        if name == "mean" and path is not None:
            out["checkpoint"] = _rank_checkpoint(rank, model, inputs, plans["fsdp+data"], path)
    return out


MODELS = ("gpt", "bert-sgmoe", "llama", "mean")
CASES = [
    (name, label, dup)
    for name in MODELS
    for label in PLANS
    if not (name == "mean" and label == "recompute")  # no repeated layers
    for dup in ((False, True) if (name, label) in DUPLICATED else (False,))
]
_RESULTS: list = []


def _results(tmp_path_factory) -> list:
    if not _RESULTS:
        pytest.importorskip("transformers")
        jobs = [(name, _make_plans(name)) for name in MODELS]
        path = str(tmp_path_factory.mktemp("mesh") / "checkpoint")
        _RESULTS.extend(run_distributed(_rank_parity, WORLD, jobs, path, timeout=600, pg_timeout=120))
    return _RESULTS


@pytest.mark.parametrize("name, label, dup", CASES, ids=[f"{n}-{p}-{'dup' if d else 'one'}" for n, p, d in CASES])
def test_mesh_plan_matches_one_device(name, label, dup, tmp_path_factory):
    _check(name, label, dup, (name, label, dup), tmp_path_factory)


COMPILED_CASES = [(name, label, dup) for (name, label), dups in COMPILED.items() for dup in dups]


@pytest.mark.parametrize(
    "name, label, dup", COMPILED_CASES, ids=[f"{n}-{p}-{'dup' if d else 'one'}" for n, p, d in COMPILED_CASES]
)
def test_compiled_mesh_plan_matches_one_device(name, label, dup, tmp_path_factory):
    _check(name, label, dup, (name, label, dup, "compiled"), tmp_path_factory)


@pytest.mark.parametrize("label, dup", LOCAL["mean"], ids=[f"{p}-{'dup' if d else 'one'}" for p, d in LOCAL["mean"]])
def test_local_batch_inputs_on_a_mesh(label, dup, tmp_path_factory):
    _check("mean", label, dup, ("mean", label, dup, "local"), tmp_path_factory)


def test_a_checkpoint_of_a_mesh_plan_loads_into_the_plain_model(tmp_path_factory):
    from hidup.runtime import checkpoint

    results = _results(tmp_path_factory)
    path, saved = results[0]["checkpoint"]
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = MeanClassifier()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        info = checkpoint.load(path, model, restore_rng=False)
    finally:
        torch.set_default_dtype(before)
    assert info["world_size"] == WORLD and info["step"] == 1
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name]), name
        assert all(torch.equal(r["checkpoint"][1][name], saved[name]) for r in results), name


def _check(name, label, dup, key, tmp_path_factory):
    tol = _tol(name)
    for rank, results in enumerate(_results(tmp_path_factory)):
        r = results[key]
        where = f"{name} {label} duplication={dup} rank {rank}"
        assert r["norm"] <= 1e-5, f"{where}: the global gradient norm off by {r['norm']:.2e} (float32 sum)"
        assert r["loss"] <= tol, f"{where}: loss off by {r['loss']:.2e} (relative)"
        assert r["piece"] <= tol, f"{where}: a gradient piece off by {r['piece']:.2e}"
        assert r["gathered"] <= tol, f"{where}: a gathered gradient off by {r['gathered']:.2e}"
        assert r["second"] <= tol, f"{where}: the loss after one SGD step off by {r['second']:.2e}"


def test_verify_runs_a_mesh_plan(tmp_path):
    """``hidup verify --plan P`` runs a data x tensor 2x2 plan on 4 ranks (the plan records its
    model and mesh: no flags)."""
    import subprocess
    import sys
    from pathlib import Path

    import hidup
    from hidup.frontend.trace import trace_module
    from hidup.search.api import forced

    model, inputs = hidup.models.build("gpt", world_size=WORLD, **ZOO)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace_module(model, inputs, mesh=MESH).graph
        plan = forced(graph, PROFILE, ("data", "tensor"), duplication=False, model_source=("gpt", ZOO), **SEARCH)
    path = plan.save(tmp_path / "plan.json")
    root = Path(__file__).resolve().parent.parent

    def cli(*argv):
        return subprocess.run(
            [sys.executable, "-m", "hidup", *argv], cwd=root, capture_output=True, text=True, timeout=300
        )

    out = cli("verify", "--plan", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK: the plan matches the single-device model" in out.stdout
    assert "world 4 as a 2x2 mesh" in out.stdout and "data+tensor" in out.stdout  # per-axis kinds ran

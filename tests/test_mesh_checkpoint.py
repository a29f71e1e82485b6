"""Checkpoints of plans on a 2x2 device mesh, through DCP (gloo on CPU, float64).

A small GPT is compiled under two 2x2 plans -- ``data+tensor`` (weights replicated on axis 0, split
on axis 1) and ``fsdp+data`` (weights split on axis 0, replicated on axis 1) -- and under a one-axis
tensor-parallel plan on ranks 0 and 1 (a world of 2), all from the same weights and the same global
batches.  Each trains two Adam steps, saves, and trains two more: its uninterrupted loss curve.  Then

* every checkpoint is loaded into every other plan (2x2 -> 2x2 of the other kind, 2x2 -> world 2,
  world 2 -> 2x2) and into the plain model on one process, with another learning rate, other
  weights and another RNG state, and the next two steps' losses must equal the saving plan's
  uninterrupted ones.  All plans compute the same float64 math, so they agree to float64 rounding:
  ``1e-9`` relative holds with a margin of a million, while loading the wrong slice (or the wrong
  Adam moment, RNG state or learning rate) changes the loss at the first or second digit;
* DCP's metadata shows that every chunk of a split tensor is written once, by a rank that holds
  that chunk in hidup's layout (offsets computed here from the mesh coordinates, outer axis first:
  rank ``(i, j)`` holds chunk ``2 i + j`` of ``gather_0|gather_0``), replicated tensors once, whole,
  and that nothing else is in the files;
* tensors split on both axes (``gather_0|gather_0``, ``gather_0|gather_1``, ``gather_1|gather_0``)
  round-trip through a checkpoint into the logical tensor on one process, and a layout that splits
  a dim unevenly is refused with one message on every rank;
* ``hidup train --plan P --checkpoint-dir D`` on a 2x2 plan, stopped and resumed, continues the
  loss curve of an uninterrupted run.

All ranks run in one spawned process group of 4; the world of 2 is a subgroup of ranks 0 and 1.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from dist_util import run_distributed

MESH = (2, 2)
WORLD = 4
PROFILE = "h200x4-nvlink"
GPT = dict(layers=1, d_model=16, heads=4, ffn=32, seq_len=4, batch_per_gpu=2, vocab=32)
TRAIN_STEPS, MORE_STEPS = 2, 2
REL_TOL = 1e-9
PLANS = ("data+tensor", "fsdp+data", "world2")
ROOT = Path(__file__).resolve().parent.parent


def _build(seed: int = 0):
    """The GPT in float64, its global batch the 2x2 mesh's (every plan sees the same batches)."""
    import hidup

    return hidup.models.build("gpt", world_size=WORLD, dtype="float64", seed=seed, **GPT)


def gpt64():
    """The GPT in float64 as a model factory for ``hidup train`` (which rebuilds it by this name); its
    global batch is the 2x2 mesh's on any world size (no ``world_size`` parameter)."""
    return _build()


def _make_plans() -> dict:
    from hidup.frontend.trace import trace_module
    from hidup.search.api import forced

    model, inputs = _build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mesh_graph = trace_module(model, inputs, mesh=MESH).graph
        plans = {
            "data+tensor": forced(mesh_graph, PROFILE, ("data", "tensor"), duplication=False),
            "fsdp+data": forced(mesh_graph, PROFILE, ("fsdp", "data"), duplication=False),
            "world2": forced(trace_module(model, inputs, 2).graph, PROFILE, "tensor", duplication=False),
        }
    return plans


def _step(module, opt, inputs) -> float:
    """One Adam step on a global batch drawn from the global RNG (equal on every rank)."""
    tokens, targets = (torch.randint(0, GPT["vocab"], t.shape) for t in inputs)
    loss = module(tokens, targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    global_loss = getattr(module, "global_loss", None)
    return float(global_loss(loss) if global_loss is not None else loss.detach())


def _forms(module) -> dict:
    from hidup.codegen.params import iter_shards

    return {s.logical_name: (str(s.form), tuple(t.shape)) for _, t, s in iter_shards(module)}


class _Pieces(nn.Module):
    """Parameters stored as pieces on the 2x2 mesh, as a compiled module holds them
    (``param_shards``: local name -> ParamShard, ``mesh_groups``, ``group``)."""

    def __init__(self, rank: int, pieces: dict):
        from hidup.codegen.mesh import mesh_groups

        super().__init__()
        self.group, self.mesh_groups, self.param_shards = None, mesh_groups(MESH, rank), {}
        for name, (shard, piece) in pieces.items():
            self.param_shards[name] = shard
            self.register_parameter(name, nn.Parameter(piece))


def _nested(rank: int, root: Path) -> dict:
    """Tensors split on both axes (cut by hidup's shard_tensor) are saved; a layout splitting 6 rows
    over 2x2 ranks is refused."""
    from hidup.codegen.params import ParamShard, shard_tensor
    from hidup.ir import Layout, gather
    from hidup.runtime import checkpoint

    g = torch.Generator().manual_seed(11)
    full = {
        "a": torch.randn(8, 6, generator=g),
        "b": torch.randn(4, 6, generator=g),
        "c": torch.randn(6, 4, generator=g),
    }
    layouts = {
        "a": Layout((gather(0), gather(0))),
        "b": Layout((gather(0), gather(1))),
        "c": Layout((gather(1), gather(0))),
    }
    pieces = {
        name: (ParamShard(name, tuple(full[name].shape), layout), shard_tensor(full[name], layout, rank, WORLD, MESH))
        for name, layout in layouts.items()
    }
    module = _Pieces(rank, pieces)
    checkpoint.save(root / "nested", module)
    out = {"nested_forms": _forms(module), "nested_full": full}
    uneven = _Pieces(rank, {"u": (ParamShard("u", (6, 4), layouts["a"]), torch.zeros(2, 4))})
    try:
        checkpoint.save(root / "uneven", uneven)
        out["uneven"] = "saved"
    except ValueError as e:
        out["uneven"] = str(e)
    out["uneven_left"] = sorted(p.name for p in root.iterdir() if "uneven" in p.name)
    return out


def _rank(rank, world, plans, root):
    import torch.distributed as dist

    import hidup
    from hidup.runtime import checkpoint

    root = Path(root)
    torch.set_default_dtype(torch.float64)
    sub = dist.new_group([0, 1])  # collective: every rank makes it
    model, inputs = _build()
    modules = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for label in ("data+tensor", "fsdp+data"):
            modules[label] = hidup.compile(model, plans[label], rank, WORLD, inputs)
        if rank < 2:
            modules["world2"] = hidup.compile(model, plans["world2"], rank, 2, inputs, group=sub)
    out = {"forms": {label: _forms(m) for label, m in modules.items()}, "curve": {}, "resumed": {}}

    # uninterrupted: two steps, a checkpoint, two more (each plan from the same initial weights)
    for label, module in modules.items():
        torch.manual_seed(7)
        opt = torch.optim.Adam(module.parameters(), lr=1e-2)
        first = [_step(module, opt, inputs) for _ in range(TRAIN_STEPS)]
        checkpoint.save(root / label, module, opt, step=TRAIN_STEPS, loss_history=first, extra={"plan": label})
        if label == "data+tensor":
            out["saved"] = hidup.full_state_dict(module)
        out["curve"][label] = first + [_step(module, opt, inputs) for _ in range(MORE_STEPS)]

    # resumed from every checkpoint in every plan: other weights (trained on), learning rate and RNG
    for saved in PLANS:
        for label, module in modules.items():
            torch.manual_seed(1000 + rank)
            opt = torch.optim.Adam(module.parameters(), lr=0.5)
            info = checkpoint.load(root / saved, module, opt)
            steps = [_step(module, opt, inputs) for _ in range(MORE_STEPS)]
            out["resumed"][(saved, label)] = (info, opt.param_groups[0]["lr"], steps)
    out.update(_nested(rank, root))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("meshckpt")
    plans = _make_plans()
    results = run_distributed(_rank, WORLD, plans, str(root), timeout=300, pg_timeout=120)
    return root, plans, results


def _close(a: list, b: list) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= REL_TOL * abs(y) for x, y in zip(a, b))


def test_the_plans_split_parameters_on_each_axis(runs):
    _, _, results = runs
    forms = results[0]["forms"]
    dt = [f.split("|") for f, _ in forms["data+tensor"].values()]
    fd = [f.split("|") for f, _ in forms["fsdp+data"].values()]
    assert any(a1.startswith("gather") for _, a1 in dt) and not any(a0.startswith("gather") for a0, _ in dt)
    assert sum(a0.startswith("gather") for a0, _ in fd) >= len(fd) // 2
    assert any(f.startswith("gather") for f, _ in forms["world2"].values())


def test_every_plan_computes_the_same_curve(runs):
    _, _, results = runs
    reference = results[0]["curve"]["data+tensor"]
    for rank, r in enumerate(results):
        for label, curve in r["curve"].items():
            assert _close(curve, reference), f"rank {rank} {label}: {curve} vs {reference}"


@pytest.mark.parametrize("saved", PLANS)
def test_resuming_in_any_plan_continues_the_curve(runs, saved):
    _, _, results = runs
    for rank, r in enumerate(results):
        want = r["curve"][saved][TRAIN_STEPS:] if saved in r["curve"] else results[0]["curve"][saved][TRAIN_STEPS:]
        for label in r["curve"]:
            info, lr, steps = r["resumed"][(saved, label)]
            assert info["step"] == TRAIN_STEPS and info["extra"] == {"plan": saved}
            assert info["world_size"] == (2 if saved == "world2" else WORLD)
            assert lr == 1e-2, f"rank {rank}: the learning rate was not restored"
            assert _close(steps, want), f"rank {rank}: {saved} -> {label}: resumed {steps}, uninterrupted {want}"
        if saved in r["curve"]:  # the same plan and world: bit for bit
            assert r["resumed"][(saved, saved)][2] == want, rank


def test_a_mesh_checkpoint_loads_into_the_plain_model(runs):
    from hidup.runtime import checkpoint

    root, _, results = runs
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model, inputs = _build(seed=5)
        opt = torch.optim.Adam(model.parameters(), lr=0.5)
        info = checkpoint.load(root / "data+tensor", model, opt)  # world 4 -> 1: rank 0's RNG state
        assert info["world_size"] == WORLD and opt.param_groups[0]["lr"] == 1e-2
        for name, value in results[0]["saved"].items():
            assert torch.equal(dict(model.state_dict())[name], value), name
        steps = [_step(model, opt, inputs) for _ in range(MORE_STEPS)]
    finally:
        torch.set_default_dtype(before)
    want = results[0]["curve"]["data+tensor"][TRAIN_STEPS:]
    assert _close(steps, want), f"one process: {steps}, the 2x2 plan uninterrupted {want}"


def _holders(form: str, logical: tuple, rank: int) -> tuple[int, ...]:
    """Offsets of the chunk that ``rank`` holds of a tensor stored as ``form`` (written out from the
    mesh coordinates, outer axis first, independently of hidup and DTensor)."""
    forms = form.split("|")
    sizes = MESH if len(forms) == 2 else (2,)
    coords = divmod(rank, MESH[1]) if len(forms) == 2 else (rank,)
    offsets, shape = [0] * len(logical), list(logical)
    for f, c, n in zip(forms, coords, sizes):
        if f.startswith("gather_"):
            d = int(f[len("gather_") :])
            shape[d] //= n
            offsets[d] += c * shape[d]
    return tuple(offsets)


def _check_written(path: Path, forms: dict, ranks: int) -> int:
    """Every chunk once, by a rank holding it; returns how many split tensors were seen."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    metadata = FileSystemReader(path).read_metadata()
    split = 0
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        kind, name = key.split(".", 1)
        form, local_shape = forms[name if kind == "model" else name.rsplit(".", 1)[0]]  # optim.<name>.<state>
        if "gather" not in form:
            assert [tuple(c.sizes) for c in md.chunks] == [tuple(md.size)], key  # once, whole
            continue
        split += 1
        holders: dict[tuple, set] = {}
        for r in range(ranks):
            holders.setdefault(_holders(form, tuple(md.size), r), set()).add(r)
        offsets = [tuple(c.offsets) for c in md.chunks]
        assert sorted(offsets) == sorted(holders), (key, form, offsets)  # each distinct piece once
        assert all(tuple(c.sizes) == local_shape for c in md.chunks) and len(holders) == len(md.chunks), key
        for chunk in md.chunks:
            where = metadata.storage_data[MetadataIndex(key, chunk.offsets)].relative_path
            writer = int(where.split("_")[2])
            assert writer in holders[tuple(chunk.offsets)], (key, form, chunk.offsets, where)
    written: dict[str, int] = {}
    for where in metadata.storage_data.values():
        written[where.relative_path] = written.get(where.relative_path, 0) + where.length
    assert {p.name: p.stat().st_size for p in path.glob("*.distcp")} == written  # nothing but the entries
    return split


@pytest.mark.parametrize("label", ("data+tensor", "fsdp+data"))
def test_each_rank_writes_only_chunks_it_holds(runs, label):
    root, _, results = runs
    forms = results[0]["forms"][label]
    for rank, r in enumerate(results):  # every rank stores its piece where the layout puts it
        for name, (form, local_shape) in r["forms"][label].items():
            assert form == forms[name][0] and local_shape == forms[name][1], (rank, name)
    split = _check_written(root / label, forms, WORLD)
    params = sum("gather" in f for f, _ in forms.values())
    assert split == 3 * params and params >= 3  # weights and both Adam moments


def test_tensors_split_on_both_axes_round_trip(runs):
    from hidup.runtime import checkpoint

    root, _, results = runs
    forms = results[0]["nested_forms"]
    assert forms == {
        "a": ("gather_0|gather_0", (2, 6)),
        "b": ("gather_0|gather_1", (2, 3)),
        "c": ("gather_1|gather_0", (3, 2)),
    }
    assert _check_written(root / "nested", forms, WORLD) == 3
    full = results[0]["nested_full"]
    plain = nn.Module()
    for name, value in full.items():
        plain.register_parameter(name, nn.Parameter(torch.zeros_like(value)))
    checkpoint.load(root / "nested", plain, restore_rng=False)
    for name, value in full.items():
        assert torch.equal(getattr(plain, name), value), name


def test_an_uneven_split_is_refused_on_every_rank(runs):
    _, _, results = runs
    for rank, r in enumerate(results):
        text = r["uneven"]
        assert "u of shape (6, 4) is stored as gather_0|gather_0" in text and "not evenly" in text, (rank, text)
        assert "Fix:" in text and r["uneven_left"] == [], (rank, r["uneven_left"])


# ------------------------------------------------------------------------------------- hidup train
def test_train_resumes_a_mesh_plan_on_the_same_curve(tmp_path, capsys, monkeypatch):
    """``hidup train --plan P`` (a data x tensor 2x2 plan of :func:`gpt64`): stopped after 2 of 4
    steps with a checkpoint, then ``--resume``d; its 4 losses equal those of an uninterrupted run of
    the same model and batches (``hidup train --model test_mesh_checkpoint:gpt64``, one process
    here: the same float64 math, to rounding)."""
    import json

    from hidup.cli import main
    from hidup.frontend.trace import trace_module
    from hidup.search.api import forced

    model, inputs = gpt64()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace_module(model, inputs, mesh=MESH).graph
        plan = forced(graph, PROFILE, ("data", "tensor"), duplication=False, model_source="test_mesh_checkpoint:gpt64")
    path = plan.save(tmp_path / "plan.json")
    result = tmp_path / "run.json"

    def train(*argv) -> list[float]:
        out = subprocess.run(
            [sys.executable, "-m", "hidup", "train", "--plan", str(path), "--iterations", "4", *argv],
            cwd=ROOT / "tests",  # where the factory is imported from
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert "world 4 as a 2x2 mesh" in out.stdout, out.stdout
        return json.loads(result.read_text())["losses"]

    ckpt = tmp_path / "ck"
    part = train("--checkpoint-dir", str(ckpt), "--stop-after", "2", "--json", str(result))
    assert len(part) == 2 and (ckpt / "checkpoint" / ".metadata").is_file()
    assert len(list((ckpt / "checkpoint").glob("__*_0.distcp"))) == WORLD  # every rank wrote its file
    resumed = train("--checkpoint-dir", str(ckpt), "--resume", "--json", str(result))

    monkeypatch.chdir(ROOT / "tests")
    before = torch.get_default_dtype()
    try:
        code = main(["train", "--model", "test_mesh_checkpoint:gpt64", "--iterations", "4", "--json", str(result)])
    finally:
        torch.set_default_dtype(before)
    assert not code, capsys.readouterr().err
    full = json.loads(result.read_text())["losses"]
    assert len(full) == len(resumed) == 4 and resumed[:2] == part
    assert _close(resumed, full), f"uninterrupted {full}\nresumed       {resumed}"

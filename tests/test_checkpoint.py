"""Checkpoints through torch.distributed.checkpoint (gloo on CPU, float64).

A small GPT is compiled under a tensor-parallel plan (its projections and embeddings ``gather_0``
or ``gather_1``: each rank stores a slice; its layer norms replicated), trained with Adam, and
checkpointed on 2 ranks.  Then

* the checkpoint loads on 4 ranks under their own plan and into the plain model on one process,
  and the parameters and Adam state equal the gathered originals bit for bit;
* training resumed from it (fresh weights, another learning rate and RNG state, all restored by
  the load) gives the losses and parameters of uninterrupted training bit for bit: the
  distributed program and the data are the same, so float64 rounding is the same too;
* a save that fails after every rank wrote its file, or between the two renames that put the new
  checkpoint in place, leaves the previous one loadable; the next save succeeds and tidies up;
* DCP's metadata shows that rank ``r`` wrote slice ``r`` of every sharded tensor and no rank
  wrote a whole one (and every byte of every file is one of the recorded entries);
* a missing path, an incomplete directory or a checkpoint of another model is refused with one
  message, in Python and by ``hidup train --resume``; single-file checkpoints of format 1 load.

All ranks of one world run in one spawned process group.
"""

from __future__ import annotations

import os
import random
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from dist_util import run_distributed

GPT = dict(layers=1, d_model=16, heads=4, ffn=32, seq_len=4, batch_per_gpu=2, vocab=32)
PROFILE = "h200x4-nvlink"
TRAIN_STEPS, MORE_STEPS = 2, 2


def _plan(world: int):
    """The forced tensor-parallel plan of the GPT on ``world`` ranks."""
    import hidup
    from hidup.frontend.trace import trace_module
    from hidup.search import forced

    model, inputs = hidup.models.build("gpt", world_size=world, dtype="float64", **GPT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return forced(trace_module(model, inputs, world).graph, PROFILE, "tensor", duplication=False)


def _compiled(rank, world, plan, seed=0):
    import hidup

    model, inputs = hidup.models.build("gpt", world_size=world, dtype="float64", seed=seed, **GPT)
    return hidup.compile(model, plan, rank, world, inputs), inputs


def _step(module, opt, inputs) -> float:
    """One Adam step on a batch drawn from the global RNG (equal on every rank, so the global
    batch is consistent): a resumed run matches only if the load restored the RNG."""
    tokens, targets = (torch.randint(0, GPT["vocab"], t.shape) for t in inputs)
    loss = module(tokens, targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(module.global_loss(loss))


def _forms(module) -> dict:
    """Logical name -> (the dim its form shards, else False; the shape this rank stores)."""
    from hidup.codegen.params import iter_shards

    return {s.logical_name: (s.form.is_gather and s.form.dim, tuple(t.shape)) for _, t, s in iter_shards(module)}


def _gathered_optimizer_state(module, opt) -> dict:
    """Adam's state by logical name, per-element tensors gathered to their logical shape."""
    from hidup.codegen.params import gather_tensor, iter_shards

    out = {}
    for _, t, shard in iter_shards(module):
        entry = {}
        for key, value in opt.state.get(t, {}).items():
            if value.dim() > 0:
                value = gather_tensor(value, shard.form, getattr(module, "group", None))
            entry[key] = value.clone()
        if entry:
            out[shard.logical_name] = entry
    return out


def _rank_world2(rank, world, plan, root):
    """Train, save, train on (the reference); resume from the save and train on; the crash cases."""
    import hidup
    from hidup.runtime import checkpoint

    root = Path(root)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(7)
    module, inputs = _compiled(rank, world, plan)
    out = {}
    out["forms"] = _forms(module)
    opt = torch.optim.Adam(module.parameters(), lr=1e-2)
    losses = [_step(module, opt, inputs) for _ in range(TRAIN_STEPS)]
    checkpoint.save(root / "ckpt", module, opt, step=TRAIN_STEPS, loss_history=losses, extra={"note": "w2"})
    out["saved"] = (hidup.full_state_dict(module), _gathered_optimizer_state(module, opt))
    out["reference"] = ([_step(module, opt, inputs) for _ in range(MORE_STEPS)], hidup.full_state_dict(module))

    torch.manual_seed(999)  # the resumed run starts from other weights, RNG and learning rate
    module, inputs = _compiled(rank, world, plan, seed=123)
    opt = torch.optim.Adam(module.parameters(), lr=0.5)
    out["info"] = checkpoint.load(root / "ckpt", module, opt)
    out["lr"] = opt.param_groups[0]["lr"]
    out["resumed"] = ([_step(module, opt, inputs) for _ in range(MORE_STEPS)], hidup.full_state_dict(module))
    out.update(_crashes(rank, world, plan, root / "crash", module, opt, inputs))
    return out


def _load_fresh(rank, world, plan, path):
    """A freshly built module with the checkpoint at ``path`` loaded: its logical state."""
    import hidup
    from hidup.runtime import checkpoint

    module, _ = _compiled(rank, world, plan, seed=321)
    info = checkpoint.load(path, module, restore_rng=False)
    return info["step"], hidup.full_state_dict(module)


def _crashes(rank, world, plan, path: Path, module, opt, inputs) -> dict:
    from torch.distributed.checkpoint import FileSystemWriter

    import hidup
    from hidup.runtime import checkpoint

    out = {}
    checkpoint.save(path, module, opt, step=10)
    previous = hidup.full_state_dict(module)
    _step(module, opt, inputs)  # the failed saves hold other values

    # 1. rank 1 fails after its file is written: no .metadata, the new directory is never renamed
    write_data = FileSystemWriter.write_data

    def write_then_fail(self, plan, planner):
        write_data(self, plan, planner).wait()
        raise OSError(28, "No space left on device (simulated)")

    if rank == 1:
        FileSystemWriter.write_data = write_then_fail
    try:
        checkpoint.save(path, module, opt, step=11)
    except OSError as e:
        out["write_error"] = str(e)
    finally:
        FileSystemWriter.write_data = write_data
    tmp = path.parent / f".{path.name}.tmp"
    out["left_by_write"] = sorted(p.name for p in tmp.iterdir())
    out["after_write"] = _load_fresh(rank, world, plan, path)

    # 2. rank 0 fails between its two renames: the previous checkpoint waits as .crash.old
    rename = os.rename

    def fail_on_the_new_one(src, dst):
        if Path(src) == tmp:  # the new checkpoint's directory, after the previous one moved aside
            raise OSError(5, "Input/output error (simulated)")
        return rename(src, dst)

    if rank == 0:
        os.rename = fail_on_the_new_one
    try:
        checkpoint.save(path, module, opt, step=12)
    except OSError as e:
        out["rename_error"] = str(e)
    finally:
        os.rename = rename
    out["mid_swap"] = (path.exists(), (path.parent / f".{path.name}.old").is_dir(), checkpoint.exists(path))
    out["after_rename"] = _load_fresh(rank, world, plan, path)
    out["previous"] = previous

    # 3. the next save succeeds and leaves nothing else behind
    checkpoint.save(path, module, opt, step=13)
    out["next"] = (_load_fresh(rank, world, plan, path), hidup.full_state_dict(module))
    out["siblings"] = sorted(p.name for p in path.parent.iterdir())
    return out


def _rank_load(rank, world, plan, path):
    """Load on another world under its own plan: the logical state, Adam's, and the local shapes."""
    import hidup
    from hidup.runtime import checkpoint

    torch.set_default_dtype(torch.float64)
    module, _ = _compiled(rank, world, plan, seed=5)
    opt = torch.optim.Adam(module.parameters(), lr=0.5)
    info = checkpoint.load(path, module, opt)
    return info, hidup.full_state_dict(module), _gathered_optimizer_state(module, opt), _forms(module)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    results = run_distributed(_rank_world2, 2, _plan(2), str(root), timeout=240)
    return root, results


def _equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        if isinstance(a[name], dict):
            _equal(a[name], b[name], f"{what} {name}")
        else:
            assert torch.equal(a[name], b[name]), f"{what} {name}: {a[name]} != {b[name]}"


# ------------------------------------------------------------------------------------- resharding
def test_the_plan_shards_parameters(world2):
    _, results = world2
    forms = results[0]["forms"]
    sharded = {n: f for n, f in forms.items() if f[0] is not False}
    assert len(sharded) >= 3, forms  # the test is about sharded state
    assert any(f[0] is False for f in forms.values())  # and replicated state next to it


def test_loads_on_four_ranks_under_their_plan(world2):
    root, results = world2
    params, adam = results[0]["saved"]
    loaded = run_distributed(_rank_load, 4, _plan(4), str(root / "ckpt"), timeout=240)
    for rank, (info, state, opt_state, forms) in enumerate(loaded):
        assert info == {
            "step": TRAIN_STEPS,
            "loss_history": results[0]["info"]["loss_history"],
            "extra": {"note": "w2"},
            "world_size": 2,
        }
        _equal(state, params, f"rank {rank} parameter")
        _equal(opt_state, adam, f"rank {rank} Adam state")
        for name, (dim, shape_on_2) in results[0]["forms"].items():
            if dim is not False:  # physically re-sharded: a quarter of the logical dim
                assert forms[name][0] == dim and forms[name][1][dim] * 2 == shape_on_2[dim], (name, forms[name])


def test_loads_into_the_plain_model_on_one_process(world2):
    import hidup
    from hidup.runtime import checkpoint

    root, results = world2
    params, adam = results[0]["saved"]
    model, _ = hidup.models.build("gpt", world_size=1, dtype="float64", seed=9, **GPT)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    info = checkpoint.load(root / "ckpt", model, opt, restore_rng=False)
    assert info["step"] == TRAIN_STEPS and info["world_size"] == 2
    assert opt.param_groups[0]["lr"] == 1e-2
    _equal(dict(model.state_dict()), params, "parameter")
    _equal({n: opt.state[p] for n, p in model.named_parameters()}, adam, "Adam state")
    assert checkpoint.info(root / "ckpt") == info


# ------------------------------------------------------------------------------------ exact resume
def test_resume_is_bit_identical(world2):
    _, results = world2
    for rank, r in enumerate(results):
        assert r["info"]["step"] == TRAIN_STEPS and len(r["info"]["loss_history"]) == TRAIN_STEPS
        assert r["lr"] == 1e-2
        ref_losses, ref_params = r["reference"]
        losses, params = r["resumed"]
        assert losses == ref_losses, f"rank {rank}: resumed {losses}, uninterrupted {ref_losses}"
        _equal(params, ref_params, f"rank {rank} parameter after resuming")


# ------------------------------------------------------------------------------------------ crashes
def test_a_save_that_fails_while_writing_keeps_the_previous_checkpoint(world2):
    _, results = world2
    for rank, r in enumerate(results):
        assert "No space left on device (simulated)" in r["write_error"], rank  # every rank raised
        assert {"__0_0.distcp", "__1_0.distcp"} <= set(r["left_by_write"]) and ".metadata" not in r["left_by_write"]
        step, state = r["after_write"]
        assert step == 10
        _equal(state, r["previous"], f"rank {rank} parameter")


def test_a_save_that_fails_between_the_renames_keeps_the_previous_checkpoint(world2):
    _, results = world2
    for rank, r in enumerate(results):
        assert "Input/output error (simulated)" in r["rename_error"], rank  # rank 1 learns rank 0's failure
        assert r["mid_swap"] == (False, True, True)  # only .crash.old is left, and load finds it
        step, state = r["after_rename"]
        assert step == 10
        _equal(state, r["previous"], f"rank {rank} parameter")
        (step, state), now = r["next"]
        assert step == 13
        _equal(state, now, f"rank {rank} parameter")
        assert "crash" in r["siblings"] and not any(n.startswith(".crash") for n in r["siblings"]), r["siblings"]


# ------------------------------------------------------------------------------ what each rank wrote
def test_each_rank_writes_only_its_own_slices(world2):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    root, results = world2
    path = root / "ckpt"
    metadata = FileSystemReader(path).read_metadata()
    forms = results[0]["forms"]
    sharded_keys = 0
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        kind, name = key.split(".", 1)
        dim, local_shape = forms[name if kind == "model" else name.rsplit(".", 1)[0]]  # optim.<name>.<state>
        if dim is False:
            assert [tuple(c.sizes) for c in md.chunks] == [tuple(md.size)], key  # written once, whole
            continue
        sharded_keys += 1
        assert len(md.chunks) == 2, key
        for chunk in md.chunks:
            assert tuple(chunk.sizes) == local_shape, (key, chunk)  # a slice, never the whole tensor
            rank = chunk.offsets[dim] // local_shape[dim]
            where = metadata.storage_data[MetadataIndex(key, chunk.offsets)]
            assert where.relative_path == f"__{rank}_0.distcp", (key, chunk.offsets, where)
    assert sharded_keys >= 9  # weights and both Adam moments of the sharded parameters
    written: dict[str, int] = {}
    for where in metadata.storage_data.values():
        written[where.relative_path] = written.get(where.relative_path, 0) + where.length
    files = {p.name: p.stat().st_size for p in path.glob("*.distcp")}
    assert files.keys() == {"__0_0.distcp", "__1_0.distcp"}
    assert files == written  # nothing in a file but the entries the metadata records


# ------------------------------------------------------------------------------------------- errors
def test_a_bad_path_or_another_model_is_refused_with_one_message(world2, tmp_path):
    import hidup
    from hidup.runtime import checkpoint

    root, _ = world2
    model, _ = hidup.models.build("gpt", world_size=1, dtype="float64", **GPT)
    with pytest.raises(FileNotFoundError, match="checkpoint .*nowhere does not exist"):
        checkpoint.load(tmp_path / "nowhere", model)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        checkpoint.load(tmp_path / "empty", model)
    wider, _ = hidup.models.build("gpt", world_size=1, dtype="float64", **{**GPT, "ffn": 64})
    with pytest.raises(
        ValueError,
        match=r"trunk.layers.0.ffn.fc1.weight: checkpoint .* holds shape \(32, 16\), "
        r"the model expects \(64, 16\)",
    ):
        checkpoint.load(root / "ckpt", wider)
    deeper, _ = hidup.models.build("gpt", world_size=1, dtype="float64", **{**GPT, "layers": 2})
    with pytest.raises(KeyError, match="has no entry for 'trunk.layers.1."):
        checkpoint.load(root / "ckpt", deeper)
    sgd = torch.optim.SGD([model.decoder.weight], lr=0.1)
    with pytest.raises(ValueError, match="does not match the optimizer's"):
        checkpoint.load(root / "ckpt", model, sgd)


def _main(argv: list[str], capsys) -> tuple[int, str]:
    """``hidup ARGV`` in this process: (exit status, stderr); a traceback escapes as an exception."""
    from hidup.cli import main

    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
        if isinstance(code, str):
            print(code, file=sys.stderr)
            code = 1
    return code or 0, capsys.readouterr().err


def test_train_resume_from_another_model_is_one_message(capsys, tmp_path):
    model = [
        "--model",
        "gpt",
        "--layers",
        "1",
        "--d-model",
        "16",
        "--heads",
        "4",
        "--seq-len",
        "4",
        "--batch-per-gpu",
        "2",
        "--vocab",
        "32",
    ]
    run = ["--iterations", "1", "--checkpoint-dir", str(tmp_path)]
    assert _main(["train", *model, "--ffn", "32", *run], capsys)[0] == 0
    assert (tmp_path / "checkpoint" / ".metadata").is_file()
    code, err = _main(["train", *model, "--ffn", "64", *run, "--resume"], capsys)
    assert code == 1 and "Traceback" not in err, err
    assert "cannot resume from checkpoint" in err and "holds shape (32, 16), the model expects (64, 16)" in err, err
    code, err = _main(
        ["train", *model, "--ffn", "32", "--iterations", "1", "--checkpoint-dir", str(tmp_path / "none"), "--resume"],
        capsys,
    )
    assert code == 1 and "Traceback" not in err and "--resume: no checkpoint at" in err, err


def test_single_file_checkpoints_still_load(world2, tmp_path):
    import hidup
    from hidup.runtime import checkpoint

    _, results = world2
    params, adam = results[0]["saved"]
    names = list(params)
    path = tmp_path / "checkpoint.pt"
    state = {
        "version": 1,
        "world_size": 2,
        "step": 4,
        "loss_history": [1.0, 0.5, 0.25, 0.125],
        "params": params,
        "optimizer": {
            "groups": [
                {"lr": 0.25, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0, "amsgrad": False, "params": names}
            ],
            "state": adam,
        },
        "rng": [{"torch": torch.get_rng_state(), "python": random.getstate()}] * 2,
        "extra": {},
    }
    torch.save(state, path)  # the version 1 format: one torch.save file
    first = torch.rand(3)
    model, _ = hidup.models.build("gpt", world_size=1, dtype="float64", seed=9, **GPT)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    info = checkpoint.load(path, model, opt)
    assert torch.equal(torch.rand(3), first)  # the RNG state it holds (of rank 0: another world)
    assert (
        info
        == checkpoint.info(path)
        == {"step": 4, "loss_history": [1.0, 0.5, 0.25, 0.125], "extra": {}, "world_size": 2}
    )
    assert opt.param_groups[0]["lr"] == 0.25
    _equal(dict(model.state_dict()), params, "parameter")
    _equal({n: opt.state[p] for n, p in model.named_parameters()}, adam, "Adam state")


def test_keep_holds_the_last_checkpoints_each_loadable(tmp_path):
    """``keep=3``: the newest in ``checkpoint``, the two before it as ``checkpoint.step-<N>``, older ones
    deleted; each loads with its own step and values."""
    from hidup.runtime import checkpoint

    path = tmp_path / "checkpoint"
    model = nn.Linear(3, 3)
    for step in range(1, 6):
        with torch.no_grad():
            model.weight.fill_(step)
        checkpoint.save(path, model, step=step, keep=3)
    assert [p.name for p in checkpoint.kept(path)] == ["checkpoint.step-3", "checkpoint.step-4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "checkpoint.step-3", "checkpoint.step-4"]
    for where, step in ((path.parent / "checkpoint.step-3", 3), (path.parent / "checkpoint.step-4", 4), (path, 5)):
        fresh = nn.Linear(3, 3)
        assert checkpoint.load(where, fresh, restore_rng=False)["step"] == step
        assert torch.equal(fresh.weight.detach(), torch.full((3, 3), float(step)))
    checkpoint.save(path, model, step=6)  # keep=1 (the default) deletes what it replaces
    assert [p.name for p in checkpoint.kept(path)] == ["checkpoint.step-3", "checkpoint.step-4"]

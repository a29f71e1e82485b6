"""Launch (rank layout, process group, failure), checkpoints (atomic, re-sharding) and data."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from dist_util import run_distributed
from hidup.codegen.params import ParamShard, full_state_dict, shard_tensor
from hidup.ir import REPLICATE, gather
from hidup.runtime import checkpoint
from hidup.runtime.data import StdlibCorpus, SyntheticTokens, stdlib_bytes
from hidup.runtime.launch import LaunchError, launch, layout_from_env

# ----------------------------------------------------------------------------------------------
# layout


def test_layout_noderank_cpn():
    lay = layout_from_env(
        {"NODERANK": "1", "CPN": "4", "NNODES": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    )
    assert (lay.world_size, lay.nnodes, lay.cpn, lay.node_rank) == (8, 2, 4, 1)
    assert lay.local_rank is None
    from dataclasses import replace

    assert replace(lay, local_rank=3).rank == 7
    assert (lay.master_addr, lay.master_port) == ("10.0.0.1", 1234)


def test_one_node_without_a_port_hosts_its_rendezvous_on_a_free_one():
    """Two jobs on one machine never collide on a default port: a one-node launch that names none
    takes port 0, which the launcher turns into a free port of its own store."""
    assert layout_from_env({"CPN": "2"}).master_port == 0
    assert layout_from_env({}).master_port == 0
    assert layout_from_env({"CPN": "2", "MASTER_PORT": "1234"}).master_port == 1234


def test_two_one_node_launches_at_once_without_a_port(monkeypatch):
    import threading

    monkeypatch.delenv("MASTER_PORT", raising=False)
    results, errors = [], []

    def one():
        try:
            results.append(launch(_rank_and_world, cpn=2))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert results == [[(0, 2), (1, 2)]] * 2


def _rank_and_world(ctx):
    return ctx.rank, ctx.world_size


def test_layout_flags_win_over_env():
    lay = layout_from_env({"CPN": "4", "MASTER_PORT": "1"}, cpn=2, master_port=777)
    assert (lay.world_size, lay.cpn, lay.master_port) == (2, 2, 777)


def test_layout_torchrun():
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "29400",
    }
    lay = layout_from_env(env)
    assert (lay.source, lay.rank, lay.world_size, lay.local_rank, lay.node_rank, lay.cpn) == ("torchrun", 5, 8, 1, 1, 4)


def test_layout_single_when_nothing_set():
    lay = layout_from_env({})
    assert (lay.source, lay.world_size) == ("single", 1)


@pytest.mark.parametrize(
    "env, match",
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, "LOCAL_RANK"),
        ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "outside"),
        (
            {
                "RANK": "3",
                "WORLD_SIZE": "4",
                "LOCAL_RANK": "0",
                "CPN": "2",
                "NODERANK": "0",
                "MASTER_ADDR": "h",
                "MASTER_PORT": "1",
            },
            "contradicts",
        ),
        (
            {
                "RANK": "1",
                "WORLD_SIZE": "4",
                "LOCAL_RANK": "1",
                "CPN": "2",
                "NNODES": "3",
                "MASTER_ADDR": "h",
                "MASTER_PORT": "1",
            },
            "NNODES",
        ),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "MASTER_ADDR"),
        ({"NODERANK": "0"}, "CPN"),
        ({"CPN": "2", "NNODES": "2"}, "NODERANK"),
        ({"CPN": "2", "NNODES": "2", "NODERANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "outside"),
        ({"CPN": "2", "NNODES": "2", "NODERANK": "1"}, "MASTER_ADDR"),
        ({"CPN": "2", "NNODES": "2", "NODERANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "0"}, "one node only"),
        ({"CPN": "two"}, "not an integer"),
        ({"CPN": "0"}, "at least 1"),
    ],
)
def test_layout_errors(env, match):
    with pytest.raises(LaunchError, match=match):
        layout_from_env(env)


# ----------------------------------------------------------------------------------------------
# launch (spawned ranks on gloo)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sum_ranks(ctx, scale):
    import torch.distributed as dist

    x = torch.tensor([float(ctx.rank)])
    dist.all_reduce(x)
    return ctx.rank, ctx.world_size, ctx.local_rank, ctx.backend, float(x) * scale


def _raise_on_rank1(ctx):
    import torch.distributed as dist

    if ctx.rank == 1:
        raise RuntimeError("rank 1 broke")
    dist.barrier()


def _rank1_vanishes(ctx):
    import torch.distributed as dist

    if ctx.rank == 1:
        os._exit(0)  # dies silently, without an error report
    dist.all_reduce(torch.ones(1))


def _abort_on_exit(ctx):
    import atexit

    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))
    if ctx.rank == 1:
        atexit.register(os.abort)  # returns its result, then dies with SIGABRT while exiting
    return ctx.rank


def test_launch_keeps_results_when_a_rank_dies_after_returning():
    with pytest.warns(RuntimeWarning, match="returned its result, then one died on exit"):
        out = launch(_abort_on_exit, cpn=2, master_port=_free_port(), env={}, timeout_s=30, backend="gloo")
    assert out == [0, 1]


def test_launch_spawns_cpn_ranks():
    out = launch(_sum_ranks, 10.0, cpn=2, master_port=_free_port(), env={}, timeout_s=30, backend="gloo")
    assert out == [(0, 2, 0, "gloo", 10.0), (1, 2, 1, "gloo", 10.0)]


def test_launch_spawns_afresh_when_asked(monkeypatch):
    """``HIDUP_START_METHOD=spawn`` starts each rank as a new interpreter (the fork server is the
    default on Linux); anything else is refused with the two choices."""
    from hidup.runtime.launch import start_method

    monkeypatch.setenv("HIDUP_START_METHOD", "spawn")
    assert start_method() == "spawn"
    out = launch(_sum_ranks, 1.0, cpn=2, master_port=_free_port(), env={}, timeout_s=30, backend="gloo")
    assert out == [(0, 2, 0, "gloo", 1.0), (1, 2, 1, "gloo", 1.0)]
    monkeypatch.setenv("HIDUP_START_METHOD", "fork")
    with pytest.raises(LaunchError, match="expected forkserver or spawn"):
        start_method()


def _sum_ranks_on_device(ctx):
    import torch.distributed as dist

    x = torch.tensor([float(ctx.rank)], device=ctx.device)
    dist.all_reduce(x)
    return ctx.backend, str(ctx.device), float(x)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_launch_nccl_by_default_on_gpus():
    out = launch(_sum_ranks_on_device, cpn=2, master_port=_free_port(), env={}, timeout_s=60)
    assert out == [("nccl", "cuda:0", 1.0), ("nccl", "cuda:1", 1.0)]


def test_launch_reports_a_failing_rank():
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="rank 1 broke"):
        launch(_raise_on_rank1, cpn=2, master_port=_free_port(), env={}, timeout_s=20, backend="gloo")
    assert time.monotonic() - t0 < 30


def test_launch_dead_rank_fails_fast():
    t0 = time.monotonic()
    with pytest.raises(LaunchError):
        launch(_rank1_vanishes, cpn=2, master_port=_free_port(), env={}, timeout_s=5, backend="gloo")
    assert time.monotonic() - t0 < 30


def _hangs(ctx, marker):
    """Every rank writes the marker, then waits forever outside any collective (no timeout ends it)."""
    with open(marker, "a") as f:
        f.write(f"{ctx.rank}\n")
    while True:
        time.sleep(0.1)


def stall_then_report(marker: str) -> None:
    """Launch two ranks that hang (:func:`_hangs`) under a watchdog that calls them stalled once both
    started; print the launcher's error (run in a process of its own by the test below)."""

    def stalled():
        return "no progress" if os.path.isfile(marker) and len(open(marker).read().split()) == 2 else None

    try:
        launch(_hangs, marker, cpn=2, master_port=_free_port(), env={}, timeout_s=20, backend="gloo", stalled=stalled)
    except LaunchError as e:
        print(f"LaunchError: {e}", flush=True)


def test_launch_stops_ranks_that_stall(tmp_path):
    """Run in a fresh process: the ranks print their stacks to the standard error of the process that
    started the fork server (hidup.runtime.launch), which for a launch inside this test session is
    wherever an earlier test's output went."""
    marker = tmp_path / "started"
    here = str(Path(__file__).parent)
    code = f"import sys; sys.path.insert(0, {here!r}); import test_runtime as t; t.stall_then_report({str(marker)!r})"
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert time.monotonic() - t0 < 90
    assert "were stopped: no progress" in run.stdout, run.stdout + run.stderr[-3000:]
    err = run.stderr  # each rank printed where it waited before it was killed
    assert err.count("in _hangs") == 2, err[-3000:]
    assert "Python stacks of local rank 0" in err and "Python stacks of local rank 1" in err


def test_launch_single_process():
    out = launch(lambda ctx: (ctx.rank, ctx.world_size, ctx.device.type), env={})
    assert out == [(0, 1, "cuda" if torch.cuda.is_available() else "cpu")]


# ----------------------------------------------------------------------------------------------
# checkpoints


class _Sharded(nn.Module):
    """A module laid out as codegen lays one out: weight sharded along dim 0, bias replicated."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, rank: int, world: int):
        super().__init__()
        self.w = nn.Parameter(shard_tensor(weight, gather(0), rank, world).clone())
        self.b = nn.Parameter(bias.clone())
        self.register_buffer("scale", torch.arange(4.0))
        self.param_shards = {
            "w": ParamShard("lin.weight", tuple(weight.shape), gather(0)),
            "b": ParamShard("lin.bias", tuple(bias.shape), REPLICATE),
            "scale": ParamShard("scale", (4,), REPLICATE, is_buffer=True),
        }
        self.group = None


def _logical():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 4, generator=g), torch.randn(8, generator=g)


def _train_and_save(rank, world, path):
    w, b = _logical()
    m = _Sharded(w, b, rank, world)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    m.w.sum().backward()  # some gradient, different per rank slice
    (m.b * 2).sum().backward()  # replicated: alike on every rank, as a compiled module keeps it
    opt.step()
    torch.manual_seed(100 + rank)
    checkpoint.save(path, m, opt, step=7, loss_history=[3.0, 2.5], extra={"plan": "x"})
    state = full_state_dict(m)
    opt_state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in (("w", m.w), ("b", m.b))}
    return state, opt_state, torch.rand(1)


def _load(rank, world, path):
    w, b = _logical()
    m = _Sharded(torch.zeros_like(w), torch.zeros_like(b), rank, world)
    opt = torch.optim.Adam(m.parameters(), lr=0.5)
    info = checkpoint.load(path, m, opt)
    return (
        info,
        full_state_dict(m),
        {n: dict(opt.state[p]) for n, p in (("w", m.w), ("b", m.b))},
        opt.param_groups[0]["lr"],
        torch.rand(1),
        m.w.detach().clone(),
    )


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    """A checkpoint saved by two ranks (read, never written, by the tests) and what each rank saved."""
    path = tmp_path_factory.mktemp("ckpt") / "ckpt.pt"
    return path, run_distributed(_train_and_save, 2, path)


def test_checkpoint_resumes_on_another_world(saved_checkpoint):
    path, saved = saved_checkpoint
    for world in (4, 2):
        loaded = run_distributed(_load, world, path)
        for rank, (info, state, opt_state, lr, rnd, local_w) in enumerate(loaded):
            assert info == {"step": 7, "loss_history": [3.0, 2.5], "extra": {"plan": "x"}, "world_size": 2}
            assert lr == 0.1
            for k in saved[0][0]:
                torch.testing.assert_close(state[k], saved[0][0][k])
            assert local_w.shape == (8 // world, 4)  # physically re-sharded
            full_avg = torch.cat([saved[r][1]["w"]["exp_avg"] for r in range(2)])
            torch.testing.assert_close(opt_state["w"]["exp_avg"], full_avg.chunk(world)[rank])
            torch.testing.assert_close(opt_state["b"]["exp_avg_sq"], saved[0][1]["b"]["exp_avg_sq"])
            if world == 2:  # same world: each rank gets its own RNG stream back
                torch.testing.assert_close(rnd, saved[rank][2])
            else:
                torch.testing.assert_close(rnd, saved[0][2])


def test_checkpoint_loads_into_a_plain_module(saved_checkpoint):
    path = saved_checkpoint[0]
    plain = nn.Module()
    plain.lin = nn.Linear(4, 8)
    plain.register_buffer("scale", torch.zeros(4))
    info = checkpoint.load(path, plain, restore_rng=False)
    assert info["step"] == 7
    assert plain.scale.tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(KeyError, match="no entry for 'weight'"):
        checkpoint.load(path, nn.Linear(4, 8), restore_rng=False)


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    from hidup.files import atomic_write

    path = tmp_path / "a.pt"
    atomic_write(path, lambda f: torch.save({"x": 1}, f))

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        atomic_write(path, lambda f: torch.save({"x": Unpicklable()}, f))
    assert torch.load(path, weights_only=False) == {"x": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt"]
    assert atomic_write(tmp_path / "new" / "b.json", "{}\n").read_text() == "{}\n"  # the directory is made
    assert atomic_write(path, b"raw").read_bytes() == b"raw"


# ----------------------------------------------------------------------------------------------
# data


def test_synthetic_batches_are_deterministic():
    d = SyntheticTokens(batch=4, seq=8, vocab=50, seed=1)
    t, y = d.batch_at(3)
    assert t.shape == y.shape == (4, 8) and t.dtype == torch.int64
    assert torch.equal(t[:, 1:], y[:, :-1])
    t2, _ = SyntheticTokens(batch=4, seq=8, vocab=50, seed=1).batch_at(3)
    assert torch.equal(t, t2)
    assert not torch.equal(t, d.batch_at(4)[0])
    lt, ly = d.local_batch(3, 1, 2)
    assert torch.equal(lt, t[2:]) and torch.equal(ly, y[2:])
    with pytest.raises(ValueError, match="multiple of the world size"):
        d.local_batch(0, 0, 3)


def test_stdlib_corpus():
    data = stdlib_bytes(max_bytes=1 << 20)
    assert len(data) == 1 << 20
    assert b"def " in data and b"import " in data
    c = StdlibCorpus(batch=3, seq=16, max_bytes=1 << 20)
    t, y = c.batch_at(0)
    assert t.shape == (3, 16) and int(t.max()) < 256
    assert torch.equal(t[:, 1:], y[:, :-1])
    assert bytes(t[0].tolist()) == data[:16]
    assert bytes(t[1].tolist()) == data[17:33]
    assert torch.equal(StdlibCorpus(batch=3, seq=16, max_bytes=1 << 20).batch_at(5)[0], c.batch_at(5)[0])
    first = [t for t, _ in zip(c, range(2))]
    assert torch.equal(first[1][0], c.batch_at(1)[0])

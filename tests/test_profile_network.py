"""Two-level profiles: node and network collective tables, group levels, the built-in cluster profile,
and their measurement on several (simulated) nodes on gloo."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

import hidup.profiler.profile as P
from dist_util import run_distributed
from hidup.cli import profile_flags
from hidup.profiler.measure import machine as measure
from hidup.profiler.measure.comm import network_groups, node_groups
from hidup.runtime.launch import Layout

CLUSTER = "h100x64-ib400"
ROOT = Path(__file__).resolve().parent.parent
RINGS = ("all_gather", "reduce_scatter", "all_reduce")


@pytest.fixture(scope="module")
def cluster() -> P.Profile:
    return P.load(CLUSTER)


def _tables_equal(a: dict, b: dict, rel: float = 0.0) -> bool:
    return a.keys() == b.keys() and all(
        a[c].keys() == b[c].keys()
        and all(
            a[c][g].alpha == b[c][g].alpha
            and a[c][g].sizes == b[c][g].sizes
            and all(x == pytest.approx(y, rel=rel) for x, y in zip(a[c][g].algbw, b[c][g].algbw))
            for g in a[c]
        )
        for c in a
    )


# ------------------------------------------------------------------------------------------ schema


def test_round_trip_keeps_both_levels(cluster, tmp_path):
    assert cluster.gpus_per_node == 8 and cluster.network is not None
    back = P.load(P.save(cluster, tmp_path / "c.json"))
    assert back.to_dict() == cluster.to_dict()
    assert back.gpus_per_node == 8 and _tables_equal(back.network.collectives, cluster.network.collectives)
    doc = json.loads((tmp_path / "c.json").read_text())
    assert set(doc["network"]) == {"collectives", "concurrency"} and doc["gpus_per_node"] == 8
    # a network's concurrency round-trips too
    measured = copy.copy(cluster)
    measured.network = P.NetworkTables(cluster.network.collectives, {"all_reduce": {8: ([1e6, 1e8], [1.2, 1.5])}})
    again = P.Profile.from_dict(measured.to_dict())
    assert again.network.concurrency == {"all_reduce": {8: ([1e6, 1e8], [1.2, 1.5])}}
    assert again.pair_speedup("all_reduce", 8, 1e8, level="network") == pytest.approx(1.5)
    assert again.pair_speedup("all_reduce", 8, 1e8) == 1.0  # the node level has none


def test_one_level_profiles_load_unchanged():
    for name in ("h200x4-nvlink", "h200x4-socket", "paper-v100-9.7gbps"):
        prof = P.load(name)
        assert prof.gpus_per_node == 0 and prof.network is None
        doc = prof.to_dict()
        assert "network" not in doc and P.Profile.from_dict(doc).to_dict() == doc


def _doc_with(cluster, path: tuple, value):
    doc = json.loads(json.dumps(cluster.to_dict()))
    at = doc
    for key in path[:-1]:
        at = at[key]
    if value is KeyError:
        del at[path[-1]]
    else:
        at[path[-1]] = value
    return doc


@pytest.mark.parametrize(
    "path, value, names",
    [
        (("network", "collectives", "all_reduce", "8", "alpha"), "fast", "network.collectives.all_reduce.8.alpha"),
        (("network", "collectives", "all_gather", "4", "algbw"), [1.0], "network.collectives.all_gather.4.algbw"),
        (("network", "collectives", "all_to_all", "2", "sizes"), [2.0, 1.0] * 4, "network.collectives.all_to_all.2"),
        (("network", "collectives", "reduce_scatter"), KeyError, "network.collectives.reduce_scatter"),
        (("network", "collectives", "broadcast"), {}, "unknown collective"),
        (("network", "collectives"), KeyError, "network.collectives"),
        (("network", "concurrency"), {"all_reduce": {"1": {}}}, "network.concurrency.all_reduce.1"),
        (("network", "latency"), 1.0, "unknown field"),
        (("network",), [], "network"),
        (("gpus_per_node",), 0, "gpus_per_node"),  # a network section needs the node size
        (("gpus_per_node",), -8, "gpus_per_node"),
        (("gpus_per_node",), True, "gpus_per_node"),
    ],
)
def test_bad_network_section_names_the_field(cluster, path, value, names):
    with pytest.raises(P.ProfileError, match=names.replace(".", r"\.")):
        P.Profile.from_dict(_doc_with(cluster, path, value), where="c.json")


# ----------------------------------------------------------------------------------------- queries


def test_level_selects_the_table(cluster):
    nbytes = 3e7
    for c in P.COLLECTIVES:
        node, net = cluster.collectives[c][8], cluster.network.collectives[c][8]
        assert cluster.comm_time(c, 8, nbytes) == cluster.comm_time(c, 8, nbytes, level="node")
        assert cluster.comm_time(c, 8, nbytes) == pytest.approx(node.time(nbytes), rel=1e-12)
        assert cluster.comm_time(c, 8, nbytes, level="network") == pytest.approx(net.time(nbytes), rel=1e-12)
        assert cluster.table(c, 4, level="network") == (cluster.network.collectives[c][4], 1.0)
        assert cluster.bandwidth(c, 8, nbytes, level="network") == pytest.approx(nbytes / net.net_time(nbytes))
        # a group size without a table: the nearest one, ring-scaled, as at the node level
        tab, factor = cluster.table(c, 16, level="network")
        assert tab is net and factor == pytest.approx((7 / 8) / (15 / 16))
        assert cluster.comm_time(c, 16, nbytes, level="network") == pytest.approx(
            net.alpha + net.net_time(nbytes) / factor, rel=1e-12
        )
    assert cluster.comm_time("all_reduce", 1, nbytes, level="network") == 0.0
    with pytest.raises(ValueError, match="unknown level 'rack'"):
        cluster.comm_time("all_reduce", 8, nbytes, level="rack")


def test_network_level_without_network_tables_says_how_to_get_them():
    one = P.load("h200x4-nvlink")
    for query in (
        lambda: one.comm_time("all_reduce", 4, 1e6, level="network"),
        lambda: one.comm_time("all_reduce", 1, 1e6, level="network"),
        lambda: one.table("all_gather", 4, level="network"),
        lambda: one.pair_speedup("all_gather", 4, 1e6, level="network"),
    ):
        with pytest.raises(P.ProfileError, match="no network tables") as err:
            query()
        assert "exp/profiler.py" in str(err.value) and CLUSTER in str(err.value)
    assert one.comm_time("all_reduce", 4, 1e6) > 0  # the node level is what it always was


@pytest.mark.parametrize(
    "gpus_per_node, stride, group, world, level",
    [
        (0, 1, 64, None, "node"),  # one-node profile: every group is at the node level
        (0, 8, 8, None, "node"),
        (8, 1, 8, None, "node"),  # 8 x 8 mesh, inner axis: inside a node
        (8, 8, 8, None, "network"),  # 8 x 8 mesh, outer axis: one rank per node
        (8, 1, 16, None, "network"),  # a 1-D world of 16 on 8-GPU nodes
        (4, 2, 2, None, "node"),  # 2 x 2 on a 4-GPU node: both axes inside it
        (4, 1, 2, None, "node"),
        (8, 2, 4, None, "node"),  # 4 x 2 on 8-GPU nodes
        (8, 4, 4, None, "network"),  # 4 x 4 on 8-GPU nodes: ranks 0, 4, 8, 12
        (8, 3, 2, None, "network"),  # 2 x 3 on 8: the group {6, 9} spans nodes 0 and 1
        (8, 3, 2, 6, "node"),  # ... unless the whole world (6 ranks) sits on one node
        (8, 1, 3, 12, "network"),
        (8, 5, 1, None, "node"),  # an axis of one rank does not communicate
    ],
)
def test_group_level(cluster, gpus_per_node, stride, group, world, level):
    prof = copy.copy(cluster)
    prof.gpus_per_node = gpus_per_node
    assert prof.group_level(stride, group, world=world) == level


def test_group_level_matches_rank_placement():
    """The rule against the ranks themselves: an axis is at the node level exactly when each of its
    groups has all members on one node, over every mesh of two axes up to 64 ranks."""
    prof = copy.copy(P.load(CLUSTER))
    for per_node in (2, 4, 8):
        prof.gpus_per_node = per_node
        for outer in range(1, 9):
            for inner in range(1, 9):
                world = outer * inner
                for stride, size in ((inner, outer), (1, inner)):
                    groups = {}
                    for r in range(world):
                        start = r - ((r // stride) % size) * stride
                        groups.setdefault(start, []).append(r)
                    one_node = all(len({m // per_node for m in g}) == 1 for g in groups.values())
                    want = "node" if one_node else "network"
                    assert prof.group_level(stride, size, world=world) == want, (per_node, outer, inner, stride)
    with pytest.raises(ValueError, match="stride"):
        prof.group_level(0, 2)


def test_network_is_slower_than_the_node_in_the_cluster_profile(cluster):
    for c in P.COLLECTIVES:
        for g in (2, 4, 8, 16):
            for nbytes in (1 << 12, 1 << 16, 1 << 20, 1 << 24, 1 << 28, 1 << 30):
                node = cluster.comm_time(c, g, nbytes)
                net = cluster.comm_time(c, g, nbytes, level="network")
                assert net > node > 0, (c, g, nbytes)
    # bandwidth-bound: about the NVLink / NIC bus bandwidth ratio (460 / 47 GB/s)
    ratio = cluster.comm_time("all_reduce", 8, 1 << 30, level="network") / cluster.comm_time("all_reduce", 8, 1 << 30)
    assert 9 < ratio < 11


# ------------------------------------------------------------------------------- derived profiles


def test_fitted_keeps_the_network_and_fits_it(cluster):
    fitted = cluster.fitted()
    assert fitted.gpus_per_node == 8 and fitted.network is not None
    assert _tables_equal(fitted.network.collectives, cluster.network.collectives, rel=1e-12)  # consistent
    # one wrong network entry is pulled back to the link's consensus, as at the node level
    bad = copy.copy(cluster)
    colls = {c: dict(t) for c, t in cluster.network.collectives.items()}
    ar = colls["all_reduce"][8]
    colls["all_reduce"][8] = P.CommTable(ar.alpha, list(ar.sizes), ar.algbw[:-1] + [ar.algbw[-1] / 3])
    bad.network = P.NetworkTables(colls)
    moved = bad.fitted().network.collectives["all_reduce"][8].algbw[-1]
    assert ar.algbw[-1] / 3 < moved < ar.algbw[-1] and moved == pytest.approx(ar.algbw[-1] / math.exp(0.15), rel=1e-3)


def test_perturb_covers_the_network_and_draws_it_last(cluster):
    noisy = cluster.perturb(0.2, seed=3)
    assert noisy.gpus_per_node == 8 and noisy.network is not None
    for c in P.COLLECTIVES:
        for g, tab in cluster.network.collectives[c].items():
            new = noisy.network.collectives[c][g]
            assert new.sizes == tab.sizes and new.alpha == tab.alpha
            assert new.algbw != tab.algbw
            assert all(0.8 - 1e-12 <= b / a <= 1.2 + 1e-12 for a, b in zip(tab.algbw, new.algbw))
    # the one-level fields get the draws they get without a network section
    flat = copy.copy(cluster)
    flat.network, flat.gpus_per_node = None, 0
    plain = flat.perturb(0.2, seed=3).to_dict()
    assert {k: v for k, v in noisy.to_dict().items() if k not in ("network", "gpus_per_node")} == {
        k: v for k, v in plain.items() if k != "gpus_per_node"
    }
    slower = cluster.perturb(0.0, comm_scale=2.0)
    net, slow = cluster.network.collectives["all_to_all"][4], slower.network.collectives["all_to_all"][4]
    assert slow.alpha == 2 * net.alpha and slow.algbw == [b / 2 for b in net.algbw]


# --------------------------------------------------------------------------- built-in cluster


def test_cluster_profile_is_built_from_stated_public_figures(cluster):
    assert CLUSTER in P.builtin_names() and cluster.source == "builtin" and "H100" in cluster.gpu
    notes = cluster.notes
    for phrase in ("public figures", "datasheet", "dense", "HBM3", "nccl-tests", "400 Gb/s", "ring relation"):
        assert phrase in notes, phrase
    for phrase in ("H200", "900 GB/s", "3.35 TB/s", "4.8 TB/s", "exp/records/predict/h200-9/h200.json"):
        assert phrase in notes, phrase  # where the compute tables come from, and how they are scaled
    assert 2.5e12 < cluster.memory_bandwidth < 3.35e12 and cluster.op_overhead > 0
    for level, tables, low, high in (
        ("node", cluster.collectives, 430e9, 470e9),
        ("network", cluster.network.collectives, 44e9, 48e9),
    ):
        for g in (2, 4, 8):
            assert all(g in tables[c] for c in P.COLLECTIVES), (level, g)
            ar, ag, rs = (tables[c][g] for c in ("all_reduce", "all_gather", "reduce_scatter"))
            # one link: all-reduce is a reduce-scatter and an all-gather, net of alpha
            for i, s in enumerate(ar.sizes):
                assert s / ar.algbw[i] == pytest.approx(s / ag.algbw[i] + s / rs.algbw[i], rel=2e-3)
            # nccl-tests bus bandwidth of all-reduce, 2(n-1)/n S / t(S): rising with size, latency-bound when small
            busbw = [2 * (g - 1) / g * s / cluster.comm_time("all_reduce", g, s, level=level) for s in ar.sizes]
            assert all(a < b for a, b in zip(busbw, busbw[1:])), (level, g)
            assert low < busbw[-1] < high and busbw[0] < 0.1 * busbw[-1], (level, g, busbw)
    for c in RINGS:  # consistent rings: fitted() takes the tables as given
        for g in (2, 4, 8):
            assert cluster.fitted().collectives[c][g].algbw == pytest.approx(cluster.collectives[c][g].algbw)


def test_cluster_compute_is_a_measured_hopper_below_the_datasheet_peak(cluster):
    """GEMMs, attention and Adam come from the measured H200 (same die as the H100 SXM): every GEMM runs
    below the 989.5 TFLOP/s datasheet peak, large ones at 60-85 % of it, and beyond the measured grid the
    rate saturates (it never grows past the largest measured shape); Adam, memory-bound, runs slower
    than the H200's by the HBM ratio 4.8 / 3.35."""
    measured = P.load(ROOT / "exp/records/predict/h200-9/h200.json")
    peak, grid = 989.5e12, cluster.gemm["bf16"]
    assert set(cluster.gemm) >= {"bf16", "tf32"} and cluster.attention["bf16"].variants
    for dims in [(4096, 4096, 4096), (8192, 28672, 8192), (16384, 8192, 28672)]:
        for layout in ("nt", "nn", "tn"):
            assert 0.6 * peak < grid.rate(*dims, layout) < 0.85 * peak, (dims, layout)
    assert grid.rate(65536, 65536, 65536) == grid.rate(16384, 16384, 16384) < peak  # saturates past the grid
    assert cluster.flops["bf16"] < peak and cluster.rate_at("bf16", 2 * 32768**3) < peak
    assert cluster.optimizer_s_per_byte == pytest.approx(measured.optimizer_s_per_byte * 4.8 / 3.35)
    assert cluster.memory_bandwidth == pytest.approx(measured.memory_bandwidth * 3.35 / 4.8)
    causal = cluster.attention["bf16"].time("causal", 128, 4096, 4096, 64)
    flops = 4 * 64 * 4096 * 4096 * 128 / 2  # the two matmuls, half the score matrix
    assert flops / causal[0] < 0.7 * peak and 2.5 * flops / causal[1] < 0.7 * peak


# ------------------------------------------------------------------------------------ measuring


def test_node_and_network_groups():
    assert node_groups(8, 4, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert node_groups(8, 4, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert node_groups(6, 3, 2) == [[0, 1], [3, 4]]  # never across a node boundary
    assert network_groups(8, 4, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert network_groups(12, 2, 3) == [[0, 2, 4], [0 + 6, 2 + 6, 4 + 6], [1, 3, 5], [7, 9, 11]]
    assert network_groups(12, 4, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]  # the third node sits out
    with pytest.raises(ValueError, match="do not split into nodes"):
        node_groups(6, 4, 2)
    with pytest.raises(ValueError, match=r"group size 4 is not in \[2, 2\]"):
        network_groups(8, 4, 4)


def test_gpus_per_node_flag_is_checked_against_the_launch():
    one_host = Layout(4, 1, 4, 0, "127.0.0.1", 0)
    assert profile_flags._check_gpus_per_node(None, one_host) is None
    assert profile_flags._check_gpus_per_node(2, one_host) == 2
    with pytest.raises(SystemExit, match="do not split into nodes of 3"):
        profile_flags._check_gpus_per_node(3, one_host)
    with pytest.raises(SystemExit, match="contradicts the launch's 2 nodes of 4"):
        profile_flags._check_gpus_per_node(2, Layout(8, 2, 4, 0, "h", 1))
    with pytest.raises(SystemExit, match="launch >= 2 ranks"):
        profile_flags._check_gpus_per_node(2, Layout(1, 1, 1, 0, "h", 1, source="single"))
    with pytest.raises(ValueError, match="give a divisor of 4"):
        measure._gpus_per_node(4, 3)


def test_a_multi_node_launch_measures_its_nodes(monkeypatch):
    """Without the flag, the launch's own nodes (NNODES/CPN, torchrun's LOCAL_WORLD_SIZE) are measured."""
    seen = []

    def stop(world, device, options):
        seen.append(options.gpus_per_node)
        raise RuntimeError("measured")

    monkeypatch.setattr(measure, "_measure", stop)
    for layout, flag, want in (
        (Layout(8, 2, 4, 0, "h", 1, 0), None, 4),
        (Layout(8, 1, 8, 0, "h", 1, 0), None, None),
        (Layout(8, 1, 8, 0, "h", 1, 0), 2, 2),
    ):
        ctx = SimpleNamespace(device=SimpleNamespace(type="cuda"), layout=layout, world_size=8, rank=0)
        with pytest.raises(RuntimeError, match="measured"):
            measure._rank_main(ctx, measure.ProfileOptions(gpus_per_node=flag), None)
        assert seen[-1] == want, layout
    assert len(seen) == 3


SIZES = [4096, 16384]


def _two_nodes_rank(rank, world, out):
    """Profile 4 gloo ranks as 2 nodes x 2, recording every group each rank creates."""
    import torch.distributed as dist

    created = []
    new_group = dist.new_group

    def recording(ranks=None, *args, **kwargs):
        created.append(list(ranks))
        return new_group(ranks, *args, **kwargs)

    dist.new_group = recording
    try:
        prof = measure.profile_machine(
            world,
            sizes=SIZES,
            dtypes=("fp32",),
            progress=False,
            out=out if rank == 0 else None,
            matmul_sizes=(32,),
            budget_s=0.005,
            name="two-nodes",
            gpus_per_node=2,
        )
    finally:
        dist.new_group = new_group
    return prof.to_dict(), created


def test_two_simulated_nodes_measure_both_levels(tmp_path):
    out = tmp_path / "nodes.json"
    res = run_distributed(_two_nodes_rank, 4, out, timeout=120)
    docs, created = zip(*res)
    assert all(d == docs[0] for d in docs), "every rank returns the same profile"
    # every rank creates every group in the same order: inside the nodes (and a second communicator
    # each, for the pairs), then one rank per node
    assert all(c == created[0] for c in created)
    assert created[0] == [[0, 1], [2, 3]] * 2 + [[0, 2], [1, 3]] * 2
    prof = P.load(out)
    assert prof.gpus_per_node == 2 and prof.world_sizes == [4] and prof.network is not None
    assert "inside a node of 2 ranks and [2] across 2 nodes" in prof.notes
    for tables in (prof.collectives, prof.network.collectives):
        assert set(tables) == set(P.COLLECTIVES) and all(set(t) == {2} for t in tables.values())
        assert all(t[2].sizes == [float(s) for s in SIZES] for t in tables.values())
    for concurrency in (prof.concurrency, prof.network.concurrency):  # pairs on each level's largest groups
        assert set(concurrency) == set(P.COLLECTIVES) and all(set(t) == {2} for t in concurrency.values())
    raw = json.loads(out.with_name("nodes.raw.json").read_text())
    assert raw["gpus_per_node"] == 2
    curves = {c["op"]: c for c in raw["network_collectives"]}
    for c in P.COLLECTIVES:  # the network table gives back the times measured across the nodes
        for s, t in zip(curves[c]["sizes"], curves[c]["seconds"]):
            assert prof.comm_time(c, 2, s, level="network") == pytest.approx(t, rel=2e-3)
    assert prof.group_level(2, 2) == "network" and prof.group_level(1, 2) == "node"

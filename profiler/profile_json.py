"""A profile read from its JSON form: every field validated, with errors that name it.

:func:`profile_from_dict` builds a :class:`~hidup.profiler.profile.Profile` from the object
:meth:`Profile.to_dict` writes (the schema is in :mod:`hidup.profiler.profile`).  A wrong or missing
field raises :class:`~hidup.profiler.profile.ProfileError` as ``<where>: field '<name>': <what is
wrong>``, ``<where>`` being the file it came from.  Fields of older profiles are read too: the
corrections given at the top level, and the deleted factors ``ops_scale``/``dup_scale`` (kept in the
notes, not applied).
"""

from __future__ import annotations

import math

from .corrections import CorrectionError, Corrections
from .gemm import GemmGrid
from .profile import COLLECTIVES, DTYPES, SCHEMA_VERSION, SOURCES, NetworkTables, Profile, ProfileError
from .tables import CommTable

__all__ = ["profile_from_dict"]


def profile_from_dict(d: dict, where: str = "profile") -> Profile:
    """The profile of the JSON object ``d``, validated; errors name the offending field as
    ``<where>: field <name>: ...`` (module docstring)."""

    def bad(fieldname: str, msg: str) -> ProfileError:
        return ProfileError(f"{where}: field {fieldname!r}: {msg}")

    def number(value, fieldname: str, positive: bool = True) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad(fieldname, f"expected a finite number, got {value!r}")
        if positive and value <= 0:
            raise bad(fieldname, f"must be > 0, got {value!r}")
        if not positive and value < 0:
            raise bad(fieldname, f"must be >= 0, got {value!r}")
        return float(value)

    def group_size(key, fieldname: str) -> int:
        try:
            g = int(key)
        except (TypeError, ValueError):
            raise bad(fieldname, "group size keys must be integers >= 2") from None
        if g < 2:
            raise bad(fieldname, "group size keys must be integers >= 2")
        return g

    if not isinstance(d, dict):
        raise ProfileError(f"{where}: expected a JSON object, got {type(d).__name__}")
    version = d.get("version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise bad("version", f"this hidup reads profile schema {SCHEMA_VERSION}, got {version!r}")
    name = d.get("name")
    if not isinstance(name, str) or not name:
        raise bad("name", "a non-empty string is required")
    source = d.get("source", "measured")
    if source not in SOURCES:
        raise bad("source", f"expected one of {SOURCES}, got {source!r}")
    for key in ("host", "gpu", "date", "notes"):
        if not isinstance(d.get(key, ""), str):
            raise bad(key, f"expected a string, got {d[key]!r}")
    ws = d.get("world_sizes", [])
    if not isinstance(ws, list) or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in ws):
        raise bad("world_sizes", f"expected a list of positive integers, got {ws!r}")

    fl = d.get("flops")
    if not isinstance(fl, dict):
        raise bad("flops", "a mapping {fp32, tf32, bf16, fp16} -> FLOP/s is required")
    flops = {}
    for dt in DTYPES:
        if dt not in fl:
            raise bad(
                f"flops.{dt}",
                "missing; give the device FLOP/s for this dtype (use the fp32 value if the device has no faster mode)",
            )
        flops[dt] = number(fl[dt], f"flops.{dt}")
    extra = set(fl) - set(DTYPES)
    if extra:
        raise bad("flops", f"unknown dtype(s) {sorted(extra)}; expected {DTYPES}")

    sizes_in = d.get("matmul_sizes", {})
    if not isinstance(sizes_in, dict) or set(sizes_in) - set(DTYPES):
        raise bad("matmul_sizes", f"expected a mapping {{dtype of {DTYPES}: {{size: FLOP/s}}}}")
    matmul_sizes = {}
    for dt, per in sizes_in.items():
        if not isinstance(per, dict):
            raise bad(f"matmul_sizes.{dt}", "expected a mapping size -> FLOP/s")
        if not all(str(n).isdigit() and int(n) > 0 for n in per):
            raise bad(f"matmul_sizes.{dt}", f"sizes must be positive integers, got {sorted(per)}")
        matmul_sizes[dt] = {int(n): number(r, f"matmul_sizes.{dt}.{n}") for n, r in per.items()}

    gemm_in = d.get("gemm", {})
    if not isinstance(gemm_in, dict) or set(gemm_in) - set(DTYPES):
        raise bad("gemm", f"expected a mapping {{dtype of {DTYPES}: {{sizes, rates}}}}")
    gemm = {}
    for dt, grid in gemm_in.items():
        try:
            gemm[dt] = GemmGrid.from_dict(grid)
        except ValueError as e:
            raise bad(f"gemm.{dt}", str(e)) from None

    ops_in = d.get("ops", {})
    if not isinstance(ops_in, dict):
        raise bad("ops", "expected a mapping op key -> {forward, backward}")
    ops = {}
    for k, v in ops_in.items():
        if not isinstance(v, dict) or "forward" not in v or "backward" not in v:
            raise bad(f"ops[{k!r}]", 'expected {"forward": seconds, "backward": seconds}')
        ops[k] = (
            number(v["forward"], f"ops[{k!r}].forward", positive=False),
            number(v["backward"], f"ops[{k!r}].backward", positive=False),
        )

    def tables(cin, prefix: str) -> dict[str, dict[int, CommTable]]:
        """The collective tables of ``cin``; ``prefix`` names where they are (``collectives``)."""
        if not isinstance(cin, dict):
            raise bad(prefix, f"a mapping with {COLLECTIVES} is required")
        colls: dict[str, dict[int, CommTable]] = {}
        for c in COLLECTIVES:
            if c not in cin:
                raise bad(f"{prefix}.{c}", "missing; every collective needs at least one group size")
            groups = cin[c]
            if not isinstance(groups, dict) or not groups:
                raise bad(f"{prefix}.{c}", "expected a non-empty mapping group size -> table")
            colls[c] = {}
            for g, t in groups.items():
                f = f"{prefix}.{c}.{g}"
                gi = group_size(g, f)
                if not isinstance(t, dict):
                    raise bad(f, "expected {alpha, sizes, algbw}")
                for key in ("alpha", "sizes", "algbw"):
                    if key not in t:
                        raise bad(f"{f}.{key}", "missing")
                alpha = number(t["alpha"], f"{f}.alpha", positive=False)
                sizes, bws = t["sizes"], t["algbw"]
                if not isinstance(sizes, list) or not sizes:
                    raise bad(f"{f}.sizes", "expected a non-empty list of byte counts")
                if not isinstance(bws, list) or len(bws) != len(sizes):
                    raise bad(f"{f}.algbw", f"expected a list as long as sizes ({len(sizes)} entries)")
                sizes = [number(s, f"{f}.sizes[{i}]") for i, s in enumerate(sizes)]
                bws = [number(b, f"{f}.algbw[{i}]") for i, b in enumerate(bws)]
                if any(b <= a for a, b in zip(sizes, sizes[1:])):
                    raise bad(f"{f}.sizes", f"must be strictly increasing, got {sizes}")
                colls[c][gi] = CommTable(alpha, sizes, bws)
        extra = set(cin) - set(COLLECTIVES)
        if extra:
            raise bad(prefix, f"unknown collective(s) {sorted(extra)}; expected {COLLECTIVES}")
        return colls

    def speedups(cc, prefix: str) -> dict[str, dict[int, tuple[list[float], list[float]]]]:
        """The concurrency tables of ``cc``; ``prefix`` names where they are (``concurrency``)."""
        concurrency: dict[str, dict[int, tuple[list[float], list[float]]]] = {}
        cc = cc or {}
        if not isinstance(cc, dict):
            raise bad(prefix, "expected an object {collective: {group size: {sizes, speedup}}}")
        for c, groups in cc.items():
            if c not in COLLECTIVES or not isinstance(groups, dict):
                raise bad(prefix, f"unknown collective {c!r} or malformed entry; expected {COLLECTIVES}")
            for g, entry in groups.items():
                f = f"{prefix}.{c}.{g}"
                gi = group_size(g, f)
                if not isinstance(entry, dict):
                    raise bad(f, "expected {sizes, speedup}")
                sizes = [number(x, f + ".sizes") for x in entry.get("sizes", [])]
                speed = [number(x, f + ".speedup") for x in entry.get("speedup", [])]
                if not sizes or len(sizes) != len(speed) or any(b <= a for a, b in zip(sizes, sizes[1:])):
                    raise bad(f, "sizes must be strictly increasing and as many as the speedups")
                concurrency.setdefault(c, {})[gi] = (sizes, speed)
        return concurrency

    colls = tables(d.get("collectives"), "collectives")
    membw = number(d.get("memory_bandwidth", 0.0), "memory_bandwidth", positive=False)
    overhead = number(d.get("op_overhead", 0.0), "op_overhead", positive=False)
    overhead_graph = number(d.get("op_overhead_graph", 0.0), "op_overhead_graph", positive=False)
    ops_timing = d.get("ops_timing", "eager")
    opt_rate = number(d.get("optimizer_s_per_byte", 0.0), "optimizer_s_per_byte", positive=False)
    layout_bw = number(d.get("layout_bandwidth", 0.0), "layout_bandwidth", positive=False)
    grad_copy = number(d.get("grad_copy_overhead", 0.0), "grad_copy_overhead", positive=False)
    grad_copy_graph = number(d.get("grad_copy_overhead_graph", 0.0), "grad_copy_overhead_graph", positive=False)
    notes = d.get("notes", "")
    dropped = {k: number(d[k], k) for k in ("ops_scale", "dup_scale") if k in d}  # deleted factors
    dropped = {k: v for k, v in dropped.items() if v != 1.0}
    if dropped:
        notes += (
            ("; " if notes else "")
            + ", ".join(f"{k} {v:.3f}" for k, v in sorted(dropped.items()))
            + " not applied (factors about 1 that this hidup no longer has)"
        )
    legacy = {k: number(d[k], k) for k in Corrections.names() if k in d}  # before "corrections"
    if legacy and "corrections" in d:
        raise bad(
            "corrections",
            f"given both at the top level ({sorted(legacy)}) and under 'corrections'; keep the 'corrections' object",
        )
    try:
        corrections = (
            Corrections.from_dict(d["corrections"], f"{where}: field 'corrections'")
            if "corrections" in d
            else Corrections.from_legacy(legacy)
        )
    except CorrectionError as e:
        raise ProfileError(str(e)) from None
    if ops_timing not in ("graph", "eager"):
        raise bad("ops_timing", f"must be 'graph' or 'eager', got {ops_timing!r}")
    concurrency = speedups(d.get("concurrency", {}), "concurrency")
    gpus_per_node = d.get("gpus_per_node", 0)
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 0:
        raise bad("gpus_per_node", f"expected an integer >= 0 (0 = one node), got {gpus_per_node!r}")
    network = None
    if d.get("network") is not None:
        net = d["network"]
        if not isinstance(net, dict):
            raise bad("network", "expected an object {collectives, concurrency}")
        extra = set(net) - {"collectives", "concurrency"}
        if extra:
            raise bad("network", f"unknown field(s) {sorted(extra)}; expected collectives and concurrency")
        if gpus_per_node == 0:
            raise bad(
                "gpus_per_node",
                "a profile with a 'network' section needs the GPUs per node (> 0), which say which groups cross nodes",
            )
        network = NetworkTables(
            tables(net.get("collectives"), "network.collectives"),
            speedups(net.get("concurrency", {}), "network.concurrency"),
        )
    return Profile(
        name,
        flops,
        colls,
        ops,
        d.get("host", ""),
        d.get("gpu", ""),
        list(ws),
        d.get("date", ""),
        source,
        notes,
        membw,
        overhead,
        overhead_graph,
        concurrency,
        ops_timing,
        opt_rate,
        layout_bw,
        grad_copy,
        grad_copy_graph,
        corrections,
        gpus_per_node,
        network,
        matmul_sizes,
        transpose_bandwidth=number(d.get("transpose_bandwidth", 0.0), "transpose_bandwidth", positive=False),
        gemm=gemm,
    )

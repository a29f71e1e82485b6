"""The time breakdown of exp/breakdown.py: synthetic chrome traces checked number by number, the CPU
fallback, the command line, and the interval algebra under it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exp import breakdown

ROOT = Path(__file__).resolve().parent.parent


def _kernel(name, ts, dur, stream, device=0, cat="kernel"):
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "ts": ts,
        "dur": dur,
        "tid": stream,
        "pid": device,
        "args": {"device": device, "stream": stream},
    }


SYNTHETIC = {
    "traceEvents": [
        _kernel("ampere_sgemm_128x64_nn", 1000, 10, 7),  # compute [0, 10)
        _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 1005, 20, 20),  # comm    [5, 25)
        _kernel("void at::native::vectorized_elementwise_kernel", 1020, 10, 7),  # compute [20, 30)
        _kernel("Memcpy DtoD (Device -> Device)", 1030, 2, 7, cat="gpu_memcpy"),  # comm by default [30, 32)
        _kernel("Memset (Device)", 1040, 1, 7, cat="gpu_memset"),  # compute [40, 41)
        _kernel("ncclDevKernel_AllGather_RING_LL", 900, 500, 20, device=1),  # another device: ignored
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000, "tid": 1, "pid": 1},  # host: ignored
        {"ph": "i", "name": "marker", "ts": 1000},
    ]
}


def test_breakdown_of_a_synthetic_trace():
    b = breakdown.analyze(SYNTHETIC)
    us = 1e-6
    assert b["source"] == "device" and b["device"] == 0 and b["events"] == 5
    assert b["compute_s"] == pytest.approx(21 * us)  # [0,10) + [20,30) + [40,41)
    assert b["comm_s"] == pytest.approx(22 * us)  # [5,25) + [30,32)
    assert b["hidden_s"] == pytest.approx(10 * us)  # [5,10) + [20,25)
    assert b["exposed_s"] == pytest.approx(12 * us)
    assert b["span_s"] == pytest.approx(41 * us)
    assert b["idle_s"] == pytest.approx(8 * us)  # [32,40)
    assert b["hidden_fraction"] == pytest.approx(10 / 22)
    assert b["streams"] == {"comm": 2, "compute": 1}

    c = breakdown.analyze(SYNTHETIC["traceEvents"], dtod_as_comm=False)  # a bare event list works too
    assert c["compute_s"] == pytest.approx(23 * us) and c["comm_s"] == pytest.approx(20 * us)
    assert c["hidden_s"] == pytest.approx(10 * us) and c["idle_s"] == pytest.approx(8 * us)

    other = breakdown.analyze(SYNTHETIC, device=1)
    assert other["comm_s"] == pytest.approx(500 * us) and other["compute_s"] == 0.0


def test_breakdown_concurrent_comm_and_several_steps():
    """Communication of two streams at once (two copies' communicators, an all-reduce beside them) is
    measured; a trace of several ProfilerStep annotations is reported per iteration."""
    events = [
        _kernel("ncclDevKernel_SendRecv", 0, 20, 16),  # copy A  [0, 20)
        _kernel("ncclDevKernel_SendRecv", 10, 20, 20),  # copy B  [10, 30)
        _kernel("ncclDevKernel_AllReduce", 25, 10, 36),  # gradient all-reduce [25, 35)
        _kernel("ncclDevKernel_SendRecv", 40, 10, 16),  # copy A alone [40, 50)
        _kernel("sm90_gemm", 30, 20, 7),
    ]  # compute [30, 50)
    b = breakdown.analyze(events)
    us = 1e-6
    assert b["steps"] == 1 and b["concurrent_comm_s"] == pytest.approx(15 * us)  # [10, 20) + [25, 30)
    assert b["comm_s"] == pytest.approx(45 * us) and b["streams"]["comm"] == 3
    steps = [
        {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "ts": 0, "dur": 50, "tid": 1} for i in (1, 2)
    ]
    two = breakdown.analyze(events + steps)
    assert two["steps"] == 2 and two["concurrent_comm_s"] == pytest.approx(7.5 * us)
    assert two["span_s"] == pytest.approx(25 * us) and two["comm_s"] == pytest.approx(22.5 * us)
    row = breakdown.breakdown_rows([("r", b)])[0]
    assert len(row) == len(breakdown.BREAKDOWN_HEADERS) and row[-1] == breakdown.ms(15 * us)


def test_breakdown_cpu_fallback_and_cli(tmp_path):
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 0, "dur": 100, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "ts": 40, "dur": 20, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "ts": 10, "dur": 20, "tid": 1},
    ]
    b = breakdown.analyze(events)
    assert b["source"] == "cpu"
    assert b["comm_s"] == pytest.approx(20e-6) and b["compute_s"] == pytest.approx(80e-6)
    assert b["hidden_s"] == 0.0 and b["span_s"] == pytest.approx(100e-6)

    import gzip

    trace = tmp_path / "w2-ddp.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump(SYNTHETIC, f)
    doc = tmp_path / "benchmarks.md"
    assert breakdown.main([str(trace), "--doc", str(doc), "--json", str(tmp_path / "b.json")]) == 0
    saved = json.loads((tmp_path / "b.json").read_text())
    assert saved["w2-ddp"]["hidden_s"] == pytest.approx(10e-6)
    text = doc.read_text()
    assert "<!-- begin breakdown -->" in text and "| w2-ddp | 0.04 | 0.02 | 0.02 | 0.01 | 0.01 | 45 | 0.01 |" in text


def test_breakdown_rejects_a_non_trace(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"not": "a trace"}')
    with pytest.raises(ValueError, match="traceEvents"):
        breakdown.analyze(bad)
    with pytest.raises(ValueError, match="no device kernels"):
        breakdown.analyze([{"ph": "X", "cat": "python_function", "name": "f", "ts": 0, "dur": 1}])


_intervals = st.lists(st.tuples(st.integers(0, 100), st.integers(0, 30)).map(lambda t: (t[0], t[0] + t[1])), max_size=8)


@settings(max_examples=200, deadline=None)
@given(_intervals, _intervals)
def test_interval_algebra(a, b):
    # inclusion-exclusion: |A ∩ B| = |A| + |B| - |A ∪ B|; and |A \ B| = |A| - |A ∩ B|
    inter = breakdown.intersect_length(a, b)
    assert inter == breakdown.total_length(a) + breakdown.total_length(b) - breakdown.total_length(a + b)
    assert breakdown.total_length(breakdown.subtract(a, b)) == breakdown.total_length(a) - inter

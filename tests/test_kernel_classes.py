"""exp/kernel_classes.py: generated kernels' bytes read from inductor's code, grouped by class."""

import io
import json
import tarfile

import pytest

from exp import kernel_classes


def _module(kernels: dict[str, float], launched: list[str], bf16: bool = False) -> str:
    """A compiled graph's module as inductor writes it: each kernel with its bytes, then ``call``."""
    parts = []
    for name, gb in kernels.items():
        dtype = "tl.bfloat16" if bf16 else "tl.float32"
        parts.append(
            f"{name} = async_compile.triton('{name}', '''\n@triton_heuristics.pointwise(\n"
            f"    inductor_meta={{'kernel_name': '{name}', 'kernel_num_gb': {gb}}},\n)\n"
            f"def {name}(in_ptr0):\n    x = tl.load(in_ptr0).to({dtype})\n''', device_str='cuda')\n"
        )
    parts.append("def call(args):\n" + "".join(f"    {name}.run(buf0, stream=stream0)\n" for name in launched))
    return "\n".join(parts)


def _tgz(tmp_path, modules: dict[str, str]) -> str:
    path = tmp_path / "code.tgz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in modules.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def test_kernels_are_grouped_by_class_with_their_bytes(tmp_path, capsys):
    fwd = _module({"triton_poi_fused_add_0": 0.04, "triton_red_fused_sum_1": 0.02, "triton_per_fused_sum_2": 1e-4},
                  ["triton_poi_fused_add_0", "triton_red_fused_sum_1", "triton_per_fused_sum_2"])  # fmt: skip
    other = _module({"triton_poi_fused_add_0": 0.08}, ["triton_poi_fused_add_0"])  # same name, other bytes
    low = _module({"triton_poi_fused_cast_0": 0.01}, ["triton_poi_fused_cast_0"], bf16=True)
    unlaunched = _module({"triton_poi_fused_dead_9": 1.0}, [])
    code = _tgz(tmp_path, {"a/fwd.py": fwd, "b/other.py": other, "c/low.py": low, "d/dead.py": unlaunched})
    found = kernel_classes.kernel_bytes(code)
    assert found["tf32"]["triton_red_fused_sum_1"] == [0.02]
    assert sorted(found["tf32"]["triton_poi_fused_add_0"]) == [0.04, 0.08]
    assert found["bf16"]["triton_poi_fused_cast_0"] == [0.01] and "triton_poi_fused_dead_9" not in found["tf32"]

    def kernel(name, ms, calls, kind="generated"):
        return {"name": name, "ms": ms, "calls": calls, "kind": kind}

    run = {"precision": "tf32", "mode": "compile+graph", "kernels": {"per_kernel": [
        kernel("triton_red_fused_sum_1", 0.02, 2), kernel("triton_per_fused_sum_2", 0.01, 4),
        kernel("triton_poi_fused_add_0", 0.05, 2), kernel("sm90_gemm", 1.0, 3, "matmul")]}}  # fmt: skip
    by_class = kernel_classes.classes(run, found["tf32"])
    assert by_class["red"] == pytest.approx([0.02, 0.04, 2])  # 0.02 GB a call, twice a step
    assert by_class["tiny"] == pytest.approx([0.01, 4e-4, 4])  # under 4 MB a call: latency-bound
    assert by_class["mixed"][0] == pytest.approx(0.05) and "poi" not in by_class  # bytes not known
    runs = tmp_path / "rank.json"
    runs.write_text(json.dumps({"runs": [run, {"precision": "bf16", "mode": "compile+graph", "kernels": {}}]}))
    assert kernel_classes.main([str(runs), code]) == 0
    out = capsys.readouterr()
    red = next(line.split() for line in out.out.splitlines() if line.split()[0] == "red")
    assert red[1:7] == ["0.020", "ms", "0.040", "GB", "2000", "GB/s"] and "no per-kernel times" in out.err

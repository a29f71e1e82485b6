"""The rule example of docs/design.md ("Rules") does what the page says, in a fresh interpreter (a
registered rule is global): the op it declares traces with no fallback, and every signature it yields
passes the simulated-SPMD test, forward and backward, on 2 and 4 ranks."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHECK = textwrap.dedent("""
    import sys, warnings
    sys.path.insert(0, "tests")
    import torch
    from torch import nn
    from spmd import check_op
    from hidup.frontend.trace import FallbackWarning, trace

    class M(nn.Module):
        def forward(self, x):
            return torch.cummax(x, 1)[0].sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        graph = trace(M(), (torch.randn(4, 6),), world_size=2)
    assert graph.fallbacks == [], graph.fallbacks
    sigs = check_op(torch.ops.aten.cummax.default, (torch.randn(4, 6, 8, dtype=torch.float64), 1))
    print(sorted(str(s) for s in sigs[2]))
""")


def test_the_documented_rule_traces_and_passes_the_spmd_test():
    page = (ROOT / "docs" / "design.md").read_text()
    section = page[page.index("## Rules") :]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = subprocess.run([sys.executable, "-c", block + CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    sigs = out.stdout.strip()
    assert "gather_0" in sigs and "gather_2" in sigs and "gather_1" not in sigs, sigs  # never the scanned dim

"""The duplicated copies' runner (``hidup.codegen.duplicate.StagedCopies``) on its own, on a GPU: the
two copies' streams and where each copy's inputs are made.  End-to-end parity of duplicated plans
(gloo and NCCL) is in ``test_codegen.py``."""

from __future__ import annotations

import pytest
import torch


class _TwoStages(torch.nn.Module):
    def forward(self, x, y):
        return ((x * 2).relu() * y).sum()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the copies' CUDA streams)")
def test_staged_copies_make_each_copys_inputs_on_its_stream():
    """A global input's half is a new tensor; made on the calling stream, the backward would free it
    into that stream's pool while the copy stream still reads it (an overwritten label made
    nll_loss assert).  Each copy's inputs must be made on the copy's own stream."""
    from hidup.codegen.duplicate import StagedCopies, copy_inputs

    gm = torch.fx.symbolic_trace(_TwoStages())
    for node in gm.graph.nodes:
        node.meta["stage"] = 0 if node.op == "placeholder" or node.name in ("mul", "relu") else 1
    runner = StagedCopies(gm, torch.device("cuda"))
    assert runner.num_stages == 2
    x = torch.randn(8, 3, device="cuda", requires_grad=True)
    y = torch.randn(8, 3, device="cuda")
    seen = []

    def inputs_of(c):
        seen.append(torch.cuda.current_stream())
        return copy_inputs([x, y], [0, 0], [2, 2], c)  # blocks = 2: a gathered (new) half

    loss = runner(inputs_of, (None, None))
    loss.backward()
    assert seen == runner.streams
    torch.testing.assert_close(loss, ((x * 2).relu() * y).sum())
    torch.testing.assert_close(x.grad, 2 * (x > 0) * y)

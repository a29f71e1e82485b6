"""GraphedStep: one call = forward + backward with fresh gradients, eager on CPU, captured on CUDA."""

from __future__ import annotations

import pytest
import torch

import hidup.models
from hidup.codegen.graphs import GraphCaptureError, GraphedStep

TINY = dict(layers=2, d_model=32, heads=4, ffn=64, batch_per_gpu=2, vocab=64, seq_len=8)


def _reference(model, inputs):
    model.zero_grad(set_to_none=True)
    loss = model(*inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_step(model, inputs, step):
    ref_loss, ref_grads = _reference(model, inputs)
    for _ in range(2):  # a second call overwrites the gradients instead of adding to them
        model.zero_grad(set_to_none=True)  # harmless: the step re-attaches its gradients
        loss = step(*inputs)
        assert not loss.requires_grad
        torch.testing.assert_close(loss, ref_loss)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert grads.keys() == ref_grads.keys()
        for n, g in ref_grads.items():
            torch.testing.assert_close(grads[n], g, msg=n)


def test_eager_step_on_cpu_matches_forward_backward():
    model, inputs = hidup.models.build("bert-sgmoe", world_size=1, **TINY)
    step = GraphedStep(model, inputs)
    assert step.graph is None  # CPU: eager, same semantics
    _check_step(model, inputs, step)


def test_step_refuses_other_shapes_and_cpu_capture():
    model, inputs = hidup.models.build("mlp", world_size=1, **TINY)
    step = GraphedStep(model, inputs)
    bigger = tuple(torch.cat([x, x]) for x in inputs)
    with pytest.raises(ValueError, match="captured for shape"):
        step(*bigger)
    with pytest.raises(ValueError, match="inputs"):
        step(*inputs[:-1])
    with pytest.raises(GraphCaptureError, match="CUDA device"):
        GraphedStep(model, inputs, enabled=True)


def _graph_parity_rank(ctx):
    from hidup.runtime.verify import parity_report

    return parity_report(ctx, "bert-switch", TINY, style="searched", duplication=True, steps=2, cuda_graph=True)


def test_compiled_module_step_in_parity_world2():
    """The verify path with cuda_graph=True (eager on CPU) gives the single-device loss and gradients."""
    from torch.distributed.elastic.utils.distributed import get_free_port

    from hidup.runtime.launch import launch

    report = launch(
        _graph_parity_rank,
        nnodes=1,
        cpn=2,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=get_free_port(),
        backend="gloo",
        timeout_s=60,
    )[0]
    assert report["cuda_graph"] is False  # CPU: the eager path of the same object
    assert report["loss_rel"] <= 1e-5 and report["grad_rel"] <= 1e-5 and report["steps_rel"] <= 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["bert-sgmoe", "gpt"])
def test_captured_step_matches_eager_on_cuda(name):
    model, inputs = hidup.models.build(name, world_size=1, **TINY)
    model = model.cuda()
    inputs = tuple(x.cuda() for x in inputs)
    step = GraphedStep(model, inputs)
    assert step.graph is not None
    _check_step(model, inputs, step)


def _adam_run(model, inputs, step, steps):
    """Parameters after ``steps`` calls of ``step`` (which holds the optimizer)."""
    for _ in range(steps):
        step(*inputs)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_warmup_steps_leave_parameters_and_adam_state_as_found():
    """The snapshot taken before capture and written back after: parameters and state are restored
    in place (the graph keeps their addresses), state the warm-up created is zeroed (fresh Adam), so
    the run then continues exactly as one that never warmed up."""
    from hidup.codegen.graphs import fused_adam

    torch.manual_seed(0)  # mlp: every gradient well away from zero, where Adam's normalised update is stable
    model, inputs = hidup.models.build("mlp", world_size=1, **TINY)
    model = model.double()
    inputs = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    reference = _adam_run(model, inputs, GraphedStep(model, inputs, optimizer=torch.optim.Adam(model.parameters())), 3)

    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    opt = fused_adam(model.parameters(), 1e-3, torch.device("cpu"))
    step = GraphedStep(model, inputs, optimizer=opt)
    before = step._snapshot()
    addresses = [p.data_ptr() for p in model.parameters()]
    _adam_run(model, inputs, step, 2)  # what the warm-up and trial steps do
    step._restore(before)
    assert [p.data_ptr() for p in model.parameters()] == addresses
    for n, p in model.named_parameters():
        assert torch.equal(p, start[n]), n
    for st in opt.state.values():
        assert all(not torch.is_tensor(v) or not v.any() for v in st.values())
    after = _adam_run(model, inputs, step, 3)
    for n, p in after.items():  # fused vs foreach kernels: equal to rounding, in float64
        torch.testing.assert_close(p, reference[n], rtol=1e-12, atol=1e-12, msg=n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_step_with_fused_adam_matches_eager_on_cuda():
    from hidup.codegen.graphs import fused_adam

    model, inputs = hidup.models.build("gpt", world_size=1, **TINY)
    model = model.cuda()
    inputs = tuple(x.cuda() for x in inputs)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    eager = _adam_run(
        model,
        inputs,
        GraphedStep(model, inputs, enabled=False, optimizer=fused_adam(model.parameters(), 1e-3, "cuda")),
        4,
    )
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    step = GraphedStep(model, inputs, optimizer=fused_adam(model.parameters(), 1e-3, "cuda"), choose=True)
    graphed = _adam_run(model, inputs, step, 4)
    for n, p in graphed.items():
        torch.testing.assert_close(p, eager[n], msg=n)

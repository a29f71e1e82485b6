"""A subset of the exactness sweep (``exp/exactness.py``) in CI: families the other parity tests do not
build (Gemma-2's soft-capping, Gemma-3's sliding and full layers, Phi-3's fused projections, GPT-NeoX's
parallel residual and partial rotary) and OLMoE by all-to-all, each under a style the command line
offers, through ``verify``'s own report on two gloo ranks.  The whole sweep (every style, world 2 and
4, duplication on and off, eight families) runs with ``python -m exp.exactness``.

Tolerance: the ``transformers`` losses are computed in float32 (logits upcast) over the batch's
tokens, so loss and gradients carry float32 rounding of that sum: ``4 * tokens * eps_32``.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from dist_util import run_distributed

pytest.importorskip("transformers")

JOBS = [
    ("gemma2", "tensor", True),
    ("gemma3", "searched", True),
    ("phi3", "tensor", False),
    ("gpt_neox", "data", True),
    ("olmoe", "expert-all-to-all", True),
]


def _tolerance() -> float:
    from exp.exactness import BATCH, SEQ

    return 4 * BATCH * SEQ * torch.finfo(torch.float32).eps


def _rank(rank, world):
    from hidup.runtime.verify import parity_report

    warnings.simplefilter("ignore")
    ctx = types.SimpleNamespace(rank=rank, world_size=world, device=torch.device("cpu"))
    out = {}
    for model, style, dup in JOBS:
        report = parity_report(
            ctx, f"exp.exactness:{model}", {}, style=style, duplication=dup, profile="h200x4-nvlink",
            locate=_tolerance(),
        )  # fmt: skip
        if rank == 0:
            out[(model, style, dup)] = report
    return out


@pytest.fixture(scope="module")
def reports():
    return run_distributed(_rank, 2, timeout=900, pg_timeout=300)[0]


@pytest.mark.parametrize("model, style, dup", JOBS, ids=[f"{m}-{s}-{'dup' if d else 'nodup'}" for m, s, d in JOBS])
def test_family_matches_one_device(reports, model, style, dup):
    r = reports[(model, style, dup)]
    where = f"{model} {style} plan, duplication {dup}"
    assert r["duplication"] == dup, f"{where}: ran with duplication {r['duplication']}"
    assert r["loss_rel"] <= _tolerance(), f"{where}: loss rel diff {r['loss_rel']:.2e}"
    assert r["grad_rel"] <= _tolerance(), f"{where}: gradient rel diff {r['grad_rel']:.2e}; {r.get('first_mismatch')}"
    assert "first_mismatch" not in r

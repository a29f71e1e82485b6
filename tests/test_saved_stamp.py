"""The record of what autograd saves, stamped for a stamped stack's middle blocks (:mod:`hidup.frontend.saved_blocks`),
is the record a run of every block gives, item for item and in order -- and the whole export's.

Stacks of 8 blocks (copies 3 and 4 of block 2 stamped): a transformers Llama, the zoo GPT and the zoo
BERT-SGMoE (dense and MoE layers in turn, a period of 2), on a 2x2 mesh (the Llama on 4 ranks too),
under bf16 autocast and fp32.  A stack whose blocks hand a view of their input on to the next block (block
``k`` then touches block ``k-2``'s storage) is traced stamped but its record must not be: every
block runs.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hidup
import hidup.frontend.saved_blocks
from hidup.frontend.trace import trace_module
from test_trace_stamp import SIZE, _transformers

BLOCKS = 8


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


class Relay(nn.Module):
    """``(x, h) -> (x + tanh(lin(h * gain)), view of x)``: the view hands block ``k-1``'s storage to block
    ``k+1``, whose product with its gain saves it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.gain = nn.Parameter(torch.ones(16))

    def forward(self, x, h):
        return x + torch.tanh(self.lin(h * self.gain)), x.view(x.shape)


class RelayStack(nn.Module):
    def __init__(self, blocks: int):
        super().__init__()
        self.layers = nn.ModuleList(Relay() for _ in range(blocks))
        self.head = nn.Linear(16, 4)

    def forward(self, x, y):
        h = x * 2.0
        for layer in self.layers:
            x, h = layer(x, h)
        return F.cross_entropy(self.head(x + h), y)


BUILDERS = {
    "llama": lambda: _transformers("llama", BLOCKS),
    "gpt": lambda: hidup.models.build("gpt", world_size=4, layers=BLOCKS, **SIZE),
    "bert-sgmoe": lambda: hidup.models.build("bert-sgmoe", world_size=4, layers=2 * BLOCKS, **SIZE),
    "relay": lambda: (RelayStack(BLOCKS), (torch.randn(8, 16), torch.randint(0, 4, (8,)))),
}


@pytest.fixture
def decisions(monkeypatch):
    """Whether each record made while the test runs stamped its blocks (one entry per record)."""
    made = []
    real = hidup.frontend.saved_blocks.BlockStamper._decide

    def decide(self):
        made.append(real(self))
        return made[-1]

    monkeypatch.setattr(hidup.frontend.saved_blocks.BlockStamper, "_decide", decide)
    return made


def _records(recorder, precision: str):
    """(stamped record, the record of every block run) of one recorder."""
    stamped = recorder._run(precision)
    blocks, recorder.blocks = recorder.blocks, []
    try:
        every = recorder._run(precision)
    finally:
        recorder.blocks = blocks
    return stamped, every


CASES = [("llama", None), ("llama", (2, 2)), ("gpt", (2, 2)), ("bert-sgmoe", (2, 2)), ("relay", None)]


@pytest.mark.parametrize("name, mesh", CASES, ids=[f"{n}-{'mesh2x2' if m else 'world4'}" for n, m in CASES])
def test_stamped_record_is_the_record_of_every_block(name, mesh, decisions):
    model, inputs = BUILDERS[name]()
    stamped_trace = _quiet(trace_module, model, inputs, 4, mesh=mesh, stamp_layers=True)
    whole_trace = _quiet(trace_module, model, inputs, 4, mesh=mesh, stamp_layers=False)
    recorder = stamped_trace.graph.autograd_saved
    assert len(recorder.blocks) == BLOCKS - 3, "the stack was not stamped"
    for precision in ("bf16", "fp32"):
        decisions.clear()
        stamped, every = _records(recorder, precision)
        assert decisions == [name != "relay"]  # the relay's blocks touch the block before the last
        assert sum(len(items) for items in stamped.saved.values()) > 3 * BLOCKS
        assert repr(stamped) == repr(every)
        assert repr(stamped) == repr(whole_trace.graph.autograd_saved._run(precision))


def test_stamped_record_prices_plans_alike(decisions):
    """The memory model reads the stamped record as it reads the whole trace's: the same plan, memory
    and prediction under a budget that binds."""
    model, inputs = BUILDERS["llama"]()
    stamped_trace = _quiet(trace_module, model, inputs, 4, stamp_layers=True)
    whole_trace = _quiet(trace_module, model, inputs, 4, stamp_layers=False)
    free = _quiet(hidup.search, whole_trace.graph, "h200x4-nvlink", precision="bf16", duplication=False)
    budget = 0.9 * free.memory["total"]
    plans = [
        _quiet(hidup.search, t.graph, "h200x4-nvlink", precision="bf16", duplication=False, memory_budget=budget)
        for t in (stamped_trace, whole_trace)
    ]
    assert True in decisions
    assert plans[0].to_dict() == plans[1].to_dict()

"""Parallel branches are not depth: a branch beside a chain, both read by one head, is fitted
apart from the chain (`DepthProfile.follows`), so a healthy two-branch model is not told of
vanishing gradients, while a chain that does lose its gradient still is."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchscope.findings import Severity
from torchscope.grads import gradient_flow
from torchscope.grads.analyze import depth_profile, find_vanishing

# Norms by eager `vector_norm` and by the fused kernel: the links compare norms read apart.
pytestmark = pytest.mark.usefixtures("reduction_path")


class _TwoBranches(nn.Module):
    """An embedding feeds an RNN -> LSTM -> GRU stack and, beside it, an RNNCell looped in
    Python; the head reads the last step of both. Autograd runs the cell (built last in the
    forward) between the head and the stack."""

    def __init__(self, cell: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.rnn = nn.RNN(8, 8, batch_first=True)
        self.lstm = nn.LSTM(8, 8, num_layers=2, batch_first=True, bidirectional=True)
        self.gru = nn.GRU(16, 8, batch_first=True)
        self.cell = nn.RNNCell(8, 8)
        self.head = nn.Linear(16, 5)
        self.use_cell = cell

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.emb(ids)
        o, _ = self.rnn(e)
        o, _ = self.lstm(o)
        o, _ = self.gru(o)
        hc = torch.zeros(e.shape[0], 8)
        if self.use_cell:
            for t in range(e.shape[1]):
                hc = self.cell(e[:, t], hc)
        return self.head(torch.cat([o[:, -1], hc], -1))


class _SigmoidChain(nn.Module):
    """Six sigmoid layers in a chain (no repeated block), and optionally an RNNCell branch
    beside them into the same head."""

    def __init__(self, cell: bool) -> None:
        super().__init__()
        self.fc_a, self.fc_b, self.fc_c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.fc_d, self.fc_e, self.fc_f = (nn.Linear(16, 16), nn.Linear(16, 16),
                                           nn.Linear(16, 16))
        self.act = nn.Sigmoid()
        self.cell = nn.RNNCell(8, 8) if cell else None
        self.head = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x[:, -1]
        for fc in (self.fc_a, self.fc_b, self.fc_c, self.fc_d, self.fc_e, self.fc_f):
            h = self.act(fc(h))
        hc = torch.zeros(x.shape[0], 8)
        if self.cell is not None:
            for t in range(x.shape[1]):
                hc = self.cell(x[:, t], hc)
        return self.head(torch.cat([h, hc], -1))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_healthy_branch_beside_an_rnn_stack_is_no_layer_of_depth(seed: int) -> None:
    torch.manual_seed(seed)
    model = _TwoBranches().train()
    flow = gradient_flow(model, torch.randint(0, 20, (3, 7)), loss_fn="sum")
    prof = depth_profile(flow)
    # The cell and the GRU are both fed by the head's input gradient (a torch.cat): two
    # branches, not two depths; the stack's own links come from its input gradients.
    assert dict(prof.follows) == {"cell": None, "gru": None, "lstm": "gru", "rnn": "lstm"}
    assert [[u.name for u in s] for s in prof.stacks] == [["cell"], ["gru", "lstm", "rnn"]]
    found = [f for f in flow.findings() if f.code == "grads.vanishing"]
    assert all(f.severity < Severity.WARNING for f in found), found
    # With the cell's branch or without it, the stack reads the same.
    torch.manual_seed(seed)
    alone = gradient_flow(_TwoBranches(cell=False).train(), torch.randint(0, 20, (3, 7)),
                          loss_fn="sum")
    assert [(f.severity, f.summary) for f in find_vanishing(alone)] == \
        [(f.severity, f.summary) for f in find_vanishing(flow)]


@pytest.mark.parametrize("cell", [False, True])
def test_a_vanishing_chain_is_told_with_a_branch_beside_it_or_without(cell: bool) -> None:
    torch.manual_seed(0)
    flow = gradient_flow(_SigmoidChain(cell).train(), torch.randn(4, 5, 8), loss_fn="sum")
    (f,) = [f for f in flow.findings() if f.code == "grads.vanishing"]
    assert f.severity >= Severity.WARNING, f
    assert f.evidence["farthest"] == "fc_a" and f.evidence["positions"] >= 4
    assert f.evidence["nearest"] in ("fc_e", "fc_f")
    if cell:
        stacks = [[u.name for u in s] for s in depth_profile(flow).stacks]
        assert ["cell"] in stacks and not any("cell" in s and len(s) > 1 for s in stacks)

"""Small models and data for the run-monitor tests."""

from __future__ import annotations

import torch
from torch import nn


class Gated(nn.Module):
    """fc1's contribution goes through a gate `g`; a skip path keeps fc2's input alive, so
    fc1's gradient (∝ g) can fall while the others' do not."""

    def __init__(self) -> None:
        super().__init__()
        self.skip = nn.Linear(8, 16)
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.Tanh()
        self.gate = nn.Parameter(torch.ones(()))
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.skip(x) + self.gate * self.act(self.fc1(x))  # (B, 16)
        out: torch.Tensor = self.fc2(h)  # (B, 2)
        return out


class Log(nn.Module):
    """log(x): NaN for negative inputs (the fault a shifted input produces)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class Faulty(nn.Module):
    """fc1 → ReLU → `bad` (log of its input + shift) → fc2; NaN once `shift` goes negative."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.relu = nn.ReLU()
        self.bad = Log()
        self.fc2 = nn.Linear(16, 2)
        self.shift = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bad(self.relu(self.fc1(x)) + self.shift)  # (B, 16)
        out: torch.Tensor = self.fc2(h)
        return out


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))


def batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` seeded (x (8, 8), y (8, 2)) batches."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)) for _ in range(n)]

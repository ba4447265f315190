"""TARGET factories for the compile tests; the child process rebuilds models from here."""

from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn


class CrashNet(nn.Module):
    """Kills its own process with SIGSEGV on the first forward, as a broken kernel would."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        os.kill(os.getpid(), signal.SIGSEGV)
        return self.fc(x)


def crash() -> tuple[nn.Module, torch.Tensor]:
    return CrashNet(), torch.randn(2, 4)


class PrintNet(nn.Module):
    """One graph break: a print() in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        print("debug: after fc")
        return x.relu()


def prints() -> tuple[nn.Module, torch.Tensor]:
    return PrintNet(), torch.randn(2, 4)


class DisabledNet(nn.Module):
    """A forward Dynamo never compiles (torch.compiler.disable): no graph at all."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(x).relu()  # (B, 4)
        return out


def disabled() -> tuple[nn.Module, torch.Tensor]:
    return DisabledNet(), torch.randn(2, 4)


class SlowNet(nn.Module):
    """Half a second per forward, eager or compiled: a measurement still running when the
    test stops its parent."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.5)
        out: torch.Tensor = self.fc(x)  # (B, 4)
        return out


def slow() -> tuple[nn.Module, torch.Tensor]:
    return SlowNet(), torch.randn(2, 4)

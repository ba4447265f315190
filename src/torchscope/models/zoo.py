"""Built-in models, each with a default example input: the lesson's models and a benchmark net."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


class TinyCNN(nn.Module):
    """The lesson's CNN: conv1 3→8 3x3 → ReLU → conv2 8→16 3x3 → pool → fc → 10."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 16, 3)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.conv1(x))  # (B, 8, H-2, W-2)
        x = self.pool(self.conv2(x))  # (B, 16, 1, 1)
        out: torch.Tensor = self.fc(torch.flatten(x, 1))  # (B, classes)
        return out


class MLP(nn.Module):
    """The lesson's 2-layer MLP, 128 → 256 → 10."""

    def __init__(self, d_in: int = 128, d_hidden: int = 256, d_out: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.relu(self.fc1(x)))  # (B, d_in) -> (B, d_out)
        return out


class DeepMLP(nn.Sequential):
    """The lesson's 8-block network: `blocks` × [Linear(width, width) + ReLU]."""

    def __init__(self, width: int = 64, blocks: int = 8) -> None:
        super().__init__(
            *[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks)]
        )


class _ResBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.relu(self.bn(self.conv(x)))  # (B, C, H, W)
        return out


class ResNetMini(nn.Module):
    """A small ResNet-like net for benchmarks: a stem, `blocks` residual conv+BN+ReLU blocks."""

    def __init__(self, channels: int = 64, blocks: int = 8, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()
        )
        self.blocks = nn.Sequential(*[_ResBlock(channels) for _ in range(blocks)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))  # (B, C, H, W)
        out: torch.Tensor = self.fc(torch.flatten(self.pool(x), 1))  # (B, classes)
        return out


@dataclass(frozen=True)
class BuiltinModel:
    """A built-in model: its factory, its default input shape, and what it is for."""

    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    description: str

    def example_input(self, seed: int = 0) -> torch.Tensor:
        """A seeded random batch of the default shape."""
        g = torch.Generator().manual_seed(seed)
        return torch.randn(self.input_shape, generator=g)


BUILTINS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel("tiny-cnn", TinyCNN, (32, 3, 32, 32), "the lesson's CNN (conv1, conv2, fc)"),
        BuiltinModel("mlp", MLP, (64, 128), "the lesson's 2-layer MLP, 128→256→10"),
        BuiltinModel("deep-mlp", DeepMLP, (32, 64), "8 × [Linear(64,64) + ReLU]"),
        BuiltinModel("resnet-mini", ResNetMini, (16, 3, 64, 64), "8 residual blocks at 64 ch"),
    )
}

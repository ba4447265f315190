"""Activation-capture overhead on resnet-mini: bare training step vs stats capture vs peers.

Run: .venv/bin/python benchmarks/capture_overhead.py
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from torch.nn import functional

sys.path.insert(0, str(Path(__file__).parent))
from _timing import interleaved_medians, print_ratios

from torchscope.capture import capture_activations, watch_activations
from torchscope.models import ResNetMini


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = ResNetMini()
    x = torch.randn(16, 3, 64, 64)
    y = torch.randint(0, 10, (16,))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        functional.cross_entropy(model(x), y).backward()

    def hand_written() -> None:
        # What users write by hand: five .item() stats per leaf module, a host sync each.
        stats: list[tuple[float, ...]] = []

        def hook(_m: torch.nn.Module, _i: object, o: torch.Tensor) -> None:
            d = o.detach()
            stats.append((d.mean().item(), d.std().item(), d.min().item(), d.max().item(),
                          d.norm().item()))

        hs = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
        try:
            step()
        finally:
            for h in hs:
                h.remove()

    def with_torchscope(counts: bool = True) -> None:
        with watch_activations(model, count_nonfinite=counts) as acts:
            step()
        assert acts.records

    runs = {"bare training step": step,
            "torchscope stats, exact NaN/Inf counts": with_torchscope,
            "torchscope stats, finiteness only": lambda: with_torchscope(False),
            "hand-written 5-stat .item() hooks": hand_written}
    medians = interleaved_medians(runs, repeats=7, warmup=2)
    print_ratios("resnet-mini, batch 16x3x64x64, forward+backward, 2 threads", medians,
                 "bare training step")

    peers: dict[str, object] = {}
    if importlib.util.find_spec("torchinfo"):
        import torchinfo

        def fwd() -> None:
            with torch.no_grad():
                model(x)

        def info() -> None:
            torchinfo.summary(model, input_data=x, verbose=0)

        def ts_fwd() -> None:
            capture_activations(model, x)

        peers = interleaved_medians({"bare forward": fwd, "torchscope capture_activations": ts_fwd,
                                     "torchinfo.summary": info}, repeats=5, warmup=1)
        print_ratios("forward only (no_grad)", peers, "bare forward")  # type: ignore[arg-type]
    if importlib.util.find_spec("torchlens"):
        print("torchlens is installed but not run here; add it to compare.")
    else:
        print("torchlens not installed: skipped.")


if __name__ == "__main__":
    main()

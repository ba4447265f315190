"""Issue 12, defects 5 and 6: the profiler overhead knows its noise, and host syncs are
warned about only where there is a device to wait for."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from torchscope._timing import compare, fmt_ratio
from torchscope.findings import Severity, Subject
from torchscope.profiling import ProfileResult, profile_steps
from torchscope.report.profiling import timing_line


class _Reads(nn.Module):
    """Reads a value to Python in every forward, as transformers' mask code does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 2.0 if x.abs().max().item() > 100 else 1.0  # one host read per call
        return self.fc(x) * scale  # (B, 4)


def _codes(result: ProfileResult) -> dict[str, Severity]:
    return {f.code: f.severity for f in result.findings()}


def test_item_on_cpu_is_a_host_read_not_a_sync_warning() -> None:
    result = profile_steps(_Reads(), torch.randn(8, 16), steps=2, baseline_steps=0)
    assert result.device == "cpu"
    assert result.calls("aten::_local_scalar_dense") == 2  # torch saw the reads
    codes = _codes(result)
    assert "profiling.host_sync" not in codes
    assert codes["profiling.host_read"] == Severity.INFO
    read = next(f for f in result.findings() if f.code == "profiling.host_read")
    assert "1 time(s) per step" in read.summary and read.evidence["device"] == "cpu"


def test_a_healthy_cpu_step_has_no_host_finding() -> None:
    result = profile_steps(nn.Linear(16, 4), torch.randn(8, 16), steps=2, baseline_steps=0)
    assert not {"profiling.host_sync", "profiling.host_read"} & set(_codes(result))


def test_gpt2_mask_code_on_cpu_raises_no_sync_warning() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32)
    model = GPT2LMHeadModel(cfg).train()
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :3] = 0  # padding: transformers checks the mask with .item()
    inputs = {"input_ids": torch.randint(0, 100, (2, 16)), "attention_mask": mask}
    result = profile_steps(model, inputs, steps=2, baseline_steps=0, by_module=False)
    assert result.calls("aten::_local_scalar_dense") > 0
    assert all(f.severity == Severity.INFO for f in result.findings()
               if f.code.startswith("profiling.host"))
    assert "profiling.host_sync" not in _codes(result)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_item_on_cuda_is_a_host_sync_warning() -> None:
    model = _Reads().cuda()
    result = profile_steps(model, torch.randn(8, 16, device="cuda"), steps=2,
                           baseline_steps=0)
    assert result.device == "cuda"
    assert _codes(result)["profiling.host_sync"] == Severity.WARNING
    assert "profiling.host_read" not in _codes(result)
    sync = next(f for f in result.findings() if f.code == "profiling.host_sync")
    assert "1 time(s) per step" in sync.summary  # one .item(), counted once
    # The watch's own waits at step boundaries were recorded too, and left out.
    assert result.calls("torchscope::step_sync") >= 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_healthy_cuda_step_has_no_host_finding() -> None:
    """The profiler records torchscope's own device waits at step boundaries; they are no
    sync of the user's step."""
    result = profile_steps(nn.Linear(16, 4).cuda(), torch.randn(8, 16, device="cuda"),
                           steps=2, baseline_steps=0)
    assert result.calls("cudaDeviceSynchronize") >= 2
    assert not {"profiling.host_sync", "profiling.host_read"} & set(_codes(result))


def test_the_overhead_carries_its_interval() -> None:
    result = profile_steps(nn.Linear(16, 4), torch.randn(8, 16), steps=3)
    t = result.timing
    r = t.overhead_ratio
    assert r is not None and r.n_a == t.profiled_steps == 3
    assert r.n_b == t.baseline_steps >= 3  # repeated until the spread is known
    assert len(t.profiled_samples) == 3 and sum(t.profiled_samples) == pytest.approx(
        t.profiled_total_ms)
    assert t.overhead is not None and r.value == pytest.approx(t.overhead)
    assert r.low <= r.value <= r.high
    line = timing_line(result)
    if r.above:
        # As `fmt_ratio` writes it: a third digit where a bound lies near 1.
        assert f"{fmt_ratio(r)} overhead" in line
    else:
        assert "no measurable profiler overhead" in line
    # An explicit count is kept exactly (a step that fails is then inside the window).
    exact = profile_steps(nn.Linear(16, 4), torch.randn(8, 16), steps=2, baseline_steps=2)
    assert exact.timing.baseline_steps == 2


def _with_overhead(result: ProfileResult, profiled: list[float],
                   baseline: list[float]) -> ProfileResult:
    timing = replace(result.timing, baseline_ms=sorted(baseline)[len(baseline) // 2],
                     profiled_ms=sorted(profiled)[len(profiled) // 2],
                     overhead_ratio=compare(profiled, baseline))
    return replace(result, timing=timing)


def test_an_overhead_below_one_or_inside_the_noise_is_none() -> None:
    base = profile_steps(nn.Linear(16, 4), torch.randn(8, 16), steps=2, baseline_steps=0)
    # The "0.55× profiler overhead": the profiled steps ran faster.
    faster = _with_overhead(base, [5.5, 5.4, 5.6, 5.5, 5.45], [10.0, 10.1, 9.9, 10.0, 10.2])
    line = timing_line(faster)
    assert "no measurable profiler overhead" in line and "0.55× (" not in line
    assert "profiling.overhead" not in _codes(faster)
    # A median of 2× above the 1.5× threshold, but inside the noise: no finding.
    noisy = _with_overhead(base, [20.0, 2.0, 40.0, 21.0, 3.0], [10.0, 30.0, 1.0, 10.5, 2.0])
    assert noisy.timing.overhead is not None and noisy.timing.overhead > 1.5
    assert noisy.timing.overhead_ratio is not None
    assert not noisy.timing.overhead_ratio.measurable
    assert "profiling.overhead" not in _codes(noisy)
    assert "no measurable profiler overhead" in timing_line(noisy)
    # A clear 2× slowdown is told, with its interval: as a caveat about the measurement
    # (info, ranked after every finding about the user's work), never as a warning ("make
    # demo" led with "steps ran 7.36× (1.66–11.32) slower under the profiler").
    slow = _with_overhead(base, [20.0, 20.2, 19.9, 20.1, 20.0], [10.0, 10.1, 9.9, 10.0, 10.2])
    assert _codes(slow)["profiling.overhead"] == Severity.INFO
    finding = next(f for f in slow.findings() if f.code == "profiling.overhead")
    assert finding.subject is Subject.MEASUREMENT
    assert slow.findings()[-1].subject is Subject.MEASUREMENT
    assert "2.00× (1.95–2.04)" in finding.summary
    assert "2.00× (1.95–2.04) overhead" in timing_line(slow)

"""Which tensor reads of a step wait for the device: read from the profiler's event tree,
so that Adam's `.item()` on its host-side step counters is no synchronisation on a GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.autograd.profiler_util import EventList, FunctionEvent

from torchscope.findings import Severity
from torchscope.profiling import profile_steps, watch_time
from torchscope.profiling.records import HostReads, ProfileResult
from torchscope.profiling.syncs import host_reads


def _tree(spans: list[tuple[str, int, int]]) -> EventList:
    """Events of one host thread, nested by their time ranges as torch nests them."""
    events = EventList([FunctionEvent(i, name, thread=1, start_us=a, end_us=b)
                        for i, (name, a, b) in enumerate(spans)])
    events._build_tree()
    return events


# What a CUDA step's trace holds: a read of a device tensor (a copy and a stream wait
# inside it), AdamW's read of its host-side step counter, a `.cpu()` copy, and a read the
# dataset makes inside the DataLoader's `__next__`.
_CUDA_STEP = [
    ("aten::item", 0, 100), ("aten::_local_scalar_dense", 5, 95),
    ("cudaMemcpyAsync", 10, 20), ("cudaStreamSynchronize", 20, 90),
    ("Optimizer.step#AdamW.step", 200, 400), ("aten::item", 210, 230),
    ("aten::_local_scalar_dense", 211, 229),
    ("aten::to", 500, 600), ("aten::_to_copy", 501, 599), ("aten::copy_", 502, 598),
    ("cudaMemcpyAsync", 510, 520), ("cudaStreamSynchronize", 520, 590),
    ("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 700, 800),
    ("aten::_local_scalar_dense", 710, 720),
]


def test_reads_of_device_tensors_are_told_from_reads_of_host_ones() -> None:
    assert host_reads(_tree(_CUDA_STEP)) == HostReads(reads=2, device=1, waits=1,
                                                      linked=True, optimizer=1)
    adam_only = host_reads(_tree(_CUDA_STEP[4:7]))
    assert adam_only == HostReads(reads=1, device=0, waits=0, linked=False, optimizer=1)
    # A read in a step range of an optimizer that is not torch.optim's is not told apart.
    mine = [("Optimizer.step#MyOpt.step", 200, 400), *_CUDA_STEP[5:7]]
    assert host_reads(_tree(mine)).optimizer == 0


def _adam_steps(device: torch.device) -> tuple[ProfileResult, ProfileResult]:
    """Three profiled AdamW steps of a 4-parameter MLP on `device`: without and with a
    `loss.item()` a step."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(8, 16, device=device)
    results = []
    for read in (False, True):
        with watch_time(model, optimizer=opt, steps=3) as w:
            for _ in range(5):
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                if read:
                    loss.item()
        assert w.result is not None
        results.append(w.result)
    return results[0], results[1]


def test_adam_s_step_counters_are_no_host_read_on_cpu() -> None:
    """torch.optim's AdamW reads each parameter's step counter with `.item()` on every step,
    on a GPU too, where the counters stay on the host: 39 reads a step on a 4-layer Llama
    read as an info to look at. A `loss.item()` of the step still is one."""
    quiet, loud = _adam_steps(torch.device("cpu"))
    assert quiet.host_reads is not None
    assert quiet.host_reads.reads == quiet.host_reads.optimizer == 3 * 4  # 4 parameters
    assert "profiling.host_read" not in {f.code for f in quiet.findings()}
    [read] = [f for f in loud.findings() if f.code == "profiling.host_read"]
    assert read.summary.startswith("the step reads tensor values to Python 1 time(s)")


def _read_step() -> ProfileResult:
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)

    def train_step() -> None:
        loss = model(x).sum()
        loss.backward()
        loss.item()  # one read per step

    return profile_steps(train_step, steps=2, baseline_steps=0)


def test_on_a_gpu_only_reads_that_wait_are_a_warning() -> None:
    result = _read_step()
    assert result.host_reads == HostReads(reads=2, device=0, waits=0, linked=False)
    (info,) = [f for f in result.findings() if f.code.startswith("profiling.host_")]
    assert info.code == "profiling.host_read" and info.evidence["calls"] == 2
    # The same op table as a GPU step would give, with what its event tree would say.
    waited = replace(result, device="cuda",
                     host_reads=HostReads(reads=2, device=2, waits=0, linked=True))
    (warn,) = [f for f in waited.findings() if f.code.startswith("profiling.host_")]
    assert warn.code == "profiling.host_sync" and warn.severity == Severity.WARNING
    assert warn.evidence["calls"] == 2
    adam = replace(result, device="cuda",
                   host_reads=HostReads(reads=2, device=0, waits=0, linked=True))
    assert not [f for f in adam.findings() if f.code.startswith("profiling.host_")]
    unlinked = replace(result, device="cuda",
                       host_reads=HostReads(reads=2, device=0, waits=0, linked=False))
    assert [f.code for f in unlinked.findings() if f.code.startswith("profiling.host_")] \
        == ["profiling.host_sync"]  # cannot be told: every read counts, as before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_adam_on_cuda_is_no_synchronisation_and_a_loss_item_is() -> None:
    quiet, loud = _adam_steps(torch.device("cuda"))
    assert quiet.host_reads is not None and quiet.host_reads.reads > 0  # AdamW's counters
    assert "profiling.host_sync" not in {f.code for f in quiet.findings()}
    sync = [f for f in loud.findings() if f.code == "profiling.host_sync"]
    assert sync and sync[0].evidence["calls"] == 3


# A GradScaler's step on CUDA: its unscale op, then `GradScaler.step`'s read of found_inf
# (a device tensor) just before the optimizer's step, then its scale update.
_READ_AT = [("aten::item", 0, 100), ("aten::_local_scalar_dense", 5, 95),
            ("cudaMemcpyAsync", 10, 20), ("cudaStreamSynchronize", 20, 90)]


def _read(at: int) -> list[tuple[str, int, int]]:
    return [(name, a + at, b + at) for name, a, b in _READ_AT]


_SCALER_STEP = [("aten::_amp_foreach_non_finite_check_and_unscale_", 0, 50), *_read(100),
                ("Optimizer.step#SGD.step", 300, 400), ("aten::_amp_update_scale_", 500, 510)]


def test_a_grad_scaler_s_inf_check_is_told_from_the_loop_s_reads() -> None:
    assert host_reads(_tree(_SCALER_STEP)) == HostReads(reads=1, device=1, waits=0,
                                                        linked=True, scaler=1)
    # A step the scaler skipped: the read, then the update, no optimizer step.
    skipped = [_SCALER_STEP[0], *_read(100), ("aten::_amp_update_scale_", 500, 510)]
    assert host_reads(_tree(skipped)).scaler == 1
    # The loop's own read of the loss before the backward is not the scaler's; of two reads
    # after the unscale (a clipped norm's `.item()`, then found_inf) the last one is.
    loop = [*_read(-1000), *_SCALER_STEP[:1], *_read(60), *_read(200),
            ("Optimizer.step#SGD.step", 300, 400)]
    assert host_reads(_tree(loop)) == HostReads(reads=3, device=3, waits=0, linked=True,
                                                scaler=1)
    # A fused optimizer takes found_inf on the device: a read before its step is the loop's.
    fused = [*_SCALER_STEP[:1], *_read(100), ("Optimizer.step#AdamW.step", 300, 400),
             ("aten::_fused_adamw_", 310, 390)]
    assert host_reads(_tree(fused)).scaler == 0


def _scaled_steps(*, read: bool, fused: bool = False) -> ProfileResult:
    """Three profiled float16 autocast steps with a GradScaler (and a `loss.item()` each)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True) if fused else \
        torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(8, 16)
    with watch_time(model, optimizer=opt, steps=3) as w:
        for _ in range(5):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if read:
                loss.item()
    assert w.result is not None
    return w.result


def test_a_grad_scaler_s_read_is_no_host_read_and_on_a_gpu_an_info_of_its_own() -> None:
    """`GradScaler.step` reads found_inf once a step: the doctor's own fp16 step read as
    a host read of the user's step, and on a GPU as a warning to drop `.item()`."""
    quiet = _scaled_steps(read=False)
    assert quiet.host_reads is not None and quiet.host_reads.scaler == 3
    assert not [f for f in quiet.findings() if f.code.startswith("profiling.host_")]
    [read] = [f for f in _scaled_steps(read=True).findings()
              if f.code == "profiling.host_read"]
    assert read.evidence["calls"] == 3  # the loss's reads only
    # The same op table as a GPU step would give, found_inf being a device tensor there.
    gpu = replace(quiet, device="cuda",
                  host_reads=HostReads(reads=3, device=3, waits=0, linked=True, scaler=3))
    codes = [f.code for f in gpu.findings() if f.code.startswith(("profiling.host_",
                                                                    "profiling.scaler"))]
    assert codes == ["profiling.scaler_sync"]
    [info] = [f for f in gpu.findings() if f.code == "profiling.scaler_sync"]
    assert info.severity == Severity.INFO and "fused=True" in info.fix
    # A fused optimizer: GradScaler.step reads nothing.
    fused = _scaled_steps(read=False, fused=True)
    assert fused.host_reads is not None and fused.host_reads.scaler == 0
    assert not [f for f in fused.findings() if f.code.startswith("profiling.host_")]

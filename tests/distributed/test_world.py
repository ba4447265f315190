"""The distributed package in one process: reading the job, joining results, timeouts, trace
names, collective names; and hooks that see through a DDP wrapper, on a real one-rank gloo
group (DDP needs a process group; one rank is enough to wrap and train)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torchscope
from torchscope.distributed import (
    TIMEOUT_ENV,
    DistributedError,
    Ranked,
    World,
    gather,
    merge_findings,
    strategy_of,
    timeout_s,
    world,
)
from torchscope.findings import Finding, Severity
from torchscope.hooks import parallel_wrapper, unwrap_parallel
from torchscope.profiling.comm import comm_kind
from torchscope.profiling.trace import rank_trace_path


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_one_process_is_a_world_of_one() -> None:
    assert world() == World() and not world().distributed
    assert world().describe() == "one process"
    assert strategy_of(_net()) == "none"
    flow = torchscope.gradient_flow(_net(), torch.randn(3, 4), loss_fn="sum")
    joined = flow.gather()
    assert isinstance(joined, Ranked) and joined.results == (flow,) and flow.ranks is None
    assert [f.code for f in joined.findings()] == [f.code for f in flow.findings()]


def test_ddp_wrapper_is_seen_through(one_rank: None) -> None:
    net = _net()
    model = DDP(net)
    assert world() == World(0, 1, "gloo", 0)
    assert strategy_of(model) == "ddp" and strategy_of(net) == "none"
    assert parallel_wrapper(model) is model and unwrap_parallel(model) is net
    assert unwrap_parallel(net) is net
    x = torch.randn(3, 4)
    with torchscope.watch_activations(model) as acts:
        model(x)
    assert [r.module for r in acts.records] == ["0", "1", "2"]  # not "module.0"
    flow = torchscope.gradient_flow(model, x, loss_fn="sum")
    # One rank has nothing to exchange: no rank part, and the norms are torch's .grad.
    assert flow.ranks is None
    assert [p.name for p in flow.params] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for i, p in enumerate(net.parameters()):
        assert flow.params[i].norm == pytest.approx(p.grad.norm().item(), rel=1e-6)
    assert torchscope.audit_hooks(model).local_total == 0


def test_merge_findings_says_once_what_every_rank_says() -> None:
    a = Finding("x.same", Severity.INFO, "on all", module="fc")
    b = Finding("x.one", Severity.WARNING, "only here", module="fc")
    merged = merge_findings([[a], [a, b]])
    assert [(f.code, f.summary, f.evidence["ranks"]) for f in merged] == [
        ("x.same", "on all", "all"), ("x.one", "on rank 1: only here", "1")]


def test_gather_in_one_process_needs_no_group() -> None:
    joined = gather({"a": 1})
    assert joined is not None and joined.results == ({"a": 1},) and len(joined) == 1


def test_timeout_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert timeout_s() == 120.0 and timeout_s(3) == 3.0
    monkeypatch.setenv(TIMEOUT_ENV, "7.5")
    assert timeout_s() == 7.5
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(DistributedError, match="TORCHSCOPE_TIMEOUT_S='soon'"):
        timeout_s()


def test_rank_trace_paths_share_one_folder() -> None:
    assert rank_trace_path("t/step.json.gz", 1) == Path("t/step.rank1.json.gz")
    assert rank_trace_path("t/step.json", 0) == Path("t/step.rank0.json")
    assert rank_trace_path("traces", 3) == Path("traces/rank3.json.gz")


@pytest.mark.parametrize(("name", "kind"), [
    ("c10d::allreduce_", "all_reduce"), ("c10d::_reduce_scatter_base_", "reduce_scatter"),
    ("c10d::_allgather_base_", "all_gather"), ("gloo:all_gather", "all_gather"),
    ("nccl:all_reduce", "all_reduce"), ("ncclDevKernel_AllGather_RING_LL", "all_gather"),
    ("c10d::broadcast_", "broadcast"), ("aten::mm", None), ("FSDP::all_gather (fc)", None),
])
def test_collective_names(name: str, kind: str | None) -> None:
    assert comm_kind(name) == kind


def test_the_failure_store_is_a_clone_and_the_shared_store_keeps_its_timeout() -> None:
    """A failing rank posts through a client of its own with a 2 s timeout (a store whose
    host died must not hold it for 5 minutes); the group's store, which the user's code
    and torch's threads share, keeps its timeout throughout. The client is a connection
    of its own to the same TCP store."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]
    from torch.distributed.distributed_c10d import _get_default_store

    from torchscope.distributed.comm import _quick_store

    # torch's stubs declare no `timeout` on stores: Any.
    tcp: Any = TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=tcp, rank=0, world_size=1,
                            timeout=timedelta(seconds=45))
    try:
        shared: Any = _get_default_store()
        before = shared.timeout
        with _quick_store() as quick:
            assert quick is not None and quick is not shared
            assert quick.timeout == timedelta(seconds=2)
            assert shared.timeout == before and tcp.timeout == timedelta(seconds=300)
            quick.set("torchscope/probe", "seen")
            assert tcp.get("torchscope/probe") == b"seen"
        assert shared.timeout == before
    finally:
        dist.destroy_process_group()
    with _quick_store() as none:  # no group: nothing to post through
        assert none is None


_STORE_HOST = """
import sys, time
from datetime import timedelta
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=600),
                 wait_for_workers=False)
print(store.port, flush=True)
sys.stdin.read()  # until the test closes it
"""


def test_a_failure_posted_to_a_store_whose_host_died_returns_soon() -> None:
    """The store's host (torchrun's agent, or rank 0) is gone: posting and reading failures
    give up after the client's own short timeout, not the shared store's 600 s (a clone
    would connect with those, retrying the dead host all along). Nothing is posted or
    read, and nothing raises."""
    import subprocess
    import sys
    import threading

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from torchscope.distributed.comm import post_failure, posted_failures

    host = subprocess.Popen([sys.executable, "-c", _STORE_HOST], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        client: Any = TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=600))
        dist.init_process_group("gloo", store=client, rank=0, world_size=1)
    finally:
        host.communicate("", timeout=60)  # the host leaves
    try:
        answers: list[object] = []
        worker = threading.Thread(target=lambda: answers.extend(
            [post_failure("ValueError: bad batch"), posted_failures()]), daemon=True)
        worker.start()
        worker.join(120)  # a hang guard, far below the store's 600 s, not a timing
        assert not worker.is_alive(), "posting to a dead store's host waited on it"
        assert answers == [None, {}]
        assert client.timeout == timedelta(seconds=600)
    finally:
        dist.destroy_process_group()

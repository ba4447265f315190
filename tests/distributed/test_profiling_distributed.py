"""Time on DDP and FSDP2, on two real gloo processes: communication by kind, the straggler,
and per-rank traces that HolisticTraceAnalysis can read (one folder, `distributedInfo`)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from ._launch import run_ranks


def _trace(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if path.name.endswith(".gz") else raw)


def test_ddp_profile_comm_straggler_and_traces(tmp_path: Path) -> None:
    ranks = run_ranks("profile_ddp", tmp_path)
    for r, a in enumerate(ranks):
        assert a["kinds"] == {"all_reduce": 1.0}  # one bucket: one all-reduce per step
        assert 0 < a["exposed_ms"] <= a["comm_ms"] + 1e-9
        # Cut at the profiler's step ranges, the waits per step add up to the mean's.
        assert len(a["exposed_per_step"]) == 3
        assert sum(a["exposed_per_step"]) / 3 == pytest.approx(a["exposed_ms"], rel=1e-6)
        assert a["compute_ms"] > 0
        # Module names are those of one process: no DDP "module." prefix.
        assert a["modules"] == ["", "0", "1", "2", "3", "4"]
        assert a["top_op"] is not None and not a["top_op"].startswith(("gloo", "c10d"))
        assert a["trace"] == str(tmp_path / "traces" / f"rank{r}.json.gz")
    # Rank 1 trains on 128x the rows: rank 0 waits for it, and the joined result says so.
    assert ranks[0]["gathered"] == 2 and ranks[1]["gathered"] is None
    timing = [(a["step_ms"], a["exposed_ms"]) for a in ranks]  # (step, waited) per rank
    assert ranks[0]["straggler"] is not None and ranks[0]["straggler"]["rank"] == 1, timing
    assert ranks[0]["straggler"]["summary"].startswith("rank 1 is a straggler")
    assert ranks[0]["exposed_ms"] > ranks[1]["exposed_ms"]
    # One folder, one trace per rank, each with its own rank in distributedInfo.
    files = sorted((tmp_path / "traces").iterdir())
    assert [f.name for f in files] == ["rank0.json.gz", "rank1.json.gz"]
    for r, f in enumerate(files):
        trace = _trace(f)
        info = trace["distributedInfo"]
        assert info["rank"] == r and info["world_size"] == 2 and info["backend"] == "gloo"
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "gloo:all_reduce" in names and any(str(n).startswith("ProfilerStep#")
                                                  for n in names)


def test_fsdp2_watch_time_sees_all_gather_and_reduce_scatter(tmp_path: Path) -> None:
    ranks = run_ranks("watch_time_fsdp", tmp_path)
    for r, a in enumerate(ranks):
        # 3 sharded Linears: an all-gather each in forward and backward, a reduce-scatter
        # each in backward (gloo runs it as an all-reduce: the c10d op names it).
        assert a["kinds"] == {"all_gather": 6.0, "reduce_scatter": 3.0}
        assert a["trace"] == str(tmp_path / "fsdp" / f"step.rank{r}.json")
        assert _trace(Path(a["trace"]))["distributedInfo"]["rank"] == r
        assert a["hooks"][0] == a["hooks"][1]
        # Module self times hold no communication: FSDP2's all-gathers (in the children's
        # hooks, inside the root's range) and reduce-scatters count outside modules.
        assert a["comm_ms"] > 0
        assert a["modules_ms"] + a["comm_ms"] <= a["phases_ms"] + 1e-6, a
        # The root (an nn.Sequential) does almost nothing itself: far less than the
        # collectives that its children's FSDP2 hooks run inside its range.
        assert a["root_self_ms"] < a["comm_ms"], a
    assert ranks[0]["gathered"] == 2 and ranks[1]["gathered"] is None

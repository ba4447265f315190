"""torch.compile under DDP, on two real gloo processes: DDPOptimizer's intentional breaks at
bucket boundaries are labelled expected; a real break (a print) still warns."""

from __future__ import annotations

from pathlib import Path

from ._launch import run_ranks


def test_ddp_bucket_breaks_are_expected_not_warnings(tmp_path: Path) -> None:
    for a in run_ranks("ddp_breaks", tmp_path):
        blocks, prints = a["blocks"], a["prints"]
        # torch itself reports every bucket's graph as a break (four 1 MiB buckets).
        assert blocks["reasons"] == ["DDPOptimizer intentional graph-break"]
        assert blocks["graphs"] == 4
        assert [f[:2] for f in blocks["findings"]] == [["compile.ddp_buckets", "info"]]
        assert "not a graph break to fix" in blocks["findings"][0][2]
        codes = [f[:2] for f in prints["findings"]]
        assert ["compile.graph_break", "warning"] in codes
        assert ["compile.ddp_buckets", "info"] in codes
        warning = next(f for f in prints["findings"] if f[0] == "compile.graph_break")
        assert "print() call" in warning[2]
        assert a["optimize_ddp"] is True  # torch's default: nothing was switched off

"""Memory per rank on two real gloo processes: FSDP2's shards against DDP's replicas of the
same model, and analyze_memory counting what the rank holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from ._launch import run_ranks


def test_fsdp2_bytes_per_rank_against_ddp(tmp_path: Path) -> None:
    ranks = run_ranks("memory_ranks", tmp_path)
    for a in ranks:
        ddp, fsdp = a["ddp"], a["fsdp2"]
        assert ddp["strategy"] == "ddp" and fsdp["strategy"] == "fsdp2"
        # DDP: every rank holds the whole model, plus gradient buckets (one more copy).
        assert ddp["parameters"] == ddp["replicated_parameters"] == ddp["local_params"]
        assert ddp["buckets"] == ddp["gradients"] and ddp["saving"] == 1.0
        # FSDP2 on 2 ranks: half the parameters, gradients and Adam state, no buckets; what
        # it would hold under DDP is exactly DDP's figure for the same model.
        assert fsdp["parameters"] * 2 == ddp["parameters"] == fsdp["replicated_parameters"]
        assert fsdp["parameters"] == fsdp["local_params"]
        assert fsdp["gradients"] * 2 == ddp["gradients"]
        assert fsdp["optimizer"] < ddp["optimizer"]
        assert fsdp["buckets"] == 0
        assert fsdp["replicated_total"] == ddp["total"]
        assert fsdp["saving"] > 2.0
        # analyze_memory's totals are the rank's own bytes.
        for case in (ddp, fsdp):
            assert case["report_params"] == case["parameters"]
            assert case["report_grads"] == case["gradients"]
            assert case["report_optimizer"] == case["optimizer"]
            assert case["saved"] > 0


def test_activations_and_memory_gather_every_rank_on_rank_0(tmp_path: Path) -> None:
    from torchscope.capture import watch_activations

    from ._cases import batch, mlp

    ranks = run_ranks("activations_and_memory", tmp_path)
    assert all("raised" not in a for a in ranks), ranks
    for a in ranks:
        # The names of one process (not module.0), each rank's statistics its own rows'.
        assert a["names"] == ["0", "1", "2", "3", "4"]
        assert all(a["stats_equal"]) and a["hooks"] == 0
    zero, one = ranks
    assert zero["gathered"] and zero["memory_gathered"] and zero["world"] == 2
    assert not one["gathered"] and not one["memory_gathered"]
    assert zero["findings_are_a_list"]
    # Rank r's row on rank 0 holds rank r's numbers: a single process on that rank's rows.
    for r in range(2):
        x, _ = batch(r, 2)
        net = mlp()
        with watch_activations(net) as ref:
            net(x)
        assert zero["per_rank_means"][r] == pytest.approx(
            [rec.outputs[0].mean for rec in ref.records], rel=1e-5, abs=1e-7)
    assert zero["memory_saved"][0] == zero["memory_saved"][1] > 0

"""Gradients on DDP and FSDP2, on two real gloo processes, against torch itself and against
one process on the concatenated batch."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ._launch import run_ranks

REL = 1e-5


def _close(a: float, b: float, rel: float = REL) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


@pytest.mark.parametrize("ddp", [{}, {"find_unused_parameters": True}, {"static_graph": True},
                                 {"gradient_as_bucket_view": True, "static_graph": True}],
                         ids=["default", "unused-found", "static-graph", "bucket-views"])
def test_ddp_local_and_synchronised_norms(tmp_path: Path, ddp: dict[str, bool]) -> None:
    """Each local norm is read in its hook, before DDP's: with `gradient_as_bucket_view`
    `.grad` is DDP's bucket itself, all-reduced in place, and under a static graph it holds
    another number by the end of backward (measured), so the local norms cannot wait for
    it. The synchronised norms are torch's, whatever DDP's options."""
    ranks = run_ranks("ddp_grads", tmp_path, **ddp)
    for r, a in enumerate(ranks):
        # Hooks went on the wrapped module: the names of one process, no "module." prefix.
        assert a["names"] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
        assert a["modules"] == ["4", "3", "2", "1", "0"]
        assert a["activations"] == ["0", "1", "2", "3", "4"]
        for name in a["names"]:
            # The synchronised norm is torch's .grad after DDP, and one process's gradient
            # on the whole batch.
            assert a["reported"][name] == pytest.approx(a["actual"][name], rel=1e-6)
            assert a["reported"][name] == pytest.approx(a["whole_ref"][name], rel=REL)
        # The local norm (before the all-reduce) is this rank's rows alone.
        row = a["local"][r]
        for i, name in enumerate(a["names"]):
            assert row[i] == pytest.approx(a["local_ref"][name], rel=1e-6)
        assert a["hooks"] == [0, 0]
        assert "grads.ranks_diverge" not in a["codes"]
    # Every rank reports the same synchronised norms and sees both ranks' local ones.
    assert ranks[0]["synced"] == ranks[1]["synced"]
    assert ranks[0]["synced"][0] == ranks[0]["synced"][1]
    assert ranks[0]["local"] == ranks[1]["local"]
    assert ranks[0]["local"][0] != ranks[0]["local"][1]
    # gather() joins both flows on rank 0 only.
    assert ranks[0]["gathered"] == 2 and ranks[0]["gathered_ranks"] == [0, 1]
    assert ranks[1]["gathered"] is None
    assert ranks[0]["activations_gathered"] == [5, 5]  # activation records, both ranks
    assert ranks[1]["activations_gathered"] is None


def test_ddp_unused_parameter_raises_divergence(tmp_path: Path) -> None:
    ranks = run_ranks("ddp_unused", tmp_path)
    for a in ranks:
        assert "grads.ranks_diverge" in a["codes"], a
        assert a["severity"] == "error"
        assert "a.weight" in a["summary"]
    # torch agrees: DDP never all-reduced, the ranks hold different gradients.
    assert ranks[0]["actual"]["a.weight"] != ranks[1]["actual"]["a.weight"]
    # The next step's forward raises in DDP's reducer: the fix names the wrap, not inputs.
    for a in ranks:
        assert a["second"] is not None and "find_unused_parameters=True" in a["second"]
        assert "--input" not in a["second"]


def test_fsdp2_global_norms_match_one_process(tmp_path: Path) -> None:
    ranks = run_ranks("fsdp_norms", tmp_path)
    for a in ranks:
        assert set(a["layers"]) == {"0", "2", "4"}
        for layer, norm in a["layers"].items():
            assert _close(norm, a["ref_layers"][layer]), (layer, norm, a["ref_layers"][layer])
        for name, norm in a["params"].items():
            # DTensor.full_tensor() is torch's global gradient (the test may all-gather).
            assert _close(norm, a["full_tensor"][name])
            # ‖w‖ of the whole parameter too, so ‖g‖/‖w‖ is the one-process figure.
            assert _close(a["weights"][name], a["full_weights"][name])
        assert _close(a["total_norm"], a["ref_total"])
        # Each rank's shard alone under-reports: the global norm needs both.
        for i, name in enumerate(a["params"]):
            shards = [row[i] for row in a["local"]]
            assert all(s < a["params"][name] for s in shards)
            assert math.sqrt(sum(s * s for s in shards)) == pytest.approx(a["params"][name])
        assert a["shard_rows"] == [2] * 6
        assert a["modules"] == ["0", "1", "2", "3", "4"]
        assert a["hooks"][0] == a["hooks"][1]
        assert a["codes"] == []


def test_fsdp2_watch_samples_and_gathers(tmp_path: Path) -> None:
    ranks = run_ranks("fsdp_watch", tmp_path)
    for a in ranks:
        assert a["refused"] is not None and "optimizer=" in a["refused"]
        assert a["samples"] == 2 and a["history_steps"] == [0, 2]
        assert a["hooks"][0] == a["hooks"][1]
        # The update of each sharded parameter is the whole parameter's, as torch's
        # full_tensor() before and after the step gives it, and so is its ratio to ‖w‖.
        assert set(a["updates"]) == set(a["moved"]) and a["moved"]
        for name, moved in a["moved"].items():
            assert moved > 0 and _close(a["updates"][name], moved), (name, a["updates"])
            assert _close(a["ratios"][name], moved / a["whole_weights"][name])
    assert ranks[0]["updates"] == ranks[1]["updates"]
    assert ranks[0]["gathered"] == 2 and ranks[1]["gathered"] is None


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_the_monitor_on_ranks_reads_each_ranks_forward(tmp_path: Path, strategy: str) -> None:
    """Under FSDP2 the monitor raised at its first step (a DTensor gradient in the
    every-step NaN check), and the unsharded weights that FSDP2 swaps in were counted as
    saved activations, some steps and not others."""
    ranks = run_ranks("monitor_ranks", tmp_path, strategy=strategy)
    for a in ranks:
        assert a["steps"] == 3 and a["samples"] == 3
        assert len(a["stds"]) == 3
        for got, want in zip(a["stds"], a["ref_stds"], strict=True):
            assert _close(got, want, 1e-4)
        assert a["saved"] == [a["single"]] * 3
        assert a["hooks"][0] == a["hooks"][1]
    assert ranks[0]["stds"] != ranks[1]["stds"]  # each rank's own rows
    # One report in the folder every rank was given: rank 0's, not a race between ranks.
    assert ranks[1]["paths"] is None and ranks[0]["paths"] is not None
    report = json.loads(Path(ranks[0]["paths"][1]).read_text())
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["report.html", "report.json"]
    assert report["kind"] == "run" and report["sections"]["run"]["data"]["steps"] == 3


def test_no_hook_left_on_any_rank_after_rank1_raises(tmp_path: Path) -> None:
    ranks = run_ranks("raises_on_rank1", tmp_path)
    assert ranks[1]["error"] == "RuntimeError: rank 1 fails on purpose"
    assert ranks[0]["error"] is not None  # its all-reduce lost its peer: it raises too
    for a in ranks:
        assert a["hooks"] == [0, 0], a


def test_hsdp_norms_sum_over_the_shard_group_only(tmp_path: Path) -> None:
    ranks = run_ranks("hsdp_norms", tmp_path, nproc=4)
    for r, a in enumerate(ranks):
        # Mesh (replicate=2, shard=2): ranks 0,1 hold one replica's shards, 2,3 the other's.
        assert a["shard_rows"] == [[0, 1] if r < 2 else [2, 3]] * 6
        for name, norm in a["params"].items():
            assert _close(norm, a["full_tensor"][name]), (name, norm)
        for name, moved in a["moved"].items():
            assert moved > 0 and _close(a["updates"][name], moved), (name, a["updates"])
        # Summed over the replicas too it would read 0.02 * sqrt(2).
        assert a["used"] == pytest.approx(0.02, rel=1e-4)
        assert a["applied"] == pytest.approx(a["used"], rel=1e-6)


def test_fsdp2_reads_the_norm_each_clipped_update_used(tmp_path: Path) -> None:
    """Under FSDP2 each rank holds shards of the clipped gradients: the norm the update used
    is joined from both ranks' shards in the step's exchange (one rank's alone is about
    0.5 / sqrt(2)). It equals torch's norm of the clipped gradients' full tensors on both
    ranks, and the step that does not clip reads none."""
    ranks = run_ranks("fsdp_clip", tmp_path)
    for a in ranks:
        assert "raised" not in a, a
        assert min(a["returned"]) > 1.0  # clipping acted on both clipped steps
        assert a["used"] == pytest.approx([0.5, 0.5], rel=1e-5)
        assert [a["applied"][k] for k in ("0", "1")] == pytest.approx(a["used"], rel=1e-6)
        assert set(a["applied"]) == {"0", "1"} and a["last"] is None
        assert a["history"][:2] == pytest.approx(a["used"], rel=1e-6)
        assert a["history"][2] is None
        assert a["hooks"] == ranks[0]["hooks"]
        # The step's total is the backward's (what clip_grad_norm_ returned), and the
        # clipping reads as their ratio.
        assert a["total"] == pytest.approx(a["returned"][1], rel=1e-5)
        assert a["factor"] == pytest.approx(a["returned"][1] / 0.5, rel=1e-4)


def test_fsdp2_zeroing_in_place_is_told_from_accumulation(tmp_path: Path) -> None:
    """FSDP2 accumulates into a DTensor gradient's shard, and the loop's in-place ops move
    only the DTensor's own version counter. Zeroing in place before each backward read as
    no zeroing at all (`grads.not_zeroed` on a healthy loop); never zeroing must still be
    caught, and zeroing between the backward and the step too (the weights never move). In
    the same launch: an optimizer built before `fully_shard` (`grads.not_optimized`)."""
    ranks = run_ranks("fsdp_zeroing", tmp_path)
    for a in ranks:
        assert "raised" not in a, a
        healthy, never, before = a["in_place"], a["never"], a["before_step"]
        assert healthy["unzeroed"] == 0 and "grads.not_zeroed" not in healthy["codes"]
        assert healthy["moved"] > 0
        assert never["unzeroed"] == 3 and "grads.not_zeroed" in never["codes"]
        assert before["moved"] == 0.0  # torch agrees: the update used no gradient
        assert "grads.cleared_before_step" in before["codes"]
        assert "grads.not_zeroed" not in before["codes"]
        # An optimizer built before fully_shard holds the replaced parameters: torch agrees
        # that the model never moves, and every parameter is named, on every rank.
        first = a["optimizer_first"]
        assert first["moved"] == 0.0 and "grads.not_optimized" in first["codes"]
        assert first["unoptimized"] == [f"{i}.{k}" for i in (0, 2, 4) for k in ("weight", "bias")]
        assert all(not a[m]["unoptimized"] for m in ("in_place", "never", "before_step"))


def test_lightning_ddp_reports_the_synchronised_gradients(tmp_path: Path) -> None:
    """Lightning hands the callback the module inside its DDP wrapper: the norms must still
    be those of the synchronised gradients the optimizer steps with, on every rank."""
    pytest.importorskip("pytorch_lightning")
    ranks = run_ranks("lightning_ddp", tmp_path, timeout=150.0)
    for a in ranks:
        assert "raised" not in a, a
        assert a["steps"] == [0, 1, 2, 3]
        assert a["reported"] == pytest.approx(a["synced"], rel=1e-6)
    assert ranks[0]["reported"] == pytest.approx(ranks[1]["reported"], rel=1e-9)


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp-args-on-cpu"])
def test_hf_trainer_on_ranks_reports_the_synchronised_gradients(tmp_path: Path,
                                                                 fsdp: bool) -> None:
    """The Trainer logs `grad_norm`, the total norm of the synchronised gradients that
    clipping returned: the callback's sampled totals must be that, on both ranks. With
    `fsdp` in TrainingArguments on CPU, accelerate trains through DDP all the same, and the
    callback reported each rank's own gradients (the ranks disagreed)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    ranks = run_ranks("hf_ddp", tmp_path, timeout=150.0, fsdp=fsdp)
    for a in ranks:
        assert "raised" not in a, a
        assert a["wrapper"] == "DistributedDataParallel"
        assert a["steps"] == [1, 3] and len(a["logged"]) == 2
        assert a["reported"] == pytest.approx(a["logged"], rel=1e-5)
    assert ranks[0]["reported"] == pytest.approx(ranks[1]["reported"], rel=1e-9)


def test_ddp_norms_are_read_before_the_loop_clips(tmp_path: Path) -> None:
    """The synchronised gradients are read when DDP's all-reduce has landed, at the end of
    backward: a loop that clips before opt.step() must not see its clipped gradients in
    the report, which would read 0.5 here. The report agrees with clip_grad_norm_'s return
    (the norm before clipping) and with torch's .grad after backward, on both ranks; the
    norm the update used (`applied_norms`) is the clipped 0.5."""
    ranks = run_ranks("ddp_clip", tmp_path)
    for a in ranks:
        assert "raised" not in a, a
        assert a["returned"][-1] > 1.0  # clipping acted
        assert a["total_norm"] == pytest.approx(a["returned"][-1], rel=1e-6)
        assert a["totals"] == pytest.approx(a["returned"], rel=1e-6)  # every step
        assert a["applied"] == pytest.approx([0.5] * 3, rel=1e-5)  # what opt.step() used
        assert a["reads"] == [True, False]  # read on the sampled step only
        for name, norm in a["synced"].items():
            assert a["reported"][name] == pytest.approx(norm, rel=1e-6)
    assert ranks[0]["total_norm"] == ranks[1]["total_norm"]


def test_fsdp1_is_refused_in_one_line_with_no_hook_left(tmp_path: Path) -> None:
    """Watched as a plain model, FSDP1 reported a total gradient norm of 0.0 on both ranks."""
    ranks = run_ranks("fsdp1_refused", tmp_path)
    for a in ranks:
        assert "raised" not in a, a
        assert set(a["errors"]) == {"watch", "monitor"}
        for where, error in a["errors"].items():
            assert error is not None, where
            assert "FullyShardedDataParallel (FSDP1)" in error, (where, error)
            assert "Fix: shard with torch.distributed.fsdp.fully_shard" in error
        assert a["hooks"][0] == a["hooks"][1], a


@pytest.mark.parametrize("change", [True, False])
def test_ddp_a_gradient_changed_on_one_rank_after_the_all_reduce_is_a_divergence(
        tmp_path: Path, change: bool) -> None:
    """F3: rank 1 doubles head.weight.grad between backward and opt.step() at step 1. The
    synchronised gradients agree (read as backward ends), but the replicas' weights differ
    from then on: the last sample's weight norms, joined from every rank in the one exchange
    at the watch's end, say so on every rank, and name the head. The same loop without the
    change is silent. Then a change that keeps the weight norms (below)."""
    answers = run_ranks("ddp_grad_changed_on_one_rank", tmp_path, change=change)
    for a in answers:
        assert "raised" not in a, a
        assert a["steps"] == [0, 1, 2] and a["last"] == 2
        assert a["held"] == [True, True, True]  # no exchange during the block
        assert a["torch_differs"] is change
        # Where the weight norms cannot tell (in the same launch): a zero-initialised head
        # stepped by -u on one rank and +u on the other, its gradient negated there after
        # the all-reduce at the block's one step. The step's own weight norms (before the
        # update) and the heads' norms and plain sums after it agree; the weights as the
        # watch ended, joined at its end, name the head on every rank.
        b = a["negated"]
        assert b["torch_differs"] is change
        if not change:
            assert a["diverge"] == [] and b["diverge"] == []
            continue
        (f,) = a["diverge"]
        assert f["seen_in"] == "weights" and f["names"] == "4.weight", f
        assert "weights differ between the DDP replicas" in f["summary"]
        assert b["norms_equal"] and b["sums_equal"]
        assert len({tuple(r) for r in b["weights_before"]}) == 1  # zeros on both
        (f,) = b["diverge"]
        assert f["seen_in"] == "weights" and f["names"] == "4.weight", f
        assert "at the watch's end" in f["summary"] and "weighted sum" in f["summary"]


def test_ddp_rank_skew_names_the_rank_with_the_larger_local_gradient(tmp_path: Path) -> None:
    """Rank 1's inputs 50× larger: its local gradient (before the all-reduce) is more than
    SKEW_RATIO times rank 0's, which grads.rank_skew says on every rank; the same rows
    unscaled say nothing."""
    from torchscope.grads.ranks import SKEW_RATIO

    answers = run_ranks("ddp_skew", tmp_path)
    for a in answers:
        assert "raised" not in a, a
        assert a["even"]["findings"] == {}
        lo, hi = a["skewed"]["local"]
        assert hi / lo >= SKEW_RATIO
        f = a["skewed"]["findings"]["grads.rank_skew"]
        assert f["high_rank"] == 1 and f["low_rank"] == 0
        assert _close(f["ratio"], hi / lo)

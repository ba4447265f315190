"""Findings about a run, on real training: silent on a healthy run; the right code at the right
module when a layer's gradient falls away, activations drift, units die, or NaN appears."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from torch import nn

import torchscope
from torchscope.findings import Finding, Severity
from torchscope.monitoring import RunRecord
from torchscope.report.document import load_schema

from .._builders import makemore_mlp, t5_relu
from ._models import Faulty, Gated, batches


def _run(model: nn.Module, opt: torch.optim.Optimizer, steps: int, every: int,
         after_step: Callable[[int], None] | None = None,
         before_step: Callable[[int], None] | None = None) -> RunRecord:
    data = batches(8)
    with torchscope.monitor(model, opt, every=every, out=None, memory=False) as mon:
        for i in range(steps):
            x, y = data[i % len(data)]
            if before_step is not None:
                before_step(i)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if after_step is not None:
                with torch.no_grad():
                    after_step(i)
    assert mon.result is not None
    return mon.result


def _run_findings(record: RunRecord) -> list[Finding]:
    return [f for f in record.findings() if f.code.startswith("run.")]


def test_a_healthy_run_has_no_run_warnings() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    run = _run(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), 120, 5)
    assert run.samples == 24
    loud = [f for f in _run_findings(run) if f.severity >= Severity.WARNING]
    assert not loud, [f.summary for f in loud]


def test_a_layer_whose_gradient_falls_away_is_named() -> None:
    """fc1's gradient is proportional to a gate that weight decay drives to zero; the other
    layers keep theirs."""
    torch.manual_seed(0)
    model = Gated()
    gate = [model.gate]
    rest = [p for p in model.parameters() if p is not model.gate]
    opt = torch.optim.SGD([{"params": rest}, {"params": gate, "weight_decay": 0.5}], lr=0.1)
    run = _run(model, opt, 150, 5)
    fell = [f for f in _run_findings(run) if f.code == "run.grad_fell"
            and f.severity == Severity.WARNING]
    assert [f.module for f in fell] == ["fc1"], [f.summary for f in _run_findings(run)]
    f = fell[0]
    assert f.summary.startswith("fc1's gradient fell ")
    assert f"between step {f.evidence['first_step']} and step {f.evidence['last_step']}" \
        in f.summary
    assert f.evidence["ratio"] >= 10 and f.evidence["relative_to_median"] >= 10
    assert f.evidence["first_step"] == 0 and f.evidence["last_step"] == 145


def test_a_llama_fitting_its_batch_has_no_gradient_warning() -> None:
    """A transformers Llama fitting one batch with AdamW and clipping: the loss falls
    smoothly, the total gradient norm falls, and the final RMSNorm gain's gradient grows
    more than 10x as its direction settles. That is said as info, not as a warning."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=200, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    batch = {"input_ids": torch.randint(0, 200, (2, 32)),
             "labels": torch.randint(0, 200, (2, 32))}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    losses = []
    with torchscope.monitor(model, opt, every=5, out=None, memory=False,
                            activations=False) as mon:
        for _ in range(40):
            opt.zero_grad(set_to_none=True)
            loss = model(**batch).loss
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
    run = mon.result
    assert run is not None
    assert losses[-1] < 0.75 * losses[0]  # it fits
    assert run.total_norms[-1] < run.total_norms[0]
    found = _run_findings(run)
    loud = [f for f in found if f.severity >= Severity.WARNING]
    assert not loud, [f.summary for f in loud]
    # It does train on one batch, on purpose: said as info.
    assert [f.severity for f in found if f.code == "run.same_batch"] == [Severity.INFO]
    grew = [f for f in found if f.code == "run.grad_grew"]
    assert [f.module for f in grew] == ["model.norm"], [f.summary for f in found]
    assert grew[0].severity == Severity.INFO
    assert "while the total gradient norm fell" in grew[0].summary
    assert grew[0].evidence["ratio"] >= 10 and grew[0].evidence["total_change"] > 1


def test_a_layer_whose_gradient_grows_with_the_total_is_a_warning() -> None:
    """The gate of `Gated` grows 10 % a step outside the watched optimizer: its own
    gradient (the root's) grows far faster than the others', and the total with it. An
    optimizer of its own steps it at lr 0 and never zeroes it, so its gradient also adds
    up (a gate that no optimizer stepped would be `grads.not_optimized`, and its growth
    no finding of its own)."""
    torch.manual_seed(0)
    model = Gated()
    opt = torch.optim.SGD([p for p in model.parameters() if p is not model.gate], lr=0.01)
    own = torch.optim.SGD([model.gate], lr=0.0)

    def grow(_i: int) -> None:
        own.step()
        model.gate.mul_(1.1)

    run = _run(model, opt, 30, 5, after_step=grow)
    assert run.unoptimized == ()
    assert run.total_norms[-1] > 5 * run.total_norms[0]
    grew = [f for f in _run_findings(run) if f.code == "run.grad_grew" and f.module == ""]
    assert [f.severity for f in grew] == [Severity.WARNING], \
        [f.summary for f in _run_findings(run)]
    assert "total_change" not in grew[0].evidence
    assert grew[0].evidence["relative_to_median"] >= 10


def test_activation_drift_is_reported() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    run = _run(model, torch.optim.SGD(model.parameters(), lr=0.01), 60, 4,
               after_step=lambda i: model[2].weight.mul_(1.1))
    drift = [f for f in _run_findings(run) if f.code == "run.activation_drift"
             and f.severity == Severity.WARNING]
    assert [f.module for f in drift] == ["2"]
    assert drift[0].evidence["ratio"] > 100
    assert "2's output std grew" in drift[0].summary


def test_dead_units_that_grow_are_reported() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    run = _run(model, torch.optim.SGD(model.parameters(), lr=0.01), 60, 4,
               after_step=lambda i: model[0].bias.sub_(0.05))
    dead = [f for f in _run_findings(run) if f.code == "run.dead_units"]
    assert [f.module for f in dead] == ["1"]
    assert dead[0].evidence["last_fraction"] >= 0.25
    assert dead[0].evidence["last_fraction"] - dead[0].evidence["first_fraction"] >= 0.1


@pytest.mark.parametrize("every", [1, 5])
def test_nan_onset_names_the_step_and_the_module(every: int) -> None:
    torch.manual_seed(0)
    model = Faulty()

    def shift(i: int) -> None:
        model.shift = 1.0 if i < 12 else -100.0  # log of a negative number from step 12

    run = _run(model, torch.optim.SGD(model.parameters(), lr=0.01), 20, every,
               before_step=shift)
    onset = run.onset
    assert onset.gradient_step == 12  # every step is checked, sampled or not
    assert onset.nonfinite_steps == 8
    nonfinite = [f for f in run.findings() if "nonfinite" in f.code]
    assert [f.code for f in nonfinite] == ["run.nonfinite"]  # the capabilities' give way
    f = nonfinite[0]
    assert f.severity == Severity.ERROR
    if every == 1:
        assert (onset.forward_step, onset.module, onset.module_type) == (12, "bad", "Log")
        assert f.summary == "NaN/Inf first produced by bad (Log) at step 12"
        assert f.module == "bad"
    else:
        # The first sampled forward after it: the NaN weights of fc1 now produce it.
        assert onset.forward_step == 15
        assert "first held NaN/Inf at step 12" in f.summary
        assert "at step 15" in f.summary
        # The summary says why fc1 produces it: no GradScaler skipped step 12's update.
        assert "likely from its own weights" in f.summary and f.module == "fc1"
        assert "the cause is at or before step 12" in f.summary


def test_nan_written_by_the_update_is_named_as_the_update_not_a_module(tiny_gpt2) -> None:
    """A GPT-2 kept in float16 under AdamW: step 0's gradients are finite, its update writes
    NaN/Inf into the weights (eps 1e-8 is 0 in float16), and step 1's embedding produces
    NaN from them. The run names the update, not the embedding at step 1."""
    torch.manual_seed(0)
    model = tiny_gpt2.train().to(torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    with torchscope.monitor(model, opt, every=1, out=None, memory=False) as mon:
        for _ in range(3):
            opt.zero_grad()
            model(ids, labels=ids).loss.backward()
            opt.step()
    run = mon.result
    assert run.onset.gradient_step == 1 and run.onset.forward_step == 1
    assert run.broken_update is not None and run.broken_update.step == 0
    nonfinite = [f for f in run.findings() if "nonfinite" in f.code]
    assert [f.code for f in nonfinite] == ["grads.nonfinite_update"]
    assert nonfinite[0].severity == Severity.ERROR
    assert "eps=1e-08 is 0 in float16" in nonfinite[0].summary


@pytest.mark.parametrize(("loop", "every", "told"), [
    ("one batch", 2, True), ("one batch", 1, True), ("one batch in micro-batches", 3, True),
    ("new batches", 2, False), ("two batches in turn", 2, False),
    ("two batches in turn", 1, False), ("each batch twice (R-Drop)", 2, False),
    ("new batches in micro-batches", 3, False)])
def test_a_loop_that_trains_on_one_batch_is_told(loop: str, every: int, told: bool) -> None:
    """A batch taken once before the loop is trained on at every step: each sampled step's
    input equals the next step's. Batches that come round again with the dataset's length
    (every second step here, sampled every second step) are never consecutive, and a second
    forward of the step's own batch (R-Drop) or its micro-batches are no steps."""
    torch.manual_seed(0)
    model = Gated()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = batches(24)
    steps = 12
    with torchscope.monitor(model, opt, every=every, out=None, memory=False) as mon:
        for i in range(steps):
            x, y = data[0] if loop.startswith("one batch") else \
                data[i % 2] if loop.startswith("two") else data[i]
            opt.zero_grad()
            if "micro-batches" in loop:  # two halves, one backward each
                for half in (slice(0, 4), slice(4, 8)):
                    nn.functional.mse_loss(model(x[half]), y[half]).backward()
            else:
                loss = nn.functional.mse_loss(model(x), y)
                if "twice" in loop:
                    loss = loss + nn.functional.mse_loss(model(x), y)
                loss.backward()
            opt.step()
    run = mon.result
    assert run is not None
    # Each sampled step and the next: steps 0 and 1, 2 and 3, ... (every step with every=1).
    pairs = len(range(0, steps - 1, every))
    assert run.same_inputs == (pairs, pairs if told else 0)
    found = [f for f in run.findings() if f.code == "run.same_batch"]
    assert [f.severity for f in found] == ([Severity.INFO] if told else [])
    if told:
        assert "trains on one batch" in found[0].summary
        assert "next(iter(loader))" in found[0].fix


@pytest.mark.slow
def test_a_compiled_model_is_said_to_run_eagerly_under_the_monitor() -> None:
    """...and runs compiled again after it: the monitor's watches, each holding the eager
    stance and closed in the order they opened, had left the process in force_eager."""
    stance = str(torch._dynamo.eval_frame._stance.stance)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    compiled = torch.compile(model, backend="eager")  # never compiled: eager under the monitor
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    run = _run(compiled, opt, 4, 2)
    assert run.compiled == ("",)
    found = [f for f in run.findings() if f.code == "run.compiled_eager"]
    assert [f.severity for f in found] == [Severity.INFO]
    assert "(<root>) ran eagerly while the monitor was open" in found[0].summary
    assert "for the whole run: the step times, saved bytes and profile here are the eager " \
        "model's" in found[0].summary
    # Said once for the run, not again by each of its watches.
    assert [f.code for f in run.findings() if f.code.endswith(".compiled_eager")] \
        == ["run.compiled_eager"]
    assert str(torch._dynamo.eval_frame._stance.stance) == stance == "default"
    plain = _run(model, opt, 4, 2)
    assert plain.compiled == ()
    assert not [f for f in plain.findings() if f.code == "run.compiled_eager"]


def test_activations_that_drift_together_are_one_finding() -> None:
    """Every weight scaled up 10 % a step, no normalisation: every layer's output grows,
    each faster than the one before. One finding says the whole model drifted; a layer is
    named only where it went 10x further than the median layer (it had one warning per
    layer, a dozen on a diverging Llama)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)], nn.Linear(8, 2))
    run = _run(model, torch.optim.SGD(model.parameters(), lr=0.0), 40, 2,
               after_step=lambda i: [m.weight.mul_(1.1) for m in model])
    drift = [f for f in _run_findings(run) if f.code == "run.activation_drift"]
    whole = [f for f in drift if f.module is None]
    assert len(whole) == 1 and whole[0].severity == Severity.WARNING
    assert "the whole model's activations drifted together (5 layers)" in whole[0].summary
    named = [f for f in drift if f.module is not None]
    assert len(named) < 5
    for f in named:
        assert f.evidence["ratio"] >= 10 * whole[0].evidence["median_change"]
        assert "more than the median layer's" in f.summary


def test_a_convnext_layer_scale_growing_from_1e6_is_no_activation_drift(
        train_own_loss: Any) -> None:
    """transformers' ConvNeXt scales each block's branch by a layer scale that starts at
    1e-6; AdamW moves it by about the learning rate a step, so the branch's output grows
    hundreds of times in a few steps while the residual stream does not move. That had two
    `run.activation_drift` warnings; a layer that starts at a normal scale still has one."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
        num_channels=3, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, num_labels=5,
        image_size=32))
    batch = {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.randint(0, 5, (4,))}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with torchscope.monitor(model, opt, every=1, out=None, memory=False) as mon:
        train_own_loss(model, batch, opt, 6)
    run = mon.result
    assert run is not None
    branch = "convnext.encoder.stages.0.layers.0.drop_path"
    std = run.act_std.series(branch)
    assert std[-1] > 100 * std[0]  # it did grow that much...
    first = [v for v in run.act_std.values[0] if v == v]  # NaN: no std for that layer
    assert std[0] < 1e-3 * statistics.median(first)  # ...from negligible
    drift = [f for f in run.findings() if f.code == "run.activation_drift"]
    assert not drift, [f.summary for f in drift]
    # Their gradients grow with the scale while the total does not: one info for all of
    # them (it was one per layer, eight here).
    grew = [f for f in run.findings() if f.code == "run.grad_grew"]
    assert [f.severity for f in grew] == [Severity.INFO], [f.summary for f in grew]
    assert int(grew[0].evidence["layers"]) > 3
    assert "dwconv" in str(grew[0].evidence["modules"])


def test_the_whole_model_s_gradients_growing_with_the_total_is_a_warning() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)], nn.Linear(8, 2))
    run = _run(model, torch.optim.SGD(model.parameters(), lr=0.0), 40, 2,
               after_step=lambda i: [m.weight.mul_(1.1) for m in model])
    assert run.total_norms[-1] > 10 * run.total_norms[0]
    whole = [f for f in _run_findings(run) if f.code == "run.grad_grew" and f.module is None]
    assert [f.severity for f in whole] == [Severity.WARNING]
    assert "total_change" not in whole[0].evidence


def test_gradients_that_grow_under_clipping_are_not_told_to_clip() -> None:
    """The same growth in a loop that clips at 0.01: the monitor reads the norm each update
    used (every sample), and the fixes say that the loop clips already."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)], nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    data = batches(8)
    with torchscope.monitor(model, opt, every=2, out=None, memory=False) as mon:
        for i in range(40):
            x, y = data[i % len(data)]
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            opt.step()
            with torch.no_grad():
                for m in model:
                    m.weight.mul_(1.1)
    run = mon.result
    assert run is not None and len(run.applied_norms) == run.samples == 20
    assert all(a == pytest.approx(0.01, rel=1e-4) for a in run.applied_norms)
    (whole,) = [f for f in _run_findings(run) if f.code == "run.grad_grew" and f.module is None]
    assert whole.severity == Severity.WARNING
    assert "clips already" in whole.fix and "clip_grad_norm_" not in whole.fix
    grew = [f for f in run.findings() if f.code == "grads.exploding" and "grew" in f.summary]
    assert grew and all("already clips" in f.fix for f in grew)
    assert [f.code for f in run.findings()].count("grads.clipped") == 1


def test_a_framework_s_clipping_setting_is_known_though_no_step_reached_it() -> None:
    """Under the HF Trainer (max_grad_norm=1.0 by default) or Lightning (gradient_clip_val)
    the loop clips, but gradients growing below the threshold were never clipped, and the
    fix told the user to add clipping. The callbacks now pass the setting on."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)], nn.Linear(8, 2))
    run = _run(model, torch.optim.SGD(model.parameters(), lr=0.0), 40, 2,
               after_step=lambda i: [m.weight.mul_(1.1) for m in model])
    told = [f for f in _run_findings(run) if f.code == "run.grad_grew" and f.module is None]
    assert [f.severity for f in told] == [Severity.WARNING]
    assert "clip_grad_norm_" in (told[0].fix or "")  # a plain loop that does not clip
    framed = replace(run, clip_setting="max_grad_norm=1")
    (whole,) = [f for f in _run_findings(framed) if f.code == "run.grad_grew"
                and f.module is None]
    assert whole.fix is not None and "clips already (max_grad_norm=1)" in whole.fix
    assert "clip_grad_norm_" not in whole.fix


def test_a_regression_head_growing_to_its_targets_is_told_as_the_model_s_output() -> None:
    """An MLP fitting targets of 300 ± 100: its head's output grows thousands of times as it
    learns. That is worth a word (unscaled targets), but the fix said "activations that
    drift this far change what every later layer sees" of the last layer. The head is
    marked as the model's output, and its fix says what sets that scale."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 1))
    w = torch.randn(8, 1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    with torchscope.monitor(model, opt, every=20, out=None, memory=False) as mon:
        for _ in range(200):
            x = torch.randn(64, 8)
            y = 300 + 100 * (x @ w)  # (64, 1)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    run = mon.result
    assert run is not None and run.activations is not None
    head = run.act_std.series("4")
    assert head[-1] > 100 * head[0]  # it did grow that far
    assert {r.module for r in run.activations.records if r.model_output} == {"4"}
    (told,) = [f for f in run.findings() if f.code == "run.activation_drift"
               and f.module == "4"]
    assert told.fix is not None and "model's output" in told.fix
    assert "standardise a regression's targets" in told.fix
    assert "every later layer" not in told.fix


def test_dinov2_behind_a_1e5_layer_scale_is_no_gradient_growth_warning(
        train_own_loss: Any) -> None:
    """transformers' DINOv2 trained from scratch with the paper's layer scale of 1e-5:
    every block's branch gets gradient through that scale, which AdamW grows by the
    learning rate a step, so the median layer's gradient grows 25x in a few steps while the
    model's total falls. That was a warning telling to lower the learning rate."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.Dinov2ForImageClassification(transformers.Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=28, patch_size=14, layerscale_value=1e-5, num_labels=3))
    batch = {"pixel_values": torch.randn(2, 3, 28, 28), "labels": torch.randint(0, 3, (2,))}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with torchscope.monitor(model, opt, every=1, out=None, memory=False,
                            activations=False) as mon:
        train_own_loss(model, batch, opt, 8)
    run = mon.result
    assert run is not None
    assert run.total_norms[-1] < run.total_norms[0]
    # The median is taken outside the blocks behind the scale (the embeddings, the head):
    # the blocks' layers are the ones that grew, one info for them all.
    whole = [f for f in _run_findings(run) if f.code == "run.grad_grew" and f.module is None]
    assert not whole
    (grew,) = [f for f in _run_findings(run) if f.code == "run.grad_grew"]
    assert grew.severity == Severity.INFO and int(grew.evidence["layers"]) >= 10
    assert float(grew.evidence["ratio_min"]) >= 10
    assert all(m.startswith("dinov2.encoder.layer.")
               for m in str(grew.evidence["modules"]).split(", "))
    assert "while the total gradient norm fell" in grew.summary
    loud = [f for f in _run_findings(run) if f.severity >= Severity.WARNING]
    assert not loud, [f.summary for f in loud]


def test_a_convnext_trained_well_is_no_gradient_fall_warning() -> None:
    """A transformers ConvNeXt learning a toy task (AdamW 1e-3, clipped at 1): the stem and
    the downsampling layers' gradients fall about 400x with the loss, as they should. Taken
    against a median over every layer, most of them in blocks behind a layer scale of 1e-6
    whose gradients follow the scale as it grows, that fall read 13x the median's: seven
    `run.grad_fell` warnings on a healthy run. The median is now taken outside them."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
        hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], num_labels=10))
    gen = torch.Generator().manual_seed(0)
    protos = torch.randn(10, 3, 32, 32, generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    with torchscope.monitor(model, opt, every=5, out=None, memory=False,
                            activations=False) as mon:
        for _ in range(100):
            y = torch.randint(0, 10, (16,), generator=gen)
            x = protos[y] + 0.5 * torch.randn(16, 3, 32, 32, generator=gen)  # (16, 3, 32, 32)
            loss = model(pixel_values=x, labels=y).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    run = mon.result
    assert run is not None and losses[-1] < 0.1 * losses[0]  # it learned
    stem = run.grad_param.series("convnext.embeddings.patch_embeddings")
    assert stem[0] > 100 * stem[-1]  # the stem's gradient did fall that much
    loud = [f for f in _run_findings(run) if f.severity >= Severity.WARNING]
    assert not loud, [f.summary for f in loud]
    (whole,) = [f for f in _run_findings(run) if f.code == "run.grad_fell"]
    assert whole.module is None and float(whole.evidence["median_change"]) > 100


def test_a_run_that_never_zeroes_its_gradients_says_so() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = batches(4)
    with torchscope.monitor(model, opt, every=5, out=None, memory=False) as mon:
        for i in range(20):
            x, y = data[i % len(data)]
            nn.functional.mse_loss(model(x), y).backward()  # no zero_grad()
            opt.step()
    run = mon.result
    assert run is not None and (run.unzeroed_steps, run.first_unzeroed) == (19, 1)
    assert run.total_norms[-1] > 3 * run.total_norms[0]  # the sums grow
    [f] = [f for f in run.findings() if f.code == "grads.not_zeroed"]
    assert f.severity == Severity.WARNING and f.evidence["steps"] == 19


@pytest.mark.parametrize("loop", ["forgot_train", "train_again", "no_dropout"])
def test_steps_trained_in_eval_mode_after_an_evaluation_are_a_warning(loop: str) -> None:
    """An evaluation at each epoch's end calls model.eval() and never model.train(): every
    later epoch trains with dropout off and BatchNorm frozen on its running statistics."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(),
                               nn.Dropout(0.1), nn.Linear(16, 2)]
    if loop == "no_dropout":  # the mode changes nothing: eval mode is no news
        layers = [nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.0), nn.Linear(16, 2)]
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = batches(4)
    with torchscope.monitor(model, opt, every=5, out=None, memory=False) as mon:
        for _ in range(3):
            if loop == "train_again":
                model.train()
            for x, y in data:
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            model.eval()
            with torch.no_grad():
                model(data[0][0])  # the evaluation: no gradients, no step
    run = mon.result
    assert run is not None
    found = [f for f in run.findings() if f.code == "run.eval_mode"]
    if loop == "forgot_train":
        assert (run.modes.train, run.modes.eval, run.modes.first_eval) == (4, 8, 4)
        assert [f.severity for f in found] == [Severity.WARNING]
        assert found[0].evidence["modules"] == 2 and "model.train()" in found[0].fix
    elif loop == "train_again":
        assert (run.modes.train, run.modes.eval) == (12, 0) and not found
    else:
        assert run.modes.eval == 8 and run.modes.sensitive == 0 and not found


class _AutocastInside(nn.Module):
    """Autocast entered inside the model's forward, as accelerate does for the HF Trainer's
    bf16/fp16: the root's pre-hooks run before it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return self.net(x).float()


@pytest.mark.parametrize("loop", ["fp16", "fp16_scaled", "fp16_scaled_not_given",
                                  "fp16_inside", "bf16", "float32"])
def test_float16_autocast_without_a_grad_scaler_is_a_warning(loop: str) -> None:
    """float16 autocast gives float16 gradients, which flush to zero below 6e-8 unless a
    GradScaler scales the loss; bfloat16 has float32's range, and float32 is no autocast.
    A loop's GradScaler not given to the monitor is found stepping the optimizer: that
    loop read as unscaled, and its norms, 65536 times too large, as exploding."""
    torch.manual_seed(0)
    model: nn.Module = _AutocastInside() if loop == "fp16_inside" else nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu") if loop.startswith("fp16_scaled") else None
    dtype = torch.bfloat16 if loop == "bf16" else torch.float16
    with torchscope.monitor(model, opt, every=2, out=None, memory=False,
                            scaler=None if loop == "fp16_scaled_not_given" else scaler) as mon:
        for x, y in batches(4):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype, enabled=loop in (
                    "fp16", "fp16_scaled", "fp16_scaled_not_given", "bf16")):
                loss = nn.functional.mse_loss(model(x).float(), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
    assert not torch.is_autocast_enabled("cpu")
    run = mon.result
    assert run is not None
    found = [f for f in run.findings() if f.code == "run.fp16_unscaled"]
    expected = {"bf16": (("torch.bfloat16", 4),), "float32": ()}.get(
        loop, (("torch.float16", 4),))
    assert run.modes.autocast == expected
    assert run.modes.main_autocast == (expected[0][0] if expected else None)
    if loop in ("fp16", "fp16_inside"):
        assert [f.severity for f in found] == [Severity.WARNING]
        assert found[0].evidence == {"steps": 4, "of": 4}
        assert "GradScaler" in found[0].fix and "bfloat16" in found[0].fix
    else:
        assert not found
    assert run.scaler == loop.startswith("fp16_scaled")
    if scaler is not None:  # the norms are the unscaled ones: under 10 here, not ~6.5e5
        assert max(run.total_norms) < 10.0
        assert not [f for f in run.findings() if f.code == "grads.exploding"]


def _train_lm(model: nn.Module, *, lr: float, steps: int, length: int,
              memory: bool) -> RunRecord:
    """Monitor `steps` AdamW steps of a transformers language model (vocabulary of 128) on
    seeded batches of 4 sequences, one step in 5 sampled."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    with torchscope.monitor(model, opt, every=5, out=None, memory=memory) as mon:
        for _ in range(steps):
            ids = torch.randint(3, 128, (4, length), generator=g)
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
    assert mon.result is not None
    return mon.result


def test_a_small_init_embedding_growing_into_its_scale_is_no_falling_gradient_warning(
        ) -> None:
    """transformers' RWKV starts its embedding at std 1e-4 before a LayerNorm: over 40
    AdamW steps the embedding grows 55x and its gradient falls as much (a gradient behind a
    normalisation scales as 1/||w||), and the LayerNorm's output leaves its eps regime, 28x,
    with the same effect on its own gradient. Both read as layers that stop learning."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.RwkvForCausalLM(transformers.RwkvConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, attention_hidden_size=64,
        intermediate_size=128, context_length=32))
    run = _train_lm(model, lr=1e-3, steps=40, length=16, memory=True)
    fell = {f.module: f for f in run.findings() if f.code == "run.grad_fell" and f.module}
    emb, ln = fell["rwkv.embeddings"], fell["rwkv.blocks.0.pre_ln"]
    assert emb.severity == ln.severity == Severity.INFO
    assert emb.evidence["weights_growth"] > 10 and ln.evidence["output_growth"] > 10
    assert "normalises its output" in emb.summary
    assert not [f for f in run.findings() if f.severity >= Severity.WARNING]


def _train_images(model: nn.Module, *, batch: int, size: int, classes: int, seed: int,
                  memory: bool = True) -> RunRecord:
    """40 AdamW steps (lr 1e-3) of a transformers image classifier on random images and
    labels, monitored every 5 steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    with torchscope.monitor(model, opt, every=5, out=None, memory=memory) as mon:
        for _ in range(40):
            x = torch.randn(batch, 3, size, size, generator=g)
            y = torch.randint(0, classes, (batch,), generator=g)
            opt.zero_grad()
            model(pixel_values=x, labels=y).loss.backward()
            opt.step()
    assert mon.result is not None
    return mon.result


def test_a_gradient_read_while_the_weights_were_zero_is_no_baseline() -> None:
    """transformers' Data2VecVision starts its class token at zero, before a LayerNorm of
    eps 1e-12: its gradient is 52 at step 0 and 0.04 once AdamW has moved it. That read as
    "the embeddings' gradient fell 1,070x, 1,700x more than the median layer's" (warning).
    Samples taken while a layer's weights were all zero are left out of its trend."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.Data2VecVisionForImageClassification(
        transformers.Data2VecVisionConfig(
            image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=64, num_labels=5, use_mean_pooling=True))
    run = _train_images(model, batch=2, size=32, classes=5, seed=0, memory=False)
    cls = "data2vec_vision.embeddings"
    weights, grads = run.weight.series(cls), run.grad_param.series(cls)
    assert weights[0] == 0 and all(w > 0 for w in weights[1:])  # a zero init, then moved
    assert grads[0] > 100 * max(grads[1:])
    assert not [f for f in run.findings() if f.code == "run.grad_fell" and f.module == cls]
    assert not [f for f in run.findings() if f.severity >= Severity.WARNING]


def test_one_more_dead_unit_of_a_small_layer_is_no_warning() -> None:
    """transformers' RegNet, 40 AdamW steps on batches of 8: a squeeze-excitation ReLU of 8
    channels, each seen on 8 values, had 2 channels zero on one sample and 3 on the last;
    the first and the last sample alone read as dead units growing, 25% to 38%."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.RegNetForImageClassification(transformers.RegNetConfig(
        embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
        groups_width=8, num_labels=10))
    run = _train_images(model, batch=8, size=64, classes=10, seed=1)
    se = "regnet.encoder.stages.2.layers.0.layer.2.attention.1"
    fractions = [v for v in run.act_dead.series(se) if v == v]
    assert fractions[0] == 0.25 and fractions[-1] == 0.375  # one channel of 8 more
    assert not [f for f in run.findings() if f.code == "run.dead_units"]


def test_a_drift_is_named_at_the_layer_that_makes_it_not_at_the_dropout_after_it() -> None:
    """A transformers GPT-2 diverging under AdamW at lr 0.5: each projection's output drift
    was said twice, again at the dropout it feeds (`resid_dropout`, `mlp.dropout`), which
    only passes it on. GPT-2's MLP registers c_proj before the activation it calls first,
    so the layer before the dropout is read from the forward's call order."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=4, n_head=4, n_positions=32))
    run = _train_lm(model, lr=0.5, steps=60, length=32, memory=False)
    drift = [f for f in run.findings() if f.code == "run.activation_drift" and f.module]
    named = {f.module for f in drift}
    assert any(m.endswith("c_proj") for m in named)
    assert not [m for m in named if "dropout" in m], sorted(named)


@pytest.mark.parametrize("routing", ["collapsed", "healthy"])
def test_experts_no_token_reaches_are_dead_over_the_run(routing: str) -> None:
    """transformers' DeepSeek-V3, a mixture of 8 experts (top 2) in fused weights: two
    experts that its routing bias keeps the router from ever picking got a zero slice of
    the experts' gradient at every step (torch agrees), which no finding said. Over 6
    sampled steps they are `run.dead_experts`; with the routing as built, it is silent."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, n_group=1, topk_group=1))
    moe = model.model.layers[1].mlp
    if routing == "collapsed":
        with torch.no_grad():
            moe.gate.e_score_correction_bias[[2, 5]] = -1e4
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    idle: list[list[int]] = []
    with torchscope.monitor(model, opt, every=1, out=None, activations=False,
                            memory=False) as mon:
        for _ in range(6):
            x = torch.randint(0, 128, (4, 16), generator=g)
            opt.zero_grad()
            model(input_ids=x, labels=x).loss.backward()
            grad = moe.experts.gate_up_proj.grad  # (experts, 2 * moe_intermediate, hidden)
            per_expert = torch.linalg.vector_norm(grad.flatten(1), dim=1)  # (experts,)
            idle.append([e for e in range(8) if float(per_expert[e]) == 0.0])
            opt.step()
    run = mon.result
    assert run is not None and run.last is not None
    [use] = run.experts
    assert use.module == "model.layers.1.mlp.experts" and use.samples == 6
    assert list(use.idle) == [sum(e in step for step in idle) for e in range(8)]
    read = run.last.param("model.layers.1.mlp.experts.gate_up_proj").expert_norms
    assert read is not None
    assert list(read) == pytest.approx(per_expert.tolist(), rel=1e-5)
    found = [f for f in run.findings() if f.code == "run.dead_experts"]
    if routing == "collapsed":
        assert idle == [[2, 5]] * 6
        [f] = found
        assert f.severity == Severity.WARNING and f.module == use.module
        assert f.evidence["experts"] == "2,5" and f.evidence["of"] == 8
        assert "load-balancing" in f.fix
    else:
        assert idle == [[]] * 6 and not found


@pytest.mark.parametrize("routing", ["collapsed", "healthy"])
def test_experts_kept_as_modules_no_token_reaches_are_dead_too(routing: str) -> None:
    """transformers' Switch Transformers keeps each expert a module of its own: an expert
    its router never picks (here its routing bias) gets no gradient at all in a step. Over
    6 sampled steps that is `run.dead_experts` too; torch agrees step by step, and the
    routing as built is silent (an expert missed now and then is not dead)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.SwitchTransformersForConditionalGeneration(
        transformers.SwitchTransformersConfig(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
            num_heads=4, num_experts=4, encoder_sparse_step=1, decoder_sparse_step=1,
            router_bias=True, decoder_start_token_id=0, pad_token_id=0))
    moe = model.encoder.block[0].layer[1].mlp
    if routing == "collapsed":
        with torch.no_grad():
            moe.router.classifier.bias[1] = -1e4
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    idle = [0] * 4
    with torchscope.monitor(model, opt, every=1, out=None, activations=False,
                            memory=False) as mon:
        for _ in range(6):
            x = torch.randint(0, 64, (4, 16), generator=g)
            opt.zero_grad()
            model(input_ids=x, labels=torch.randint(0, 64, (4, 8), generator=g)).loss.backward()
            for e, expert in enumerate(moe.experts.children()):
                idle[e] += all(p.grad is None or not p.grad.any() for p in expert.parameters())
            opt.step()
    run = mon.result
    assert run is not None
    use = next(u for u in run.experts if u.module == "encoder.block.0.layer.1.mlp.experts")
    assert use.param == "" and use.samples == 6 and list(use.idle) == idle
    found = [f for f in run.findings() if f.code == "run.dead_experts"]
    if routing == "collapsed":
        assert idle[1] == 6
        [f] = found
        assert f.module == use.module and f.evidence["experts"] == "1"
    else:
        assert max(max(u.idle) for u in run.experts) < 6 and not found


def test_t5_feed_forward_units_that_die_in_training_are_counted_on_their_last_dim() -> None:
    # T5 v1.0's ReLU feed-forward on (batch, tokens, d_ff), trained at a learning rate high
    # enough for units to die: at each sampled step the run's dead fraction is torch's
    # count of units zero at every token of the batch. Counted over dim 1 (the tokens), it
    # read 0 throughout.
    model = t5_relu()
    act = "decoder.block.1.layer.2.DenseReluDense.act"
    seen: list[float] = []  # torch's dead fraction at the first call of each forward

    def count(_m: nn.Module, _i: object, out: torch.Tensor) -> None:
        seen.append(float((out.amax(dim=(0, 1)) == 0).sum()) / out.shape[-1])

    hook = model.get_submodule(act).register_forward_hook(count)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    try:
        with torchscope.monitor(model, opt, every=5, out=None, memory=False) as mon:
            for _ in range(30):
                ids = torch.randint(0, 100, (8, 16), generator=g)
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
    finally:
        hook.remove()
    run = mon.result
    assert run is not None and len(seen) == 30
    series = run.act_dead.series(act)
    assert len(run.act_dead.steps) == 6
    assert series == [seen[s] for s in run.act_dead.steps]
    assert max(series) >= 0.1  # units died: 13 of 64 by the last sample here


@pytest.mark.parametrize(("lr", "saturates"), [(0.1, True), (1e-3, False)])
def test_tanh_units_that_saturate_in_training(lr: float, saturates: bool, tmp_path: Path
                                              ) -> None:
    # Adam at 0.1 drives the pre-activations wide: the second tanh goes from 9% of its
    # values in the flat tails to over 90% in 60 steps. At each sampled step the run's
    # fraction is torch's, at the step's forward; at 1e-3 the run stays where it began.
    model = makemore_mlp(5 / 3)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    seen: list[float] = []
    hook = model[3].register_forward_hook(
        lambda _m, _i, out: seen.append(int((out.abs() >= 0.95 ** 0.5).sum()) / out.numel()))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(512, 30, generator=g), torch.randint(0, 27, (512,), generator=g)
    try:
        with torchscope.monitor(model, opt, every=4, out=tmp_path, memory=False) as mon:
            for _ in range(60):
                i = torch.randint(0, 512, (32,), generator=g)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x[i]), y[i]).backward()
                opt.step()
    finally:
        hook.remove()
    run = mon.result
    assert run is not None
    series = run.act_sat.series("3")
    assert series == [seen[s] for s in run.act_sat.steps]
    found = {f.module for f in run.findings() if f.code == "run.saturated"}
    if saturates:
        assert series[0] < 0.25 and series[-1] > 0.9 and "3" in found
    else:
        assert max(series) < 0.25 and not found
    assert "4" not in run.act_sat.layers  # the output Linear; no bounded activation
    doc = json.loads((tmp_path / "report.json").read_text())
    jsonschema.Draft202012Validator(load_schema()).validate(doc)
    sat = doc["sections"]["act_history"]["data"]["sat_frac"]
    assert sat["layers"] == ["1", "3"] and [row[1] for row in sat["values"]] == series
    page = (tmp_path / "report.html").read_text()
    assert ('data-plot="run-act-sat"' in page) == saturates


def test_a_head_no_optimizer_steps_is_named_not_its_growing_gradient() -> None:
    # The optimizer was built before the head was added: its gradient only adds up
    # (nothing steps or zeroes it), 18x over the run. That growth is no finding of its
    # own; the cause is.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    opt = torch.optim.Adam([*model[0].parameters(), *model[2].parameters()], lr=1e-3)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    with torchscope.monitor(model, opt, every=2, out=None, memory=False) as mon:
        for _ in range(20):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    run = mon.result
    assert run is not None and run.unoptimized == ("4.weight", "4.bias")
    head = run.grad_param.series("4")
    assert head[-1] > 10 * head[0]  # the pile-up
    codes = {(f.code, f.module) for f in run.findings()}
    assert ("grads.not_optimized", "4") in codes
    assert not {c for c in codes if c[0] in ("run.grad_grew", "run.grad_fell")}


@pytest.mark.parametrize("lr", [0.05, 1e-7])
def test_a_small_step_is_read_against_how_far_the_gradients_fell(lr: float) -> None:
    """An MLP fitting a linear target with SGD: after 1,500 steps its loss is about 6e-8
    and its steps move the weights by about 3e-6 of their norm, as a fitted model's do.
    That was "possibly too small a step: raise the learning rate". The same small step
    from a learning rate of 1e-7, whose gradients never fell, still asks for a larger one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)  # (64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    with torchscope.monitor(model, opt, every=50, out=None, memory=False,
                            activations=False) as mon:
        for _ in range(1500):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    run = mon.result
    assert run is not None
    (f,) = [f for f in run.findings() if f.code == "grads.update_ratio"]
    assert f.severity == Severity.INFO and float(f.evidence["median"]) < 1e-5
    if lr == 0.05:
        assert loss.item() < 1e-6
        assert run.total_norms[0] > 1000 * run.total_norms[-1]
        assert float(f.evidence["gradient_fall"]) > 1000
        assert "fits its data" in f.summary and f.fix.startswith("nothing while the loss")
    else:
        assert "gradient_fall" not in f.evidence and f.fix.startswith("raise the learning")


def _own_norms(model: nn.Module) -> dict[str, float]:
    """Each module's own parameters' joint norm (what the run's weight series reads)."""
    out = {}
    for name, m in model.named_modules():
        own = [p.detach().double() for p in m.parameters(recurse=False)]
        if own:
            out[name] = float(torch.sqrt(sum(p.square().sum() for p in own)))
    return out


@pytest.mark.parametrize("case", ["lr_0.1", "lr_0.1_no_decay", "weight_decay_50", "healthy"])
def test_weights_carried_far_from_their_scale_are_one_warning(case: str) -> None:
    """transformers' GPT-2 under AdamW at lr 0.1 (each weight moves by about 0.1 a step,
    against an init of std 0.02) or with weight_decay 50 (each step multiplies the weights
    by 1 - 1e-3 * 50 = 0.95), neither learning: the median layer's weights grow or shrink
    by 10x or more, against torch's own norms. At lr 1e-3 and the usual decay: silent."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32))
    lr, wd = {"lr_0.1": (0.1, 0.01), "lr_0.1_no_decay": (0.1, 0.0),
              "weight_decay_50": (1e-3, 50.0), "healthy": (1e-3, 0.01)}[case]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    g = torch.Generator().manual_seed(0)
    norms: list[dict[str, float]] = []
    with torchscope.monitor(model, opt, every=5, out=None, memory=False,
                            activations=False) as mon:
        for i in range(100):
            ids = torch.randint(0, 100, (4, 16), generator=g)  # (4, 16)
            model(input_ids=ids, labels=ids).loss.backward()
            if i in (0, 95):  # the first and the last sample, read before the update
                norms.append(_own_norms(model))
            opt.step()
            opt.zero_grad()
    run = mon.result
    assert run is not None and run.param_groups == ((lr, wd),)
    found = [f for f in run.findings() if f.code == "run.weight_scale"]
    if case == "healthy":
        assert not found, [f.summary for f in found]
        return
    (f,) = found
    ref = statistics.median(norms[1][k] / norms[0][k] for k in norms[0])
    assert f.severity == Severity.WARNING
    assert float(f.evidence["median_change"]) == pytest.approx(ref, rel=1e-4)
    (whole,) = [f for f in run.findings() if f.code == "run.grad_fell" and f.module is None]
    if case.startswith("lr_0.1"):
        assert ref > 10 and "weights grew" in f.summary and "lower the learning rate" in f.fix
        assert "while its weights grew" in whole.summary  # not "while the loss falls"
        # Without any weight decay, nothing bounds the growth: the fix says so.
        assert ("no parameter group has weight decay" in f.fix) == (wd == 0)
    else:
        assert ref < 0.1 and "weights shrank" in f.summary
        assert f.evidence["decay_per_step"] == pytest.approx(0.05)
        assert "1 - lr × weight_decay = 0.95 every step at its peak" in f.fix


def test_nan_made_between_modules_in_a_run_is_not_the_input_s() -> None:
    """The run said "the model's input already held NaN/Inf" where code in the model's own
    forward made it, while the capture said otherwise of the same forward."""

    class LogBetween(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.out = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 4) -> (N, 2)
            return self.out(torch.log(torch.relu(self.lin(x)) - 10.0))  # NaN: log of < 0

    torch.manual_seed(0)
    model = LogBetween()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with torchscope.monitor(model, opt, every=1, out=None, memory=False) as mon:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
    run = mon.result
    assert run is not None
    (told,) = [f for f in run.findings() if f.code == "run.nonfinite"]
    assert "no watched module covers, before out" in told.summary
    assert "input already held" not in told.summary

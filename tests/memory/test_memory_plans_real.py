"""Checkpoint plans that just work on real architectures (issue 12, defects 3 and 4).

Hugging Face decoders plan and verify with their KV cache on (the planner turns it off and
says so); frozen blocks are never candidates; no plan that keeps more than none is offered;
T5's encoder *and* decoder blocks are considered; a plan that fails its verification is
marked in the report instead of failing the analysis.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from torchscope.cli import app
from torchscope.errors import SelectionError
from torchscope.findings import Severity
from torchscope.memory import (
    analyze_memory,
    apply,
    plan_checkpointing,
    resolve_blocks,
    saved_activations,
)
from torchscope.memory.records import MemoryReport


def _gpt2(layers: int = 2) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_head=2, n_embd=32, vocab_size=100, n_positions=32)
    return GPT2LMHeadModel(cfg).train()


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, vocab_size=100,
                      max_position_embeddings=64)
    return LlamaForCausalLM(cfg).train()


def _ids(batch: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randint(0, 100, (batch, length), generator=torch.Generator().manual_seed(0))


def _grads_after_step(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Parameter gradients of one plain step: cross-entropy of the logits vs fixed ids."""
    model.zero_grad(set_to_none=True)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        logits = model(input_ids=ids, use_cache=False).logits  # (B, T, V)
        torch.nn.functional.cross_entropy(logits.reshape(-1, 100), ids.reshape(-1)).backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _standing_plan(report: MemoryReport) -> None:
    """The chosen plan stands: verified bitwise, and it keeps less than no checkpointing."""
    plan = report.chosen_plan
    assert plan is not None and plan.status == "ok" and plan.failed is None, report.plans
    assert plan.segments and plan.saved_bytes < report.plans.baseline_saved_bytes  # type: ignore[union-attr]
    assert report.verification is not None and report.verification.bitwise_equal
    assert not report.no_plan


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_hf_decoders_plan_and_verify_with_their_cache_on(build) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = build()
    assert model.config.use_cache is True  # the default that made the planner give up
    ids = _ids()
    before = _grads_after_step(model, ids)
    report = analyze_memory(model, {"input_ids": ids}, checkpoint="auto", repeats=1)
    _standing_plan(report)
    assert report.plans is not None
    assert any("use_cache=False" in n for n in report.plans.notes)
    assert any(f.code == "memory.plan_note" for f in report.findings())
    # The model is left as found: its config, its forward, its parameters' gradients.
    assert model.config.use_cache is True
    assert not any("forward" in vars(m) for m in model.modules())
    assert all(p.grad is None for p in model.parameters())
    after = _grads_after_step(model, ids)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_use_cache_keyword_input_is_turned_off_for_planning_only() -> None:
    torch.manual_seed(0)
    model = _gpt2()
    inputs = {"input_ids": _ids(), "use_cache": True}
    report = analyze_memory(model, inputs, checkpoint="sqrt", measure=False, repeats=1)
    _standing_plan(report)
    assert inputs["use_cache"] is True


def test_memory_cli_checkpoint_auto_on_a_gpt2_factory(tmp_path: Path) -> None:
    factory = tmp_path / "gpt2_factory.py"
    factory.write_text(
        "import torch\n"
        "from transformers import GPT2Config, GPT2LMHeadModel\n\n\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32)\n"
        "    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))\n"
        "    return GPT2LMHeadModel(cfg), {'input_ids': ids}\n")
    res = CliRunner().invoke(app, ["memory", f"{factory}:build", "--checkpoint", "auto",
                                   "--repeats", "1"])
    assert res.exit_code == 0, res.output
    assert "bitwise equal" in res.output and "use_cache=False" in res.output
    assert "memory.checkpoint_plan" not in res.output  # findings print their summary
    assert "checkpointing all 2 blocks saves" in res.output


def test_frozen_blocks_are_never_candidates() -> None:
    torch.manual_seed(0)
    model = _gpt2(layers=4)
    # A frozen backbone: embeddings and the first two blocks; the last two still train.
    for module in (model.transformer.wte, model.transformer.wpe, *model.transformer.h[:2]):
        module.requires_grad_(False)
    report = plan_checkpointing(model, {"input_ids": _ids()}, repeats=1)
    assert [b.name for b in report.blocks] == ["transformer.h.2", "transformer.h.3"]
    assert [n for n, _ in report.excluded] == ["transformer.h.0", "transformer.h.1"]
    assert all("no trainable work" in reason for _, reason in report.excluded)
    for plan in report.plans:
        assert not set(plan.checkpointed) & {"transformer.h.0", "transformer.h.1"}
        assert plan.saved_bytes <= report.baseline_saved_bytes
    m = report.measurement("all")
    assert m is not None and m.verification is not None and m.verification.bitwise_equal
    assert "memory.blocks_excluded" in [f.code for f in report.findings()]


def test_a_fully_frozen_backbone_has_no_plan_and_the_analysis_stands() -> None:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, vocab_size=100, max_position_embeddings=32)
    model = BertForSequenceClassification(cfg).train()
    model.bert.requires_grad_(False)  # only the classifier trains
    report = analyze_memory(model, {"input_ids": _ids()}, checkpoint="auto", repeats=1)
    assert report.saved.total_bytes > 0 and report.totals.parameters > 0
    assert report.chosen_plan is None and report.verification is None
    assert report.no_plan.startswith("no block is left to checkpoint: all 2 have no "
                                     "trainable work")
    assert report.plans is not None and report.plans.blocks == ()
    assert [p.name for p in report.plans.plans] == ["none"]
    found = report.findings()
    assert any(f.code == "memory.no_plan" and f.severity == Severity.INFO for f in found)
    assert not any(f.code == "memory.checkpoint_plan" for f in found)


class _Mix(nn.Module):
    """Saves only a (B, 1, D) mean inside; its (B, T, D) input is kept by nothing but a
    checkpoint of this block, so checkpointing it keeps more than not."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x.mean(1, keepdim=True))  # (B, T, D) + (B, 1, D)


class _MixNet(nn.Module):
    def __init__(self, d: int = 16, blocks: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(d, d)
        self.blocks = nn.ModuleList([_Mix(d) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)  # (B, T, D)
        for block in self.blocks:
            x = block(x)
        return x


def test_no_plan_that_keeps_more_than_none_is_offered_or_chosen() -> None:
    torch.manual_seed(0)
    model, x = _MixNet(), torch.randn(4, 32, 16)
    report = analyze_memory(model, x, checkpoint="auto", repeats=1)
    plans = report.plans
    assert plans is not None
    base = plans.baseline_saved_bytes
    for name in ("all", "sqrt"):
        plan = plans.plan(name)
        assert plan.saved_bytes > base  # what the old planner offered as 114-140 %
        assert plan.status == "keeps_more" and plan.failed is not None
        assert "no less than without checkpointing" in plan.failed
        assert plans.measurement(name) is None  # never applied
    chosen = report.chosen_plan
    assert chosen is not None and chosen.segments == () and chosen.saved_bytes == base
    for plan in plans.plans:
        if plan.status == "ok" and plan.segments:
            assert plan.saved_bytes < base
    found = report.findings()
    assert [f.code for f in found].count("memory.plan_keeps_more") == 2
    summary = next(f.summary for f in found if f.code == "memory.checkpoint_plan")
    assert "no checkpointing plan keeps fewer saved activations than none" in summary
    # Asked for by name, it is reported as not offered and never verified.
    sqrt = analyze_memory(model, x, checkpoint="sqrt", measure=False, repeats=1)
    assert sqrt.chosen == "sqrt" and sqrt.verification is None
    assert sqrt.chosen_plan is not None and sqrt.chosen_plan.status == "keeps_more"


def test_t5_plans_span_encoder_and_decoder_blocks() -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(d_model=32, d_ff=64, d_kv=16, num_heads=2, num_layers=2, vocab_size=100,
                   decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration(cfg).train()
    want = ("encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1")
    assert resolve_blocks(model).names == want
    inputs = {"input_ids": _ids(2, 12), "labels": _ids(2, 8)}
    report = analyze_memory(model, inputs, checkpoint="all", repeats=1)
    _standing_plan(report)
    assert report.plans is not None
    assert report.chosen_plan is not None and report.chosen_plan.checkpointed == want
    m = report.plans.measurement("all")
    assert m is not None and m.saved_bytes < report.plans.baseline_saved_bytes
    # The decoder blocks save activations of their own (cross-attention included).
    saved = {b.name: b.saved_bytes for b in report.plans.blocks}
    assert saved["decoder.block.0"] > 0 and saved["decoder.block.1"] > 0


class _TwoLists(nn.Module):
    """A down and an up path, each a ModuleList of repeated blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU())
                                   for _ in range(2)])
        self.up = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU())
                                 for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in [*self.down, *self.up]:
            x = block(x)  # (B, 16)
        return x


def test_every_repeated_block_list_is_planned_over() -> None:
    torch.manual_seed(0)
    model, x = _TwoLists(), torch.randn(8, 16)
    names = ("down.0", "down.1", "up.0", "up.1", "up.2")
    assert resolve_blocks(model).names == names
    report = analyze_memory(model, x, checkpoint="all", repeats=1)
    _standing_plan(report)
    assert report.checkpointable == names
    assert report.chosen_plan is not None and report.chosen_plan.checkpointed == names
    # The fix names the blocks (where the plan lowers the measured peak: a plan that
    # lowers nothing is not recommended), and applying it reproduces the plan's saved bytes.
    from torchscope.memory.analysis import apply_hint, lowers_peak

    hint = apply_hint(report.chosen_plan)
    assert hint == f"torchscope.memory.apply(model, blocks={list(names)!r})"
    fix = next(f.fix for f in report.findings() if f.code == "memory.checkpoint_plan")
    assert fix == ("" if lowers_peak(report.plans, "all") is False else hint)  # type: ignore[arg-type]
    m = report.plans.measurement("all")  # type: ignore[union-attr]
    with apply(model, blocks=list(names)):
        assert saved_activations(model, x).total_bytes == m.saved_bytes  # type: ignore[union-attr]


def test_a_frozen_prefix_keeps_the_rest_groupable() -> None:
    """A frozen first block leaves a run of consecutive children that can still share one
    checkpoint per segment."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(5)]
    model = nn.Sequential(*blocks)
    blocks[0].requires_grad_(False)
    x = torch.randn(8, 16)
    report = plan_checkpointing(model, x, loss_fn="sum", repeats=1)
    assert [b.name for b in report.blocks] == ["1", "2", "3", "4"]
    assert report.groupable  # blocks 1-4 are still consecutive children of the Sequential
    sqrt = report.plan("sqrt")
    assert sqrt.segments == ((0, 2), (2, 4)) and sqrt.checkpointed == ("1", "2", "3", "4")
    m = report.measurement("sqrt")
    assert m is not None and m.verification is not None and m.verification.bitwise_equal
    # The fix counts segments among the Sequential's children, and installs the same plan
    # (the finding gives it where the plan lowers the measured peak).
    from torchscope.memory.analysis import apply_hint, lowers_peak

    hint = apply_hint(sqrt)
    assert hint == "torchscope.memory.apply(model, blocks=model, segments=[(1, 3), (3, 5)])"
    fix = next(f.fix for f in report.findings() if f.code == "memory.checkpoint_plan"
               and f.evidence["plan"] == "sqrt")
    assert fix == ("" if lowers_peak(report, "sqrt") is False else hint)
    with apply(model, blocks=model, segments=[(1, 3), (3, 5)]) as handle:
        assert handle.checkpointed == ("1", "2", "3", "4")
        assert saved_activations(model, x, loss_fn="sum").total_bytes == m.saved_bytes


class _Jitter(nn.Module):
    """Draws from a Python generator, which checkpointing cannot replay: its recompute
    differs from its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.draws = random.Random(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * (1.0 + self.draws.random())  # (B, 8)


@pytest.mark.parametrize("measure", [True, False])
def test_a_plan_that_fails_verification_is_marked_not_raised(measure: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[_Jitter() for _ in range(4)])
    report = analyze_memory(model, torch.randn(4, 8), checkpoint="sqrt", measure=measure,
                            repeats=1)
    plan = report.chosen_plan
    assert plan is not None and plan.status == "unverified"
    assert plan.failed is not None and "checkpointing changed the result" in plan.failed
    assert report.verification is None and report.saved.total_bytes > 0
    failed = [f for f in report.findings() if f.code == "memory.checkpoint_failed"]
    assert len(failed) == 1 and failed[0].severity == Severity.WARNING
    assert not any(f.code == "memory.checkpoint_plan" for f in report.findings())
    assert not any("forward" in vars(m) for m in model.modules())


def test_given_blocks_that_match_nothing_fail_before_any_work() -> None:
    model = _MixNet()
    with pytest.raises(SelectionError):
        analyze_memory(model, torch.randn(2, 4, 16), blocks="nothing.here*", checkpoint="all")


def test_checkpointing_spectral_norm_layers_fails_verification_and_leaves_them_as_found(
        ) -> None:
    """spectral_norm runs a power iteration each training forward, which updates its
    vectors: the recomputation runs another one, so the gradients differ (the loss does
    not). The plan is refused, saying so, and the vectors are as they were."""
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(parametrizations.spectral_norm(nn.Linear(8, 8)),
                                          nn.Tanh()) for _ in range(4)])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = analyze_memory(model, torch.randn(4, 8), checkpoint="sqrt", measure=False,
                            repeats=1)
    plan = report.chosen_plan
    assert plan is not None and plan.status == "unverified" and plan.failed is not None
    assert "the same loss; largest gradient difference" in plan.failed
    assert "parametrizations.weight.original" in plan.failed
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

"""The rule catalog: stable codes, what each rule catches, what breaks, and the fix.

Adding a rule: a `Rule` here (with the words a file must contain for it to apply), a
`_tsNNN` method in `checker._Checker` called from its `run`, and a positive and a negative
fixture in tests/lint/fixtures (the tests check that every rule has both).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torchscope.errors import TorchscopeError
from torchscope.findings import Entry, Severity, Subject, declare


class LintUsageError(TorchscopeError):
    """A rule selection, a path or a `[tool.torchscope.lint]` table is not usable."""


@dataclass(frozen=True)
class Rule:
    """One lint rule.

    Attributes:
        code: stable identifier, `TS` + three digits.
        name: short kebab-case name (SARIF `rule.name`).
        summary: one sentence: the pattern the rule flags.
        breaks: what goes wrong at run time when the pattern runs.
        fix: the default fix; a finding may carry a more specific one.
        severity: how much it matters where the rule is sure; a finding where it is less
            sure carries a lower one (`LintViolation.severity`).
        triggers: words a file must contain for the rule to find anything in it (files
            with none of the enabled rules' words are only parsed); empty: always checked.
    """

    code: str
    name: str
    summary: str
    breaks: str
    fix: str
    severity: Severity
    triggers: tuple[str, ...] = ()


RULES: dict[str, Rule] = {
    r.code: r
    for r in (
        Rule(
            "TS001",
            "hook-registered-in-loop",
            "A `register_*hook` call inside a `for`/`while` body whose handle is neither removed "
            "in the same body nor used as a context manager.",
            "Every iteration adds one more hook to the same module: after N steps the hook runs "
            "N times per forward and keeps N copies of whatever it captures, so time and memory "
            "grow until the run slows down or runs out of memory.",
            "Register the hook once before the loop and call `handle.remove()` after it (in a "
            "`finally`), or scope it with `with module.register_forward_hook(fn):`.",
            Severity.ERROR,
            ("hook",),
        ),
        Rule(
            "TS002",
            "discarded-hook-handle",
            "The handle returned by `register_*hook` is neither assigned nor otherwise used: "
            "a warning where the registration runs again on the same module or tensor on "
            "every iteration of a loop (directly, or in a function this file calls from the "
            "loop) and for process-wide hooks (`register_module_*`); an info where it runs "
            "once, at setup (the hook is meant to stay for the object's life).",
            "Without the handle the hook can never be removed: it stays on the module for the "
            "rest of the process, fires in every later forward or backward (evaluation "
            "included) and keeps everything its closure references alive; registered per "
            "step, one more such hook piles up every iteration.",
            "Keep the handle (`handle = m.register_forward_hook(fn)`) and call "
            "`handle.remove()` when done, or use `with m.register_forward_hook(fn):`.",
            Severity.WARNING,
            ("hook",),
        ),
        Rule(
            "TS003",
            "deprecated-backward-hook",
            "A call to the deprecated `register_backward_hook`.",
            "On a module whose forward runs more than one autograd operation the legacy hook "
            "sees the gradients of the last operation only, so the grad_input it reports or "
            "rewrites is silently wrong.",
            "Use `register_full_backward_hook` (same `(module, grad_input, grad_output)` "
            "signature).",
            Severity.ERROR,
            ("backward_hook",),
        ),
        Rule(
            "TS004",
            "compile-in-loop",
            "`torch.compile(...)` or `model.compile()` that compiles the *same* model or "
            "function again on every iteration of a loop: in the loop body, or in a function "
            "that the same file calls from the loop with the same arguments. A loop over "
            "distinct modules (regional compilation: `for block in model.children(): "
            "block.compile()`) or over modes or backends compiles each once and is not "
            "flagged; nor is a compile that an `if` lets run once (`if step == warmup:`, "
            "`if not compiled:` around a branch that sets `compiled = True`).",
            "Every iteration builds a new compiled wrapper (`model = torch.compile(model)` nests "
            "one more each step) that goes through dynamo's cache and guard checks again; any "
            "guard change recompiles until the recompile limit, after which the model silently "
            "runs eager.",
            "Compile once, before the loop (`model = torch.compile(model)`), and call the "
            "compiled model inside it.",
            Severity.ERROR,
            ("compile",),
        ),
        Rule(
            "TS005",
            "empty-cache-as-fix",
            "`torch.cuda.empty_cache()` used as the out-of-memory fix: inside an `except "
            "torch.cuda.OutOfMemoryError` / `except RuntimeError` handler, or on every "
            "iteration of a loop with nothing released before it (no `del`, `gc.collect()`, "
            "`x = None`). Elsewhere, with nothing released, an info. Not flagged: after "
            "releasing references, next to loading a checkpoint or a model, or behind an "
            "option or a schedule (`if args.empty_cache_level >= 1`, `if step % 100 == 0`).",
            "empty_cache only returns cached blocks that no tensor uses; memory still "
            "referenced is not freed, so the out-of-memory error comes back, and the next "
            "allocations pay for cudaMalloc again.",
            "Drop the references first (`del out, loss`; `gc.collect()` for cycles) outside any "
            "except block, then retry; or need less memory (smaller batch, activation "
            "checkpointing, mixed precision).",
            Severity.WARNING,
            ("empty_cache",),
        ),
        Rule(
            "TS006",
            "host-sync-in-hook",
            "`.item()`, `.cpu()`, `.tolist()` or `print` of a tensor inside a function that "
            "is registered as a hook.",
            "Each one copies to the host and waits for the device on every forward or "
            "backward, stalling the hot path, and is a graph break under torch.compile.",
            "Reduce on the device inside the hook (keep tensors, `torch.stack` them) and copy "
            "to the host once per step, after the step.",
            Severity.WARNING,
            ("hook",),
        ),
        Rule(
            "TS007",
            "checkpoint-without-use-reentrant",
            "`torch.utils.checkpoint.checkpoint` or `checkpoint_sequential` without an "
            "explicit `use_reentrant=`.",
            "Without it PyTorch warns on every call and falls back to the reentrant "
            "implementation, which gives the checkpointed parameters no gradient when no "
            "input requires grad, rejects keyword arguments and does not work with "
            "`torch.autograd.grad`; PyTorch has announced the argument becomes required.",
            "Pass `use_reentrant=False` (recommended), or `use_reentrant=True` to keep the "
            "current behaviour explicitly.",
            Severity.WARNING,
            ("checkpoint",),
        ),
        Rule(
            "TS008",
            "hook-on-sharded-parameter",
            "`register_hook` on a parameter of a module that `fully_shard` (FSDP2) sharded "
            "in the same function.",
            "FSDP2 replaces the module's parameters with DTensors that are not on the "
            "autograd graph (backward runs on the all-gathered copies), so the hook never "
            "fires: no error, no gradient seen, no clipping or logging done.",
            "Use `p.register_post_accumulate_grad_hook(fn)`: FSDP2 runs it after the "
            "reduce-scatter, with this rank's shard of the reduced gradient in `p.grad`; or "
            "read `p.grad` after backward.",
            Severity.ERROR,
            ("fully_shard",),
        ),
        Rule(
            "TS009",
            "per-rank-grad-norm-logged",
            "A gradient norm logged under FSDP without a cross-rank reduction (`p.grad.norm()`,"
            " Lightning's `grad_norm`), or logged from a `register_hook` callback under DDP or "
            "FSDP.",
            "Under FSDP each rank holds a shard of every gradient: the norm of its shard "
            "under-reports the global norm (by about √ranks) and differs per rank. A tensor "
            "hook under DDP sees this rank's gradient before the all-reduce. The logged "
            "curve is neither the global norm nor the same on every rank.",
            "Reduce first: `dist.all_reduce` the squared local norms over the shard group and "
            "take the square root, use `p.grad.full_tensor().norm()` for one parameter, or "
            "log the total `clip_grad_norm_` returns (`.full_tensor()` under FSDP2); read "
            "gradients after backward, not in a tensor hook.",
            Severity.WARNING,
            ("norm",),
        ),
        Rule(
            "TS010",
            "eval-forward-with-grad",
            "A model called after `model.eval()` in the same function with gradients on: no "
            "`torch.no_grad()`/`torch.inference_mode()` around the call or on the function "
            "(or on every call of it in the file), and no backward in the function.",
            "`eval()` changes dropout and batch norm, not autograd: the forward still builds "
            "the graph and keeps every activation it saves until its output is dropped, so "
            "evaluation costs training's memory (and more time), and an output kept for a "
            "metric holds the whole graph.",
            "Wrap the evaluation in `with torch.no_grad():` (or `torch.inference_mode()`), "
            "or decorate the function with `@torch.no_grad()`.",
            Severity.WARNING,
            ("eval",),
        ),
        Rule(
            "TS011",
            "loss-history-kept",
            "A loss accumulated across a loop's iterations as a tensor: `total += loss`, "
            "`total = total + loss`, `metrics[\"loss\"] += loss` or `losses.append(loss)`, "
            "where the loop backpropagates `loss`, without `.item()`/`.detach()`.",
            "The accumulator holds each iteration's tensor with its autograd history, so every "
            "iteration's graph (its nodes; backward freed what they saved) stays reachable "
            "until the loop ends, and memory grows with each step (the PyTorch FAQ's first "
            "out-of-memory cause).",
            "Accumulate `loss.item()` (one host sync a step) or `loss.detach()` (stays on the "
            "device; read it once at the end).",
            Severity.WARNING,
            ("loss", "backward"),
        ),
        Rule(
            "TS012",
            "gradients-never-zeroed",
            "A loop whose own body backpropagates (`loss.backward()`, "
            "`accelerator.backward(loss)`) and calls an optimizer's `step()` while nothing in "
            "the loop (nor a function of the file it calls) zeroes the gradients: no "
            "`zero_grad()`, no `p.grad = None`.",
            "`backward()` adds to `.grad`: without zeroing, each step updates with the sum of "
            "every gradient since the loop began, so the steps grow and point at the "
            "average of the old batches rather than the current one.",
            "Call `optimizer.zero_grad()` once per step, before `backward()` or after "
            "`step()`; to accumulate over micro-batches, zero after each `step()`.",
            Severity.WARNING,
            ("backward",),
        ),
        Rule(
            "TS013",
            "eval-mode-not-undone",
            "A loop that backpropagates and calls `model.eval()` (or an evaluation function "
            "of the file that does) on the model it trains, while nothing in the loop calls "
            "`model.train()` again.",
            "`eval()` stays in effect: every step after the first evaluation trains with "
            "dropout off and BatchNorm normalising with its running statistics, which no "
            "longer update. Nothing fails; the model trains differently (and often worse).",
            "Call `model.train()` after the evaluation (or at the top of each epoch), or "
            "evaluate in a function that restores the mode it found.",
            Severity.WARNING,
            ("eval",),
        ),
        Rule(
            "TS014",
            "softmax-into-loss",
            "`cross_entropy` / `nn.CrossEntropyLoss` given the output of `softmax`, or "
            "`nll_loss` / `nn.NLLLoss` given `softmax` probabilities: directly, or through a "
            "name that the function only binds to a softmax.",
            "Cross-entropy takes logits and applies log_softmax itself: after a softmax the "
            "outputs live in [0, 1], the loss cannot go below log(1 + (C - 1)/e) (0.31 for "
            "two classes, 1.46 for ten) and the gradient shrinks as they saturate, so "
            "training stalls. NLL loss takes "
            "log-probabilities: given probabilities it computes -p, not -log p.",
            "Pass the logits to cross_entropy (keep softmax for reporting probabilities); "
            "for nll_loss, use log_softmax.",
            Severity.ERROR,
            ("softmax",),
        ),
        Rule(
            "TS015",
            "clip-before-unscale",
            "`torch.nn.utils.clip_grad_norm_` or `clip_grad_value_` in a function that scales "
            "the loss and steps through a GradScaler (`scaler.scale(loss).backward()`, "
            "`scaler.step(opt)`) without `scaler.unscale_(opt)`.",
            "The gradients still carry the loss scale (65536 at first, changing as the "
            "scaler adapts): the clip compares max_norm with the scaled norm, so it clips "
            "every step by a factor that follows the scale, not the gradients.",
            "Call `scaler.unscale_(optimizer)` before clipping; `scaler.step` then does not "
            "unscale again.",
            Severity.ERROR,
            ("clip_grad",),
        ),
        Rule(
            "TS016",
            "zero-grad-before-step",
            "`opt.zero_grad()` after a `backward()` and before `opt.step()` of that same "
            "optimizer (or `model.zero_grad()`, where the function steps one optimizer), in "
            "one block of statements.",
            "`zero_grad()` clears (or zeroes) the gradients that `backward()` has just made: "
            "the step then updates with no gradient, and the model does not learn.",
            "Call `optimizer.zero_grad()` before the forward (or after `step()`), never "
            "between `backward()` and `step()`.",
            Severity.ERROR,
            ("zero_grad",),
        ),
        Rule(
            "TS017",
            "clip-after-step",
            "`clip_grad_norm_` or `clip_grad_value_` after a backward's `opt.step()` and "
            "before the next backward, with no step after it.",
            "The optimizer has already updated with the unclipped gradients: the clip bounds "
            "nothing, and a gradient spike goes into the weights whole.",
            "Clip between `backward()` (and `scaler.unscale_(opt)`) and `opt.step()`.",
            Severity.ERROR,
            ("clip_grad",),
        ),
    )
}

# The rules join the catalogue of findings as `lint.TS001` and so on, so that
# `torchscope explain`, the docs' page of findings and the report read them as they read every
# other code. A violation where the checker is less sure carries a lower severity than its rule.
declare(*(Entry(
    code=f"lint.{r.code}", title=r.name, subject=Subject.LOOP,
    levels=frozenset(s for s in Severity if s <= r.severity),
    severity=f"{r.severity.label} where the pattern is certain; lower where the checker is "
             "less sure that the place is the trap",
    meaning=r.breaks, criterion=r.summary, fix=r.fix)
    for r in RULES.values()))


def resolve_codes(select: Iterable[str] | None, ignore: Iterable[str] = ()) -> frozenset[str]:
    """The rule codes enabled by `select` (default: all) minus `ignore`.

    Each entry is a code or a code prefix (`TS`, `TS00`, `TS001`), case-insensitive.

    Raises:
        LintUsageError: an entry matches no rule.
    """

    def expand(entries: Iterable[str], what: str) -> set[str]:
        out: set[str] = set()
        for raw in entries:
            entry = raw.strip().upper()
            if not entry:
                continue
            matched = set(RULES) if entry == "ALL" else \
                {code for code in RULES if code.startswith(entry)}
            if not matched:
                raise LintUsageError(
                    f"{what} {raw!r} matches no rule (known: {', '.join(RULES)}).",
                    fix="use a code such as TS001 or a prefix such as TS.",
                )
            out.update(matched)
        return out

    chosen = set(RULES) if select is None else expand(select, "--rules/select entry")
    return frozenset(chosen - expand(ignore, "--ignore/ignore entry"))

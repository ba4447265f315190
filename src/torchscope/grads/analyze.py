"""Diagnosis of gradient flow: pure functions from records to `Finding`s.

`diagnose` is the analyzer of `GradFlow` and `diagnose_watch` that of `GradWatch`; read them
as `flow.findings()` and `watch.findings()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from torchscope.errors import TorchscopeError
from torchscope.findings import Finding, Severity, analyzer, rank
from torchscope.grads.flow import GradWatch
from torchscope.grads.ranks import rank_findings
from torchscope.grads.records import NO_GRAD, NOT_REACHED, GradFlow, GradHistory

__all__ = [
    "GradThresholds",
    "diagnose",
    "diagnose_history",
    "diagnose_watch",
    "find_dead",
    "find_exploding",
    "find_nonfinite",
    "find_unreached",
    "find_vanishing",
    "layer_norms",
]

Metric = Literal["grad_output", "params"]


@dataclass(frozen=True)
class GradThresholds:
    """Where the diagnosis draws its lines.

    Attributes:
        vanishing_ratio: nearest-to-loss layer norm / farthest layer norm at or above which
            gradients are called vanishing (warning).
        vanishing_error_ratio: the same ratio for an error.
        exploding_ratio: farthest / nearest at or above which gradients grow toward the
            input (warning).
        exploding_norm: a total or per-layer norm above this is exploding (warning).
        exploding_error_norm: the same for an error.
        dead_norm: a gradient whose norm is at most this counts as all-zero.
        growth_ratio: in a history, last / first total norm at or above which the norm is
            growing out of bounds.
        metric: per-layer number compared: "grad_output" (gradient arriving at the layer)
            or "params" (the layer's own parameter gradients).
    """

    vanishing_ratio: float = 10.0
    vanishing_error_ratio: float = 1000.0
    exploding_ratio: float = 10.0
    exploding_norm: float = 1e3
    exploding_error_norm: float = 1e6
    dead_norm: float = 0.0
    growth_ratio: float = 100.0
    metric: Metric = "grad_output"


def _times(ratio: float) -> str:
    return f"{ratio:.0f}×" if ratio >= 10 else f"{ratio:.1f}×"


def layer_norms(flow: GradFlow, metric: Metric = "grad_output") -> list[tuple[str, float]]:
    """Per-layer norms in backward order (nearest the loss first), finite and positive only.

    Layers are the recorded modules that own parameters, or every recorded module when
    none does. "grad_output" combines all calls and micro-batches of a module; "params"
    combines the module's own parameter gradients.

    Raises:
        TorchscopeError: `metric` is neither "grad_output" nor "params".
    """
    owners = {r.module for r in flow.modules if r.owns_params}
    order = [m for m in flow.layers() if not owners or m in owners]
    if metric == "params":
        source = flow.param_norms()
    elif metric == "grad_output":
        source = flow.output_norms()
    else:
        raise TorchscopeError(f"metric={metric!r} is not a gradient metric; expected "
                              "'grad_output' or 'params'.",
                              fix="pass metric='grad_output' or metric='params'.")
    out = []
    for m in order:
        n = source.get(m)
        if n is not None and math.isfinite(n) and n > 0:
            out.append((m, n))
    return out


def find_vanishing(flow: GradFlow, thresholds: GradThresholds | None = None) -> list[Finding]:
    """Gradients that shrink from the layer nearest the loss to the farthest one."""
    t = thresholds or GradThresholds()
    norms = layer_norms(flow, t.metric)
    if len(norms) < 2:
        return []
    (near, n_near), (far, n_far) = norms[0], norms[-1]
    ratio = n_near / n_far
    if ratio < t.vanishing_ratio:
        return []
    severity = Severity.ERROR if ratio >= t.vanishing_error_ratio else Severity.WARNING
    return [Finding(
        code="grads.vanishing",
        severity=severity,
        summary=f"{far} receives {_times(ratio)} less gradient than {near}",
        evidence={"nearest": near, "nearest_norm": n_near, "farthest": far,
                  "farthest_norm": n_far, "ratio": ratio, "layers": len(norms),
                  "metric": t.metric, "step": flow.index},
        fix="add normalization (BatchNorm/LayerNorm) or residual connections, use ReLU-family "
        "activations with Kaiming init, or shorten the path from the loss to early layers.",
        module=far,
    )]


def find_exploding(flow: GradFlow, thresholds: GradThresholds | None = None) -> list[Finding]:
    """Gradients that grow toward the input, or norms above the exploding threshold."""
    t = thresholds or GradThresholds()
    found: list[Finding] = []
    norms = layer_norms(flow, t.metric)
    if len(norms) >= 2:
        (near, n_near), (far, n_far) = norms[0], norms[-1]
        ratio = n_far / n_near
        if ratio >= t.exploding_ratio:
            found.append(Finding(
                code="grads.exploding",
                severity=Severity.WARNING,
                summary=f"{far} receives {_times(ratio)} more gradient than {near}",
                evidence={"nearest": near, "nearest_norm": n_near, "farthest": far,
                          "farthest_norm": n_far, "ratio": ratio, "metric": t.metric,
                          "step": flow.index},
                fix="clip with torch.nn.utils.clip_grad_norm_, lower the learning rate or the "
                "init scale, and add normalization layers.",
                module=far,
            ))
    total = flow.total_norm
    if math.isfinite(total) and total > t.exploding_norm:
        biggest = max(((m, n) for m, n in flow.param_norms().items()
                       if n is not None and math.isfinite(n)), key=lambda x: x[1],
                      default=(None, math.nan))
        found.append(Finding(
            code="grads.exploding",
            severity=Severity.ERROR if total > t.exploding_error_norm else Severity.WARNING,
            summary=f"total gradient norm {total:.3g} is above {t.exploding_norm:g}"
            + (f"; largest at {biggest[0]} ({biggest[1]:.3g})" if biggest[0] is not None
               else ""),
            evidence={"total_norm": total, "threshold": t.exploding_norm,
                      "largest_module": biggest[0], "largest_norm": biggest[1],
                      "step": flow.index},
            fix="clip with torch.nn.utils.clip_grad_norm_ (max_norm around 1.0) and lower the "
            "learning rate.",
            module=biggest[0],
        ))
    return found


def find_dead(flow: GradFlow, thresholds: GradThresholds | None = None) -> list[Finding]:
    """Modules whose gradient is all zeros (every output gradient, or every parameter's),
    and modules that receive gradient but pass an all-zero gradient down."""
    t = thresholds or GradThresholds()
    dead_out: dict[str, list[float]] = {}
    alive_out: set[str] = set()
    for r in flow.modules:
        for g in r.grad_output:
            if g.norm is None:
                continue
            if g.norm <= t.dead_norm:
                dead_out.setdefault(r.module, []).append(g.norm)
            else:
                alive_out.add(r.module)
    dead_params: dict[str, list[str]] = {}
    alive_params: set[str] = set()
    for p in flow.params:
        if p.norm is None:
            continue
        if p.norm <= t.dead_norm:
            dead_params.setdefault(p.module, []).append(p.name)
        else:
            alive_params.add(p.module)
    found = []
    modules = [m for m in flow.layers() if m in dead_out and m not in alive_out]
    modules += [m for m in dead_params if m not in alive_params and m not in modules]
    # Receives gradient but passes none down (every ReLU unit off, a zero mask): the cause.
    blockers: dict[str, str] = {}
    for r in flow.modules:
        out_n, in_n = r.output_norm, r.input_norm
        if out_n is not None and in_n is not None and out_n > t.dead_norm >= in_n:
            blockers.setdefault(r.module, r.module_type)
    for m, type_name in blockers.items():
        found.append(Finding(
            code="grads.dead",
            severity=Severity.WARNING,
            summary=f"{m or '<root>'} ({type_name}) receives gradient but passes an all-zero "
            "gradient down",
            evidence={"kind": "blocks", "step": flow.index},
            fix="look for dead ReLUs (lower the learning rate, LeakyReLU/GELU, check biases "
            "and init) or a mask that blocks every position.",
            module=m,
        ))
    for m in modules:
        names = dead_params.get(m, []) if m not in alive_params else []
        what = "an all-zero gradient" if m in dead_out and m not in alive_out else \
            "all-zero parameter gradients"
        found.append(Finding(
            code="grads.dead",
            severity=Severity.WARNING,
            summary=f"{m or '<root>'} receives {what}",
            evidence={"kind": "zero", "zero_outputs": len(dead_out.get(m, [])),
                      "zero_params": len(names),
                      "params": ", ".join(names), "step": flow.index},
            fix="look for dead ReLUs (lower the learning rate, LeakyReLU/GELU), a branch "
            "multiplied by zero, or a mask that blocks every position.",
            module=m,
        ))
    return found


def find_nonfinite(flow: GradFlow, thresholds: GradThresholds | None = None) -> list[Finding]:
    """NaN/Inf gradients, naming the first module where they appear in backward order."""
    del thresholds  # no threshold: any NaN or Inf is reported
    bad_params = [p for p in flow.params if not p.finite]
    first = next((r for r in flow.modules if r.order is not None and not r.finite), None)
    if first is None and not bad_params and math.isfinite(flow.total_norm):
        return []
    evidence: dict[str, float | int | str | bool | None] = {
        "nonfinite_params": len(bad_params), "total_norm": flow.total_norm,
        "step": flow.index,
    }
    if first is not None:
        from_above = not all(g.finite for g in first.grad_output)
        evidence.update(module_call=first.call, backward_order=first.order,
                        arrives_from_above=from_above)
        where = first.module or "<root>"
        how = ("arrives already non-finite from above it (the loss or code outside the "
               "recorded modules)") if from_above else "is produced by its backward"
        summary = f"NaN/Inf gradient first appears at {where} in backward order: it {how}"
        module: str | None = first.module
    else:
        module = bad_params[0].module if bad_params else None
        summary = (f"NaN/Inf in the gradients of {len(bad_params)} parameter(s), first "
                   f"{bad_params[0].name}") if bad_params else "the total gradient norm is NaN/Inf"
    return [Finding(
        code="grads.nonfinite",
        severity=Severity.ERROR,
        summary=summary,
        evidence=evidence,
        fix="look for log(0), division by zero, sqrt of negatives or fp16 overflow (use "
        "GradScaler or bf16); torch.autograd.detect_anomaly() names the op.",
        module=module,
    )]


def find_unreached(flow: GradFlow, thresholds: GradThresholds | None = None) -> list[Finding]:
    """Trainable parameters that received no gradient this step."""
    del thresholds
    missing: dict[str, list[str]] = {}
    for p in flow.params:
        if p.requires_grad and p.norm is None and p.reason in (NOT_REACHED, NO_GRAD):
            missing.setdefault(p.module, []).append(p.name)
    if not missing:
        return []
    count = sum(len(v) for v in missing.values())
    mods = list(missing)
    return [Finding(
        code="grads.unreached",
        severity=Severity.INFO,
        summary=f"{count} trainable parameter(s) in {len(mods)} module(s) received no "
        f"gradient, e.g. {mods[0] or '<root>'}",
        evidence={"params": count, "modules": ", ".join(m or "<root>" for m in mods[:10]),
                  "step": flow.index},
        fix="if they should learn, make the loss depend on them; if not, freeze them "
        "(requires_grad_(False)) so optimizers and DDP skip them.",
        module=mods[0],
    )]


@analyzer(GradFlow)
def diagnose(flow: GradFlow, thresholds: GradThresholds | None = None) -> list[Finding]:
    """Every gradient finding for one step, most severe first (`flow.findings()`)."""
    found: list[Finding] = []
    for fn in (find_nonfinite, find_vanishing, find_exploding, find_dead, find_unreached):
        found += fn(flow, thresholds)
    found += rank_findings(flow)  # DDP/FSDP2 only: ranks that diverge or see skewed data
    return rank(found)


def diagnose_history(
    history: GradHistory, thresholds: GradThresholds | None = None
) -> list[Finding]:
    """Findings over sampled steps: the first non-finite total, and a growing total norm."""
    t = thresholds or GradThresholds()
    found: list[Finding] = []
    totals = history.total_norms
    bad = next((i for i, v in enumerate(totals) if not math.isfinite(v)), None)
    if bad is not None:
        found.append(Finding(
            code="grads.nonfinite",
            severity=Severity.ERROR,
            summary=f"the total gradient norm became NaN/Inf at step {history.steps[bad]}",
            evidence={"step": history.steps[bad], "samples": len(history)},
            fix="inspect that step with gradient_flow(); lower the learning rate or use "
            "GradScaler/bf16.",
        ))
    finite = [(s, v) for s, v in zip(history.steps, totals, strict=True)
              if math.isfinite(v) and v > 0]
    if len(finite) >= 2:
        (s0, v0), (s1, v1) = finite[0], finite[-1]
        if v1 / v0 >= t.growth_ratio:
            found.append(Finding(
                code="grads.exploding",
                severity=Severity.WARNING,
                summary=f"the total gradient norm grew {_times(v1 / v0)} from step {s0} to "
                f"step {s1}",
                evidence={"first_step": s0, "first_norm": v0, "last_step": s1,
                          "last_norm": v1, "ratio": v1 / v0},
                fix="clip with torch.nn.utils.clip_grad_norm_ and lower the learning rate.",
            ))
    return rank(found)


@analyzer(GradWatch)
def diagnose_watch(watch: GradWatch, thresholds: GradThresholds | None = None) -> list[Finding]:
    """Findings of a watched loop (`watch.findings()`): the last sample's, then the
    history's, most severe first."""
    last = watch.last
    found = diagnose(last, thresholds) if last is not None else []
    return rank(found + diagnose_history(watch.history, thresholds))

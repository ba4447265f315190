"""Graph breaks of one forward, from `torch._dynamo.explain`, located in the user's source."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchscope.compile._isolate import TORCH_DIR, private_code
from torchscope.compile.records import GraphBreak
from torchscope.models.target import ModelInputs

__all__ = ["BreakScan", "find_graph_breaks"]

_RESUME = re.compile(r"^torch_dynamo_resume_in_(.+)_at_\d+$")
_HOOK_DICTS = {
    "forward": "_forward_hooks",
    "forward_pre": "_forward_pre_hooks",
    "backward": "_backward_hooks",
    "backward_pre": "_backward_pre_hooks",
}


@dataclass(frozen=True)
class BreakScan:
    """What `find_graph_breaks` saw.

    Attributes:
        graph_count: graphs Dynamo produced for one call (graph breaks + 1 per frame).
        breaks: every graph break, in the order Dynamo met them.
    """

    graph_count: int
    breaks: tuple[GraphBreak, ...]


def classify_break(reason: str) -> str:
    """A short class for torch's break reason text."""
    low = reason.lower()
    if "`print`" in reason or "builtin operator print" in low:
        return "print() call"
    if "generic_jump" in low or "data-dependent" in low or "data dependent" in low:
        return "data-dependent branch"
    if "item()" in low:
        return "Tensor.item()"
    if "logging.logger" in low or "logging function" in low:
        return "logging call"
    if "tolist" in low or "numpy" in low:
        return "tensor to Python"
    if any(w in low for w in ("skip", "unsupported", "call_function", "attempted to call")):
        return "unsupported call"
    return "other"


def _split_reason(text: str) -> tuple[str, str]:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    while len(lines) > 1 and lines[0].startswith("Encountered graph break"):
        # A preface ("... when attempting to trace CALL: a function call, e.g. f(x, y):",
        # "... that we cannot resume from. ..."): the next line says what broke.
        lines = lines[1:]
    first = lines[0] if lines else text
    explanation = next((ln.split(":", 1)[1].strip() for ln in lines
                        if ln.startswith("Explanation:")), "")
    return first, explanation


def _function_name(name: str | None) -> str | None:
    """`forward` for Dynamo's resume functions such as `torch_dynamo_resume_in_forward_at_9`."""
    m = _RESUME.match(name or "")
    return m.group(1) if m else name


def _user_frame(stack: Any) -> tuple[str | None, int | None, str | None]:
    """The innermost frame outside torch's own package."""
    frames = list(stack or ())
    for fr in reversed(frames):
        filename = os.path.abspath(str(getattr(fr, "filename", "")))
        if not filename.startswith(TORCH_DIR):
            return filename, getattr(fr, "lineno", None), _function_name(getattr(fr, "name", None))
    if frames:
        fr = frames[-1]
        return str(fr.filename), fr.lineno, _function_name(fr.name)
    return None, None, None


def iter_module_hooks(model: nn.Module) -> Iterator[tuple[str, str, int, Callable[..., Any]]]:
    """`(module name, kind, handle id, hook)` for every module hook inside `model`."""
    for name, module in model.named_modules():
        for kind, attr in _HOOK_DICTS.items():
            for hook_id, fn in list((getattr(module, attr, None) or {}).items()):
                yield name, kind, int(hook_id), fn


def hook_at(model: nn.Module, file: str | None, line: int | None) -> tuple[str, str, str] | None:
    """`(module, kind, hook name)` of the module hook inside `model` whose code holds
    `file:line` (the root module is `<root>`), or None."""
    if file is None or line is None:
        return None
    target = os.path.abspath(file)
    for name, kind, _, fn in iter_module_hooks(model):
        code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__func__", None),
                                                        "__code__", None)
        if code is None or os.path.abspath(code.co_filename) != target:
            continue
        if line == code.co_firstlineno or any(ln == line for _, _, ln in code.co_lines()):
            return name or "<root>", kind, getattr(fn, "__name__", type(fn).__name__)
    return None


# Dynamo's reason for a graph that ends at a call it could not step into: where the break
# really is, it logs separately.
_STEP_UNSUPPORTED = "step_unsupported"


@contextlib.contextmanager
def _logged_breaks() -> Iterator[list[tuple[str, list[Any]]]]:
    """Every graph break Dynamo logs while open, as `(reason, user stack)`, the innermost
    frame last.

    When a break happens inside a function Dynamo was inlining and cannot resume there,
    the graph it compiles ends at the outer call, with the reason `step_unsupported`; the
    break itself (reason and stack) only reaches Dynamo's graph-break log. Dynamo's
    `log_graph_break` is wrapped for the block and put back after it.
    """
    found: list[tuple[str, list[Any]]] = []
    from torch._dynamo import symbolic_convert

    translator: Any = getattr(symbolic_convert, "InstructionTranslatorBase", None)
    original = None if translator is None else translator.__dict__.get("log_graph_break")
    if translator is None or not callable(original):
        yield found
        return

    def log_graph_break(self: Any, *args: Any, **kwargs: Any) -> Any:
        given = (*args, *kwargs.values())
        reason = next((a for a in given if isinstance(a, str)), "")
        exc = next((a for a in given if isinstance(a, BaseException)), None)
        if exc is not None and not getattr(exc, "logged", False):
            stack = (getattr(exc, "real_stack", None)
                     or torch._guards.TracingContext.extract_stack())
            found.append((reason, list(stack)))
        return original(self, *args, **kwargs)

    translator.log_graph_break = log_graph_break
    try:
        yield found
    finally:
        translator.log_graph_break = original


def _where_it_broke(text: str, stack: Any, logged: list[tuple[str, list[Any]]]
                    ) -> tuple[str, Any]:
    """The reason and stack of the break itself for a `step_unsupported` graph: the
    logged break whose stack passes through the same call. Otherwise as given."""
    if text.strip() != _STEP_UNSUPPORTED:
        return text, stack
    frames = list(stack or ())
    if not frames:
        return text, stack
    at = (os.path.abspath(str(frames[-1].filename)), frames[-1].lineno)
    for reason, logged_stack in logged:
        places = [(os.path.abspath(str(f.filename)), f.lineno) for f in logged_stack]
        if at in places[:-1]:
            return reason, logged_stack
    return text, stack


def find_graph_breaks(model: nn.Module, inputs: Any, *, train: bool = False) -> BreakScan:
    """Trace one call of `model` with Dynamo and locate every graph break.

    As `torch._dynamo.explain` does, with a backend that only collects the graphs, but
    without its `torch._dynamo.reset()`: the model runs on private copies of its forward
    code, so graphs compiled earlier in this process are neither reused nor dropped.

    Args:
        model: the eager model (not a `torch.compile` wrapper). It is called once, hooks
            included; its `forward` attributes are put back afterwards.
        inputs: a tensor, tuple, dict or `ModelInputs`.
        train: trace with autograd enabled (False: under `torch.no_grad()`).

    Returns:
        The graph count and the breaks, each with torch's reason, the user's file and line,
        and the hook it sits in when it is inside a registered hook.
    """
    mi = ModelInputs.of(inputs)
    graphs: list[Any] = []
    reasons: list[Any] = []

    def collect(gm: torch.fx.GraphModule, _example_inputs: Any) -> Callable[..., Any]:
        graphs.append(gm)
        reason = getattr(gm, "compile_subgraph_reason", None)
        if reason is not None and reason.graph_break:
            reasons.append(reason)
        return gm.forward

    with private_code(model), torch.set_grad_enabled(train), _logged_breaks() as logged:
        torch.compile(model, backend=collect)(*mi.args, **dict(mi.kwargs))
    breaks = []
    for r in reasons:
        text, stack = _where_it_broke(str(getattr(r, "reason", "")),
                                      getattr(r, "user_stack", ()), logged)
        first, explanation = _split_reason(text)
        file, line, function = _user_frame(stack)
        hook = hook_at(model, file, line)
        breaks.append(GraphBreak(
            kind=classify_break(text),
            reason=first,
            explanation=explanation,
            file=file,
            line=line,
            function=function,
            hook=None if hook is None else "{} {} hook {}".format(*hook),
            detail=text,
        ))
    return BreakScan(len(graphs), tuple(breaks))

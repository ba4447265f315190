"""torchscope's own hooks on compiled models: captured eagerly with no recompile, or refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchscope.capture import capture_activations
from torchscope.compile import watch_recompiles
from torchscope.errors import CompileError
from torchscope.hooks import (
    HookSession,
    check_compiled,
    compiled_capture,
    compiled_parts,
    unwrap_compiled,
)
from torchscope.models import TinyCNN

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("compile"),
              pytest.mark.usefixtures("fresh_dynamo")]


def _called_compiled() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    model = TinyCNN()
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        compiled(x)  # traced and cached without any hook
    return model, compiled, x


def test_raw_hooks_on_compiled_model_never_fire() -> None:
    # The trap the guard exists for: torch's behaviour, not torchscope's.
    model, compiled, x = _called_compiled()
    fired: list[str] = []
    handle = model.conv1.register_forward_hook(lambda *_: fired.append("conv1"))
    try:
        with watch_recompiles() as w, torch.no_grad():
            compiled(x)
    finally:
        handle.remove()
    assert fired == []
    assert w.compiles == 0


def test_capture_on_compiled_model_records_every_module_without_recompiling() -> None:
    # HookSession runs compiled parts eagerly while it holds hooks, for every capability.
    model, compiled, x = _called_compiled()
    with watch_recompiles() as w:
        cap = capture_activations(compiled, x)
        with torch.no_grad():
            compiled(x)  # the cached graph is still used afterwards
    check = cap.session.compiled_check
    assert check is not None and check.compiled == ("",) and check.compiles == 0
    assert w.compiles == 0
    eager = capture_activations(model, x)
    assert [r.module for r in cap.records] == [r.module for r in eager.records]
    for got, ref in zip(cap.records, eager.records, strict=True):
        assert got.outputs[0].mean == pytest.approx(ref.outputs[0].mean, rel=1e-6, abs=1e-7)


def test_guarded_backward_hooks_fire_and_gradients_match_eager() -> None:
    model, compiled, x = _called_compiled()
    seen: list[float] = []
    with compiled_capture(compiled, what="gradient flow") as guard, HookSession(model) as s:
        s.full_backward_hook(model.conv2, lambda _m, _gi, go: seen.append(float(go[0].norm())))
        compiled(x).square().mean().backward()
    assert len(seen) == 1 and guard.check.compiles == 0
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    model(x).square().mean().backward()
    for got, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad)


def test_refuse_policy_and_inner_compiled_parts() -> None:
    outer = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    outer[0] = torch.compile(outer[0], backend="eager")
    assert compiled_parts(outer) == ("0",)
    with pytest.raises(CompileError, match="compiled model") as info:
        check_compiled(outer, policy="refuse", what="capture_activations")
    assert info.value.fix
    assert not check_compiled(TinyCNN()).is_compiled
    inplace = TinyCNN()
    inplace.compile(backend="eager")
    assert compiled_parts(inplace) == ("",)
    # A method compiled on the instance (Lightning's `fit` on a compiled module) is a
    # compiled part; one that torch._dynamo.disable wraps is not.
    method = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    method[1].forward = torch.compile(method[1].forward, backend="eager")
    method[0].forward = torch._dynamo.disable(method[0].forward)
    assert compiled_parts(method) == ("1",)


def test_unwrap_compiled() -> None:
    model = TinyCNN()
    assert unwrap_compiled(torch.compile(model, backend="eager")) is model
    assert unwrap_compiled(model) is model


def test_compiled_capture_whose_enter_fails_restores_the_stance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch._dynamo.eval_frame as eval_frame

    import torchscope.hooks.compiled as hooks_compiled

    class Broken:
        def __enter__(self) -> None:
            raise RuntimeError("no watcher")

        def __exit__(self, *_exc: object) -> None:
            return None

    monkeypatch.setattr(hooks_compiled, "CompileCounter", Broken)
    compiled = torch.compile(TinyCNN(), backend="eager")
    with pytest.raises(RuntimeError, match="no watcher"), compiled_capture(compiled):
        pass
    assert eval_frame._stance.stance == "default"


def test_captures_closed_in_the_order_they_opened_restore_the_stance() -> None:
    """The run monitor opens one capture per watch and closes them first to last: each
    restored the stance it had found, `force_eager` for all but the first."""
    import torch._dynamo.eval_frame as eval_frame

    compiled = torch.compile(TinyCNN(), backend="eager")
    first, second = compiled_capture(compiled), compiled_capture(compiled)
    first.__enter__()
    second.__enter__()
    assert eval_frame._stance.stance == "force_eager"
    first.__exit__(None, None, None)
    assert eval_frame._stance.stance == "force_eager"  # the second still needs it
    second.__exit__(None, None, None)
    assert eval_frame._stance.stance == "default"


def test_hook_session_on_a_compiled_model_leaves_the_process_as_found() -> None:
    import os

    import torch._dynamo.eval_frame as eval_frame

    model, compiled, x = _called_compiled()
    stance, compile_fn = eval_frame._stance.stance, torch.compile
    env, rng = dict(os.environ), torch.get_rng_state()
    fired: list[int] = []
    with HookSession(compiled) as s:
        s.forward_hook(model.conv1, lambda *_: fired.append(1))
        assert eval_frame._stance.stance == "force_eager"  # compiled parts run eagerly
        compiled(x).sum().backward()
    assert fired == [1] and s.compiled_check is not None and s.compiled_check.compiles == 0
    assert eval_frame._stance.stance == stance and torch.compile is compile_fn
    assert dict(os.environ) == env and torch.equal(torch.get_rng_state(), rng)
    assert not model.conv1._forward_hooks
    with watch_recompiles() as w, torch.no_grad():
        compiled(x)  # the graph cached before the session, as it was
    assert w.compiles == 0


def test_a_model_given_to_watch_recompiles_is_refused_before_it_can_hang() -> None:
    # Taken as the on_recompile callback, a compiled model was called from inside Dynamo's
    # compile callback on the first recompile, re-entered the compiler and hung.
    compiled = torch.compile(nn.Linear(4, 4))
    for model in (compiled, nn.Linear(4, 4)):
        with pytest.raises(CompileError, match="takes no model") as err:
            watch_recompiles(model)  # type: ignore[arg-type]
        assert "watch_recompiles() as w" in str(err.value)
    handler = torch._dynamo.callback.callback_handler
    before = (list(handler.start_callbacks), list(handler.end_callbacks))
    with pytest.raises(CompileError):
        watch_recompiles(compiled)  # type: ignore[arg-type]
    assert (list(handler.start_callbacks), list(handler.end_callbacks)) == before

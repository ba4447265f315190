"""compile_once, the compile-in-a-loop detector, recompile watching and the hook audit.

Dynamo runs with backend="eager" here: the guards, recompiles and hook behaviour are
Dynamo's, and no inductor compile is paid.
"""

from __future__ import annotations

import copy
import inspect
import pickle
import warnings

import pytest
import torch
from torch import nn

from torchscope.compile import (
    CompileLoopWarning,
    RecompileWarning,
    audit_compiled_hooks,
    compile_guard,
    compile_once,
    late_hooks,
    track_compiled,
    watch_recompiles,
)
from torchscope.errors import CompileError
from torchscope.models import TinyCNN

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("compile"),
              pytest.mark.usefixtures("fresh_dynamo")]


def x4() -> torch.Tensor:
    return torch.randn(4, 3, 16, 16)


def test_compile_once_returns_the_same_wrapper() -> None:
    model = TinyCNN()
    compiled = compile_once(model, backend="eager")
    assert compile_once(model, backend="eager") is compiled
    assert compile_once(model, backend="eager", dynamic=False) is not compiled
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    assert compiled._orig_mod is model
    x = x4()
    torch.testing.assert_close(compiled(x), model(x))
    compile_once(model, backend="eager", dynamic=False)(x)  # runs its first-call stamp
    # Copies never inherit a wrapper of the original.
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        other = compile_once(clone, backend="eager")
        assert other is not compiled
        other(x)
    with pytest.raises(CompileError, match="original module"):
        compile_once(compiled)


def test_compile_in_a_loop_warns_at_the_call_site() -> None:
    model = TinyCNN()
    x = x4()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with compile_guard() as guard:
            for _ in range(3):
                torch.compile(model, backend="eager")(x)
    loops = [w for w in caught if issubclass(w.category, CompileLoopWarning)]
    assert len(loops) == 1  # once, on the second compile of the same module
    assert loops[0].filename == __file__
    assert "compile_once" in str(loops[0].message)
    assert guard.compile_calls == {"TinyCNN": 3}
    assert torch.compile.__module__.startswith("torch")  # restored on exit


def test_compile_once_in_a_loop_does_not_warn() -> None:
    model = TinyCNN()
    x = x4()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileLoopWarning)
        with compile_guard() as guard:
            for _ in range(3):
                compile_once(model, backend="eager")(x)
    assert guard.compile_calls == {}


def test_batch_size_changes_are_recompiles_with_guard_text() -> None:
    compiled = torch.compile(TinyCNN(), backend="eager", dynamic=False)
    with watch_recompiles() as w:
        for bs in (32, 16, 8):
            compiled(torch.randn(bs, 3, 16, 16))
    assert w.compiles == 3
    assert [r.guard for r in w.recompiles] == [
        "tensor 'x' size mismatch at index 0. expected 32, actual 16",
        "tensor 'x' size mismatch at index 0. expected 16, actual 8",
    ]
    # Each later recompile lists the failure of every cached graph, newest first.
    assert len(w.recompiles[1].reasons) == 2


def test_hook_registered_after_first_call_is_flagged_and_never_fires() -> None:
    model = TinyCNN()
    compiled = compile_once(model, backend="eager")
    x = x4()
    compiled(x)
    fired: list[int] = []
    early_audit = audit_compiled_hooks(compiled)
    handle = model.conv1.register_forward_hook(lambda _m, _i, _o: fired.append(1))
    try:
        compiled(x)
        assert fired == []  # torch's own behaviour: the traced graph has no such hook
        late = late_hooks(compiled)
        assert late is not None and [(h.module, h.kind) for h in late] == [("conv1", "forward")]
        findings = audit_compiled_hooks(compiled)
    finally:
        handle.remove()
    assert [f.code for f in early_audit] == []
    assert [f.code for f in findings] == ["compile.late_hook"]
    assert findings[0].module == "conv1"
    assert "never fire" in findings[0].summary


def test_untracked_wrapper_is_reported() -> None:
    compiled = torch.compile(TinyCNN(), backend="eager")
    assert late_hooks(compiled) is None
    assert [f.code for f in audit_compiled_hooks(compiled)] == ["compile.hooks_untracked"]
    track_compiled(compiled)
    compiled(x4())
    assert late_hooks(compiled) == ()


def test_hook_appending_to_a_list_recompiles_every_call() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    outputs: list[torch.Tensor] = []

    def keep(_m: nn.Module, _i: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        outputs.append(out)

    handle = model[0].register_forward_hook(keep)
    try:
        compiled = compile_once(model, backend="eager")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with compile_guard(recompile_warn_at=3) as guard:
                findings = audit_compiled_hooks(compiled, inputs=torch.randn(2, 8), calls=4)
    finally:
        handle.remove()
    assert len(outputs) == 4
    assert len(guard.recompiles) == 3  # calls 2, 3 and 4 each recompiled
    # The guards are on the list the hook appends to: its emptiness, then its length.
    line = inspect.getsourcelines(keep)[1] + 1
    assert all(r.source == f"{__file__}:{line}" for r in guard.recompiles), guard.recompiles
    assert "len(" in guard.recompiles[-1].guard
    hook = [f for f in findings if f.code == "compile.hook_recompiles"]
    assert len(hook) == 1
    assert hook[0].evidence["hook"] == "keep" and hook[0].evidence["recompiles"] == 3
    assert "every call" in hook[0].summary
    rec = [w for w in caught if issubclass(w.category, RecompileWarning)]
    assert len(rec) == 1 and "recompiled 3×" in str(rec[0].message)


def test_guard_whose_watcher_cannot_start_leaves_torch_compile_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torchscope.compile.watch import RecompileWatcher

    def refuse(self: RecompileWatcher) -> None:
        raise RuntimeError("no callbacks")

    original = torch.compile
    monkeypatch.setattr(RecompileWatcher, "install", refuse)
    with pytest.raises(RuntimeError, match="no callbacks"), compile_guard():
        pass
    assert torch.compile is original

"""profile_steps on the shared Step: the StepInfo it reports, the `target=` spelling, and the
process left as it was found."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from torchscope.models import MLP, TinyCNN
from torchscope.profiling import profile_steps
from torchscope.step import Step


def _stance() -> str:
    return str(torch._dynamo.eval_frame._stance.stance)


def test_step_info_is_the_first_step_of_a_plain_step() -> None:
    torch.manual_seed(0)
    model = TinyCNN()
    twin = copy.deepcopy(model)
    x = torch.randn(8, 3, 16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    result = profile_steps(model, x, optimizer=opt, steps=2, baseline_steps=0)
    torch.manual_seed(1)
    plain = Step(twin, x).forward_backward()
    assert result.step is not None
    assert result.step.loss == "auto → cross-entropy vs seeded targets"
    assert result.step.loss_value == float(plain)  # the warm-up step, on the unchanged model
    assert result.step.optimizer == "SGD"
    assert result.step.describe().startswith("loss: auto → cross-entropy vs seeded targets = ")


def test_a_ready_step_with_accumulation_is_profiled_as_it_is() -> None:
    model = MLP(16, 32, 4)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    step = Step(model, x, loss_fn="cross_entropy", target=y, accumulate=2,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    result = profile_steps(step, steps=2, baseline_steps=0)
    assert result.step is not None
    assert result.step.loss == "cross-entropy vs given targets"
    assert result.step.accumulate == 2
    assert result.calls("aten::addmm") == 2 * 2 * 2  # 2 Linear × 2 micro-batches × 2 steps
    assert [p.calls for p in result.phases] == [4, 4, 2]  # forward/backward per micro-batch


def test_target_is_the_one_spelling() -> None:
    model = MLP(16, 32, 4)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    result = profile_steps(model, x, target=y, steps=1, baseline_steps=0)
    assert result.step is not None and result.step.loss == "auto → cross-entropy vs given targets"
    with pytest.raises(TypeError, match="targets"):
        profile_steps(model, x, targets=y, steps=1)  # type: ignore[call-arg]


def test_a_step_function_has_no_step_info() -> None:
    model = MLP(16, 32, 4)
    x = torch.randn(8, 16)

    def train_step() -> None:
        model(x).sum().backward()

    result = profile_steps(train_step, model=model, steps=1, baseline_steps=0)
    assert result.step is None


def test_process_state_is_left_as_found() -> None:
    class Dropout(nn.Module):  # draws from the global generator every forward
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 4)
            self.drop = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.drop(self.fc(x))

    model = Dropout()
    x = torch.randn(8, 16)
    stance, compile_fn = _stance(), torch.compile
    env = dict(os.environ)
    rng = torch.get_rng_state()
    result = profile_steps(model, x, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                           steps=2, baseline_steps=1)
    assert result.steps == 2
    assert dict(os.environ) == env  # Kineto's log level and inductor's cache dir included
    assert torch.equal(torch.get_rng_state(), rng)
    assert _stance() == stance and torch.compile is compile_fn
    assert not torch.autograd._profiler_enabled()

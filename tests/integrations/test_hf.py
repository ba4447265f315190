"""TorchscopeTrainerCallback in a real transformers Trainer (CPU, a 2-layer GPT-2 from a config,
20 steps, gradient_accumulation_steps=2, max_grad_norm=1.0): the pre-clip total norm equals
the `grad_norm` clipping returned, scalars reach state.log_history and later callbacks' logs,
weights are bitwise unchanged, and a train() that raises leaves no hook."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from torchscope.hooks import audit_hooks  # noqa: E402
from torchscope.integrations.hf import TorchscopeTrainerCallback  # noqa: E402

from .._builders import assert_broadcast_told  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning")


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 100, (80, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Logs(TrainerCallback):  # type: ignore[misc]
    """A reporter stand-in: the `logs` each on_log hands to the callbacks after this one."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        self.seen.append(dict(logs or {}))


class Explode(TrainerCallback):  # type: ignore[misc]
    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == 7:
            raise RuntimeError("out of data at step 7")


def _trainer(tmp: Path, callbacks: list[TrainerCallback], steps: int = 20,
             **options: Any) -> tuple[Trainer, torch.nn.Module]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100,
                                       n_positions=32))
    args = TrainingArguments(**{
        "output_dir": str(tmp), "max_steps": steps, "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2, "max_grad_norm": 1.0, "learning_rate": 1e-3,
        "logging_steps": 1, "report_to": "none", "save_strategy": "no", "use_cpu": True,
        "seed": 0, "disable_tqdm": True, "dataloader_num_workers": 0, **options})
    return Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks), model


def test_hf_trainer_reports_the_pre_clip_norm_and_trains_unchanged(tmp_path: Path) -> None:
    transformers.logging.set_verbosity_error()
    callback = TorchscopeTrainerCallback(every=2, out=tmp_path / "run")
    later = Logs()
    trainer, model = _trainer(tmp_path / "a", [callback, later])
    with callback:
        trainer.train()
    plain_trainer, plain = _trainer(tmp_path / "b", [])
    plain_trainer.train()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    assert audit_hooks(model, include_global=False).local_total == 0
    run = callback.result
    assert run is not None and run.steps == 20 and run.samples == 10
    assert run.clip_setting == "max_grad_norm=1"  # the Trainer's own, for the fixes
    assert run.grad_param.steps == tuple(range(1, 20, 2))  # global_step 2, 4, ... 20
    assert run.last is not None and run.last.backward_calls == 2
    steps = [e for e in trainer.state.log_history if "grad_norm" in e]
    assert len(steps) == 20
    sampled = [e for e in steps if "torchscope/grad_norm/total" in e]
    assert [e["step"] for e in sampled] == list(range(2, 21, 2))
    for entry in sampled:
        ours = entry["torchscope/grad_norm/total"]
        assert entry["torchscope/step"] == entry["step"] - 1  # 0-based optimizer step
        assert math.isclose(ours, entry["grad_norm"], rel_tol=1e-6), entry
        assert entry["grad_norm"] > 1.0  # clipping acted: a post-clip norm would read 1.0
    for step, total in zip(run.grad_param.steps, run.total_norms, strict=True):
        assert math.isclose(total, steps[step]["grad_norm"], rel_tol=1e-6)
    # The Trainer clipped every step to max_grad_norm=1.0 before the update: read there.
    assert len(run.applied_norms) == 10
    assert all(math.isclose(a or 0, 1.0, rel_tol=1e-5) for a in run.applied_norms)
    # The callbacks after this one got the scalars in `logs`, on the sampled steps.
    assert [logs["torchscope/grad_norm/total"] for logs in later.seen
            if "torchscope/grad_norm/total" in logs] == [
        e["torchscope/grad_norm/total"] for e in sampled]
    doc = json.loads((tmp_path / "run" / "report.json").read_text())
    assert doc["options"]["producer"] == "torchscope.integrations.hf"
    assert run.modes.autocast == () and doc["step"]["autocast"] is None
    assert "transformer.h.0.attn.c_attn" in doc["sections"]["grad_history"]["data"][
        "param_norms"]["layers"]
    assert doc["sections"]["grad_history"]["data"]["applied_norms"] == list(run.applied_norms)
    # The linear schedule ends at lr 0; the run keeps the peak its samples saw, with the
    # Trainer's two groups (decay and no decay).
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [0.0, 0.0]
    peak = max(float(e["learning_rate"]) for e in steps)
    assert [wd for _, wd in run.param_groups] == [0.0, 0.0]
    assert all(lr == pytest.approx(peak, rel=0.1) for lr, _ in run.param_groups)


def test_a_trainer_with_torch_compile_runs_eagerly_under_the_callback(tmp_path: Path) -> None:
    """`torch_compile=True`: the Trainer calls the model through a compile wrapper that no
    callback is given. Dynamo traced the callback's hooks into its graph and recompiled at
    every step (3.7 s a step instead of 14 ms on a LoRA Llama). The model now runs eagerly
    while the callback is open, and the report says so; compiled code runs again after."""
    from torchscope.hooks.compiled import CompileCounter

    transformers.logging.set_verbosity_error()
    callback = TorchscopeTrainerCallback(every=2, out=None)
    trainer, model = _trainer(tmp_path / "a", [callback], steps=6, torch_compile=True,
                              torch_compile_backend="eager")
    with CompileCounter() as counter, callback:
        trainer.train()
    assert counter.compiles == 0
    assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    run = callback.result
    assert run is not None and run.compiled == ("",) and run.samples == 3
    assert "transformer.h.0.attn.c_attn" in run.act_std.layers  # the hooks fired
    assert run.last is not None and run.last.modules
    assert [f.severity.name for f in run.findings() if f.code == "run.compiled_eager"] \
        == ["INFO"]
    assert not [f for f in run.findings() if f.code == "grads.unseen_forward"]
    assert audit_hooks(model, include_global=False).local_total == 0
    assert str(torch._dynamo.eval_frame._stance.stance) == "default"
    with CompileCounter() as counter:
        trainer.model_wrapped(input_ids=torch.zeros(1, 8, dtype=torch.long))
    assert counter.compiles >= 1  # compiled again once the callback closed


def test_a_bf16_trainer_is_reported_as_trained_under_bfloat16_autocast(tmp_path: Path
                                                                       ) -> None:
    """Accelerate enters the Trainer's autocast inside the model's forward, after the
    root's forward pre-hooks; bfloat16 needs no GradScaler, so no warning."""
    transformers.logging.set_verbosity_error()
    callback = TorchscopeTrainerCallback(every=2, out=tmp_path / "run")
    trainer, model = _trainer(tmp_path / "a", [callback], steps=4, bf16=True)
    with callback:
        trainer.train()
    run = callback.result
    assert run is not None and run.steps == 4
    assert run.modes.autocast == (("torch.bfloat16", 4),)
    assert "run.fp16_unscaled" not in {f.code for f in run.findings()}
    doc = json.loads((tmp_path / "run" / "report.json").read_text())
    assert doc["step"]["autocast"] == "torch.bfloat16"
    assert "autocast: torch.bfloat16" in doc["step"]["text"]
    assert audit_hooks(model, include_global=False).local_total == 0


def test_install_puts_the_callback_before_the_reporters(tmp_path: Path) -> None:
    transformers.logging.set_verbosity_error()
    earlier = Logs()
    trainer, _ = _trainer(tmp_path / "a", [earlier], steps=4)
    callback = TorchscopeTrainerCallback(every=1, out=None).install(trainer)
    assert trainer.callback_handler.callbacks[0] is callback
    with callback:
        trainer.train()
    assert all("torchscope/grad_norm/total" in logs for logs in earlier.seen if "loss" in logs)


def _tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files under `log_dir`: (step, value) by tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(log_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


@pytest.mark.parametrize("how", ["callbacks", "add_callback", "install"])
def test_report_to_tensorboard_gets_the_scalars_however_the_callback_is_given(
        tmp_path: Path, how: str) -> None:
    """`report_to="tensorboard"`: the Trainer puts its TensorBoard callback before the
    user's, so a callback given as `callbacks=[callback]` added its scalars to `logs` after
    TensorBoard had written them (0 torchscope tags, against 19 with `install`). It now
    installs itself on the Trainer that calls it: every scalar of every sample is in the
    event files, at the Trainer's step, with the value the run reports."""
    pytest.importorskip("tensorboard")
    transformers.logging.set_verbosity_error()
    callback = TorchscopeTrainerCallback(every=2, out=None)
    trainer, _ = _trainer(tmp_path / "a", [callback] if how == "callbacks" else [], steps=6,
                          report_to="tensorboard", logging_steps=2)
    if how == "add_callback":
        trainer.add_callback(callback)
    elif how == "install":
        callback.install(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "cannot log" line: it can
        warnings.filterwarnings("ignore", category=UserWarning, module="(?!torchscope)")
        with callback:
            trainer.train()
    run = callback.result
    assert run is not None and run.samples == 3
    scalars = _tensorboard_scalars(tmp_path / "a")  # output_dir/runs/...
    ours = {tag: v for tag, v in scalars.items() if "torchscope/" in tag}
    names = [e for e in trainer.state.log_history if "torchscope/step" in e]
    expected = {k for e in names for k in e if k.startswith("torchscope/")}
    assert len(expected) > 10  # the total, the step, a norm per layer
    assert {tag.removeprefix("train/") for tag in ours} == expected
    total = dict(ours["train/torchscope/grad_norm/total"])
    assert sorted(total) == [2, 4, 6]  # the Trainer's global step of each log
    for step, value in zip(run.grad_param.steps, run.total_norms, strict=True):
        assert math.isclose(total[step + 1], value, rel_tol=1e-6)


def test_a_callback_given_to_a_second_trainer_moves_to_it(tmp_path: Path) -> None:
    """One callback, two Trainers made with it in turn: each puts it first in its list."""
    transformers.logging.set_verbosity_error()
    callback = TorchscopeTrainerCallback(every=1, out=None)
    first, _ = _trainer(tmp_path / "a", [callback], steps=2, report_to="tensorboard")
    second, _ = _trainer(tmp_path / "b", [callback], steps=2, report_to="tensorboard")
    assert first.callback_handler.callbacks[0] is callback
    assert second.callback_handler.callbacks[0] is callback
    with callback:
        second.train()
    assert callback.result is not None and callback.result.steps == 2
    assert any("train/torchscope/grad_norm/total" in tags
               for tags in _tensorboard_scalars(tmp_path / "b"))


def test_a_callback_no_trainer_calls_says_it_cannot_reach_the_loggers(tmp_path: Path
                                                                      ) -> None:
    """Events called by other code than a Trainer: the callback cannot put itself before
    `report_to`'s loggers, and says so in one line at on_train_begin, with the fix."""
    transformers.logging.set_verbosity_error()
    trainer, model = _trainer(tmp_path / "a", [], steps=2, report_to="tensorboard")
    callback = TorchscopeTrainerCallback(every=1, out=None)
    with pytest.warns(UserWarning) as seen:
        callback.on_train_begin(trainer.args, trainer.state, trainer.control, model=model)
    callback.close()
    (line,) = [str(w.message) for w in seen if "torchscope" in str(w.message)]
    assert "\n" not in line and "tensorboard" in line and "callback.install(trainer)" in line
    assert audit_hooks(model, include_global=False).local_total == 0


def test_a_train_that_raises_leaves_no_hook_and_a_partial_report(tmp_path: Path) -> None:
    transformers.logging.set_verbosity_error()
    callback = TorchscopeTrainerCallback(every=2, out=tmp_path / "run")
    trainer, model = _trainer(tmp_path / "a", [callback, Explode()])
    with pytest.raises(RuntimeError, match="out of data at step 7"), callback:
        trainer.train()
    assert audit_hooks(model, include_global=False).local_total == 0
    run = callback.result
    assert run is not None and run.status == "stopped" and run.steps == 7
    data = json.loads((tmp_path / "run" / "report.json").read_text())["sections"]["run"]
    assert data["data"]["status"] == "stopped"


_DDP_SCRIPT = """
import json, os, sys, time
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers import logging as hf_logging
from torchscope.integrations.hf import TorchscopeTrainerCallback

hf_logging.set_verbosity_error()


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 100, (80, 16), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100,
                                   n_positions=32))
args = TrainingArguments(
    output_dir=sys.argv[1], max_steps=6, per_device_train_batch_size=2,
    gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=1e-3, logging_steps=1,
    report_to="none", save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
    dataloader_num_workers=0, ddp_backend="gloo")
callback = TorchscopeTrainerCallback(every=1, out=None, activations=False, memory=False)
trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
with callback:
    trainer.train()
rank = int(os.environ["RANK"])
logged = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"wrapped": type(trainer.model_wrapped).__name__, "logged": logged,
               "reported": list(callback.result.total_norms)}, f)
# Let gloo's threads release the last collectives before the group goes (else torch may
# abort the process at exit), as the doctor's ranks do.
time.sleep(0.05)
torch.distributed.destroy_process_group()
"""


def test_hf_trainer_under_ddp_reports_the_synchronised_norm(tmp_path: Path) -> None:
    """Two ranks under torchrun: the Trainer wraps the model in DDP out of the callback's
    sight. Each rank must report the Trainer's own grad_norm (synchronised, before
    clipping), not the norm of its own rows' gradients."""
    import os
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_DDP_SCRIPT)
    src = Path(__file__).resolve().parents[2] / "src"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(src), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", str(script), str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=240, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for a in ranks:
        assert a["wrapped"] == "DistributedDataParallel"
        assert len(a["logged"]) == 6 and any(v > 1.0 for v in a["logged"])  # clipping acted
        assert a["reported"] == pytest.approx(a["logged"], rel=1e-6)
    assert ranks[0]["reported"] == ranks[1]["reported"]


class OwnLossRegressor(torch.nn.Module):
    """A model of the user's for the Trainer that returns its own loss, as Trainer models
    do: one output per row against `(N,)` labels, squeezed or not."""

    def __init__(self, squeeze: bool) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 1))
        self.squeeze = squeeze

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)  # (N, 1)
        pred = out.squeeze(-1) if self.squeeze else out
        return {"loss": (pred - labels).square().mean(), "logits": out}


class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 8, generator=g), torch.randn(64, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def _rows_args(tmp: Path) -> TrainingArguments:
    """Four steps of 16 `Rows` each."""
    return TrainingArguments(
        output_dir=str(tmp), max_steps=4, per_device_train_batch_size=16,
        learning_rate=1e-3, report_to="none", save_strategy="no", use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0)


@pytest.mark.parametrize("squeeze", [False, True])
def test_a_models_own_loss_is_read_under_the_trainer(tmp_path: Path, squeeze: bool) -> None:
    # No callback sees the Trainer's loss: the model's own, returned with its output, is
    # read at its first forward with gradients.
    transformers.logging.set_verbosity_error()
    callback = TorchscopeTrainerCallback(every=2, out=None)
    torch.manual_seed(0)
    args = _rows_args(tmp_path)
    trainer = Trainer(model=OwnLossRegressor(squeeze), args=args, train_dataset=Rows(),
                      callbacks=[callback])
    with callback:
        trainer.train()
    run = callback.result
    assert run is not None and run.steps == 4
    assert_broadcast_told(run, not squeeze, ((16, 1), (16, 16)))
    if not squeeze:
        assert run.loss_broadcast.output == "['logits']"


def test_a_resumed_run_numbers_its_steps_on_from_the_checkpoint(tmp_path: Path) -> None:
    """Resumed from checkpoint-4, the Trainer counts on from global_step 4; the callback
    counted from 0 again, so its sampled steps fell where the Trainer logged nothing and its
    step numbers named steps of the earlier run."""
    transformers.logging.set_verbosity_error()
    first, _ = _trainer(tmp_path, [], steps=8, save_strategy="steps", save_steps=4)
    first.train()
    callback = TorchscopeTrainerCallback(every=2, out=None)
    resumed, _ = _trainer(tmp_path, [callback], steps=8)
    with callback:
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    run = callback.result
    assert run is not None and run.first_step == 4 and run.steps == 4
    assert run.grad_param.steps == (5, 7)  # after global_step 6 and 8, 0-based as ever
    logged = [(e["step"], e["torchscope/step"], e["torchscope/grad_norm/total"],
               e["grad_norm"]) for e in resumed.state.log_history if "torchscope/step" in e]
    assert [(step, ours) for step, ours, _, _ in logged] == [(6, 5), (8, 7)]
    assert all(math.isclose(ours, theirs, rel_tol=1e-6) for _, _, ours, theirs in logged)


def test_a_run_resumed_into_the_same_folder_continues_its_report(tmp_path: Path) -> None:
    """Resumed from checkpoint-4 with the same `out`: the report of the run before is not
    overwritten; the new one goes on from its samples before step 4, with the resume
    marked."""
    transformers.logging.set_verbosity_error()
    out = tmp_path / "run"
    before = TorchscopeTrainerCallback(every=2, out=out)
    first, _ = _trainer(tmp_path, [before], steps=8, save_strategy="steps", save_steps=4)
    with before:
        first.train()
    callback = TorchscopeTrainerCallback(every=2, out=out)
    resumed, _ = _trainer(tmp_path, [callback], steps=8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with callback:
            resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert not [w for w in seen if str(w.message).startswith("torchscope")]
    a, run = before.result, callback.result
    assert a is not None and a.grad_param.steps == (1, 3, 5, 7)
    assert run is not None and run.first_step == 4 and run.resumed_at == (4,)
    assert run.grad_param.steps == (1, 3, 5, 7)  # 1 and 3 from the run before
    assert run.total_norms[:2] == a.total_norms[:2]
    data = json.loads((out / "report.json").read_text())["sections"]["run"]["data"]
    assert data["resumed_at"] == [4] and data["steps"] == 4


class Regressor(torch.nn.Module):
    """One output per row; its own loss only where it is given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None
                ) -> dict[str, torch.Tensor]:
        out = self.net(x)  # (N, 1)
        return {"logits": out} if labels is None else \
            {"loss": (out.squeeze(-1) - labels).square().mean(), "logits": out}


def _broadcasting_loss(outputs: dict[str, torch.Tensor], labels: torch.Tensor,
                       num_items_in_batch: Any = None) -> torch.Tensor:
    return torch.nn.functional.mse_loss(outputs["logits"], labels)  # (N, 1) vs (N,)


@pytest.mark.parametrize("install", [False, True])
def test_a_loss_the_trainer_computes_outside_the_model(tmp_path: Path, install: bool) -> None:
    """With compute_loss_func the Trainer pops the labels and computes the loss itself: the
    model returns none, so the broadcast went untold and the report read as clean. The
    callback hands the Trainer's loss to the monitor, installed by hand or given in
    `callbacks=[...]` (it installs itself on the Trainer calling it)."""
    transformers.logging.set_verbosity_error()
    callback = TorchscopeTrainerCallback(every=2, out=None)
    torch.manual_seed(0)
    args = _rows_args(tmp_path)
    trainer = Trainer(model=Regressor(), args=args, train_dataset=Rows(),
                      compute_loss_func=_broadcasting_loss, callbacks=[callback])
    if install:
        callback.install(trainer)
    with callback:
        trainer.train()
    run = callback.result
    assert run is not None and run.steps == 4
    assert "compute_loss" not in vars(trainer)  # the Trainer's own method again
    assert_broadcast_told(run, True, ((16, 1), (16, 16)))
    assert run.loss_seen and "run.loss_unseen" not in [f.code for f in run.findings()]


def test_a_loss_no_callback_event_of_a_trainer_handed_over_is_said_unseen(tmp_path: Path
                                                                          ) -> None:
    """The monitor opened by events no Trainer called (so not installed): the Trainer's
    own loss never reaches it, and the report says so, with the fix."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    trainer = Trainer(model=Regressor(), args=_rows_args(tmp_path), train_dataset=Rows(),
                      compute_loss_func=_broadcasting_loss)
    callback = TorchscopeTrainerCallback(every=2, out=None)
    callback.on_train_begin(trainer.args, trainer.state, trainer.control,
                            model=trainer.model)
    trainer.train()  # no event of it reaches the callback: no step ends, no loss is seen
    callback.close()
    run = callback.result
    assert run is not None and not run.loss_seen
    (unseen,) = [f for f in run.findings() if f.code == "run.loss_unseen"]
    assert unseen.fix is not None and "callback.install(trainer)" in unseen.fix

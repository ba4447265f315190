"""TorchscopeCallback in a real pytorch-lightning Trainer (CPU, tiny model, 20 steps):
accumulate_grad_batches=2, bitwise-identical weights, the gradients Lightning hands to
on_before_optimizer_step, scalars in the trainer's logger, no hook left, and a fit that
raises."""

from __future__ import annotations

import csv
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pl = pytest.importorskip("pytorch_lightning")
from pytorch_lightning.loggers import CSVLogger  # noqa: E402

from torchscope.hooks import audit_hooks  # noqa: E402
from torchscope.integrations.lightning import TorchscopeCallback  # noqa: E402

from .._builders import assert_broadcast_told  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")


class Net(pl.LightningModule):
    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(16, 2)
        self.fail_at = fail_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(self.act(self.fc1(x))))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        if self.fail_at is not None and self.global_step == self.fail_at:
            raise RuntimeError(f"bad batch at step {self.global_step}")
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Wrapper(pl.LightningModule):
    """No forward of its own: the training step calls `self.model`."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Reference(pl.Callback):
    """What Lightning hands to on_before_optimizer_step: each parameter's gradient norm."""

    def __init__(self) -> None:
        self.norms: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # type: ignore[no-untyped-def]
        self.norms.append({n: torch.linalg.vector_norm(p.grad).item()
                           for n, p in pl_module.named_parameters()})


def _fit(module: pl.LightningModule, tmp: Path, *callbacks: pl.Callback,
         steps: int = 20, ckpt_path: str | None = None, **options: Any) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(160, 8, generator=g),
                                        torch.randn(160, 2, generator=g))
    loader = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True)
    options = {"log_every_n_steps": 1, **options}
    trainer = pl.Trainer(max_steps=steps, accumulate_grad_batches=2, accelerator="cpu",
                         devices=1, logger=CSVLogger(tmp), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=list(callbacks), **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer


def test_lightning_s_gradient_clipping_is_read_after_its_closure(tmp_path: Path) -> None:
    """`gradient_clip_val`: Lightning clips inside the closure it passes to the optimizer's
    step, after `on_before_optimizer_step` ended the step: the norm the update used is
    read once the closure has returned."""
    callback = TorchscopeCallback(every=2, out=None)
    pl.seed_everything(0, verbose=False)
    _fit(Net(), tmp_path, callback, steps=8, gradient_clip_val=0.01)
    run = callback.result
    assert run is not None and len(run.total_norms) == 4
    assert run.clip_setting == "gradient_clip_val=0.01"  # the Trainer's own, for the fixes
    assert all(t > 0.5 for t in run.total_norms)  # before clipping
    assert len(run.applied_norms) == 4
    assert all(math.isclose(a or 0, 0.01, rel_tol=1e-4) for a in run.applied_norms)
    (clipped,) = [f for f in run.findings() if f.code == "grads.clipped"]
    assert clipped.evidence["clipped"] == 4
    # The fix names the setting a Trainer user has, not only clip_grad_norm_'s argument.
    assert clipped.fix is not None and "gradient_clip_val" in clipped.fix


def _module_norm(norms: dict[str, float], module: str) -> float:
    return math.sqrt(math.fsum(v * v for k, v in norms.items()
                               if k.rsplit(".", 1)[0] == module))


def test_lightning_fit_is_watched_exactly_and_left_unchanged(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    watched = Net()
    pl.seed_everything(0, verbose=False)
    plain = Net()
    callback = TorchscopeCallback(every=3, out=tmp_path / "run", profile=2)
    reference = Reference()
    trainer = _fit(watched, tmp_path / "logs", callback, reference)
    _fit(plain, tmp_path / "logs-plain")
    for a, b in zip(watched.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)  # bitwise, dropout's random stream included
    assert audit_hooks(watched, include_global=False).local_total == 0
    assert not trainer.optimizers[0]._optimizer_step_pre_hooks
    run = callback.result
    assert run is not None and run.status == "completed"
    assert run.steps == trainer.global_step == 20 and run.step_by == "manual"
    # The steps after which the step count is a multiple of 3, as Lightning logs.
    assert run.grad_param.steps == (2, 5, 8, 11, 14, 17)
    assert run.last is not None and run.last.backward_calls == 2  # accumulate_grad_batches
    assert run.last.micro_batches == 2
    for layer in ("fc1", "fc2"):
        for step, value in zip(run.grad_param.steps, run.grad_param.series(layer),
                               strict=True):
            assert math.isclose(value, _module_norm(reference.norms[step], layer),
                                rel_tol=1e-6)
    # Scalars went straight to the trainer's logger (CSV here), at the sampled steps.
    rows = list(csv.DictReader((Path(trainer.logger.log_dir) / "metrics.csv").open()))
    logged = {int(float(r["torchscope/step"])): float(r["torchscope/grad_norm/total"])
              for r in rows if r.get("torchscope/step")}
    assert set(logged) == set(run.grad_param.steps)
    for step, total in zip(run.grad_param.steps, run.total_norms, strict=True):
        assert math.isclose(logged[step], total, rel_tol=1e-6)
    doc = json.loads((tmp_path / "run" / "report.json").read_text())
    assert doc["kind"] == "run"
    assert doc["options"]["producer"] == "torchscope.integrations.lightning"
    assert doc["sections"]["profile"]["status"] == "ok"
    # Lightning steps with a closure: forward and backward run inside the optimizer's step
    # range, which holds Lightning's own code too. Forward and backward are read from
    # torch's ranges; the optimizer's update is not told apart, and not called costly.
    profile = run.profile
    assert profile is not None
    assert [(p.name, p.derived) for p in profile.phases] == [("forward", True),
                                                             ("backward", True)]
    codes = {f.code: f for f in run.findings()}
    assert "profiling.optimizer_share" not in codes
    assert not codes["profiling.top_op"].evidence["op"].startswith("Optimizer.")
    assert any("closure" in n for n in profile.notes)
    # Lightning zeroes in the closure that each step runs: the first step's closure held
    # the first backward the watch saw, with nothing before it to compare with.
    assert run.unzeroed_steps == 0 and "grads.not_zeroed" not in codes


def test_mixed_precision_is_reported_as_the_autocast_dtype_it_ran(tmp_path: Path) -> None:
    """Lightning autocasts around `training_step`; on CPU its "16-mixed" is bfloat16, which
    needs no GradScaler: no run.fp16_unscaled."""
    callback = TorchscopeCallback(every=2, out=None)
    _fit(Net(), tmp_path / "logs", callback, steps=4, precision="16-mixed")
    run = callback.result
    assert run is not None and run.modes.autocast == (("torch.bfloat16", 4),)
    assert "run.fp16_unscaled" not in {f.code for f in run.findings()}


def test_a_fit_that_raises_leaves_no_hook_and_a_partial_report(tmp_path: Path) -> None:
    module = Net(fail_at=7)
    callback = TorchscopeCallback(every=2, out=tmp_path / "run")
    with pytest.raises(RuntimeError, match="bad batch at step 7"):
        _fit(module, tmp_path / "logs", callback)
    assert audit_hooks(module, include_global=False).local_total == 0
    run = callback.result
    assert run is not None and run.status == "stopped" and run.steps == 7
    assert "bad batch at step 7" in run.error
    data = json.loads((tmp_path / "run" / "report.json").read_text())["sections"]["run"]
    assert data["data"]["status"] == "stopped" and data["data"]["steps"] == 7


def test_the_model_the_training_step_calls_is_watched(tmp_path: Path) -> None:
    module = Wrapper()
    callback = TorchscopeCallback(every=5, out=None)
    _fit(module, tmp_path / "logs", callback, steps=10)
    run = callback.result
    assert run is not None and run.model == "Sequential" and run.inputs == "(4x8)"
    assert run.act_std.layers == ("0", "1", "2")  # the forward was seen: activations too
    assert audit_hooks(module, include_global=False).local_total == 0
    with pytest.raises(Exception, match="not a submodule"):
        _fit(Wrapper(), tmp_path / "logs2", TorchscopeCallback(module="net", out=None),
             steps=2)


def test_a_compiled_module_given_to_fit_runs_eagerly_under_the_callback(
        tmp_path: Path) -> None:
    """`trainer.fit(torch.compile(module))`: Lightning unwraps the compiled module and sets
    compiled `forward` and `training_step` on the instance. torchscope did not see them as
    compiled, Dynamo traced its hooks and compiled 90 frames in 8 steps; they now run
    eagerly while the callback is open, the report says so once, and they compile again
    after."""
    from torchscope.hooks.compiled import CompileCounter

    module = Net()
    callback = TorchscopeCallback(every=2, out=None)
    with CompileCounter() as counter:
        _fit(torch.compile(module, backend="eager"), tmp_path / "logs", callback, steps=6)
    assert counter.compiles == 0
    run = callback.result
    assert run is not None and run.compiled == ("",) and run.samples == 3
    assert run.act_std.layers and run.last is not None and run.last.modules
    assert [f.code for f in run.findings() if f.code.endswith(".compiled_eager")] \
        == ["run.compiled_eager"]
    assert audit_hooks(module, include_global=False).local_total == 0
    assert str(torch._dynamo.eval_frame._stance.stance) == "default"
    with CompileCounter() as counter:
        module(torch.randn(4, 8))
    assert counter.compiles >= 1


class Gan(pl.LightningModule):
    """Manual optimization, two optimizers, the generator's first: the discriminator's
    step, then the generator's, whose backward goes through the discriminator too."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.disc = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        self.disc_norms: list[dict[str, float]] = []  # the discriminator's, at its steps

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> None:
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        real = batch[0]
        bce = nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        fake = self.gen(torch.randn(len(real), 4))
        loss_d = bce(self.disc(real), ones) + bce(self.disc(fake.detach()), zeros)
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        self.disc_norms.append({n: torch.linalg.vector_norm(p.grad).item()
                                for n, p in self.disc.named_parameters()})
        opt_d.step()
        opt_g.zero_grad()
        self.manual_backward(bce(self.disc(fake), ones))  # adds to the disc's gradients
        opt_g.step()

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return (torch.optim.Adam(self.gen.parameters(), 1e-3),
                torch.optim.Adam(self.disc.parameters(), 1e-3))


def test_a_gans_discriminator_is_sampled_at_its_own_optimizers_steps(tmp_path: Path) -> None:
    # The first optimizer was taken for every watched module: the discriminator's samples
    # were read at the generator's steps, its gradients then holding the generator's pass.
    module = Gan()
    callback = TorchscopeCallback(every=1, out=None, module="disc", log=False)
    pl.seed_everything(0, verbose=False)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(64, 8) * 2), batch_size=16)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    run = callback.result
    assert run is not None and run.steps == 4 and run.samples == 4
    assert run.optimizer == "Adam"
    for layer in ("0", "2"):
        for step, value in zip(run.grad_param.steps, run.grad_param.series(layer),
                               strict=True):
            assert math.isclose(value, _module_norm(module.disc_norms[step], layer),
                                rel_tol=1e-6)
    assert audit_hooks(module, include_global=False).local_total == 0


class Regressor(pl.LightningModule):
    """One output per sample against `(N,)` targets, as a regression tutorial writes it:
    `mse_loss(self(x), y)` compares every output with every target unless squeezed."""

    def __init__(self, squeeze: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.squeeze = squeeze

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        x, y = batch  # (N, 8), (N,)
        out = self(x)  # (N, 1)
        return nn.functional.mse_loss(out.squeeze(-1) if self.squeeze else out, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("squeeze", [False, True])
def test_a_loss_that_broadcasts_the_output_against_the_target_is_told(
        tmp_path: Path, squeeze: bool) -> None:
    callback = TorchscopeCallback(every=2, out=None)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g),
                                        torch.randn(64, generator=g))
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Regressor(squeeze), torch.utils.data.DataLoader(ds, batch_size=16))
    run = callback.result
    assert run is not None and run.steps == 4
    assert_broadcast_told(run, not squeeze, ((16, 1), (16, 16)))


def test_a_trainer_without_a_logger_gets_no_warning_from_the_scalars(tmp_path: Path) -> None:
    """`logger=False`: the sampled steps' scalars go nowhere, and Lightning says nothing
    about them (with `logger=True` passed to `log_dict` it warned once per scalar)."""
    callback = TorchscopeCallback(every=2, out=None)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g),
                                        torch.randn(64, 1, generator=g))
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(Regressor(squeeze=False),
                    torch.utils.data.DataLoader(ds, batch_size=16))
    run = callback.result
    assert run is not None and run.steps == 4 and run.samples
    assert not [w for w in seen if "torchscope/" in str(w.message)], \
        [str(w.message) for w in seen]


class CausalLM(pl.LightningModule):
    """A LightningModule around a transformers GPT-2, as fine-tuning scripts write it: the
    training step calls `self.model(**batch)` and takes its own loss."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        self.model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=1, n_head=2, n_embd=32, vocab_size=100, n_positions=16, pad_token_id=0))

    def training_step(self, batch: dict[str, torch.Tensor], i: int) -> torch.Tensor:
        loss: torch.Tensor = self.model(**batch).loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("masked", [False, True])
def test_labels_on_padding_are_told_through_a_wrapped_transformers_model(
        tmp_path: Path, masked: bool) -> None:
    """The labels copied from right-padded ids reach the wrapped model, not the
    LightningModule: they are counted at its own forward (3 + 6 padded positions a batch
    of two rows, at each of the 2 sampled steps)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in (13, 10, 16, 7):
        ids = torch.randint(1, 100, (16,), generator=g)
        mask = (torch.arange(16) < n).long()  # (16,)
        ids[mask == 0] = 0
        labels = ids.masked_fill(mask == 0, -100) if masked else ids.clone()
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    loader = torch.utils.data.DataLoader(rows, batch_size=2)  # default collate: stacked
    callback = TorchscopeCallback(every=2, out=None)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    module = CausalLM()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    run = callback.result
    assert run is not None and run.samples == 2
    # Sampled steps 1 and 3 see the second batch (rows 16 and 7: 0 + 9 pads) twice.
    assert run.padded_labels == (18, 0 if masked else 18)
    assert ("run.padding_in_loss" in [f.code for f in run.findings()]) == (not masked)
    assert audit_hooks(module, include_global=False).local_total == 0


def test_a_resumed_fit_numbers_its_steps_on_from_the_checkpoint(tmp_path: Path) -> None:
    """Resumed at global_step 6, Lightning logs steps 6 on; the callback counted from 0
    again and logged torchscope/step 0 beside Lightning's step 6."""
    first = _fit(Net(), tmp_path / "a", steps=6)
    first.save_checkpoint(tmp_path / "six.ckpt")
    callback = TorchscopeCallback(every=2, out=None)
    _fit(Net(), tmp_path / "b", callback, steps=10, ckpt_path=str(tmp_path / "six.ckpt"))
    run = callback.result
    assert run is not None and run.first_step == 6 and run.steps == 4
    assert run.grad_param.steps == (7, 9)  # the steps after which 8 and 10 were done


class LoggingNet(Net):
    """Net that logs its loss, as training steps do."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        loss = super().training_step(batch, i)
        self.log("loss", loss)
        return loss


def _csv_rows(trainer: pl.Trainer) -> list[dict[str, str]]:
    return list(csv.DictReader((Path(trainer.logger.log_dir) / "metrics.csv").open()))


@pytest.mark.parametrize(("every", "log_every"), [(10, 50), (10, 10), (4, 6), (1, 3)])
def test_every_sample_reaches_the_logger_at_its_own_step(tmp_path: Path, every: int,
                                                         log_every: int) -> None:
    """Lightning logs the steps after which the step count is a multiple of
    `log_every_n_steps`; a value given to `log_dict` in between waits for the next one.
    The CSV row of step 9 held the step-0 sample, and with the default
    `log_every_n_steps=50` 4 samples of 20 reached the logger. Every sample is now in the
    CSV at its own step, with the value the run reports."""
    callback = TorchscopeCallback(every=every, out=None)
    trainer = _fit(LoggingNet(), tmp_path, callback, steps=40,
                   log_every_n_steps=log_every)
    run = callback.result
    assert run is not None and run.samples == 40 // every
    assert run.grad_param.steps == tuple(range(every - 1, 40, every))
    logged = [(int(r["step"]), float(r["torchscope/step"]),
               float(r["torchscope/grad_norm/total"]))
              for r in _csv_rows(trainer) if r.get("torchscope/grad_norm/total")]
    assert [step for step, _, _ in logged] == list(run.grad_param.steps)  # none lags
    for (step, ours, total), want in zip(logged, run.total_norms, strict=True):
        assert ours == step and math.isclose(total, want, rel_tol=1e-6)
    # Lightning's own metrics keep their steps.
    losses = [int(r["step"]) for r in _csv_rows(trainer) if r.get("loss")]
    assert losses == list(range(log_every - 1, 40, log_every))


def test_a_fit_resumed_into_the_same_folder_continues_its_report(tmp_path: Path) -> None:
    """Resumed from a step-6 checkpoint with the same `out`: the report of the fit before
    is not overwritten; the new one goes on from its samples, with the resume marked."""
    out = tmp_path / "run"
    first = TorchscopeCallback(every=2, out=out)
    trainer = _fit(Net(), tmp_path / "a", first, steps=6)
    trainer.save_checkpoint(tmp_path / "six.ckpt")
    callback = TorchscopeCallback(every=2, out=out)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _fit(Net(), tmp_path / "b", callback, steps=10, ckpt_path=str(tmp_path / "six.ckpt"))
    assert not [w for w in seen if str(w.message).startswith("torchscope")]
    a, run = first.result, callback.result
    assert a is not None and a.grad_param.steps == (1, 3, 5)
    assert run is not None and run.first_step == 6 and run.resumed_at == (6,)
    assert run.grad_param.steps == (1, 3, 5, 7, 9)
    assert run.total_norms[:3] == a.total_norms
    data = json.loads((out / "report.json").read_text())["sections"]["run"]["data"]
    assert data["resumed_at"] == [6]
    assert "at step 6 from a checkpoint" in (out / "report.html").read_text()

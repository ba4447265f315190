"""The labelled run zoo: short training runs under `torchscope.monitor`, each with the
run-level findings an expert expects of it, as `tests/zoo` is for one step.

Healthy runs (real architectures from `transformers` configs at hidden 128 and 6 layers,
and CNNs; AdamW with warm-up and SGD with momentum; 30 steps; the plain loop, Lightning and
the HF Trainer) expect nothing at warning or above. Faulted runs name the code, the step
and the module their finding must carry (`expected`); `allowed` lists codes that are true
consequences of the same fault. Every run is tiny (a few seconds on one CPU core).

Plain Python, no pytest: `tests/runzoo/conftest.py` runs them for the tests and
`benchmarks/run_zoo.py` for the precision and recall it prints.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import torchscope
from torchscope.findings import Finding, Severity
from torchscope.monitoring import RunRecord

STEPS = 30
EVERY = 3


@dataclass(frozen=True)
class Expect:
    """A finding the run must get: `code` at `module` (None: the model as a whole), at
    least `severity`, dated at `step` where given (its evidence's first or onset step)."""

    code: str
    module: str | None
    step: int | None = None
    severity: Severity = Severity.WARNING


@dataclass(frozen=True)
class Run:
    """One zoo run: `train()` runs it under the monitor and returns its record."""

    name: str
    train: Callable[[], RunRecord]
    expected: tuple[Expect, ...] = ()
    allowed: frozenset[str] = field(default_factory=frozenset)

    @property
    def healthy(self) -> bool:
        return not self.expected


# Evidence keys that date a finding, most specific first.
_STEP_KEYS = ("onset_step", "gradient_step", "first_unzeroed", "first_step", "step",
              "forward_step")


def step_of(f: Finding) -> int | None:
    """The step a finding is dated at (its evidence's onset or first step), or None."""
    for k in _STEP_KEYS:
        v = f.evidence.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


@dataclass(frozen=True)
class Diagnosis:
    """What torchscope concluded on one zoo run."""

    run: Run
    findings: tuple[Finding, ...]

    def found(self, e: Expect) -> bool:
        return any(f.code == e.code and f.module == e.module and f.severity >= e.severity
                   and (e.step is None or step_of(f) == e.step) for f in self.findings)

    def flagged(self) -> list[Finding]:
        """Findings at warning or above."""
        return [f for f in self.findings if f.severity >= Severity.WARNING]

    def false_positives(self) -> list[Finding]:
        """Warnings and errors that are neither expected (code and module) nor an allowed
        consequence of the run's fault."""
        ok = {(e.code, e.module) for e in self.run.expected}
        return [f for f in self.flagged() if (f.code, f.module) not in ok
                and f.code not in self.run.allowed]


def diagnose(run: Run) -> Diagnosis:
    """Train `run` and read its findings."""
    torch.manual_seed(0)
    # One thread: two threads on a shared two-core machine spin against each other (a
    # 6-layer GPT-2 step took 3 s instead of 80 ms).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            record = run.train()
    finally:
        torch.set_num_threads(threads)
    return Diagnosis(run, tuple(record.findings()))


def precision_recall(ds: list[Diagnosis]) -> tuple[float, float, int, int, int, int]:
    """(precision, recall, true positives, false positives, expected, found) at warning and
    above: a true positive is a flagged finding an entry expects (code and module), a false
    positive one it neither expects nor allows; recall counts the expected findings found
    (code, module, step and severity)."""
    tp = fp = expected = found = 0
    for d in ds:
        wanted = {(e.code, e.module) for e in d.run.expected}
        expected += len(d.run.expected)
        found += sum(d.found(e) for e in d.run.expected)
        fp += len(d.false_positives())
        tp += len({(f.code, f.module) for f in d.flagged()} & wanted)
        # An expected info finding (a deliberate choice a warning would overstate) counts
        # as a true positive when found.
        tp += sum(1 for e in d.run.expected if e.severity < Severity.WARNING and d.found(e))
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = found / expected if expected else 1.0
    return precision, recall, tp, fp, expected, found


# ---------------------------------------------------------------- data
def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _token_batches(vocab: int = 128, batch: int = 4, seq: int = 16
                   ) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of a learnable token stream (each row counts up from a random start), as
    a language model's own labels."""
    g = _gen()
    while True:
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        ids = (start + torch.arange(seq)) % vocab  # (batch, seq)
        yield {"input_ids": ids, "labels": ids.clone()}


def _image_batches(size: int = 32, batch: int = 8, classes: int = 10,
                   key: str | None = None) -> Iterator[Any]:
    """Batches of images whose class is the channel mean's sign pattern (learnable)."""
    g = _gen()
    proto = torch.randn(classes, 3, size, size, generator=g)
    while True:
        y = torch.randint(0, classes, (batch,), generator=g)
        x = proto[y] + 0.5 * torch.randn(batch, 3, size, size, generator=g)
        yield {key: x, "labels": y} if key else (x, y)


def _vector_batches(dim: int = 32, batch: int = 64, classes: int = 4) -> Iterator[Any]:
    g = _gen()
    w = torch.randn(dim, classes, generator=g)
    while True:
        x = torch.randn(batch, dim, generator=g)
        yield x, (x @ w).argmax(-1)


# ---------------------------------------------------------------- loops
def _warmup(opt: torch.optim.Optimizer, steps: int = 5) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / steps))


def _adamw(model: nn.Module, lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


def _sgd(model: nn.Module, lr: float = 0.05) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    if isinstance(batch, dict):
        out = model(**batch)
        loss: torch.Tensor = out.loss
        return loss
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def plain(build: Callable[[], nn.Module], data: Callable[[], Iterator[Any]],
          optimizer: Callable[[nn.Module], torch.optim.Optimizer] = _adamw, *,
          steps: int = STEPS, every: int = EVERY, warmup: bool = True,
          fault: Callable[[int, nn.Module], None] | None = None, zero_grad: bool = True,
          repeat: bool = False, micro: int = 1, divide: bool = True,
          loss: Callable[[nn.Module, Any], torch.Tensor] = _loss) -> Callable[[], RunRecord]:
    """A plain training loop of `steps` optimizer steps under `monitor(every=...)`.

    Args:
        fault: called with (step, model) before each step's forward (a `model.eval()`).
        zero_grad: call `optimizer.zero_grad()` each step.
        repeat: train on the first batch at every step.
        micro: backward passes per step (gradient accumulation).
        divide: divide each micro-batch's loss by `micro`.
    """

    def train() -> RunRecord:
        torch.manual_seed(0)
        model = build()
        model.train()
        opt = optimizer(model)
        sched = _warmup(opt) if warmup else None
        batches = data()
        first = next(batches)
        with torchscope.monitor(model, opt, every=every, out=None) as mon:
            for step in range(steps):
                if zero_grad:
                    opt.zero_grad()
                if fault is not None:
                    fault(step, model)
                for _ in range(micro):
                    batch = first if repeat else next(batches)
                    value = loss(model, batch)
                    mon.check_loss(value)  # the loss, for its checks and the recorder
                    (value / micro if divide else value).backward()
                opt.step()
                if sched is not None:
                    sched.step()
        assert mon.result is not None
        return mon.result

    return train


# ---------------------------------------------------------------- architectures
def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=128, n_layer=6,
                                      n_head=4))


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                                        num_hidden_layers=6, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=32))


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(vocab_size=128, hidden_size=128, num_hidden_layers=6,
                                      num_attention_heads=4, intermediate_size=256,
                                      max_position_embeddings=32))


def vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(
        image_size=32, patch_size=8, hidden_size=128, num_hidden_layers=6,
        num_attention_heads=4, intermediate_size=256, num_labels=10))


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(
        vocab_size=128, d_model=128, d_kv=32, d_ff=256, num_layers=6, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0))


def hf_resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    return ResNetForImageClassification(ResNetConfig(
        embedding_size=16, hidden_sizes=[32, 64, 128], depths=[1, 2, 2],
        layer_type="basic", num_labels=10))


def convnext() -> nn.Module:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    return ConvNextForImageClassification(ConvNextConfig(
        hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], num_labels=10))


def mobilevit() -> nn.Module:
    """MobileViT (its attention output's bias gradient falls 90x while the weight's does
    not: once a false 'stops learning' warning)."""
    from transformers import MobileViTConfig, MobileViTForImageClassification

    return MobileViTForImageClassification(MobileViTConfig(
        image_size=64, hidden_sizes=[32, 48, 64], neck_hidden_sizes=[8, 8, 16, 16, 24, 32,
                                                                    128],
        num_attention_heads=2, num_labels=10))


def whisper() -> nn.Module:
    """Whisper (its decoder's query and key gradients fall 90x under AdamW while their
    update ratio stays within 2x of the median: once a false 'stops learning')."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    return WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=128, num_mel_bins=16, d_model=128, encoder_layers=3, decoder_layers=3,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256,
        decoder_ffn_dim=256, max_source_positions=16, max_target_positions=32,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1))


def _speech_batches() -> Iterator[dict[str, torch.Tensor]]:
    g = _gen()
    tokens = _token_batches()
    while True:
        ids = next(tokens)["labels"][:, :12]
        yield {"input_features": torch.randn(4, 16, 32, generator=g), "labels": ids}


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def mlp(depth: int = 4, width: int = 64, dropout: float = 0.0) -> nn.Module:
    layers: list[nn.Module] = []
    d = 32
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(dropout))
        d = width
    return nn.Sequential(*layers, nn.Linear(d, 4))


def gelu_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 4))


def _seq2seq_batches() -> Iterator[dict[str, torch.Tensor]]:
    for b in _token_batches():
        yield {"input_ids": b["input_ids"], "labels": b["labels"].flip(-1)}


# ---------------------------------------------------------------- frameworks
def lightning_gpt2() -> RunRecord:
    """GPT-2 under Lightning 2.6 with AdamW and a warm-up, its callback sampling."""
    import pytorch_lightning as pl

    from torchscope.integrations.lightning import TorchscopeCallback

    class LM(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = gpt2()

        def training_step(self, batch: dict[str, torch.Tensor], i: int) -> torch.Tensor:
            out: torch.Tensor = self.model(**batch).loss
            return out

        def configure_optimizers(self) -> Any:
            opt = _adamw(self)
            return {"optimizer": opt,
                    "lr_scheduler": {"scheduler": _warmup(opt), "interval": "step"}}

    stream = _token_batches()
    rows = [next(stream) for _ in range(STEPS)]
    loader = torch.utils.data.DataLoader(rows, batch_size=None)
    pl.seed_everything(0, verbose=False)
    cb = TorchscopeCallback(every=EVERY, out=None)
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[cb])
    trainer.fit(LM(), loader)
    assert cb.result is not None
    return cb.result


def hf_trainer(build: Callable[[], nn.Module], data: Callable[[], Iterator[Any]],
               **options: Any) -> Callable[[], RunRecord]:
    """`build()` trained by the HF Trainer (AdamW, linear warm-up, clipping at 1.0)."""

    def train() -> RunRecord:
        import transformers
        from transformers import Trainer, TrainingArguments

        from torchscope.integrations.hf import TorchscopeTrainerCallback

        transformers.logging.set_verbosity_error()
        torch.manual_seed(0)
        stream = data()
        rows = [{k: v[i] for k, v in b.items()} for b in (next(stream) for _ in range(STEPS))
                for i in range(len(next(iter(b.values()))))]
        cb = TorchscopeTrainerCallback(every=EVERY, out=None)
        args = TrainingArguments(
            output_dir="/tmp/torchscope-runzoo-hf", max_steps=STEPS,
            per_device_train_batch_size=4, learning_rate=1e-3, warmup_steps=5,
            weight_decay=0.01, max_grad_norm=1.0, logging_strategy="no", report_to="none",
            save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
            dataloader_num_workers=0, **options)
        trainer = Trainer(model=build(), args=args, train_dataset=rows, callbacks=[cb])
        cb.install(trainer)
        with cb:
            trainer.train()
        assert cb.result is not None
        return cb.result

    return train


# ---------------------------------------------------------------- faults
def _eval_from(step: int) -> Callable[[int, nn.Module], None]:
    """An evaluation at `step` whose model.eval() is never undone."""

    def fault(i: int, model: nn.Module) -> None:
        if i == step:
            model.eval()

    return fault


def _nan_at(step: int) -> Callable[[int, nn.Module], None]:
    """From `step` on, the Log module's input is shifted negative: log gives NaN."""

    def fault(i: int, model: nn.Module) -> None:
        if i == step:
            model.shift = -10.0  # type: ignore[assignment]

    return fault


class LogNet(nn.Module):
    """fc1 → ReLU → log(· + shift) → fc2: NaN once `shift` goes negative."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.relu = nn.ReLU()
        self.log = _Log()
        self.fc2 = nn.Linear(64, 4)
        self.shift = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.log(self.relu(self.fc1(x)) + self.shift))
        return out


class _Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class Cut(nn.Module):
    """A trunk of 4 blocks whose output a stray `.detach()` cuts from the head after block
    1: blocks 0 and 1 never get a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32 if i == 0 else 64, 64),
                                                  nn.ReLU()) for i in range(4))
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, b in enumerate(self.blocks):
            x = b(x)
            if i == 1:
                x = x.detach()  # the fault
        out: torch.Tensor = self.head(x)
        return out


class NoGradStem(nn.Module):
    """A stem run under `torch.no_grad()` inside the forward (meant as a frozen feature
    extractor, but its parameters still require grad and sit in the optimizer)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(32, 64), nn.ReLU())
        self.body = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = self.stem(x)
        out: torch.Tensor = self.body(h)
        return out


def _fp16_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss under float16 autocast, with no GradScaler."""
    with torch.autocast("cpu", dtype=torch.float16):
        return _loss(model, batch)


def _dying_bias(step: int, model: nn.Module) -> None:
    """A bias pushed negative a little more every step (as a bad init or a drifting
    schedule would): the ReLU after the first layer dies unit by unit."""
    if step >= 10:
        with torch.no_grad():
            model[0].bias.sub_(0.3)


class _BadBatchAt:
    """The loss of a batch whose inputs are 300x too large at step `step` (a corrupt
    sample): a loss spike between two samples."""

    def __init__(self, step: int) -> None:
        self.step, self.now = step, -1

    def fault(self, i: int, _model: nn.Module) -> None:
        self.now = i

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        if self.now == self.step:
            x = x * 300
        return nn.functional.cross_entropy(model(x), y)


_SPIKE = _BadBatchAt(17)


def _qk_lr(lr: float) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """AdamW at 1e-3, but at `lr` for the attention's query and key projections (a
    per-group learning rate gone wrong): their scale grows until the attention saturates."""

    def build(m: nn.Module) -> torch.optim.Optimizer:
        qk = [p for n, p in m.named_parameters() if "q_proj" in n or "k_proj" in n]
        rest = [p for n, p in m.named_parameters() if "q_proj" not in n and "k_proj" not in n]
        return torch.optim.AdamW([{"params": rest, "lr": 1e-3}, {"params": qk, "lr": lr}])

    return build


def _frozen_mlp() -> nn.Module:
    m = mlp()
    for p in m[2].parameters():  # frozen by mistake (a leftover of fine-tuning code)
        p.requires_grad_(False)
    return m


# ---------------------------------------------------------------- the zoo
HEALTHY: tuple[Run, ...] = (
    Run("gpt2-adamw", plain(gpt2, _token_batches)),
    Run("llama-adamw", plain(llama, _token_batches)),
    Run("bert-adamw", plain(bert, _token_batches)),
    Run("vit-adamw", plain(vit, lambda: _image_batches(key="pixel_values"))),
    Run("t5-adamw", plain(t5, _seq2seq_batches)),
    Run("hf-resnet-sgd", plain(hf_resnet, lambda: _image_batches(key="pixel_values"), _sgd,
                               warmup=False)),
    Run("convnext-adamw", plain(convnext, lambda: _image_batches(key="pixel_values"))),
    Run("cnn-sgd", plain(cnn, _image_batches, _sgd, warmup=False)),
    Run("whisper-adamw", plain(whisper, _speech_batches)),
    Run("mlp-sgd", plain(mlp, _vector_batches, _sgd, warmup=False)),
    Run("mlp-dropout-adamw", plain(lambda: mlp(dropout=0.1), _vector_batches)),
    Run("gpt2-lightning", lightning_gpt2),
    Run("gpt2-hf-trainer", hf_trainer(gpt2, _token_batches)),
    Run("vit-hf-trainer", hf_trainer(vit, lambda: _image_batches(key="pixel_values"))),
)

FAULTED: tuple[Run, ...] = (
    Run("gelu-mlp-lr-far-too-high", plain(gelu_mlp, _vector_batches,
                                          lambda m: torch.optim.SGD(m.parameters(), lr=10.0),
                                          warmup=False, every=1),
        (Expect("run.weight_scale", None, 4),),
        allowed=frozenset({"run.activation_drift", "activations.large", "grads.dead",
                           "activations.constant", "activations.scale_drift",
                           "run.loss_spike"})),
    Run("mlp-eval-left-on", plain(lambda: mlp(dropout=0.2), _vector_batches,
                                  fault=_eval_from(10)),
        (Expect("run.eval_mode", None, 10),)),
    Run("mlp-one-batch", plain(mlp, _vector_batches, repeat=True),
        (Expect("run.same_batch", None, severity=Severity.INFO),)),
    Run("mlp-no-zero-grad", plain(mlp, _vector_batches, _sgd, warmup=False,
                                  zero_grad=False),
        (Expect("grads.not_zeroed", None, 1),),
        allowed=frozenset({"run.grad_grew", "run.weight_scale", "grads.exploding",
                           "run.activation_drift", "run.nonfinite", "grads.nonfinite",
                           "activations.large", "activations.scale_drift",
                           "run.grad_norm_overflow", "run.dead_units",
                           "activations.dead_units", "grads.dead"})),
    Run("lognet-nan", plain(LogNet, _vector_batches, fault=_nan_at(12), every=4),
        (Expect("run.nonfinite", "log", 12, Severity.ERROR),)),
    Run("mlp-frozen-layer", plain(_frozen_mlp, _vector_batches),
        (Expect("grads.frozen", "2", severity=Severity.INFO),)),
    Run("mlp-weight-decay-huge", plain(mlp, _vector_batches,
                                       lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3,
                                                                   weight_decay=200.0),
                                       warmup=False),
        (Expect("run.weight_scale", None, 12),),
        allowed=frozenset({"run.grad_grew", "run.activation_drift", "run.dead_units",
                           "activations.dead_units", "grads.dead", "grads.update_ratio"})),
    Run("mlp-detached-trunk", plain(Cut, _vector_batches),
        (Expect("run.graph_cut", "blocks.1.0"),)),
    Run("mlp-no-grad-stem", plain(NoGradStem, _vector_batches),
        (Expect("run.graph_cut", "stem.0"),)),
    Run("mlp-fp16-no-scaler", plain(mlp, _vector_batches, loss=_fp16_loss),
        (Expect("run.fp16_unscaled", None),)),
    Run("mlp-units-dying", plain(mlp, _vector_batches, _sgd, warmup=False,
                                 fault=_dying_bias, every=2),
        (Expect("run.dead_units", "1", 12),),
        allowed=frozenset({"activations.dead_units", "grads.dead", "run.grad_fell"})),
    Run("mlp-loss-spike-between-samples", plain(mlp, _vector_batches, _sgd, warmup=False,
                                                fault=_SPIKE.fault, loss=_SPIKE.loss,
                                                every=10),
        (Expect("run.loss_spike", "6", 17),),
        # what a 300x batch's update leaves: units pushed dead, a large step
        allowed=frozenset({"run.dead_units", "grads.update_ratio", "activations.dead_units",
                           "grads.dead"})),
    Run("llama-attention-logit-growth", plain(llama, _token_batches, _qk_lr(3.0),
                                              warmup=False, every=10, steps=40),
        (Expect("run.activation_drift", "model.layers.0.self_attn.q_proj", 10),),
        allowed=frozenset({"run.grad_grew"})),
    Run("mlp-accumulation-undivided", plain(mlp, _vector_batches, _sgd, warmup=False,
                                            micro=4, divide=False),
        (Expect("run.accumulation_undivided", None),)),
)

ZOO: tuple[Run, ...] = HEALTHY + FAULTED

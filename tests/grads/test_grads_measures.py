"""Scale-free measures against torch: gradient RMS, relative gradient ‖g‖/‖w‖ and the
optimizer's update ratio ‖Δw‖/‖w‖ on sampled steps, with training left bitwise unchanged."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from torchscope.findings import Severity
from torchscope.grads import gradient_flow, watch_gradients
from torchscope.grads.analyze import depth_profile


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def test_rms_and_relative_gradient_match_torch() -> None:
    model = _mlp()
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    flow = gradient_flow(model, x, loss_fn="cross_entropy", target=y)
    for name, p in model.named_parameters():
        rec = flow.param(name)
        assert p.grad is not None
        assert rec.weight_norm == torch.linalg.vector_norm(p.detach()).item()
        assert rec.rms == pytest.approx((p.grad.norm() / math.sqrt(p.numel())).item(),
                                        rel=1e-6)
        assert rec.relative == pytest.approx((p.grad.norm() / p.detach().norm()).item(),
                                             rel=1e-6)
        assert rec.update_norm is None and rec.update_ratio is None  # no update ran
    # Per layer: the weight matrix only (a bias's gradient is on another scale).
    by_module = {lg.module: lg for lg in flow.layer_grads()}
    w = model[2].weight
    assert by_module["2"].params == ("2.weight",)
    assert by_module["2"].relative == pytest.approx((w.grad.norm() / w.norm()).item(), rel=1e-6)
    out = flow.get("2").grad_output[0]
    assert by_module["2"].output_rms == pytest.approx(out.norm / math.sqrt(8 * 16), rel=1e-12)
    assert by_module["1"].params == () and by_module["1"].relative is None  # the ReLU
    model.zero_grad(set_to_none=True)


def test_depth_profile_groups_blocks_and_leaves_out_embeddings(tiny_gpt2) -> None:
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    flow = gradient_flow(tiny_gpt2, {"input_ids": ids, "labels": ids})
    prof = depth_profile(flow)
    # One position per transformer block, nearest the loss first; the embeddings and the
    # tied lm_head are not positions.
    assert [u.name for u in prof.units] == ["transformer.h.1", "transformer.h.0"]
    assert prof.units[0].modules == ("transformer.h.1.mlp.c_proj", "transformer.h.1.mlp.c_fc",
                                     "transformer.h.1.attn.c_proj",
                                     "transformer.h.1.attn.c_attn")
    assert dict(prof.excluded) == {"lm_head": "tied weight", "transformer.wpe": "embedding",
                                   "transformer.wte": "embedding"}
    tiny_gpt2.zero_grad(set_to_none=True)


def test_the_head_above_the_blocks_is_not_part_of_the_depth_trend() -> None:
    """BERT for sequence classification: the classifier and the pooler are nearer the loss
    than any encoder layer and in no repeated block; at initialisation they get about 100x
    the encoder's relative gradient. Fitted with the encoder, they made 2 healthy layers
    read as possible vanishing gradients here (a warning, with the doctor's own run of a
    narrower one)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        vocab_size=100, num_labels=3))
    inputs = {"input_ids": torch.randint(0, 100, (8, 32)), "labels": torch.randint(0, 3, (8,))}
    flow = gradient_flow(model, inputs)
    prof = depth_profile(flow)
    assert [u.name for u in prof.units] == ["classifier", "bert.pooler.dense",
                                            "bert.encoder.layer.1", "bert.encoder.layer.0"]
    head, body = prof.units[1], prof.body
    assert [u.name for u in body] == ["bert.encoder.layer.1", "bert.encoder.layer.0"]
    assert head.relative is not None and body[0].relative is not None
    assert head.relative > 30 * body[0].relative  # why the head stays out
    assert [f.code for f in flow.findings() if f.code.startswith("grads.vanishing")] == []
    # Without repeated blocks, only the nearest position is the head.
    plain = depth_profile(gradient_flow(nn.Sequential(
        nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)),
        torch.randn(8, 6)))
    assert [u.name for u in plain.body] == ["2", "0"]


class _EncoderDecoder(nn.Module):
    """Two stacks, as in an encoder-decoder: every decoder layer reads the encoder's output
    (what cross-attention does), so the encoder's gradient comes from all of them at once.
    The encoder's layers end in `encoder_act`."""

    def __init__(self, encoder_act: type[nn.Module], encoder_depth: int) -> None:
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 32), encoder_act()) for _ in range(encoder_depth))
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memory = x
        for layer in self.encoder.layers:  # type: ignore[union-attr]
            memory = layer(memory)  # (B, 32)
        h = x
        for layer in self.decoder.layers:  # type: ignore[union-attr]
            h = layer(h) + 0.1 * memory  # (B, 32)
        out: torch.Tensor = self.head(h)  # (B, 10)
        return out


def test_an_encoder_and_a_decoder_are_judged_apart() -> None:
    """A transformers BART at initialisation: level within each stack, about 90x lower in
    the encoder, which gets its gradient through cross-attention. Fitted as one chain, that
    step read as likely vanishing gradients (a warning)."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    model = BartForConditionalGeneration(BartConfig(
        vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64))
    ids = torch.randint(0, 100, (2, 16))
    flow = gradient_flow(model, {"input_ids": ids, "labels": ids})
    prof = depth_profile(flow)
    assert [[u.name for u in stack] for stack in prof.stacks] == [
        ["model.decoder.layers.0"], ["model.encoder.layers.1", "model.encoder.layers.0"]]
    dec, enc = prof.stacks[0][0], prof.stacks[1][0]
    assert dec.relative is not None and enc.relative is not None
    assert dec.relative > 50 * enc.relative  # the step between the stacks
    assert [f for f in flow.findings() if f.code == "grads.vanishing"] == []


def test_vanishing_inside_one_stack_is_still_found() -> None:
    torch.manual_seed(0)
    flow = gradient_flow(_EncoderDecoder(nn.Sigmoid, 8), torch.randn(8, 32))
    prof = depth_profile(flow)
    assert [len(stack) for stack in prof.stacks] == [4, 8]
    found = [f for f in flow.findings() if f.code == "grads.vanishing"]
    assert [f.module for f in found] == ["encoder.layers.0.0"]
    assert found[0].severity >= Severity.WARNING
    assert found[0].evidence["nearest"] == "encoder.layers.7.0"
    healthy = gradient_flow(_EncoderDecoder(nn.Tanh, 8), torch.randn(8, 32))
    assert [f for f in healthy.findings() if f.code == "grads.vanishing"
            and f.severity >= Severity.WARNING] == []


def test_numbered_stages_are_one_stack() -> None:
    """torchvision's `layer1` ... `layer4` are stages of one chain, not four stacks."""
    torch.manual_seed(0)
    model = nn.Sequential()
    for i in range(1, 5):
        model.add_module(f"layer{i}", nn.Sequential(
            *(nn.Sequential(nn.Linear(32, 32), nn.Sigmoid()) for _ in range(3))))
    model.add_module("fc", nn.Linear(32, 10))
    flow = gradient_flow(model, torch.randn(8, 32))
    prof = depth_profile(flow)
    assert len(prof.stacks) == 1 and len(prof.stacks[0]) == 12
    found = [f for f in flow.findings() if f.code == "grads.vanishing"]
    assert [f.module for f in found] == ["layer1.0.0"] and found[0].severity >= Severity.WARNING


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, *,
           watch_every: int | None, updates: bool = True
           ) -> list[tuple[int, dict[str, float], dict[str, float]]]:
    """Train `steps` steps; returns per sampled step the update norms torch computes by hand
    (a copy before `opt.step()`, the norm of the difference after), then the norms of the
    weights before the update."""
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(steps)]
    manual: list[tuple[int, dict[str, float], dict[str, float]]] = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        if watch_every is not None and i % watch_every == 0:
            manual.append((i, {n: torch.linalg.vector_norm(before[n] - p.detach()).item()
                               for n, p in model.named_parameters()},
                           {n: torch.linalg.vector_norm(w).item() for n, w in before.items()}))
    return manual


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.Adam(ps, lr=1e-3),
], ids=["sgd-momentum", "adam"])
def test_update_ratio_of_sampled_steps(make_opt, reduction_path: str) -> None:
    torch.manual_seed(0)
    plain = _mlp()
    watched = _mlp()
    watched.load_state_dict(plain.state_dict())
    opt_plain, opt_watched = make_opt(plain.parameters()), make_opt(watched.parameters())
    _train(plain, opt_plain, 7, watch_every=None)
    with watch_gradients(watched, every=3, optimizer=opt_watched) as watch:
        manual = _train(watched, opt_watched, 7, watch_every=3)
        # A sampled step keeps no parameter copy once its update is measured.
        assert watch._collector._before == []
    # Training is bitwise unchanged by the copies taken around sampled updates.
    for (n, a), b in zip(plain.named_parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b), n
    last = watch.last
    step, updates, weights = manual[-1]
    assert last is not None and last.index == 6 == step
    for rec in last.params:
        if reduction_path == "eager":  # foreach ops: the very numbers torch computes
            assert rec.update_norm == updates[rec.name], rec.name
            assert rec.weight_norm == weights[rec.name], rec.name
        else:  # the native kernels sum float32 values (and differences) in float64
            assert rec.update_norm == pytest.approx(updates[rec.name], rel=1e-6)
            assert rec.weight_norm == pytest.approx(weights[rec.name], rel=1e-6)
        assert rec.update_ratio == pytest.approx(rec.update_norm / rec.weight_norm)
    assert watch.samples == 3


def test_update_ratio_findings_and_opt_out() -> None:
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=50.0)  # far too large a step
    with watch_gradients(model, optimizer=opt) as watch:
        _train(model, opt, 2, watch_every=None)
    (f,) = [f for f in watch.findings() if f.code == "grads.update_ratio"]
    assert f.severity == Severity.WARNING and f.evidence["median"] > 0.1
    with watch_gradients(model, optimizer=opt, updates=False) as off:
        _train(model, opt, 1, watch_every=None)
    assert off.last is not None and all(p.update_norm is None for p in off.last.params)
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_a_warm_up_s_first_step_is_no_step_too_small() -> None:
    """A linear warm-up from 0 (the HF Trainer's with `warmup_ratio`, LambdaLR here) moves
    nothing on its first step: every update ratio is 0, which read as "possibly too small a
    step" with the fix to raise the learning rate."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(step / 10, 1.0))
    with watch_gradients(model, optimizer=opt) as watch:
        _train(model, opt, 1, watch_every=None)
    (f,) = [f for f in watch.findings() if f.code == "grads.update_ratio"]
    assert f.severity == Severity.INFO and f.evidence["largest"] == 0
    assert "moved no layer" in f.summary and "warm-up" in f.fix
    warmup.step()
    with watch_gradients(model, optimizer=opt) as watch:
        _train(model, opt, 1, watch_every=None)  # lr 1e-4: a step, judged as ever
    assert not [f for f in watch.findings() if "moved no layer" in f.summary]


def test_frozen_parameters_are_never_dead() -> None:
    model = _mlp()
    for p in model[2].parameters():
        p.requires_grad_(False)  # a frozen middle layer: gradient flows through it

    def codes(flow) -> dict[str, set[str | None]]:
        out: dict[str, set[str | None]] = {}
        for f in flow.findings():
            out.setdefault(f.code, set()).add(f.module)
        model.zero_grad(set_to_none=True)
        return out

    x = torch.randn(8, 6)
    healthy = codes(gradient_flow(model, x, loss_fn="sum"))
    assert healthy == {"grads.frozen": {"2"}}
    with torch.no_grad():
        model[4].weight.zero_()  # nothing flows below the head any more
    flow = gradient_flow(model, x, loss_fn="sum")
    assert flow.get("2").grad_output[0].norm == 0.0  # the frozen layer receives zeros...
    assert flow.param("2.weight").weight_norm is None  # (frozen: not read)
    found = codes(flow)
    assert found["grads.frozen"] == {"2"}
    assert "2" not in found["grads.dead"]  # ...and is not called dead;
    # the trainable layer below it is, with the others the zero head starves
    [below] = [f for f in flow.findings() if f.code == "grads.dead" and f.module == "3"]
    assert below.evidence["last"] == "0" and below.evidence["cause"] == "4"


def test_a_second_optimizer_s_parameters_get_no_update_from_the_watched_one() -> None:
    """Muon for the matrices, AdamW for the embedding and the norm, stepped after it: the
    watch given Muon measured the embedding's and the norm's update as 0 (their step comes
    after Muon's is measured). Only Muon's parameters get an update now, each equal to
    torch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 32), nn.LayerNorm(32), nn.Linear(32, 32),
                          nn.GELU(), nn.Linear(32, 50))
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and n[0] != "0"]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and n[0] != "0")]
    # torch.optim.Muon since torch 2.9; SGD plays its part before that.
    muon = getattr(torch.optim, "Muon", torch.optim.SGD)(matrices, lr=0.02)
    adamw = torch.optim.AdamW(rest, lr=1e-3)
    x = torch.randint(0, 50, (8, 16), generator=torch.Generator().manual_seed(0))
    with watch_gradients(model, every=1, optimizer=muon) as watch:
        for _ in range(3):
            muon.zero_grad()
            adamw.zero_grad()
            nn.functional.cross_entropy(model(x).reshape(-1, 50), x.reshape(-1)).backward()
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            muon.step()
            moved = {n: torch.linalg.vector_norm(p.detach() - before[n]).item()
                     for n, p in model.named_parameters()}
            adamw.step()
    last = watch.last
    assert last is not None
    for p in last.params:
        if p.name in ("2.weight", "4.weight"):
            assert p.update_norm == pytest.approx(moved[p.name], rel=1e-5) and moved[p.name] > 0
        else:
            assert p.update_norm is None, p.name
    ratios = {lg.module: lg.update_ratio for lg in last.layer_grads()}
    assert ratios["0"] is None and ratios["1"] is None and ratios["2"] is not None


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon: torch 2.9+")
def test_muon_s_step_of_about_its_learning_rate_is_not_called_large() -> None:
    """Muon orthogonalises each update, which moves a matrix by about its learning rate (0.02)
    of its norm by design: that read as "possibly too large a step" against the 1e-3 rule
    of SGD and Adam. A Muon step of 10 % or more is still a warning."""
    found: dict[float, list[str]] = {}
    for lr in (0.02, 0.5):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU(),
                              nn.Linear(64, 64, bias=False))
        opt = torch.optim.Muon(model.parameters(), lr=lr)
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
        with watch_gradients(model, optimizer=opt) as watch:
            for _ in range(2):
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
        assert watch.last is not None and watch.last.optimizer == "Muon"
        ratios = [lg.update_ratio for lg in watch.last.layer_grads() if lg.update_ratio]
        assert ratios and (min(ratios) > 0.01 if lr == 0.02 else min(ratios) > 0.1)
        found[lr] = [f.severity.name for f in watch.findings() if f.code == "grads.update_ratio"]
    assert found == {0.02: [], 0.5: ["WARNING"]}


def _stale_run(model: nn.Module, lr: float, steps: int = 3, *, autocast: bool = False
               ) -> tuple[dict[str, tuple[int, int]], object]:
    """AdamW steps of a tiny GPT-2, watched on the last one; returns what torch counts on
    that step (per parameter: elements with a nonzero gradient that `opt.step()` left
    exactly as they were, and elements with a nonzero gradient) and the watch."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    counts: dict[str, tuple[int, int]] = {}
    with watch_gradients(model, optimizer=opt, every=steps, start=steps - 1) as watch:
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(ids, labels=ids).loss
            loss.backward()
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            grads = {n: p.grad.clone() for n, p in model.named_parameters()
                     if p.grad is not None}
            opt.step()
            counts = {n: (int(((g != 0) & (p.detach() == before[n])).sum()),
                          int((g != 0).sum()))
                      for n, p in model.named_parameters() if (g := grads.get(n)) is not None}
    return counts, watch


@pytest.mark.parametrize("lr", [1e-5, 1e-8])
def test_stale_bfloat16_weights_are_counted_as_torch_counts_them(tiny_gpt2, lr: float) -> None:
    """A GPT-2 kept in bfloat16 under AdamW at a fine-tuning rate (1e-5): most updates are
    under half the spacing of bfloat16 numbers at the weights and round back to them. The
    update ratios alone read as ordinary; the count per parameter equals torch's. At 1e-8
    the ratios are tiny because the steps were rounded away: not called a small step."""
    torch.manual_seed(0)
    model = tiny_gpt2.train().to(torch.bfloat16)
    counts, watch = _stale_run(model, lr)
    last = watch.last
    assert last is not None
    stale = {p.name: p.update_stale for p in last.params if p.tied_to is None}
    assert stale == counts  # every parameter, exactly
    (f,) = [f for f in watch.findings() if f.code == "grads.stale_weights"]
    kept, moving = (sum(c[i] for c in counts.values()) for i in (0, 1))
    assert f.severity == Severity.WARNING and f.evidence["kept"] == kept
    assert f.evidence["moving"] == moving and kept / moving > 0.5
    assert "float32" in f.fix and "autocast" in f.fix
    assert not [f for f in watch.findings()
                if f.code == "grads.update_ratio" and "small" in f.summary]


@pytest.mark.parametrize("case", ["bfloat16-lr-1e-3", "float32-autocast", "lr-0"])
def test_weights_that_move_are_not_called_stale(tiny_gpt2, case: str) -> None:
    """bfloat16 weights under steps large enough to register (AdamW at 1e-3: a few percent
    kept, LayerNorm gains at 1.0 first), float32 weights under bfloat16 autocast (mixed
    precision), and a learning rate of 0 (nothing moves at all: not rounding) are silent."""
    torch.manual_seed(0)
    model = tiny_gpt2.train()
    if case != "float32-autocast":
        model = model.to(torch.bfloat16)
    counts, watch = _stale_run(model, {"bfloat16-lr-1e-3": 1e-3, "lr-0": 0.0}.get(case, 1e-5),
                               autocast=case == "float32-autocast")
    assert not [f for f in watch.findings() if f.code == "grads.stale_weights"]
    last = watch.last
    assert last is not None
    if case == "float32-autocast":
        assert all(p.update_stale is None for p in last.params)
        return
    kept, moving = (sum(c[i] for c in counts.values()) for i in (0, 1))
    if case == "lr-0":
        assert kept == moving > 0
        (f,) = [f for f in watch.findings() if f.code == "grads.update_ratio"]
        assert "moved no layer" in f.summary and "half-precision" in f.summary
    else:
        assert 0 < kept / moving < 0.1


def _broken_run(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, steps: int,
                **watch_kw: object) -> tuple[list[list[str]], list[bool], object]:
    """Watched steps of a language model; returns, per step, the parameters that torch
    shows finite before `opt.step()` (weights and gradient) and NaN/Inf after it; per step,
    whether those are NaN/Inf exactly where Adam's running square (`exp_avg_sq`) is 0
    (vacuously where none is); and the watch."""
    broken: list[list[str]] = []
    at_zero: list[bool] = []
    with watch_gradients(model, optimizer=opt, **watch_kw) as watch:  # type: ignore[arg-type]
        for _ in range(steps):
            opt.zero_grad()
            model(ids, labels=ids).loss.backward()
            finite = {n for n, p in model.named_parameters() if bool(p.isfinite().all())
                      and p.grad is not None and bool(p.grad.isfinite().all())}
            opt.step()
            broken.append([n for n, p in model.named_parameters()
                           if n in finite and not bool(p.isfinite().all())])
            at_zero.append(all(torch.equal(~p.isfinite(), opt.state[p]["exp_avg_sq"] == 0)
                               for n, p in model.named_parameters() if n in broken[-1]))
    return broken, at_zero, watch


@pytest.mark.parametrize("sampling", ["every-step", "callback", "first-only"])
def test_an_update_that_writes_nan_into_float16_weights_is_named_with_adams_eps(
        tiny_gpt2, sampling: str) -> None:
    """A GPT-2 kept in float16 under AdamW (eps 1e-8, which is 0 in float16): its first
    update turns finite weights NaN/Inf wherever a gradient's running square underflowed to
    0, and every later step is NaN. The watch names that update, as torch's own before and
    after show it, and the eps; not the NaN gradients of the steps after it. Read alike
    where a callback takes each sample before its update, and where only step 0 is
    sampled."""
    torch.manual_seed(0)
    model = tiny_gpt2.train().to(torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    kw: dict[str, object] = {"every": 1}
    if sampling == "callback":
        kw["on_sample"] = lambda flow: None
    elif sampling == "first-only":
        kw = {"every": 100}
    broken, at_zero, watch = _broken_run(model, opt, ids, 3, **kw)
    assert broken[0] and not broken[1] and not broken[2]  # torch: step 0 wrote them
    assert at_zero[0]  # the cause named is torch's: where the running square underflowed
    b = watch.broken_update
    assert b is not None and b.step == 0 and list(b.params) == broken[0]
    assert b.dtypes == ("torch.float16",) and b.optimizer == "AdamW" and b.eps == 1e-8
    found = watch.findings()
    (f,) = [f for f in found if f.code == "grads.nonfinite_update"]
    assert f.severity == Severity.ERROR and f.evidence["step"] == 0
    assert "eps=1e-08 is 0 in float16" in f.summary and "1e-4" in f.fix
    assert not [f for f in found if f.code == "grads.nonfinite"]


def test_an_overflowing_update_is_named_without_blaming_eps() -> None:
    """SGD with a learning rate that carries float16 weights past 65504: the update wrote
    Inf, and there is no eps to blame."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).half()
    opt = torch.optim.SGD(model.parameters(), lr=6e4)  # float16 holds it; lr × grad it does not
    x = torch.randn(16, 8).half()
    with watch_gradients(model, optimizer=opt, every=1) as watch:
        opt.zero_grad()
        (model(x).float().sum() * 100).backward()
        assert all(bool(p.grad.isfinite().all()) for p in model.parameters())
        opt.step()
    inf = [n for n, p in model.named_parameters() if not bool(p.isfinite().all())]
    b = watch.broken_update
    assert inf and b is not None and list(b.params) == inf and b.eps is None
    (f,) = [f for f in watch.findings() if f.code == "grads.nonfinite_update"]
    assert "eps" not in f.summary and "lower the learning rate" in f.fix


@pytest.mark.parametrize("case", ["float16-eps-1e-4", "bfloat16", "float32", "nan-input"])
def test_updates_that_keep_weights_finite_or_carry_nan_gradients_are_no_broken_update(
        tiny_gpt2, case: str) -> None:
    """float16 weights under AdamW with an eps float16 holds (1e-4), bfloat16 and float32
    weights under eps 1e-8 train finite: silent. NaN gradients (a NaN input) make NaN
    weights too, but from NaN gradients: that is `grads.nonfinite`'s, not the update's."""
    torch.manual_seed(0)
    model = tiny_gpt2.train()
    if case != "float32":
        model = model.to(torch.bfloat16 if case == "bfloat16" else torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5,
                            eps=1e-4 if case == "float16-eps-1e-4" else 1e-8)
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    nan = model.transformer.wpe.register_forward_hook(lambda m, i, o: o * math.nan) \
        if case == "nan-input" else None
    broken, _, watch = _broken_run(model, opt, ids, 2, every=1)
    if nan is not None:
        nan.remove()
    assert watch.broken_update is None and not any(broken)
    codes = {f.code for f in watch.findings()}
    assert "grads.nonfinite_update" not in codes
    assert ("grads.nonfinite" in codes) == (case == "nan-input")
    if case != "nan-input":
        assert all(bool(p.isfinite().all()) for p in model.parameters())

"""Diagnosis: pure functions over records, with configurable thresholds."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from torchscope.errors import TorchscopeError
from torchscope.findings import Severity
from torchscope.grads import GradThresholds, diagnose, gradient_flow, layer_norms
from torchscope.grads.analyze import (
    diagnose_history,
    find_broken_update,
    find_dead,
    find_exploding,
    find_nonfinite,
    find_update_ratio,
    find_vanishing,
)
from torchscope.grads.records import (
    INPUT_NO_GRAD,
    BrokenUpdate,
    GradFlow,
    GradHistory,
    ModuleGradRecord,
    ParamGradRecord,
    TensorGrad,
)


def _rec(name: str, order: int, out: float, inp: float | None,
         module_type: str = "Linear") -> ModuleGradRecord:
    return ModuleGradRecord(name, module_type, 0, 0, 0, order,
                            (TensorGrad("", (4, 4), "torch.float32", out),),
                            (TensorGrad("[0]", (4, 4), "torch.float32", inp,
                                        None if inp is not None else INPUT_NO_GRAD),),
                            owns_params=True)


def _param(module: str, norm: float | None, weight: float | None = 1.0,
           update: float | None = None) -> ParamGradRecord:
    return ParamGradRecord(f"{module}.weight", module, (4, 4), "torch.float32", True, norm,
                           weight_norm=weight, update_norm=update)


def _lesson_flow(fc: float = 3.16, conv2: float = 0.4, conv1: float = 0.047) -> GradFlow:
    mods = (_rec("fc", 0, fc, conv2), _rec("conv2", 1, conv2, conv1), _rec("conv1", 2, conv1, None))
    params = (_param("conv1", 0.1), _param("conv2", 0.2), _param("fc", 0.3))
    return GradFlow(0, mods, params, math.sqrt(0.01 + 0.04 + 0.09))


def _chain(relative: list[float], out_rms: list[float] | None = None,
           types: tuple[str, ...] = (), head: tuple[str, ...] = ()) -> GradFlow:
    """Layers l0 (nearest the loss) ... ln, each a (4, 4) weight of norm 2: parameter
    gradient norm 2 * relative[i], so relative gradient relative[i] and RMS relative[i] / 2;
    grad_output RMS out_rms[i] (default 1). Activations of `types` follow l0, l1, ... in
    backward order (between two layers); those of `head` come before l0 (an output
    activation, nearer the loss than every layer)."""
    outs = out_rms or [1.0] * len(relative)
    mods = tuple(_rec(f"l{i}", 2 * i + 1, 4.0 * o, None) for i, o in enumerate(outs))
    mods += tuple(ModuleGradRecord(f"act{i}", t, 0, 0, 0, 2 * i + 2,
                                   (TensorGrad("", (4, 4), "torch.float32", 1.0),), ())
                  for i, t in enumerate(types))
    mods += tuple(ModuleGradRecord(f"out{i}", t, 0, 0, 0, 0,
                                   (TensorGrad("", (4, 4), "torch.float32", 1.0),), ())
                  for i, t in enumerate(head))
    params = tuple(_param(f"l{i}", 2.0 * r, 2.0) for i, r in enumerate(relative))
    return GradFlow(0, mods, params, math.sqrt(math.fsum((2.0 * r) ** 2 for r in relative)))


def test_lesson_ratio_is_a_measurement_not_an_alarm() -> None:
    # Defect 1: "conv1 receives 67x less gradient than fc" compared raw norms of the two end
    # layers. Three layers hold no trend, and the raw ratio stays available as a number.
    assert find_vanishing(_lesson_flow()) == []
    assert diagnose(_lesson_flow()) == []
    (near, n_near), (far, n_far) = layer_norms(_lesson_flow())[0], layer_norms(_lesson_flow())[-1]
    assert (near, far) == ("fc", "conv1") and math.isclose(n_near / n_far, 3.16 / 0.047)


def test_steady_decay_toward_the_input_is_likely_vanishing() -> None:
    # Head, then four body layers each 10x below the one before: 1000x over the body.
    flow = _chain([5.0, 1.0, 0.1, 0.01, 0.001])
    (f,) = find_vanishing(flow)
    assert f.code == "grads.vanishing" and f.severity == Severity.WARNING
    assert f.module == "l4" and f.summary.startswith("likely vanishing gradients")
    assert "falls 1000× over 4 layers" in f.summary and "10× per layer" in f.summary
    assert f.evidence["nearest"] == "l1" and f.evidence["farthest"] == "l4"
    assert math.isclose(f.evidence["decay"], 1000.0, rel_tol=1e-9)
    assert math.isclose(f.evidence["relative_r2"], 1.0) and math.isclose(
        f.evidence["rms_change"], 1e-3, rel_tol=1e-9)
    # Configurable, and the severity says how sure: possible (info) below `likely`...
    (g,) = find_vanishing(flow, GradThresholds(likely=1e4))
    assert g.severity == Severity.INFO and g.summary.startswith("possible")
    # ...severe (error) from `severe`, silent below `possible`.
    (h,) = find_vanishing(flow, GradThresholds(severe=500.0))
    assert h.severity == Severity.ERROR and h.summary.startswith("severe")
    assert find_vanishing(flow, GradThresholds(possible=2e3, likely=1e4, bottleneck=1e4)) == []


def test_head_and_scatter_are_not_vanishing() -> None:
    # A head with 1000x the body's relative gradient over a level body (BERT at init).
    assert find_vanishing(_chain([10.0, 0.01, 0.012, 0.009, 0.011])) == []
    # Ends 100x apart with scatter in between is no steady trend...
    assert find_vanishing(_chain([1.0, 1.0, 0.001, 1.0, 0.01])) != []  # ...but a bottleneck:
    (b,) = find_vanishing(_chain([1.0, 1.0, 0.001, 1.0, 0.01]))
    assert b.severity == Severity.INFO and b.module == "l2"
    assert b.summary.startswith("possible gradient bottleneck: l2 gets 1000× less")
    assert find_vanishing(_chain([1.0, 1.0, 0.01, 1.0, 0.1])) == []  # 100x: no bottleneck
    # Two body layers are too few for a trend: a 1e4x drop is a possible bottleneck only.
    (two,) = find_vanishing(_chain([1.0, 1.0, 1e-4]))
    assert two.severity == Severity.INFO and "bottleneck" in two.summary


def test_vanishing_fix_fits_the_model() -> None:
    decaying = [5.0, 1.0, 0.1, 0.01, 0.001]
    (plain,) = find_vanishing(_chain(decaying))
    assert "add normalization" in plain.fix and "saturating" not in plain.fix
    (sig,) = find_vanishing(_chain(decaying, types=("Sigmoid", "Sigmoid")))
    assert "replace the saturating Sigmoid" in sig.fix
    # An output Tanh (a GAN generator's) lies above the layers the gradient fades over:
    # replacing it would change the model's range and touch none of them.
    (out,) = find_vanishing(_chain(decaying, head=("Tanh",)))
    assert "saturating" not in out.fix
    # Defect 1: a conv followed by BatchNorm is not told to add normalization.
    (bn,) = find_vanishing(_chain(decaying, types=("BatchNorm2d",)))
    assert "add normalization" not in bn.fix and "gain" in bn.fix


def test_exploding_growth_and_total() -> None:
    # The gradient arriving at each layer grows 10x per layer toward the input.
    flow = _chain([1.0] * 5, out_rms=[1.0, 1.0, 10.0, 100.0, 1000.0])
    (f,) = find_exploding(flow)
    assert f.code == "grads.exploding" and f.severity == Severity.WARNING and f.module == "l4"
    assert f.summary.startswith("likely exploding gradients") and "grows 1000×" in f.summary
    assert math.isclose(f.evidence["output_rms_change"], 1000.0, rel_tol=1e-9)
    # 30x growth of the backward signal alone (a residual stack adds up) is not reported;
    # with the relative gradient growing along, it is possible.
    assert find_exploding(_chain([1.0] * 5, out_rms=[1.0, 1.0, 3.1, 10.0, 31.0])) == []
    (p,) = find_exploding(_chain([1.0, 1.0, 3.1, 10.0, 31.0],
                                 out_rms=[1.0, 1.0, 3.1, 10.0, 31.0]))
    assert p.severity == Severity.INFO and p.summary.startswith("possible")
    # A huge total joins the trend's finding and raises it to an error.
    big = _chain([1e6] * 5, out_rms=[1.0, 1.0, 10.0, 100.0, 1000.0])
    (e,) = find_exploding(big)
    assert e.severity == Severity.ERROR and e.module == "l4" and "total norm" in e.summary
    # A total above the threshold without a trend: one finding at the largest layer.
    flat = GradFlow(0, (), (_param("fc", 5e3),), 5e3)
    (g,) = find_exploding(flat)
    assert g.severity == Severity.WARNING and g.module == "fc" and "5e+03" in g.summary
    (h,) = find_exploding(flat, GradThresholds(exploding_error_norm=1e3))
    assert h.severity == Severity.ERROR
    assert find_exploding(flat, GradThresholds(exploding_norm=1e4)) == []


def test_update_ratio() -> None:
    def flow(ratio: float) -> GradFlow:
        params = tuple(_param(f"l{i}", 1.0, 2.0, update=2.0 * ratio * (i + 1))
                       for i in range(3))
        return GradFlow(0, tuple(_rec(f"l{i}", i, 1.0, None) for i in range(3)), params, 1.0)

    assert find_update_ratio(flow(1e-3)) == []  # the healthy figure
    (hi,) = find_update_ratio(flow(0.2))
    assert hi.severity == Severity.WARNING and hi.module == "l2"
    assert math.isclose(hi.evidence["median"], 0.4) and "likely too large" in hi.summary
    (mid,) = find_update_ratio(flow(0.01))
    assert mid.severity == Severity.INFO and "possibly too large" in mid.summary
    (lo,) = find_update_ratio(flow(1e-7))
    assert lo.severity == Severity.INFO and lo.module == "l0" and "too small" in lo.summary
    unmeasured = GradFlow(0, (_rec("l0", 0, 1.0, None),), (_param("l0", 1.0),), 1.0)
    assert find_update_ratio(unmeasured) == []


def test_measures_on_records() -> None:
    p = ParamGradRecord("fc.weight", "fc", (2, 8), "torch.float32", True, 2.0,
                        weight_norm=8.0, update_norm=0.008)
    assert p.numel == 16 and p.rms == 0.5 and p.relative == 0.25
    assert math.isclose(p.update_ratio or 0.0, 1e-3)
    assert ParamGradRecord("b", "", (3,), "torch.float32", False, None).relative is None
    zero_w = ParamGradRecord("b", "", (3,), "torch.float32", True, 1.0, weight_norm=0.0)
    assert zero_w.relative is None  # all-zero weight: no ratio
    flow = _chain([5.0, 1.0])
    (l0, l1) = flow.layer_grads()
    assert (l0.module, l0.order, l0.relative, l0.rms) == ("l0", 1, 5.0, 2.5)
    assert l1.output_rms == 1.0 and l1.params == ("l1.weight",)


def test_dead_layers() -> None:
    flow = GradFlow(0, (_rec("fc", 0, 1.0, 0.0), _rec("conv1", 1, 0.0, None)),
                    (_param("conv1", 0.0), _param("fc", 1.0)), 1.0)
    blocks, zero = find_dead(flow)
    assert blocks.module == "fc" and blocks.evidence["kind"] == "blocks"
    assert zero.code == "grads.dead" and zero.module == "conv1"
    assert zero.summary == "conv1 receives an all-zero gradient"
    assert find_dead(flow, GradThresholds(dead_norm=-1.0)) == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_gradient_that_underflows_in_float16_says_so(dtype: torch.dtype) -> None:
    """A float16 model trained on a small loss without a GradScaler: its gradient rounds to
    zero below 6e-8 (a transformers Llama in half precision: "look for dead ReLUs" at its
    RMSNorms). The same model in float32 gets a gradient everywhere."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 1)).to(dtype)
    x = torch.randn(8, 16, dtype=dtype)
    flow = gradient_flow(model, x, loss_fn=lambda out: out.float().sum() * 1e-7)
    dead = [f for f in flow.findings() if f.code == "grads.dead"]
    if dtype == torch.float32:
        assert not dead
        return
    assert dead and all(f.evidence["float16"] for f in dead)
    assert all("GradScaler" in f.fix and "6e-8" in f.fix for f in dead)
    assert flow.param("0.weight").norm == 0.0


def test_nonfinite_first_module_in_backward_order() -> None:
    nan = math.nan
    mods = (_rec("fc", 0, 1.0, 1.0), _rec("conv2", 1, 1.0, nan), _rec("conv1", 2, nan, None))
    flow = GradFlow(0, mods, (_param("conv1", nan), _param("fc", 1.0)), nan)
    (f,) = find_nonfinite(flow)
    assert f.module == "conv2" and f.severity == Severity.ERROR
    assert f.evidence["arrives_from_above"] is False
    assert f.evidence["nonfinite_params"] == 1
    assert diagnose(flow)[0].code == "grads.nonfinite"


def test_nonfinite_end_to_end() -> None:
    class SqrtAtZero(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + (x - x.detach()).sqrt()  # value x, gradient inf at 0

    model = nn.Sequential(nn.Linear(4, 4), SqrtAtZero(), nn.Linear(4, 2))
    flow = gradient_flow(model, torch.randn(3, 4), loss_fn="sum")
    (f,) = find_nonfinite(flow)
    assert f.module == "1"  # the first in backward order to pass NaN/Inf down
    assert f.evidence["arrives_from_above"] is False
    assert not flow.finite and not math.isfinite(flow.total_norm)


def test_history_findings() -> None:
    hist = GradHistory((0, 10, 20), ("fc",), ((1.0,), (10.0,), (math.inf,)),
                       ((1.0,), (2.0,), (3.0,)), (1.0, 500.0, math.nan))
    codes = {f.code: f for f in diagnose_history(hist)}
    assert "step 20" in codes["grads.nonfinite"].summary
    assert codes["grads.exploding"].evidence["ratio"] == 500.0
    assert diagnose_history(hist, GradThresholds(growth_ratio=1000)) == [codes["grads.nonfinite"]]


def test_healthy_flow_has_no_findings() -> None:
    assert diagnose(_lesson_flow(fc=1.0, conv2=0.9, conv1=0.8)) == []


def test_dead_layer_end_to_end() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        model[0].bias.fill_(-100.0)  # every ReLU unit is off: nothing flows below it
    flow = gradient_flow(model, torch.randn(5, 4), loss_fn="sum")
    dead = {f.module: f for f in find_dead(flow)}
    assert set(dead) == {"1", "0"}  # the ReLU passes zeros down; fc1 gets only zeros
    assert dead["1"].summary == "1 (ReLU) receives gradient but passes an all-zero gradient down"
    assert dead["0"].evidence["zero_params"] == 2
    assert flow.param("0.weight").norm == 0.0 and flow.param("2.bias").norm > 0


def test_all_zero_loss_gradient_is_one_finding_about_the_loss() -> None:
    # The single-output cross-entropy trap: log_softmax over one class is 0, so every
    # layer gets a zero gradient. The cause is the loss, not any of them.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x, y = torch.randn(5, 4), torch.zeros(5, dtype=torch.long)
    flow = gradient_flow(model, x, target=y, loss_fn=nn.CrossEntropyLoss())
    assert flow.total_norm == 0.0
    (f,) = find_dead(flow)
    assert f.evidence["kind"] == "loss" and f.module is None
    assert f.evidence["zero_modules"] == 3 and f.evidence["zero_params"] == 4
    assert f.evidence["loss_value"] == 0.0 and "one class" in f.fix
    # The same model with a loss that depends on its output: silent.
    assert find_dead(gradient_flow(model, x, target=torch.randn(5, 1),
                                   loss_fn=nn.MSELoss())) == []


def test_unknown_metric_or_series_kind_is_a_clear_error() -> None:
    flow = GradFlow(0, (), (), 0.0)
    with pytest.raises(TorchscopeError, match=r"metric='norm' is not a gradient metric.*Fix"):
        layer_norms(flow, "norm")  # type: ignore[arg-type]
    history = GradHistory((0,), ("fc",), ((1.0,),), ((2.0,),), (2.0,))
    assert history.series("fc") == [1.0] and history.series("fc", "params") == [2.0]
    with pytest.raises(TorchscopeError, match=r"kind='param' is not a series.*Fix"):
        history.series("fc", "param")


class _RnnLM(nn.Module):
    def __init__(self, recurrent_scale: float) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.rnn = nn.RNN(32, 64, batch_first=True)
        self.head = nn.Linear(64, 50)
        with torch.no_grad():
            self.rnn.weight_hh_l0.mul_(recurrent_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T) token ids
        out, _ = self.rnn(self.emb(x))  # (B, T, 64)
        return self.head(out).flatten(0, 1)  # (B * T, 50)


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_an_rnn_exploding_through_time_is_told_of_its_recurrent_weight(scale: float) -> None:
    # A vanilla RNN whose recurrent weight's largest eigenvalue exceeds 1 (torch's default
    # init times 4) explodes through its 100 time steps inside one module: the advice is
    # its recurrent weight, not the depth's init.
    torch.manual_seed(0)
    model = _RnnLM(scale)
    x, y = torch.randint(0, 50, (8, 100)), torch.randint(0, 50, (800,))
    flow = gradient_flow(model, x, target=y)
    w = model.rnn.weight_hh_l0.detach()  # (64, 64)
    radius = float(torch.linalg.eigvals(w).abs().max())
    exploding = [f for f in flow.findings() if f.code == "grads.exploding"]
    if scale == 1.0:
        assert radius < 1 and not exploding
        return
    (f,) = exploding
    gain = float(w.pow(2).mean().sqrt()) * 8  # RMS x sqrt(64)
    assert radius > 1 and gain == pytest.approx(radius, rel=0.2)
    assert f"rnn.weight_hh_l0 with nn.init.orthogonal_: its RMS × √hidden is {gain:.2f}" in f.fix
    assert "lower the init scale" not in f.fix


def test_zero_parameter_gradients_under_an_arriving_gradient_are_one_finding() -> None:
    # Eight bias-free layers that each scale the signal by about 1e-7: every product of a
    # layer's arriving gradient and its input is about 1e-49, under float32's smallest
    # subnormal, so torch rounds each weight gradient to exactly 0. A gradient still
    # reaches all but the first layer, though from layer 3 down its float32 norm reads 0.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16, bias=False) for _ in range(8)])
    with torch.no_grad():
        for layer in model:
            layer.weight.normal_(0.0, 1e-7 / 4)  # std · sqrt(fan_in) = 1e-7
    x = torch.randn(4, 16)
    arriving: dict[int, torch.Tensor] = {}
    ref = copy.deepcopy(model)
    for i, layer in enumerate(ref):
        layer.register_full_backward_hook(
            lambda m, gi, go, i=i: arriving.__setitem__(i, go[0].detach()))
    ref(x.clone().requires_grad_()).sum().backward()
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in ref.parameters())
    assert [i for i in range(8) if bool(arriving[i].abs().max() > 0)] == list(range(1, 8))
    norms = [float(torch.linalg.vector_norm(arriving[i])) for i in range(8)]
    assert norms[3] == 0.0 < norms[4]  # a gradient torch's own norm reads as zero
    flow = gradient_flow(model, x, loss_fn="sum")
    (group,) = find_dead(flow)  # no layer "passes an all-zero gradient down"
    assert group.evidence["kind"] == "vanished" and group.code == "grads.dead"
    assert group.evidence["modules"] == 8 and group.evidence["zero_params"] == 8
    assert (group.evidence["first"], group.evidence["last"]) == ("7", "0")
    assert group.module == "0" and "below what float32 holds" in group.summary
    assert "activations.scale_drift" in group.fix
    assert group.evidence["smallest_arriving"] == pytest.approx(norms[4], rel=1e-4)

    # A normal gradient reaching a layer whose input is all zeros: its input is the cause.
    zero_in = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8, bias=False),
                            nn.Linear(8, 2))
    with torch.no_grad():
        zero_in[0].bias.fill_(-100.0)  # every ReLU unit off: layer 2 takes zeros
    flow = gradient_flow(zero_in, torch.randn(5, 4), loss_fn="sum")
    (one,) = [f for f in find_dead(flow) if f.evidence["kind"] == "zero_input"]
    assert one.module == "2" and one.evidence["modules"] == 1
    assert one.summary.startswith("2 (gradient norm ") and "inputs are all zero" in one.fix
    assert flow.param("2.weight").norm == 0.0 and (flow.get("2").output_norm or 0) > 0


class _Positions(nn.Module):
    """A fixed (frozen) position table added to the tokens, and a frozen bias."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = nn.Parameter(table, requires_grad=False)  # (T, C)
        self.proj = nn.Linear(8, 8)
        self.proj.bias.requires_grad_(False)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, T, C)
        return self.proj(x + self.table)


def test_a_frozen_table_left_at_zero_is_found() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 6, 8)
    zero = _Positions(torch.zeros(6, 8))
    flow = gradient_flow(zero, x, loss_fn="sum")
    assert flow.frozen_zero == ("table",)  # the zero frozen bias is not a table
    (f,) = [f for f in diagnose(flow) if f.code == "grads.frozen_zero"]
    assert f.severity == Severity.WARNING and f.module == ""
    assert f.summary.startswith("table is frozen (requires_grad=False) and all zero")
    assert torch.count_nonzero(zero.table) == 0 and not zero.table.requires_grad
    # A frozen table that holds values (a sin-cos one, pretrained weights): silent.
    filled = _Positions(torch.randn(6, 8))
    flow = gradient_flow(filled, x, loss_fn="sum")
    assert flow.frozen_zero == ()
    assert not [f for f in diagnose(flow) if f.code == "grads.frozen_zero"]


@pytest.mark.parametrize(("optimizer", "dtype", "eps", "named"), [
    ("AdamW", "torch.float16", 1e-8, True),
    ("Adagrad", "torch.float16", 1e-10, True),
    ("Adam", "torch.float16", 2.0 ** -25, True),  # a tie: rounds to even, 0
    ("Adam", "torch.float16", 1e-7, False),  # float16 holds it (as 1.2e-7)
    ("AdamW", "torch.bfloat16", 1e-8, False),  # bfloat16 has float32's range
    ("SGD", "torch.float16", 1e-8, False),  # no eps in its step
    ("AdamW", "torch.float16", None, False),
])
def test_a_broken_update_names_eps_only_where_the_dtype_rounds_it_to_zero(
        optimizer: str, dtype: str, eps: float | None, named: bool) -> None:
    """The eps is named as the cause only for an optimizer that divides by it and a dtype
    in which torch rounds it to 0; the threshold is torch's own rounding."""
    torch_dtype = getattr(torch, dtype.removeprefix("torch."))
    if eps is not None:
        assert (torch.tensor(eps, dtype=torch_dtype) == 0).item() == (
            dtype == "torch.float16" and eps <= 2.0 ** -25)
    broken = BrokenUpdate(step=3, params=("fc.weight", "fc.bias"), dtypes=(dtype,),
                          measured=4, optimizer=optimizer, eps=eps)
    (f,) = find_broken_update(broken)
    assert f.code == "grads.nonfinite_update" and f.severity == Severity.ERROR
    assert f.module == "fc" and f.evidence["parameters"] == 2 and f.evidence["step"] == 3
    assert ("is 0 in float16" in f.summary) == named
    assert find_broken_update(None) == []

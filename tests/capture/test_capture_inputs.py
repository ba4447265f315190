"""A model input that its first layer takes as it is: its statistics against torch's, and
`activations.input_scale` where it is far from unit scale (0-255 pixels never normalised),
silent on normalised data and on a model that rescales its input itself."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchscope.capture import capture_activations


class _Mlp(nn.Module):
    def __init__(self, rescale: bool = False) -> None:
        super().__init__()
        self.rescale = rescale
        self.fc1 = nn.Linear(784, 64)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 1, 28, 28)
        x = x / 255 if self.rescale else x
        out: torch.Tensor = self.fc2(self.act(self.fc1(x.flatten(1))))  # (N, 10)
        return out


def _pixels() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (32, 1, 28, 28), generator=g).float()  # (32, 1, 28, 28)


def test_raw_pixels_into_the_first_layer_are_read_and_found(reduction_path: str) -> None:
    x = _pixels()
    res = capture_activations(_Mlp(), x)
    fc1 = next(r for r in res.records if r.module == "fc1")
    s = fc1.model_input
    ref = x.double()
    assert s is not None and s.shape == (32, 784)  # read through the flatten view
    assert (s.min, s.max) == (0.0, 255.0)
    assert s.mean == pytest.approx(float(ref.mean()), rel=1e-6)
    assert s.std == pytest.approx(float(ref.std()), rel=1e-6)
    assert all(r.model_input is None for r in res.records if r.module != "fc1")
    (f,) = [f for f in res.findings() if f.code == "activations.input_scale"]
    assert f.module == "fc1" and f.severity.label == "warning"
    assert f.evidence["rms"] == pytest.approx(float(ref.square().mean().sqrt()), rel=1e-6)
    assert "divide by 255" in f.fix


@pytest.mark.parametrize("case", ["normalised", "rescaled inside"])
def test_normalised_or_rescaled_inputs_are_silent(case: str) -> None:
    x = _pixels()
    if case == "normalised":
        model, x = _Mlp(), (x / 255 - 0.5) / 0.29
    else:
        model = _Mlp(rescale=True)
    res = capture_activations(model, x)
    fc1 = next(r for r in res.records if r.module == "fc1")
    assert (fc1.model_input is None) == (case == "rescaled inside")
    assert not [f for f in res.findings() if f.code == "activations.input_scale"]


def test_a_vit_fed_pixels_its_image_processor_never_normalised() -> None:
    # transformers' ViT takes `pixel_values` as a keyword; its patch embedding's
    # convolution takes them as they are.
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, num_labels=10))
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (4, 3, 32, 32), generator=g).float()  # (4, 3, 32, 32)
    conv = "vit.embeddings.patch_embeddings.projection"
    found = {}
    for name, pixels in (("raw", raw), ("processed", (raw / 255 - 0.5) / 0.5)):
        res = capture_activations(model, {"pixel_values": pixels})
        found[name] = [f.module for f in res.findings() if f.code == "activations.input_scale"]
        s = next(r.model_input for r in res.records if r.module == conv)
        assert s is not None and s.max == float(pixels.max())
    assert found == {"raw": [conv], "processed": []}


def _table(age_column: bool) -> torch.Tensor:
    """A (256, 64) table of standardised features; with `age_column`, column 7 holds ages
    in years as they came (18 to 80), the one feature left out of the scaling."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g)  # (256, 64)
    if age_column:
        x[:, 7] = torch.randint(18, 81, (256,), generator=g).float()
    return x


def test_one_column_left_unscaled_is_found_by_its_own_scale(reduction_path: str) -> None:
    # Over the whole table the RMS is about 6.5, under the bound of 10: only the column's
    # own scale (about 52) tells.
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))
    x = _table(age_column=True)
    res = capture_activations(model, x)
    s = next(r.model_input for r in res.records if r.module == "0")
    per_column = x.double().square().mean(dim=0).sqrt()  # (64,): torch's RMS per column
    assert float(x.double().square().mean().sqrt()) < 10  # the overall scale passes
    assert s is not None and (s.feature_dim, s.feature_max_index) == (-1, 7)
    assert s.feature_rms_max == pytest.approx(float(per_column.max()), rel=1e-6)
    assert s.feature_rms_median == pytest.approx(
        float(per_column.median()), rel=1e-6)  # torch's median: the lower one
    (f,) = [f for f in res.findings() if f.code == "activations.input_scale"]
    assert f.module == "0" and f.evidence["feature"] == 7
    assert "column 7 (of 64) has RMS" in f.summary and "(x - mean) / std" in f.fix
    # Scaled like the others: silent.
    clean = capture_activations(model, _table(age_column=False))
    assert not [f for f in clean.findings() if f.code == "activations.input_scale"]


def test_a_convolution_reads_its_input_s_scale_per_channel() -> None:
    # An image batch normalised per channel, but for a depth channel in millimetres.
    model = nn.Sequential(nn.Conv2d(4, 8, 3), nn.ReLU())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, 16, 16, generator=g)  # (N, C, H, W)
    x[:, 3] = x[:, 3].abs() * 30
    res = capture_activations(model, x)
    s = next(r.model_input for r in res.records if r.module == "0")
    per_channel = x.double().square().mean(dim=(0, 2, 3)).sqrt()  # (4,)
    assert s is not None and (s.feature_dim, s.feature_max_index) == (1, 3)
    assert s.feature_rms_max == pytest.approx(float(per_channel.max()), rel=1e-6)
    (f,) = [f for f in res.findings() if f.code == "activations.input_scale"]
    assert "channel 3 (of 4)" in f.summary

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

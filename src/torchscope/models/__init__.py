"""Built-in models, TARGET loading and input SPECs."""

from torchscope.models.spec import InputSpec, parse_spec
from torchscope.models.target import LoadedTarget, ModelInputs, call_model, load_inputs, load_target
from torchscope.models.zoo import BUILTINS, MLP, BuiltinModel, DeepMLP, ResNetMini, TinyCNN

__all__ = [
    "BUILTINS",
    "MLP",
    "BuiltinModel",
    "DeepMLP",
    "InputSpec",
    "LoadedTarget",
    "ModelInputs",
    "ResNetMini",
    "TinyCNN",
    "call_model",
    "load_inputs",
    "load_target",
    "parse_spec",
]

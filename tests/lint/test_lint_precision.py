"""Precision on real code: the false positives issue 12 found in pytorch-lightning,
accelerate and transformers, each as a minimal fixture shaped like the real code (written for
this test), next to the true positive it must not hide.

TS004 (3×): regional compilation compiles each *distinct* block once. TS002 (4×): hooks
registered once, at setup, for the object's life: at most info. TS005 (3×): `empty_cache()`
around a checkpoint load, after releasing a loaded checkpoint, or behind a user's option.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchscope.cli import app
from torchscope.findings import Severity
from torchscope.lint import lint_paths, lint_source


def _found(src: str, select: str) -> list[tuple[int, str]]:
    """(line, severity) of the `select` rule's findings."""
    return [(v.line, v.severity.label)
            for v in lint_source(textwrap.dedent(src), select=[select])]


# ---------------------------------------------------------------------- TS004
def test_ts004_regional_compilation_into_a_new_container_is_silent() -> None:
    # accelerate's compile_regions: a new ModuleList of compiled blocks, recursing into
    # the children that hold repeated blocks.
    src = """
    import torch

    def compile_blocks(module, **options):
        def walk(module):
            if isinstance(module, torch.nn.ModuleList):
                out = torch.nn.ModuleList()
                for block in module:
                    out.append(torch.compile(block, **options))
            elif has_blocks(module):
                out = copy_shell(module)
                for name, child in module.named_children():
                    out.add_module(name, walk(child))
            else:
                out = torch.compile(module, **options)
            return out
        return walk(module)
    """
    assert _found(src, "TS004") == []


@pytest.mark.parametrize("tail", ["", "return module"], ids=["deepspeed", "fsdp2"])
def test_ts004_in_place_regional_compilation_is_silent(tail: str) -> None:
    # accelerate's DeepSpeed and FSDP2 variants: `block.compile()` in place, recursing on
    # the children; the FSDP2 one returns the module it compiled.
    src = f"""
    def compile_blocks_in_place(module, **options):
        if is_block_list(module):
            for block in module:
                block.compile(**options)
        elif has_blocks(module):
            for child in module.children():
                compile_blocks_in_place(child, **options)
        else:
            module.compile(**options)
        {tail}
    """
    assert _found(src, "TS004") == []


def test_ts004_regional_compilation_repeated_every_step_is_flagged() -> None:
    # The same walk run on the same model every step compiles every block again.
    src = """
    def compile_blocks_in_place(module):
        for block in module.children():
            block.compile()

    def train(model, loader):
        for epoch in range(3):
            compile_blocks_in_place(model)
            for x in loader:
                model(x)
    """
    (v,) = lint_source(textwrap.dedent(src), select=["TS004"])
    assert (v.line, v.severity) == (4, Severity.ERROR)
    assert "loop at line 7, which calls `compile_blocks_in_place`" in v.message
    nested = """
    for epoch in range(3):
        for block in model.children():
            block.compile()
    """
    assert _found(nested, "TS004") == [(4, "error")]


def test_ts004_factory_built_function_is_a_new_object_per_call() -> None:
    # A fuzzer compiling a freshly built function per configuration: nothing is compiled
    # twice; the same call on the caller's model is.
    src = """
    import torch

    class Fuzzer:
        def run_one(self):
            fn = self.make_fn()
            return torch.compile(fn)()

        def run_model(self):
            net = self.model.eval()
            return torch.compile(net)()

        def search(self, n):
            for attempt in range(n):
                self.run_one()
                self.run_model()
    """
    assert _found(src, "TS004") == [(11, "error")]


# ---------------------------------------------------------------------- TS002
def test_ts002_optimizer_post_step_hook_at_prepare_is_info() -> None:
    # accelerate's torchao preparation: one post-step hook on the first optimizer.
    src = """
    class Preparer:
        def prepare_fp8(self, *args):
            models = [a for a in args if is_module(a)]
            optimizers = [a for a in args if is_optimizer(a)]
            if optimizers:
                optimizers[0].register_step_post_hook(
                    lambda *a, **k: refresh_scales(models[0]))
            return args
    """
    assert _found(src, "TS002") == [(7, "info")]


def test_ts002_pre_hook_on_each_attention_module_at_setup_is_info() -> None:
    # accelerate's context-parallel setup: a pre-hook on every self-attention module.
    src = """
    def drop_masks(model):
        def pre(module, args, kwargs):
            kwargs.pop("attention_mask", None)
            return args, kwargs

        for name, module in model.named_modules():
            if name.endswith("self_attn"):
                module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
    """
    assert _found(src, "TS002") == [(9, "info")]


def test_ts002_layerwise_optimizer_hooks_are_info() -> None:
    # transformers' Trainer: a layer-wise optimizer steps each parameter from its own
    # post-accumulate-grad hook, meant to stay for the model's life.
    src = """
    class Trainer:
        @staticmethod
        def optimizer_setup(args, model):
            per_param = {p: make_optimizer([p]) for p in model.parameters()}

            def step_one(param):
                if param.grad is not None:
                    per_param[param].step()
                    per_param[param].zero_grad()

            for param in model.parameters():
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(step_one)
            return per_param

        def create_optimizer(self):
            self.optimizer = self.optimizer_setup(self.args, self.model)
    """
    assert _found(src, "TS002") == [(14, "info")]


def test_ts002_post_step_hook_when_loading_optimizer_state_is_info() -> None:
    # transformers' Trainer on SageMaker model parallel: the optimizer state is loaded by a
    # post-step hook, defined per checkpoint format.
    src = """
    import os

    class Trainer:
        def load_optimizer(self, checkpoint):
            if os.path.isfile(os.path.join(checkpoint, "user_content.pt")):
                def load_state(mod, opt):
                    opt.load_state_dict(read(checkpoint, partial=True))
            else:
                def load_state(mod, opt):
                    opt.load_state_dict(read(checkpoint, partial=False))
            self.model_wrapped.register_post_step_hook(load_state)
    """
    assert _found(src, "TS002") == [(12, "info")]


def test_ts002_the_same_registration_per_step_warns() -> None:
    src = """
    def attach(model, fn):
        for block in model.children():
            block.register_forward_hook(fn)

    def train(model, loader, fn):
        for x in loader:
            attach(model, fn)
            model(x)

    def setup(models, fn):
        for m in models:
            attach(m, fn)
    """
    (v,) = lint_source(textwrap.dedent(src), select=["TS002"])
    assert (v.line, v.severity) == (4, Severity.WARNING)
    assert "loop at line 7, which calls `attach`" in v.message
    in_loop = """
    for step in range(10):
        model.fc.register_forward_hook(save)
    """
    assert [(v.code, v.severity) for v in lint_source(textwrap.dedent(in_loop))] == [
        ("TS001", Severity.ERROR), ("TS002", Severity.WARNING)]


def test_ts002_loop_over_hooks_at_setup_is_info() -> None:
    src = """
    def attach_all(model, hooks):
        for fn in hooks:
            model.register_forward_hook(fn)
    """
    assert _found(src, "TS002") == [(4, "info")]


def test_info_only_run_exits_0_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "setup.py"
    path.write_text("def setup(model, fn):\n    model.register_forward_hook(fn)\n")
    result = lint_paths([path], config=False)
    assert [v.severity for v in result.violations] == [Severity.INFO]
    assert result.exit_code == 0
    run = CliRunner().invoke(app, ["lint", str(path), "--no-fixes"])
    assert run.exit_code == 0
    assert f"{path}:2:11: TS002 info: the handle" in run.stdout
    assert run.stdout.splitlines()[-1] == "Found 1 info note (TS002 ×1) in 1 file."


# ---------------------------------------------------------------------- TS005
def test_ts005_before_loading_a_checkpoint_is_silent() -> None:
    # pytorch-lightning's Strategy.load_checkpoint.
    src = """
    import torch

    class Strategy:
        def load_checkpoint(self, path):
            torch.cuda.empty_cache()
            return self.checkpoint_io.load_checkpoint(path)
    """
    assert _found(src, "TS005") == []


def test_ts005_after_dropping_a_loaded_checkpoint_is_silent() -> None:
    # pytorch-lightning's checkpoint connector once every state is restored.
    src = """
    import torch

    class Connector:
        def resume_end(self):
            log_restored(self.path)
            self._loaded = {}
            torch.cuda.empty_cache()
            self.barrier()
    """
    assert _found(src, "TS005") == []


def test_ts005_behind_a_users_option_is_silent() -> None:
    # accelerate's Megatron-LM evaluation step: `--empty-unused-memory-level` asks for it.
    src = """
    import torch

    class Engine:
        def eval_step(self, batch):
            args = get_args()
            losses = self.pipeline(batch, forward_only=True)
            if args.empty_unused_memory_level >= 1:
                torch.cuda.empty_cache()
            return losses

        def train_loop(self, loader):
            for step, batch in enumerate(loader):
                self.train_step(batch)
                if step % 100 == 0:
                    torch.cuda.empty_cache()
    """
    assert _found(src, "TS005") == []


def test_ts005_other_purposes_are_silent() -> None:
    src = """
    import torch

    def dequantize(module, names):
        for name in names:
            packed = getattr(module, name + "_blocks")
            torch.cuda.empty_cache()
            setattr(module, name, unpack(packed))
            delattr(module, name + "_blocks")

    def free_memory():
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()
    """
    assert _found(src, "TS005") == []


def test_ts005_memory_reactions_are_no_option() -> None:
    src = """
    import torch

    def train(model, loader):
        for batch in loader:
            oom = run(model, batch)
            if oom:
                torch.cuda.empty_cache()
            if torch.cuda.memory_allocated() > LIMIT:
                torch.cuda.empty_cache()
    """
    assert _found(src, "TS005") == [(8, "warning"), (10, "warning")]

"""Suite-wide fixtures: every test fails if it leaves a hook on a module it built; and models
more than one folder tests. Every test runs on one CPU thread."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from torchscope.hooks.leakcheck import HookLeakTracker

# `make test` runs two pytest-xdist workers on a machine of two cores (and CI alike). At
# torch's default of one OpenMP thread per core each worker runs two, and a thread waiting
# for a core the other worker holds spins: tests/grads and the monitor's findings took
# 180 s of wall time and 354 s of CPU that way, 47 s and 85 s with one thread per worker.
# Child processes (the CLI, the compile child, torchrun's ranks) get one thread too.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config: pytest.Config) -> None:
    """The controller (or a run without workers) makes the folder where every process of the
    run, xdist's workers and the CLI's and torchrun's children included, notes the finding
    codes it emitted (torchscope.findings._emitted); the workers inherit it."""
    if not hasattr(config, "workerinput") and "TORCHSCOPE_CODES_DIR" not in os.environ:
        os.environ["TORCHSCOPE_CODES_DIR"] = tempfile.mkdtemp(prefix="torchscope-codes-")
        config.stash[_CODES_DIR] = os.environ["TORCHSCOPE_CODES_DIR"]


_CODES_DIR = pytest.StashKey[str]()


def _full_run(config: pytest.Config) -> bool:
    """The whole suite ran (no paths, -k or -m): only then must every code have been seen."""
    return (config.args_source == pytest.Config.ArgsSource.TESTPATHS
            and not config.option.keyword and not config.option.markexpr
            and not config.option.deselect)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A declared finding code that no test emitted fails a full, passing run: each entry of
    the catalogue must be reachable, and tested (issue 44). An undeclared code fails where it
    is emitted (`torchscope.findings.declared`)."""
    folder = session.config.stash.get(_CODES_DIR, None)
    if folder is None:
        return
    try:
        if exitstatus != 0 or not _full_run(session.config):
            return
        import torchscope.catalogue
        import torchscope.lint  # declares lint.TS0xx

        seen: set[str] = set()
        for log in Path(folder).glob("codes-*.log"):
            seen.update(log.read_text(encoding="utf-8").split())
        missing = sorted(e.code for e in torchscope.catalogue.entries() if e.code not in seen)
        if missing:
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(
                    f"catalogue: {len(missing)} declared finding code(s) no test emitted: "
                    f"{', '.join(missing)}. Emit each in a test, or remove its entry.",
                    red=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("TORCHSCOPE_CODES_DIR", None)


@pytest.fixture(autouse=True)
def _no_hook_leaks() -> Iterator[None]:
    """Fail the test if any module created during it still carries hooks at its end."""
    with HookLeakTracker() as tracker:
        yield
    leaks = tracker.leaks()
    assert not leaks, "test left hooks behind: " + ", ".join(
        f"{e.owner} {e.kind}×{e.count}" for e in leaks
    )


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _console_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """The width a pipe gets (150 columns): pytest-xdist's workers inherit COLUMNS=80, which
    the CLI honours. Tests of narrow consoles set COLUMNS themselves."""
    monkeypatch.setenv("COLUMNS", "150")


class CheckpointedBlocks(torch.nn.Module):
    """Two blocks run through `torch.utils.checkpoint` by the model's own forward
    (`reentrant`: which kind; None: not checkpointed), then a head."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        nn = torch.nn
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(2))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = block(x) if self.reentrant is None else \
                checkpoint(block, x, use_reentrant=self.reentrant)
        out: torch.Tensor = self.head(x)  # (B, 2)
        return out


@pytest.fixture
def checkpointed_blocks() -> type[CheckpointedBlocks]:
    """`CheckpointedBlocks`, the class (build it with the kind of checkpoint you need)."""
    return CheckpointedBlocks


def _train_own_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                    opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()


@pytest.fixture
def train_own_loss() -> Callable[[torch.nn.Module, dict[str, torch.Tensor],
                                  torch.optim.Optimizer, int], None]:
    """`train(model, batch, opt, steps)`: `steps` optimizer steps of a transformers model on
    the loss it computes itself from `batch` (which holds the labels)."""
    return _train_own_loss


class _ScriptedPart(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # ReLU, not tanh: TorchScript runs an optimised graph after its first calls, and
        # with tanh the later calls' gradients differ from the first's in the last bit.
        return torch.relu(self.fc(x))


@pytest.fixture
def scripted_part() -> Callable[[int], torch.nn.Module]:
    """Build a `torch.jit.script`ed Linear(width, width) + ReLU: a submodule that takes no
    hook."""
    return lambda width=8: torch.jit.script(_ScriptedPart(width))


@pytest.fixture
def tiny_gpt2() -> torch.nn.Module:
    """A 2-layer GPT-2 built from a config: no download."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32)
    return GPT2LMHeadModel(cfg).eval()


@pytest.fixture(params=["eager", "fused"])
def reduction_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test on both reduction paths of `torchscope._kernels`. `eager`: every statistic
    and norm by eager ops. `fused`: by the fused kernels, ready before the test starts (built
    once per machine, so the first run may wait for them); skipped where they cannot be
    built (no C++ compiler)."""
    from torchscope import _kernels

    if request.param == "eager":
        with _kernels.disabled():
            yield "eager"
        return
    for program in _kernels.PROGRAMS:
        status = _kernels.prepare(program, wait=None)
        if status.state != "ready":
            pytest.skip(f"no fused kernel here: {status.reason}")
    yield "fused"


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test skipped without a CUDA device is also marked `cuda`, so that `pytest -m
    cuda` (benchmarks/gpu_check.py) runs exactly those."""
    for item in items:
        for mark in item.iter_markers("skipif"):
            reason = str(mark.kwargs.get("reason", ""))
            if reason.startswith("needs") and ("CUDA" in reason or "GPU" in reason):
                item.add_marker(pytest.mark.cuda)
                break

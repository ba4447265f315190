"""How fast `torchscope lint` is: the project's own tree against the 2 s budget, and scale.

Measures, in one run: linting src/torchscope in-process (the acceptance: under 2 s), the same
through the CLI in a fresh interpreter (what `make lint` pays, interpreter start and imports
included), a large real tree (torch.nn from the installed torch) for files per second, and
the third-party corpus of tests/lint/test_lint_corpus.py (pytorch-lightning, accelerate,
transformers' trainer.py, trainer_optimizer.py and GPT-2) with its findings by severity.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import torch

from torchscope.lint import lint_paths

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "torchscope"
BUDGET_S = 2.0


def _best_of(n: int, fn: object) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - t0)
    return best


def _corpus() -> list[Path] | None:
    """The paths tests/lint/test_lint_corpus.py lints, or None when a package is missing."""
    dirs: dict[str, Path] = {}
    for name in ("pytorch_lightning", "accelerate", "transformers"):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            return None
        dirs[name] = Path(next(iter(spec.submodule_search_locations)))
    tf = dirs["transformers"]
    return [dirs["pytorch_lightning"], dirs["accelerate"], tf / "trainer.py",
            tf / "trainer_optimizer.py", tf / "models" / "gpt2" / "modeling_gpt2.py"]


def main() -> None:
    own = lint_paths([SRC], config=False)
    own_s = _best_of(3, lambda: lint_paths([SRC], config=False))
    print(f"src/torchscope in-process: {own.files} files, {len(own.violations)} findings, "
          f"{own_s:.3f} s = {own_s / BUDGET_S:.1%} of the {BUDGET_S:.0f} s budget")

    env_path = str(ROOT / "src")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "torchscope", "lint", str(SRC), "--no-config"],
        capture_output=True, text=True, env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        check=False)
    cli_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torchscope"], check=True,
                   env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    import_s = time.perf_counter() - t0
    print(f"`torchscope lint src/torchscope` CLI: {cli_s:.2f} s end to end (exit "
          f"{proc.returncode}); `import torchscope` alone: {import_s:.2f} s "
          f"= {import_s / cli_s:.0%} of it")

    nn_dir = Path(torch.__file__).parent / "nn"
    big = lint_paths([nn_dir], config=False, use_gitignore=False)
    big_s = _best_of(1, lambda: lint_paths([nn_dir], config=False, use_gitignore=False))
    print(f"torch/nn ({big.files} files): {big_s:.2f} s, {big.files / big_s:.0f} files/s, "
          f"{len(big.violations)} findings; src/torchscope is {own_s / big_s:.1%} of that time")

    corpus = _corpus()
    if corpus is None:
        print("third-party corpus: pytorch-lightning, accelerate or transformers missing")
        return
    found = lint_paths(corpus, config=False)
    corpus_s = _best_of(3, lambda: lint_paths(corpus, config=False))
    by_severity = {label: sum(v.severity.label == label for v in found.violations)
                   for label in ("error", "warning", "info")}
    print(f"third-party corpus ({found.files} files): {corpus_s:.2f} s, "
          f"{found.files / corpus_s:.0f} files/s; findings by severity: {by_severity}")


if __name__ == "__main__":
    main()

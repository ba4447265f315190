"""`torchscope doctor` on ranks: launched with torch's elastic launcher (`--nproc`) and under
a plain torchrun; one-line errors (exit 2) for requests this machine cannot run and for a
rank that raises, with no process left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from torchscope.cli import app
from torchscope.report.document import load_schema

SRC = Path(__file__).resolve().parents[2] / "src"
runner = CliRunner()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(SRC), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def _run(argv: list[str], timeout: float = 170.0) -> tuple[subprocess.CompletedProcess[str],
                                                           float, list[int]]:
    """Run a command in its own session; also return the pids still in that session after
    it exited (orphans)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    seconds = time.perf_counter() - t0
    time.sleep(1.0)  # the launcher's children get a moment to exit
    left = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == proc.pid and fields[0] != "Z":  # session id, not a zombie
                left.append(int(entry.name))
    return subprocess.CompletedProcess(argv, proc.returncode, out, err), seconds, left


def _check_report(out: Path, strategy: str) -> dict:
    import jsonschema

    doc = json.loads((out / "report.json").read_text())
    jsonschema.validate(doc, load_schema())
    ranks = doc["sections"]["ranks"]
    assert ranks["status"] == "ok"
    data = ranks["data"]
    assert data["world_size"] == 2 and data["strategy"] == strategy
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert doc["environment"]["world_size"] == 2
    assert doc["sections"]["compile"]["status"] == "skipped"
    html = (out / "report.html").read_text()
    assert 'id="section-ranks"' in html and "rank" in html
    return doc


def test_cli_fsdp2_writes_a_report_with_rank_rows(tmp_path: Path) -> None:
    out = tmp_path / "rep"
    res, seconds, left = _run([sys.executable, "-m", "torchscope", "doctor", "tiny-cnn",
                               "--nproc", "2", "--strategy", "fsdp2", "--fast", "--out",
                               str(out)])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert seconds < 180
    assert left == []
    doc = _check_report(out, "fsdp2")
    rows = doc["sections"]["ranks"]["data"]["ranks"]
    for row in rows:
        # FSDP2 on two ranks: every rank holds half of DDP's parameters and gradients.
        assert row["state_bytes"] * 2 <= row["ddp_state_bytes"]
        assert set(row["comm"]) == {"all_gather", "reduce_scatter"}
        assert row["step_ms"] > 0 and row["grad_norm"] > 0
        # The time columns add up: a step is the rank's own work plus what it waited.
        if row["own_ms"] > 0:
            assert row["own_ms"] + row["exposed_ms"] == pytest.approx(row["step_ms"], rel=1e-9)
    # The global gradient norm is the same on both ranks.
    assert rows[0]["grad_norm"] == pytest.approx(rows[1]["grad_norm"], rel=1e-6)
    assert "Per rank: time per step" in res.stdout
    assert "error" not in res.stderr.lower()


_TIED_LM = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class TiedLM(nn.Module):
    # GPT-2's layout: an embedding whose weight the output head shares, repeated blocks
    # between them, and a final norm: parameters of the root group itself.
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build():
    torch.manual_seed(0)
    return TiedLM(), torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(1))
"""


def test_shard_units_are_the_blocks_and_never_a_tied_weight(tmp_path: Path) -> None:
    from torchscope.doctor.distributed import shard_units
    from torchscope.models import TinyCNN
    from torchscope.models.target import load_target

    (tmp_path / "tied.py").write_text(_TIED_LM)
    model = load_target(f"{tmp_path / 'tied.py'}:build").model
    assert shard_units(model) == list(model.blocks)  # embed and head stay in the root's
    cnn = TinyCNN()
    assert shard_units(cnn) == [c for c in cnn.children()
                                if next(c.parameters(), None) is not None]
    # Without blocks, a child that ties a weight to another is left to the root too.
    plain = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10, bias=False))
    plain[2].weight = plain[0].weight
    assert shard_units(plain) == [plain[1]]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_cli_a_tied_lm_on_two_ranks_matches_one_process(tmp_path: Path, strategy: str) -> None:
    """FSDP2 used to refuse it (one tied weight in two groups), then to fail every section
    (the root group's parameters restored under FSDP's feet after the doctor's first
    forward). Both strategies must give the gradient norm of the whole batch on one
    process."""
    from torchscope.models.target import load_target
    from torchscope.step import Step

    (tmp_path / "tied.py").write_text(_TIED_LM)
    out = tmp_path / "rep"
    res, _, left = _run([sys.executable, "-m", "torchscope", "doctor",
                         f"{tmp_path / 'tied.py'}:build", "--nproc", "2", "--strategy",
                         strategy, "--fast", "--skip", "activations,memory", "--out", str(out)])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert left == []
    doc = _check_report(out, strategy)
    assert [doc["sections"][k]["status"] for k in ("gradients", "profile")] == ["ok", "ok"]
    rows = doc["sections"]["ranks"]["data"]["ranks"]
    loaded = load_target(f"{tmp_path / 'tied.py'}:build")
    assert loaded.inputs is not None
    model, ids = loaded.model, loaded.inputs.args[0]
    # Each rank takes rows r, r + 2 and averages its own loss; the synchronised gradient is
    # the mean of the two, the whole batch's when the halves are equal.
    # The doctor's loss: cross-entropy against targets seeded with its seed, 0.
    grads = []
    for r in (0, 1):
        model.zero_grad(set_to_none=True)
        Step(model, ids[r::2], seed=0).forward_backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
    mean = [(grads[0][n] + grads[1][n]) / 2 for n in grads[0]]
    reference = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in mean]))
    for row in rows:
        assert row["grad_norm"] == pytest.approx(float(reference), rel=1e-5)


_UNUSED = """
import torch
from torch import nn

class WithAux(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 3)  # built, never called: no gradient

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))

def build():
    torch.manual_seed(0)
    return WithAux(), torch.randn(8, 8)
"""


def test_cli_ddp_on_a_model_with_an_unused_parameter_runs_every_section(
        tmp_path: Path) -> None:
    """DDP without find_unused_parameters waits for the unused parameter's gradient and
    raises at the next step: the memory and time sections failed, told to pass other
    inputs, and the gradients section read a divergence between ranks. The doctor finds
    the unused parameter first (one step before wrapping), wraps with
    find_unused_parameters=True, says so, and names the parameter."""
    (tmp_path / "aux.py").write_text(_UNUSED)
    out = tmp_path / "rep"
    res, _, left = _run([sys.executable, "-m", "torchscope", "doctor",
                         f"{tmp_path / 'aux.py'}:build", "--nproc", "2", "--strategy", "ddp",
                         "--fast", "--skip", "activations", "--out", str(out)])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert left == []
    doc = _check_report(out, "ddp")
    assert [doc["sections"][k]["status"] for k in ("gradients", "memory", "profile")] == \
        ["ok", "ok", "ok"]
    assert doc["environment"]["find_unused_parameters"] is True
    codes = {f["code"]: f for f in doc["findings"]}
    assert "grads.ranks_diverge" not in codes
    assert "aux" in codes["grads.unreached"]["summary"]


def test_cli_rank_that_raises_is_one_line_exit_2_and_leaves_no_process(tmp_path: Path) -> None:
    target = tmp_path / "model.py"
    target.write_text(_FAILS_ON_RANK_1)
    res, _, left = _run([sys.executable, "-m", "torchscope", "doctor", f"{target}:build",
                         "--nproc", "2", "--fast", "--out", str(tmp_path / "rep")])
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: rank 1 raised") and "bad batch on rank 1" in lines[0]
    assert "Traceback" not in res.stdout + res.stderr
    assert left == []


_FAILS_ON_RANK_1 = (
    "import torch\nfrom torch import nn\n\n\n"
    "class Fails(nn.Module):\n"
    "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(4, 2)\n\n"
    "    def forward(self, x):\n"
    "        if torch.distributed.get_rank() == 1:\n"
    "            raise ValueError('bad batch on rank 1')\n"
    "        return self.fc(x)\n\n\n"
    "def build():\n    return Fails(), torch.randn(8, 4)\n")

_BACKWARD_FAILS = """
import torch
from torch import nn


class Refuse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("no gradient through here")


class BackwardFails(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return Refuse.apply(self.fc(x))


def build():
    return BackwardFails(), torch.randn(8, 4)
"""


def test_cli_debug_shows_where_a_rank_failed(tmp_path: Path) -> None:
    """A traceback does not survive the trip from a rank: --debug prints its text, for a
    rank that raised and for a section that failed on rank 0."""
    target = tmp_path / "model.py"
    target.write_text(_FAILS_ON_RANK_1)
    res, _, left = _run([sys.executable, "-m", "torchscope", "doctor", f"{target}:build",
                         "--nproc", "2", "--fast", "--debug", "--out", str(tmp_path / "rep")])
    assert res.returncode != 0 and left == []
    assert "RankTracebackError: rank 1: Traceback" in res.stderr, res.stderr[-3000:]
    assert f'File "{target}", line 12, in forward' in res.stderr  # the raise, on rank 1

    target = tmp_path / "backward.py"
    target.write_text(_BACKWARD_FAILS)
    res, _, left = _run([sys.executable, "-m", "torchscope", "doctor", f"{target}:build",
                         "--nproc", "2", "--fast", "--debug", "--skip", "activations,memory",
                         "--out", str(tmp_path / "rep2")])
    assert res.returncode == 0 and left == [], res.stderr[-3000:]
    assert "section gradients failed:" in res.stderr
    line = 1 + _BACKWARD_FAILS.splitlines().index(
        '        raise ValueError("no gradient through here")')
    assert f'File "{target}", line {line}, in backward' in res.stderr, res.stderr[-3000:]


def test_a_rank_that_raised_is_named_not_one_that_lost_its_peers(tmp_path: Path) -> None:
    from torchscope.distributed import RankLostError
    from torchscope.doctor.distributed import _failure, _lost_peer

    gloo = RuntimeError("Gloo connectFullMesh failed with [pair.cc:553] Connection closed by "
                        "peer [127.0.0.1]:53419")
    assert _lost_peer(gloo) and _lost_peer(RankLostError("all_gather did not complete"))
    assert not _lost_peer(ValueError("bad batch"))
    errors = tmp_path / "errors"
    errors.mkdir()
    # Rank 0 only lost its peers; rank 3 raised the cause.
    (errors / "rank0.txt").write_text(f"lost\tRuntimeError: {gloo}")
    (errors / "rank3.txt").write_text("raised\tDistributedError: the example batch has 2 "
                                      "row(s), fewer than the 4 ranks that share it.")
    err = _failure({}, errors)
    assert str(err).startswith("rank 3 raised DistributedError: the example batch has 2")


def test_cli_more_ranks_than_rows_names_the_batch(tmp_path: Path) -> None:
    res, _, left = _run([sys.executable, "-m", "torchscope", "doctor", "mlp", "--input", "2x64",
                         "--nproc", "3", "--fast", "--out", str(tmp_path / "rep")])
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "fewer than the 3 ranks" in lines[0], res.stderr
    assert left == []


def test_plain_torchrun_runs_the_doctor_as_ranks(tmp_path: Path) -> None:
    out = tmp_path / "rep"
    res, _, left = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                         "--nproc_per_node=2", "-m", "torchscope", "doctor", "tiny-cnn",
                         "--fast", "--skip", "activations,memory", "--out", str(out)])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert left == []
    doc = _check_report(out, "ddp")
    rows = doc["sections"]["ranks"]["data"]["ranks"]
    for row in rows:
        assert set(row["comm"]) == {"all_reduce"}
        assert row["local_grad_norm"] > 0
    # DDP: the synchronised norm is the same on both ranks; the local ones differ.
    assert rows[0]["grad_norm"] == pytest.approx(rows[1]["grad_norm"], rel=1e-6)
    assert rows[0]["local_grad_norm"] != rows[1]["local_grad_norm"]
    assert res.stdout.count("torchscope doctor: tiny-cnn") == 1  # rank 0 prints, once


@pytest.mark.parametrize(("argv", "needle"), [
    (["--nproc", "0"], "--nproc 0 starts no rank"),
    (["--nproc", "2", "--strategy", "zero"], "--strategy 'zero' is not one of ddp, fsdp2"),
    (["--nproc", "2", "--backend", "mpi"], "--backend 'mpi' is not one of gloo, nccl"),
    (["--strategy", "ddp"], "--strategy and --backend need --nproc"),
    (["--nproc", "2", "--device", "cpu"], "--device cpu cannot be combined with ranks"),
])
def test_bad_distributed_options_fail_before_any_work(argv: list[str], needle: str,
                                                      tmp_path: Path) -> None:
    result = runner.invoke(app, ["doctor", "tiny-cnn", "--out", str(tmp_path / "r"), *argv])
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], lines
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_nccl_without_gpus_is_refused(tmp_path: Path) -> None:
    result = runner.invoke(app, ["doctor", "tiny-cnn", "--nproc", "2", "--backend", "nccl",
                                 "--out", str(tmp_path / "r")])
    assert result.exit_code == 2
    assert "--backend nccl needs CUDA GPUs, and torch sees none" in result.output


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() >= 64,
                    reason="needs a CUDA device")
def test_more_nccl_ranks_than_gpus_is_refused(tmp_path: Path) -> None:
    n = torch.cuda.device_count() + 1
    result = runner.invoke(app, ["doctor", "tiny-cnn", "--nproc", str(n), "--backend", "nccl",
                                 "--out", str(tmp_path / "r")])
    assert result.exit_code == 2
    assert f"--nproc {n} asks for {n} NCCL ranks" in result.output


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA devices (NCCL: one GPU per rank)")
def test_nccl_ddp_on_two_gpus(tmp_path: Path) -> None:
    out = tmp_path / "rep"
    res, _, left = _run([sys.executable, "-m", "torchscope", "doctor", "tiny-cnn", "--nproc",
                         "2", "--backend", "nccl", "--strategy", "ddp", "--fast", "--out",
                         str(out)])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert left == []
    doc = _check_report(out, "ddp")
    assert doc["sections"]["ranks"]["data"]["backend"] == "nccl"
    rows = doc["sections"]["ranks"]["data"]["ranks"]
    assert rows[0]["grad_norm"] == pytest.approx(rows[1]["grad_norm"], rel=1e-6)

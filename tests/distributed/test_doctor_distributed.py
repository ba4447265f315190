"""`torchscope doctor` on ranks: launched by the doctor (`--nproc`) and under a plain
torchrun; one-line errors (exit 2) for requests this machine cannot run and for a rank that
raises, dies, hangs or builds another model, with no process or folder left behind."""

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


def _run(argv: list[str], timeout: float = 170.0, **env: str
         ) -> tuple[subprocess.CompletedProcess[str], float, list[int]]:
    """Run a command in its own session; also return the pids still in that session after
    it exited (orphans). `env` adds environment variables."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env={**_env(), **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
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
            # Its session, or a rank the doctor's launcher started in a session of its own.
            if fields[0] != "Z" and (int(fields[3]) == proc.pid or
                                     _launched_by(entry, proc.pid)):
                left.append(int(entry.name))
    return subprocess.CompletedProcess(argv, proc.returncode, out, err), seconds, left


def _launched_by(entry: Path, pid: int) -> bool:
    """A rank process of the launcher `pid` (its environment names it), even re-parented."""
    try:
        return f"TORCHSCOPE_LAUNCHER={pid}".encode() in (entry / "environ").read_bytes()
    except OSError:
        return False


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
                               "--nproc", "2", "--strategy", "fsdp2", "--fast", "--verbose",
                               "--out", str(out)])
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
                         "--fast", "--skip", "activations", "--fail-on", "warning", "--out",
                         str(out)])
    assert left == []
    doc = _check_report(out, "ddp")
    # --fail-on: the run's joined findings decide, 1 where one is a warning or worse (the
    # step's exposed communication on gloo usually is), else 0; never 2 for a finished run.
    failing = [f["code"] for f in doc["findings"] if f["severity"] in ("warning", "error")]
    assert res.returncode == (1 if failing else 0), \
        (failing, res.stdout[-3000:] + res.stderr[-3000:])
    assert [doc["sections"][k]["status"] for k in ("gradients", "memory", "profile")] == \
        ["ok", "ok", "ok"]
    assert doc["environment"]["find_unused_parameters"] is True
    codes = {f["code"]: f for f in doc["findings"]}
    assert "grads.ranks_diverge" not in codes
    assert "ranks.uneven_split" not in codes  # 8 rows on 2 ranks
    assert "aux" in codes["grads.unreached"]["summary"]


# Rank 1 fails in its FAIL_AT-th forward (counting the doctor's unused-parameter check and
# its first plain forward): it raises in the head, or leaves with os._exit(3), or hangs. It
# notes when, so that the test can tell how long the others took to stop.
_FAILING = """
import os
import time

import torch
from torch import nn

FAIL_AT = int(os.environ["FAIL_AT"])
HOW = os.environ["HOW"]


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if torch.distributed.get_rank() == 1 and self.calls == FAIL_AT:
            with open(os.environ["FAILED_AT"], "w") as f:
                f.write(str(time.time()))
            if HOW == "raise":
                raise ValueError(f"bad batch in forward {FAIL_AT}")
            if HOW == "exit":
                os._exit(3)
            time.sleep(600)
        return self.fc(x)


class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 16))
        self.head = Head()

    def forward(self, x):
        return self.head(self.body(x))


def build():
    torch.manual_seed(0)
    width = 16 if HOW != "differ" or torch.distributed.get_rank() == 0 else 12
    return Net(width), torch.randn(8, 8)
"""


@pytest.mark.parametrize(("strategy", "how", "at", "needle"), [
    ("ddp", "raise", 3, "rank 1 raised ValueError: bad batch in forward 3 in head's forward "
                        "(during the activations section)."),
    ("fsdp2", "raise", 4, "rank 1 raised ValueError: bad batch in forward 4 in head's forward "
                          "(during the"),
    ("ddp", "exit", 3, "rank 1 died with exit code 3 in the activations section, without "
                       "raising an error."),
    ("fsdp2", "exit", 3, "rank 1 died with exit code 3 in the"),
    ("fsdp2", "differ", 0, "the model differs between ranks (rank 1 against rank 0): "
                           "body.0.weight is (12, 8) torch.float32 on rank 1 and (16, 8)"),
    ("ddp", "hang", 3, "rank 1 hung: rank 0 gave up waiting for it in a collective"),
])
def test_cli_a_failing_rank_ends_the_run_and_is_named(tmp_path: Path, strategy: str, how: str,
                                                      at: int, needle: str) -> None:
    """F1, F2, F4: whichever way rank 1 fails, the doctor stops every rank soon after (not
    after the 120 s timeout), exits 2 with one line naming rank 1 and how it failed ("Fix:"
    once), writes no report, and leaves no process or temporary folder behind."""
    target = tmp_path / "model.py"
    target.write_text(_FAILING)
    temp, failed_at = tmp_path / "temp", tmp_path / "failed_at"
    temp.mkdir()
    # --fail-on too: a failed rank leaves no findings to fail the run on; it exits 2.
    res, _, left = _run([sys.executable, "-m", "torchscope", "doctor", f"{target}:build",
                         "--nproc", "2", "--strategy", strategy, "--fast", "--fail-on",
                         "warning", "--out", str(tmp_path / "rep")],
                        FAIL_AT=str(at), HOW=how, FAILED_AT=str(failed_at), TMPDIR=str(temp),
                        TORCHSCOPE_TIMEOUT_S="8" if how == "hang" else "120")
    ended = time.time()
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert needle in lines[0], lines[0]
    assert lines[0].count("Fix:") == 1
    assert "Traceback" not in res.stdout + res.stderr
    assert not (tmp_path / "rep").exists()  # no report, let alone one that reads "ok"
    assert left == []
    # The run folder is gone (torch's own compiler cache, torchinductor_*, may stay).
    assert [f.name for f in temp.iterdir() if not f.name.startswith("torchinductor")] == []
    if how != "differ":
        # Far below the 120 s timeout a victim's collective would wait (the hang: 8 s).
        assert ended - float(failed_at.read_text()) < 60


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
    # A section that fails on a rank ends the run: the ranks would part ways after it.
    assert res.returncode != 0 and left == [], res.stderr[-3000:]
    assert "RankTracebackError: rank" in res.stderr
    line = 1 + _BACKWARD_FAILS.splitlines().index(
        '        raise ValueError("no gradient through here")')
    assert f'File "{target}", line {line}, in backward' in res.stderr, res.stderr[-3000:]


def test_plain_torchrun_names_the_rank_that_raised_on_the_others(tmp_path: Path) -> None:
    """Under a plain torchrun no launcher of torchscope's reads the ranks' failures: rank 1
    posts what it raised in the group's store, and rank 0, whose collectives fail as rank 1
    leaves, names it instead of its own lost connection."""
    target = tmp_path / "model.py"
    target.write_text(_FAILING)
    res, _, left = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                         "--nproc_per_node=2", "-m", "torchscope", "doctor", f"{target}:build",
                         "--fast", "--out", str(tmp_path / "rep")],
                        FAIL_AT="3", HOW="raise", FAILED_AT=str(tmp_path / "failed_at"))
    assert res.returncode != 0
    assert "error: rank 1 raised ValueError: bad batch in forward 3 in head's forward " \
        "(during the activations section); rank 0 stopped with it." in res.stderr, \
        res.stderr[-3000:]
    assert "Connection reset" not in res.stderr
    assert not (tmp_path / "rep").exists()
    assert left == []


def test_run_rank_leaves_its_group_and_blames_a_rank_s_own_failure(tmp_path: Path) -> None:
    """`run_rank` as a plain torchrun runs it, on 3 real ranks (see `_cases.run_rank_fails`):
    rank 1 is interrupted first, rank 2 raises its own error a second later, rank 0 then
    loses them. Rank 0 names rank 2, whose failure is its own, not rank 1, the lowest rank
    that posted one; every rank leaves its process group, and raises what it raised. The
    store a failing rank posts through is a clone: the shared one keeps its timeout."""
    from ._launch import run_ranks

    ranks = run_ranks("run_rank_fails", tmp_path, nproc=3, timeout=150.0)
    for a in ranks:
        assert a["store"] == {"before": 60.0, "during": 60.0, "quick": 2.0, "same": False}
        assert a["initialized"] is False, a
    assert ranks[1]["type"] == "KeyboardInterrupt"
    assert (ranks[2]["type"], ranks[2]["cause"]) == ("ModelError", "ValueError"), ranks[2]
    assert ranks[0]["type"] == "DistributedError", ranks[0]
    assert ranks[0]["message"].startswith(
        "rank 2 raised ValueError: bad batch on rank 2 in head's forward (during the "
        "doctor's first forward); rank 0 stopped with it."), ranks[0]


def test_a_failed_rank_is_said_one_way_and_its_own_failure_is_blamed_first() -> None:
    """One function says how a rank failed, for the launcher, a torchrun rank and a
    collective that lost it; the failure blamed is a rank's own before a victim's
    (interrupted), then the first posted, then the lowest rank."""
    from torchscope.distributed.comm import PostedFailure, failure_line, first_failure

    assert failure_line(1, "raised", error="ValueError: bad batch in forward 3",
                        module="head", part="the activations section") == \
        "rank 1 raised ValueError: bad batch in forward 3 in head's forward (during the " \
        "activations section)"
    assert failure_line(0, "raised", error="RuntimeError: x", part="start-up") == \
        "rank 0 raised RuntimeError: x (during start-up)"
    assert failure_line(1, "died", code=3, part="the activations section") == \
        "rank 1 died with exit code 3 in the activations section"
    assert failure_line(2, "died", code=-6, part="start-up") == \
        "rank 2 died from signal 6 (SIGABRT) in start-up"
    assert failure_line([1], "hung") == "rank 1 hung"
    assert failure_line([1, 3], "hung") == "ranks 1, 3 hung"
    with pytest.raises(ValueError):
        failure_line(1, "left")
    own_late = PostedFailure(3, "ValueError: mine", time=20.0)
    victim_early = PostedFailure(1, "Interrupted: SIGTERM", time=10.0, victim=True)
    own_early = PostedFailure(2, "ValueError: first", time=15.0)
    assert first_failure([victim_early, own_late]) is own_late
    assert first_failure([victim_early, own_late, own_early]) is own_early
    assert first_failure([PostedFailure(4, "E: a", time=5.0),
                          PostedFailure(2, "E: b", time=5.0)]).rank == 2  # type: ignore[union-attr]
    assert first_failure([victim_early]) is victim_early  # nothing better was posted
    assert first_failure([]) is None
    assert own_early.line() == "rank 2 raised ValueError: first"


def _said(run: Path, rank: int, kind: str, at: float, message: str) -> None:
    (run / "failures" / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "kind": kind, "type": "RuntimeError", "message": message,
        "module": None, "part": "the gradients section", "time": at, "fix": "",
        "traceback": "Traceback ..."}))


def test_the_first_real_failure_is_named_not_a_rank_that_lost_its_peers(
        tmp_path: Path) -> None:
    from torchscope.distributed import RankLostError
    from torchscope.doctor.distributed import RankExit, _lost_peer, rank_failure

    gloo = RuntimeError("Gloo connectFullMesh failed with [pair.cc:553] Connection closed by "
                        "peer [127.0.0.1]:53419")
    assert _lost_peer(gloo) and _lost_peer(RankLostError("all_gather did not complete"))
    assert not _lost_peer(ValueError("bad batch"))
    wrapped = ValueError("the section failed")
    wrapped.__cause__ = gloo
    assert _lost_peer(wrapped)
    run = tmp_path / "run"
    (run / "failures").mkdir(parents=True)
    killed = [RankExit(r, None, None, killed=True) for r in range(4)]
    # Rank 0 only lost its peers (first in time); ranks 3 and 2 raised, rank 3 first.
    _said(run, 0, "lost", 10.0, f"{gloo}")
    _said(run, 2, "raised", 12.0, "later")
    _said(run, 3, "raised", 11.0, "the cause")
    err = rank_failure(killed, run)
    assert err is not None and str(err).startswith("rank 3 raised RuntimeError: the cause")
    # A rank that died without a word before that is the first failure; gloo's words in its
    # log say the model differs.
    died = [*killed[:1], RankExit(1, -6, 9.0), *killed[2:]]
    assert str(rank_failure(died, run)).startswith(
        "rank 1 died from signal 6 (SIGABRT) in start-up, without raising an error.")
    (run / "rank1.log").write_text("terminate called after throwing an instance of "
                                   "'gloo::EnforceNotMet'\n  what():  [enforce fail at "
                                   "pair.cc:446] Received data size doesn't match")
    assert "the model differs between ranks" in str(rank_failure(died, run))
    # A rank that left with exit code 0 before its work was done (os._exit(0) in the
    # model) died too; it read as "rank 1 hung".
    quiet_exit = [*killed[:1], RankExit(1, 0, 9.0), *killed[2:]]
    (run / "rank1.log").unlink()
    for f in (run / "failures").glob("*.json"):
        f.unlink()
    _said(run, 0, "lost", 10.0, f"{gloo}")
    assert str(rank_failure(quiet_exit, run)).startswith(
        "rank 1 died with exit code 0 in start-up, without raising an error.")
    # Rank 1 died after its work was done (torch's teardown abort): no failure at all.
    for f in (run / "failures").glob("*.json"):
        f.unlink()
    for r in (0, 1):
        (run / "failures" / f"rank{r}.done").write_text("done")
    assert rank_failure([RankExit(0, 0, 8.0), RankExit(1, -6, 9.0)], run) is None
    # Only rank 0 gave up waiting: rank 1, which neither raised nor died, hung.
    for r in (0, 1):
        (run / "failures" / f"rank{r}.done").unlink()
    (run / "failures" / "rank1.part").write_text("the memory section")
    _said(run, 0, "lost", 10.0, "Timed out waiting 8000ms for recv operation to complete")
    err = rank_failure([RankExit(0, 1, 10.5), RankExit(1, None, None, killed=True)], run)
    assert str(err).startswith("rank 1 hung: rank 0 gave up waiting for it in a collective")
    assert "rank 1 was in the memory section" in str(err)


def test_cli_more_ranks_than_rows_names_the_batch(tmp_path: Path) -> None:
    res, _, left = _run([sys.executable, "-m", "torchscope", "doctor", "mlp", "--input", "2x64",
                         "--nproc", "3", "--fast", "--out", str(tmp_path / "rep")])
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "fewer than the 3 ranks" in lines[0], res.stderr
    assert lines[0].count("Fix:") == 1
    assert left == []


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_cli_an_uneven_split_is_a_note_with_each_rank_s_row_weight(tmp_path: Path,
                                                                    strategy: str) -> None:
    """F5: 7 rows on 3 ranks split 3/2/2; the ranks' gradients are averaged (DDP's
    all-reduce, FSDP2's reduce-scatter), so each of rank 0's rows weighs 1/9 of the step and
    the others' 1/6. An even split says nothing (the unused-parameter test)."""
    out = tmp_path / "rep"
    res, _, left = _run([sys.executable, "-m", "torchscope", "doctor", "mlp", "--input", "7x128",
                         "--nproc", "3", "--strategy", strategy, "--fast", "--skip",
                         "activations,memory,profile", "--out", str(out)])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert left == []
    doc = json.loads((out / "report.json").read_text())
    assert [r["rows"] for r in doc["sections"]["ranks"]["data"]["ranks"]] == [3, 2, 2]
    (note,) = [f for f in doc["findings"] if f["code"] == "ranks.uneven_split"]
    assert note["severity"] == "info"
    ev = note["evidence"]
    assert ev["rows"] == "3/2/2" and ev["batch_rows"] == 7
    assert [ev[f"rank{r}_row_weight"] for r in range(3)] == pytest.approx([1 / 9, 1 / 6, 1 / 6])
    assert "each of rank 0's rows weighs 1/9" in note["summary"]
    assert "each of rank 1's and rank 2's rows weighs 1/6" in note["summary"]


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
    assert res.stdout.count("verdict:") == 1  # rank 0 prints, once


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


def test_raised_in_names_the_innermost_module_whose_forward_raised() -> None:
    from torchscope.doctor.distributed import raised_in
    from torchscope.errors import ModelError

    class Bad(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("bad")

    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), Bad()))
    with pytest.raises(ValueError) as caught:
        model(torch.zeros(1, 2))
    assert raised_in(caught.value, model) == "1.1"
    wrapped = ModelError("the model raised")  # as the doctor's sections wrap it
    wrapped.__cause__ = caught.value
    assert raised_in(wrapped, model) == "1.1"
    assert raised_in(ValueError("elsewhere"), model) is None


def test_uneven_split_weighs_each_rank_s_rows() -> None:
    from torchscope.doctor.ranks import RankRecords, RanksRecord, uneven_split
    from torchscope.memory import RankBytes

    def record(rows: list[int]) -> RanksRecord:
        return RanksRecord(len(rows), "ddp", "gloo", tuple(
            RankRecords(r, None, None, None, RankBytes("ddp", 0, 0, 0, 0, 0, 0, 0, 0), None,
                        rows=n)
            for r, n in enumerate(rows)), batch_rows=sum(rows))

    assert uneven_split(record([4, 4])) is None
    note = uneven_split(record([3, 2, 2]))
    assert note is not None and note.code == "ranks.uneven_split"
    assert note.evidence["rank0_row_weight"] == pytest.approx(1 / 9)
    assert note.evidence["rank2_row_weight"] == pytest.approx(1 / 6)
    # Each rank's weights add up to 1/N, and all of them to 1, as the averaged gradient's.
    assert sum(float(note.evidence[f"rank{r}_row_weight"] or 0) * n
               for r, n in enumerate([3, 2, 2])) == pytest.approx(1.0)

"""The distributed test cases: each runs on every rank (see `_launch.run_ranks`) and returns
a JSON-ready answer; the tests in this folder assert on every rank's answer.

Each rank trains on its own rows of one global batch (rows r, r + world, ...), as a
`DistributedSampler` would hand them out, so a single process on the whole batch is the
reference for every synchronised number.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel as DDP

import torchscope
from torchscope.errors import describe


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def sharded_mlp() -> nn.Sequential:
    """`mlp()` with every Linear and the root sharded by FSDP2, after one forward (FSDP2
    adds its state-dict hooks at its lazy init, in the first forward)."""
    net = mlp()
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(net)
    with torch.no_grad():
        net(torch.zeros(2, 8))
    return net


def batch(rank: int, world: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(n, 8, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    return x[rank::world], y[rank::world]


def full_batch(world: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranks' rows concatenated in rank order (the mean loss does not see the order)."""
    parts = [batch(r, world, n) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def reference_grads(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    net = mlp()
    functional.cross_entropy(net(x), y).backward()
    return {n: p.grad for n, p in net.named_parameters()}


def hooks(model: nn.Module) -> int:
    """Every hook on the model, its parameters and DDP's or FSDP2's own included."""
    return sum(e.count for e in torchscope.audit_hooks(model).entries)


def ddp_grads(rank: int, world: int, out: Path, **ddp: Any) -> dict[str, Any]:
    """gradient_flow on DDP (`ddp`: the wrapper's options): local (before all-reduce) and
    synchronised norms per rank."""
    net = mlp()
    model = DDP(net, **ddp)
    before = hooks(model)
    x, y = batch(rank, world)
    flow = torchscope.gradient_flow(model, x, loss_fn="cross_entropy", target=y)
    # torch's own numbers: the synchronised .grad now in the model, the local gradient of
    # this rank's rows alone, and one process on the whole batch.
    actual = {n: p.grad.norm().item() for n, p in net.named_parameters()}
    local = {n: g.norm().item() for n, g in reference_grads(x, y).items()}
    whole = {n: g.norm().item() for n, g in reference_grads(*full_batch(world)).items()}
    ranks = flow.ranks
    assert ranks is not None
    joined = flow.gather()
    acts = torchscope.capture_activations(model, x)
    acts_joined = torchscope.distributed.gather(acts.records)
    return {
        "activations": [r.module for r in acts.records],
        "activations_gathered": None if acts_joined is None else
        [len(r) for r in acts_joined.results],
        "names": [p.name for p in flow.params],
        "modules": [r.module for r in flow.modules],
        "reported": {p.name: p.norm for p in flow.params},
        "actual": actual, "local_ref": local, "whole_ref": whole,
        "local": [list(row) for row in ranks.local],
        "synced": [list(row) for row in ranks.synced],
        "total_norm": flow.total_norm,
        "codes": [f.code for f in flow.findings()],
        "gathered": None if joined is None else len(joined.results),
        "gathered_ranks": None if joined is None else [r.ranks.rank for r in joined.results],
        "hooks": [before, hooks(model)],
    }


class WithUnused(nn.Module):
    """A model with a parameter the loss never reaches."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)
        self.extra = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu())


def ddp_unused(rank: int, world: int, out: Path) -> dict[str, Any]:
    """DDP without find_unused_parameters and a parameter nothing uses: DDP's all-reduce
    never runs, each rank keeps its own gradient."""
    net = WithUnused()
    model = DDP(net)
    x, y = batch(rank, world)
    flow = torchscope.gradient_flow(model, x, loss_fn="cross_entropy", target=y)
    found = [f for f in flow.findings() if f.code == "grads.ranks_diverge"]
    actual = {n: None if p.grad is None else p.grad.norm().item()
              for n, p in net.named_parameters()}
    # DDP's reducer still waits for the unused gradient: the next forward raises, and what
    # is wrong is the wrap, not the inputs.
    try:
        torchscope.gradient_flow(model, x, loss_fn="cross_entropy", target=y)
        second = None
    except torchscope.TorchscopeError as exc:
        second = exc.fix
    return {"codes": [f.code for f in flow.findings()],
            "summary": found[0].summary if found else None,
            "severity": found[0].severity.label if found else None,
            "actual": actual, "second": second}


def fsdp_norms(rank: int, world: int, out: Path) -> dict[str, Any]:
    """gradient_flow on FSDP2: global per-layer norms from the shards."""
    net = sharded_mlp()
    before = hooks(net)
    x, y = batch(rank, world)
    flow = torchscope.gradient_flow(net, x, loss_fn="cross_entropy", target=y)
    ref = reference_grads(*full_batch(world))
    ref_layers: dict[str, float] = {}
    for name, g in ref.items():
        module = name.rsplit(".", 1)[0]
        ref_layers[module] = math.sqrt(ref_layers.get(module, 0.0) ** 2 + g.norm().item() ** 2)
    ranks = flow.ranks
    assert ranks is not None
    # torch's way of getting a DTensor gradient's global norm, for comparison only.
    full = {n: p.grad.full_tensor().norm().item() for n, p in net.named_parameters()}
    full_w = {n: p.full_tensor().norm().item() for n, p in net.named_parameters()}
    shard_rows = [len(r) for r in ranks.shard_rows]
    return {
        "layers": {k: v for k, v in flow.param_norms().items() if v is not None},
        "ref_layers": ref_layers,
        "params": {p.name: p.norm for p in flow.params},
        "full_tensor": full,
        "weights": {p.name: p.weight_norm for p in flow.params},
        "full_weights": full_w,
        "local": [list(row) for row in ranks.local],
        "shard_rows": shard_rows,
        "total_norm": flow.total_norm,
        "ref_total": math.sqrt(sum(g.norm().item() ** 2 for g in ref.values())),
        "codes": [f.code for f in flow.findings()],
        "modules": sorted({r.module for r in flow.modules}),
        "hooks": [before, hooks(net)],
    }


def fsdp_watch(rank: int, world: int, out: Path) -> dict[str, Any]:
    """watch_gradients on FSDP2 in a loop with an optimizer; gathered at exit."""
    net = sharded_mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    before = hooks(net)
    x, y = batch(rank, world)
    try:
        torchscope.watch_gradients(net)  # no optimizer: refused in a distributed job
        refused = None
    except torchscope.TorchscopeError as exc:
        refused = describe(exc)
    moved: dict[str, float] = {}
    with torchscope.watch_gradients(net, optimizer=opt, every=2) as watch:
        for step in range(4):
            opt.zero_grad()
            functional.cross_entropy(net(x), y).backward()
            # torch's whole weights around the update (an all-gather each, for comparison)
            start = {n: p.full_tensor().clone() for n, p in net.named_parameters()}
            opt.step()
            if step == 2:  # the last sampled step
                moved = {n: (p.full_tensor() - start[n]).norm().item()
                         for n, p in net.named_parameters()}
                whole = {n: w.norm().item() for n, w in start.items()}
        last = watch.last
    joined = watch.gathered
    assert last is not None and last.index == 2
    return {"refused": refused, "samples": watch.samples,
            "history_steps": list(watch.history.steps),
            "gathered": None if joined is None else len(joined.results),
            "hooks": [before, hooks(net)],
            "updates": {p.name: p.update_norm for p in last.params}, "moved": moved,
            "ratios": {p.name: p.update_ratio for p in last.params},
            "whole_weights": whole}


def monitor_ranks(rank: int, world: int, out: Path, strategy: str) -> dict[str, Any]:
    """torchscope.monitor on a DDP or an FSDP2 model: each rank's activation columns and
    saved bytes, with torch's own statistics of its rows and one process's saved bytes."""
    net = sharded_mlp() if strategy == "fsdp2" else mlp()
    model = net if strategy == "fsdp2" else DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(rank, world)
    stds: list[float] = []
    before = hooks(net)
    # One folder for every rank, as a torchrun script's out= is: rank 0 writes the report.
    with torchscope.monitor(model, opt, every=1, out=out / "run") as mon:
        handle = net[0].register_forward_hook(
            lambda _m, _a, o: stds.append(float(o.detach().std())))
        for step in range(3):
            opt.zero_grad()
            functional.cross_entropy(model(x * (step + 1)), y).backward()
            opt.step()
    handle.remove()
    run = mon.result
    assert run is not None
    plain = mlp()  # one process, the same rows
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
    with torchscope.monitor(plain, sgd, out=None, every=1) as alone:
        functional.cross_entropy(plain(x * 1), y).backward()  # a new input, as above
        sgd.step()
    assert alone.result is not None
    single = alone.result.saved_bytes[0]
    return {"steps": run.steps, "samples": run.samples, "stds": list(run.act_std.series("0")),
            "ref_stds": stds, "saved": list(run.saved_bytes), "single": single,
            "hooks": [before, hooks(net)],
            "paths": None if mon.paths is None else [str(p) for p in mon.paths]}


def raises_on_rank1(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Every watch open on a DDP model, then rank 1 raises inside the block: no hook may stay
    on any rank, whatever the other ranks see."""
    net = mlp()
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = hooks(model)
    x, y = batch(rank, world)
    error = None
    try:
        with torchscope.watch_activations(model), \
                torchscope.watch_gradients(model, optimizer=opt), \
                torchscope.watch_time(model, optimizer=opt, steps=1, wait=0, warmup=0):
            for i in range(3):
                opt.zero_grad()
                if rank == 1 and i == 1:
                    raise RuntimeError("rank 1 fails on purpose")
                functional.cross_entropy(model(x), y).backward()
                opt.step()
    except Exception as exc:
        error = describe(exc)
    return {"error": error, "hooks": [before, hooks(model)]}



def wide(width: int = 256) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


def profile_ddp(rank: int, world: int, out: Path) -> dict[str, Any]:
    """profile_steps on DDP, rank 1 with 128× the rows of rank 0 (a straggler), traces in
    one folder; every rank's result joined on rank 0.

    The gap is wide on purpose: the slow rank's own work should stand far above the 1.3×
    threshold at every step even when another test shares the two cores. At 32× it did not
    once: rank 0, descheduled in one step, read 7.9 ms of own work against rank 1's
    11.1 ms."""
    model = DDP(wide())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    rows = 32 if rank == 0 else 4096
    x, y = torch.randn(rows, 256, generator=g), torch.randint(0, 10, (rows,), generator=g)
    result = torchscope.profile_steps(model, x, loss_fn="cross_entropy", target=y,
                                      optimizer=opt, steps=3, baseline_steps=0,
                                      trace=out / "traces")
    joined = result.gather()
    comm = result.comm
    assert comm is not None
    straggler = [f for f in joined.findings() if f.code == "profiling.straggler"] \
        if joined is not None else []
    return {
        "trace": result.trace_path,
        "kinds": {o.kind: o.calls for o in comm.ops},
        "comm_ms": comm.comm_ms, "exposed_ms": comm.exposed_ms, "compute_ms": comm.compute_ms,
        "exposed_per_step": list(comm.exposed_per_step),
        "step_ms": result.timing.profiled_ms,
        "modules": sorted(m.module for m in result.modules),
        "codes": [f.code for f in result.findings()],
        "top_op": next((f.evidence["op"] for f in result.findings()
                        if f.code == "profiling.top_op"), None),
        "straggler": None if not straggler else {"summary": straggler[0].summary,
                                                 "rank": straggler[0].evidence["rank"]},
        "gathered": None if joined is None else len(joined.results),
    }


def watch_time_fsdp(rank: int, world: int, out: Path) -> dict[str, Any]:
    """watch_time on FSDP2 in a loop: all-gathers and reduce-scatters, gathered at exit."""
    net = sharded_mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = batch(rank, world)
    before = hooks(net)
    with torchscope.watch_time(net, optimizer=opt, steps=2, wait=0, warmup=1,
                               trace=out / "fsdp" / "step.json") as watch:
        for _ in range(3):
            functional.cross_entropy(net(x), y).backward()
            opt.step()
            opt.zero_grad()
    result = watch.result
    assert result is not None and result.comm is not None
    joined = watch.gathered
    # profile_steps labels the phases: module time and communication can be set against them.
    steps = torchscope.profile_steps(net, x, loss_fn="cross_entropy", target=y, optimizer=opt,
                                     steps=2, baseline_steps=0)
    rec = steps.reconciliation
    assert steps.comm is not None
    return {"kinds": {o.kind: o.calls for o in result.comm.ops},
            "trace": result.trace_path, "hooks": [before, hooks(net)],
            "gathered": None if joined is None else len(joined.results),
            "modules_ms": rec.forward_modules_ms + rec.backward_modules_ms,
            "phases_ms": rec.forward_ms + rec.backward_ms, "comm_ms": steps.comm.comm_ms,
            "root_self_ms": next(m.forward_self_ms + m.backward_self_ms
                                 for m in steps.modules if m.module == "")}


def memory_ranks(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Per-rank bytes of the same model under DDP and under FSDP2, after an Adam step, and
    analyze_memory's totals on the sharded one."""
    from torchscope.memory import rank_bytes

    x, y = batch(rank, world)
    answers: dict[str, Any] = {}
    for name in ("ddp", "fsdp2"):
        net = mlp()
        model: nn.Module = DDP(net) if name == "ddp" else sharded_mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        functional.cross_entropy(model(x), y).backward()
        opt.step()
        b = rank_bytes(model, opt)
        report = torchscope.analyze_memory(model, x, loss_fn="cross_entropy", target=y,
                                           optimizer=opt)
        local_params = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() * 4
            for p in model.parameters())
        answers[name] = {
            "strategy": b.strategy, "parameters": b.parameters, "gradients": b.gradients,
            "optimizer": b.optimizer_state, "buckets": b.buckets, "total": b.total,
            "replicated_total": b.replicated_total, "replicated_parameters":
            b.replicated_parameters, "saving": b.saving, "local_params": local_params,
            "report_params": report.totals.parameters, "report_grads": report.totals.gradients,
            "report_optimizer": report.totals.optimizer_state,
            "saved": report.saved.total_bytes}
    return answers


class Blocks(nn.Module):
    """Four 512×512 layers (1 MiB each): with DDP's bucket_cap_mb=1, four buckets."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(512, 512) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x).relu()
        return x


class PrintsToo(Blocks):
    """`Blocks` with a print in forward: a graph break the user should fix."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        print("debug")
        for layer in self.layers[1:]:
            x = layer(x).relu()
        return x


def ddp_breaks(rank: int, world: int, out: Path) -> dict[str, Any]:
    """torch.compile under DDP: DDPOptimizer's bucket breaks, and a print."""
    import torch._dynamo

    from torchscope.compile import CompileReport, find_graph_breaks

    answers: dict[str, Any] = {}
    for name, net in (("blocks", Blocks()), ("prints", PrintsToo())):
        model = DDP(net, bucket_cap_mb=1)
        scan = find_graph_breaks(model, torch.randn(4, 512), train=True)
        report = CompileReport(name, "(4x512)", "cpu", "forward", (), scan.breaks,
                               scan.graph_count, 8, torch.__version__)
        answers[name] = {
            "graphs": scan.graph_count, "kinds": [b.kind for b in scan.breaks],
            "reasons": sorted({b.reason.split(" (")[0] for b in scan.breaks}),
            "findings": [(f.code, f.severity.label, f.summary) for f in report.findings()]}
    answers["optimize_ddp"] = torch._dynamo.config.optimize_ddp
    return answers


def hsdp_norms(rank: int, world: int, out: Path) -> dict[str, Any]:
    """HSDP (2 replicas × 2 shards): global norms sum over the shard group only."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    net = mlp()
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    x, y = batch(rank, world)
    flow = torchscope.gradient_flow(net, x, loss_fn="cross_entropy", target=y)
    full = {n: p.grad.full_tensor().norm().item() for n, p in net.named_parameters()}
    assert flow.ranks is not None
    # One watched step: each update's norm joins its shard group's shards only, and so
    # does the norm of the gradients it used, clipped to 0.02.
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    with torchscope.watch_gradients(net, optimizer=opt) as watch:
        opt.zero_grad()
        functional.cross_entropy(net(x), y).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.02)
        used = math.sqrt(sum(p.grad.full_tensor().norm().item() ** 2
                             for p in net.parameters()))
        start = {n: p.full_tensor().clone() for n, p in net.named_parameters()}
        opt.step()
        moved = {n: (p.full_tensor() - start[n]).norm().item()
                 for n, p in net.named_parameters()}
        last = watch.last
    assert last is not None
    return {"params": {p.name: p.norm for p in flow.params}, "full_tensor": full,
            "shard_rows": [list(r) for r in flow.ranks.shard_rows],
            "updates": {p.name: p.update_norm for p in last.params}, "moved": moved,
            "applied": last.applied_norm, "used": used}


def activations_and_memory(rank: int, world: int, out: Path) -> dict[str, Any]:
    """`watch_activations` and `analyze_memory` on DDP: each rank's records under the names
    of one process, joined on rank 0 by `gather()`; each rank's statistics are a single
    process's on that rank's rows."""
    from torchscope.capture import watch_activations

    x, y = batch(rank, world)
    model = DDP(mlp())
    with watch_activations(model) as acts:
        functional.cross_entropy(model(x), y).backward()
    ranked = acts.gather()
    alone = mlp()
    with watch_activations(alone) as ref:
        alone(x)
    report = torchscope.analyze_memory(model, x, loss_fn="cross_entropy", target=y)
    ranked_memory = report.gather()
    answer: dict[str, Any] = {
        "names": [r.module for r in acts.records],
        # Sums within float rounding (the first tensors may take the eager path while the
        # fused kernel loads), min and max exactly.
        "stats_equal": [
            a.module == b.module and a.outputs[0].max == b.outputs[0].max and
            math.isclose(a.outputs[0].mean, b.outputs[0].mean, rel_tol=1e-5, abs_tol=1e-7)
            for a, b in zip(acts.records, ref.records, strict=True)],
        "hooks": hooks(model),
        "gathered": ranked is not None, "memory_gathered": ranked_memory is not None}
    if ranked is not None and ranked_memory is not None:
        answer["world"] = len(ranked)
        answer["per_rank_means"] = [[r.outputs[0].mean for r in res.records]
                                    for res in ranked.results]
        answer["memory_saved"] = [m.saved.total_bytes for m in ranked_memory.results]
        answer["findings_are_a_list"] = isinstance(ranked.findings(), list)
    return answer


def lightning_ddp(rank: int, world: int, out: Path) -> dict[str, Any]:
    """TorchscopeCallback in a Lightning fit with the DDP strategy on this process group
    (Lightning sees the ranks as launched from outside, as under torchrun), next to a
    callback that reads the synchronised gradients where the step ends."""
    import os

    import pytorch_lightning as pl

    from torchscope.integrations.lightning import TorchscopeCallback

    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world),
                       "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = wide(32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)  # type: ignore[no-any-return]

        def training_step(self, batch: Any, _i: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    synced: list[float] = []

    class Reference(pl.Callback):
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any
                                     ) -> None:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            synced.append(float(torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g) for g in grads]))))

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 32, generator=g),
                                          torch.randint(0, 10, (256,), generator=g))
    cb = TorchscopeCallback(every=1, out=None, activations=False, memory=False)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=world, strategy="ddp",
                         num_nodes=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[cb, Reference()])
    trainer.fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=16))
    assert cb.result is not None
    return {"reported": list(cb.result.total_norms), "synced": synced,
            "steps": list(cb.result.grad_param.steps)}


def hf_ddp(rank: int, world: int, out: Path, fsdp: bool) -> dict[str, Any]:
    """TorchscopeTrainerCallback in a transformers Trainer on this process group (as under
    torchrun), logging every other step: the sampled total norms against the `grad_norm`
    the Trainer logs (what accelerate's clip_grad_norm_ returned on the synchronised
    gradients). With `fsdp` set on CPU, accelerate trains through DDP all the same."""
    import os

    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from torchscope.integrations.hf import TorchscopeTrainerCallback

    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))

    class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 32

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.clone()}

    extra: dict[str, Any] = {"fsdp": "full_shard", "fsdp_config": {
        "fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}} \
        if fsdp else {}
    args = TrainingArguments(
        output_dir=str(out / "trainer"), per_device_train_batch_size=2, max_steps=4,
        logging_steps=2, learning_rate=1e-3, max_grad_norm=1.0, report_to=[],
        disable_tqdm=True, use_cpu=True, save_strategy="no", ddp_backend="gloo", **extra)
    cb = TorchscopeTrainerCallback(every=2, out=None, activations=False, memory=False)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb])
    with cb:
        trainer.train()
    assert cb.result is not None
    return {"reported": list(cb.result.total_norms),
            "steps": list(cb.result.grad_param.steps),
            "logged": [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e],
            "wrapper": type(trainer.model_wrapped).__name__}


def ddp_clip(rank: int, world: int, out: Path) -> dict[str, Any]:
    """watch_gradients in a DDP loop that clips before opt.step(), with two micro-batches
    (no_sync on the first): what the watch reports against what clipping saw."""
    net = mlp()
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(rank, world, n=16)
    returned: list[float] = []
    synced: list[dict[str, float]] = []
    with torchscope.watch_gradients(model, every=1, optimizer=opt) as watch:
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            with model.no_sync():
                functional.cross_entropy(model(x[:2] * 10), y[:2]).backward()
            functional.cross_entropy(model(x[2:] * 10), y[2:]).backward()
            synced.append({n: p.grad.norm().item() for n, p in net.named_parameters()})
            returned.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
            opt.step()
        flow = watch.last
    assert flow is not None
    # An unsampled step reads nothing: its backward queues no synchronised read.
    with torchscope.watch_gradients(model, every=2, optimizer=opt) as sparse:
        unsampled_reads = []
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            functional.cross_entropy(model(x), y).backward()
            unsampled_reads.append(sparse._collector._synced is not None)
            opt.step()
    return {"returned": returned, "totals": list(watch.history.total_norms),
            "applied": list(watch.history.applied_norms), "reads": unsampled_reads,
            "total_norm": flow.total_norm,
            "reported": {p.name: p.norm for p in flow.params}, "synced": synced[-1]}


def fsdp_clip(rank: int, world: int, out: Path) -> dict[str, Any]:
    """watch_gradients in an FSDP2 loop that clips before opt.step() on two of three steps:
    the total norm each update used, joined from the ranks' shards, against torch's own
    (the clipped gradients' full tensors) and what clip_grad_norm_ saw."""
    net = sharded_mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = batch(rank, world)
    returned: list[float] = []
    used: list[float] = []
    clipped = None
    with torchscope.watch_gradients(net, every=1, optimizer=opt) as watch:
        for step in range(3):
            opt.zero_grad()
            functional.cross_entropy(net(x * 10), y).backward()
            if step < 2:  # the last step does not clip: nothing to read
                norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
                returned.append(float(norm.full_tensor()))
                # torch's norm of the clipped gradients (an all-gather each, for comparison)
                used.append(math.sqrt(sum(p.grad.full_tensor().norm().item() ** 2
                                          for p in net.parameters())))
            opt.step()
            if step == 1:
                clipped = watch.last
        flow = watch.last
    assert flow is not None and clipped is not None
    return {"returned": returned, "used": used, "applied": watch.applied_norms,
            "history": list(watch.history.applied_norms), "last": flow.applied_norm,
            "factor": clipped.clip_factor, "total": clipped.total_norm, "hooks": hooks(net)}


def fsdp_zeroing(rank: int, world: int, out: Path) -> dict[str, Any]:
    """watch_gradients on FSDP2 loops that zero the gradients in place before each backward
    (healthy), never zero them, or zero them in place between the backward and the step,
    and on one whose optimizer was built before `fully_shard` replaced the parameters; what
    each update moved, by torch's full tensors, with the watch's counts and codes."""
    answers: dict[str, Any] = {}
    x, y = batch(rank, world)
    for mode in ("in_place", "never", "before_step", "optimizer_first"):
        if mode == "optimizer_first":
            plain = mlp()
            opt = torch.optim.SGD(plain.parameters(), lr=0.1)  # before fully_shard
            for layer in plain:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            net = fully_shard(plain)
        else:
            net = sharded_mlp()
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
        moved = 0.0
        with torchscope.watch_gradients(net, optimizer=opt, every=1) as watch:
            for _ in range(4):
                if mode == "in_place":
                    opt.zero_grad(set_to_none=False)
                functional.cross_entropy(net(x), y).backward()
                if mode == "before_step":
                    opt.zero_grad(set_to_none=False)
                start = net[0].weight.full_tensor().clone()
                opt.step()
                moved += (net[0].weight.full_tensor() - start).norm().item()
                if mode == "before_step":
                    opt.zero_grad()
        answers[mode] = {"unzeroed": watch.unzeroed_steps,
                         "codes": sorted(f.code for f in watch.findings()), "moved": moved,
                         "unoptimized": list(watch.unoptimized)}
    return answers


def fsdp1_refused(rank: int, world: int, out: Path) -> dict[str, Any]:
    """FSDP1 (`FullyShardedDataParallel`) trains flat shards that no layer hook sees:
    `watch_gradients` and `monitor` refuse it in one line, before any hook, rather than
    report norms of nothing. (Lightning's `fsdp` strategy is FSDP1 too; it needs an
    accelerator, so it is not run here.)"""
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = FullyShardedDataParallel(mlp(), device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = hooks(model)
    errors: dict[str, str | None] = {}
    for name, watch in (("watch", lambda: torchscope.watch_gradients(model, optimizer=opt)),
                        ("monitor", lambda: torchscope.monitor(model, opt, out=None))):
        try:
            with watch():
                x, y = batch(rank, world)
                functional.cross_entropy(model(x), y).backward()
                opt.step()
            errors[name] = None
        except torchscope.TorchscopeError as exc:
            errors[name] = describe(exc)
    return {"errors": errors, "hooks": [before, hooks(model)]}


def ddp_grad_changed_on_one_rank(rank: int, world: int, out: Path,
                                 change: bool) -> dict[str, Any]:
    """watch_gradients(every=1) on DDP while rank 1 doubles the head's gradient after the
    all-reduce, at step 1 only (`change`); the replicas' weights then differ from step 2 on.
    During the block each sample holds this rank's numbers only (the ranks' are joined once,
    at the end); the last sample's, joined, is read after it. torch's own answer: the
    head's weights gathered from every rank after the loop."""
    import torch.distributed as dist

    net = mlp()
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(rank, world)
    flows = []
    with torchscope.watch_gradients(model, optimizer=opt, every=1) as watch:
        for step in range(3):
            opt.zero_grad()
            functional.cross_entropy(model(x), y).backward()
            if change and rank == 1 and step == 1:
                net[4].weight.grad.mul_(2)
            opt.step()
            flows.append(watch.last)
    last = watch.last
    assert last is not None and last.ranks is not None
    found = [f for f in last.findings() if f.code == "grads.ranks_diverge"]
    head = net[4].weight.detach().clone()
    every = [torch.empty_like(head) for _ in range(world)]
    dist.all_gather(every, head)
    return {"diverge": [{"summary": f.summary, **f.evidence} for f in found],
            "held": [flow.ranks is None for flow in flows if flow is not None],
            "steps": [flow.index for flow in flows if flow is not None], "last": last.index,
            "torch_differs": not all(torch.equal(every[0], w) for w in every[1:]),
            "negated": _head_negated_on_one_rank(rank, world, change)}


def _head_negated_on_one_rank(rank: int, world: int, change: bool) -> dict[str, Any]:
    """watch_gradients over one DDP step of an MLP whose head starts at zero (as a LoRA B
    matrix does), rank 1 negating the head's gradient after the all-reduce (`change`). SGD
    then leaves -u on rank 0 and +u on rank 1: equal norms, and equal element sums too (a
    softmax head's gradient sums to 0 over its classes). The sampled step read the weights
    before the update, zeros on both. torch's own answer: the heads gathered from every
    rank after the step."""
    import torch.distributed as dist

    net = mlp()
    with torch.no_grad():
        net[4].weight.zero_()
        net[4].bias.zero_()
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(rank, world)
    with torchscope.watch_gradients(model, optimizer=opt, every=1) as watch:
        opt.zero_grad()
        functional.cross_entropy(model(x), y).backward()
        if change and rank == 1:
            net[4].weight.grad.neg_()
        opt.step()
    last = watch.last
    assert last is not None and last.ranks is not None
    head = net[4].weight.detach().clone()
    every = [torch.empty_like(head) for _ in range(world)]
    dist.all_gather(every, head)
    return {"diverge": [{"summary": f.summary, **f.evidence} for f in last.findings()
                        if f.code == "grads.ranks_diverge"],
            "torch_differs": not all(torch.equal(every[0], w) for w in every[1:]),
            "norms_equal": len({torch.linalg.vector_norm(w).item() for w in every}) == 1,
            "sums_equal": all(abs(w.sum().item()) < 1e-6 for w in every),
            "weights_before": [list(r) for r in last.ranks.weights]}


def ddp_skew(rank: int, world: int, out: Path) -> dict[str, Any]:
    """gradient_flow on DDP twice: on each rank's own rows, then with rank 1's inputs 50
    times larger (its local gradient far larger than rank 0's before the all-reduce)."""
    model = DDP(mlp())
    x, y = batch(rank, world)
    answers = {}
    for name, scale in (("even", 1.0), ("skewed", 50.0 if rank == 1 else 1.0)):
        flow = torchscope.gradient_flow(model, x * scale, loss_fn="cross_entropy", target=y)
        assert flow.ranks is not None
        local = flow.ranks.local_totals()
        answers[name] = {"findings": {f.code: {"summary": f.summary, **f.evidence}
                                      for f in flow.findings() if f.code == "grads.rank_skew"},
                         "local": list(local)}
    return answers


# A model whose second forward (the doctor's first one, after its unused-parameter check)
# fails differently on each rank: rank 1 is interrupted at once, rank 2 raises its own error
# a second later, rank 0 takes four seconds and then finds its peers gone.
_RUN_RANK_FAILS = '''
import time

import torch
from torch import nn


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        rank = torch.distributed.get_rank()
        if self.calls == 2 and rank == 1:
            raise KeyboardInterrupt
        if self.calls == 2 and rank == 2:
            time.sleep(1.0)
            raise ValueError("bad batch on rank 2")
        if self.calls == 2 and rank == 0:
            time.sleep(4.0)
        return self.fc(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = Head()

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def build():
    torch.manual_seed(0)
    return Net(), torch.randn(6, 8)
'''


def run_rank_fails(rank: int, world: int, out: Path) -> dict[str, Any]:
    """`run_rank` in a process group of its own (as under a plain torchrun), on a model that
    fails differently on each rank (see `_RUN_RANK_FAILS`). What each rank raised, and
    whether the group is still initialised after it. First, on the worker's group: the
    failure store's client is a clone with a short timeout, the shared store's unchanged."""
    import os

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    from torchscope.distributed.comm import _quick_store
    from torchscope.doctor import DoctorOptions
    from torchscope.doctor.distributed import DistributedJob, run_rank

    shared = _get_default_store()
    before = shared.timeout
    with _quick_store() as quick:
        during = (shared.timeout, quick.timeout, quick is shared)
    store = {"before": before.total_seconds(), "during": during[0].total_seconds(),
             "quick": during[1].total_seconds(), "same": during[2]}
    dist.destroy_process_group()  # run_rank joins a group of its own

    target = out / f"fails{rank}.py"
    target.write_text(_RUN_RANK_FAILS)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    job = DistributedJob(f"{target}:build", (), None, "ddp", "gloo",
                         DoctorOptions(fast=True, skip=frozenset(
                             {"gradients", "memory", "profile", "compile", "lint"})),
                         timeout_s=30.0, init_method=f"file://{out / 'store-run-rank'}")
    raised: BaseException | None = None
    try:
        run_rank(job)
    except BaseException as exc:  # KeyboardInterrupt on rank 1 included
        raised = exc
    return {"store": store, "type": type(raised).__name__,
            "message": None if raised is None else (str(raised).splitlines() or [""])[0],
            "cause": type(getattr(raised, "__cause__", None)).__name__,
            "initialized": dist.is_initialized()}

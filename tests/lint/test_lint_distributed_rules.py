"""TS008 and TS009 on targeted snippets: what they say, and what they leave alone."""

from __future__ import annotations

import textwrap

from torchscope.lint import RULES, lint_source


def _found(src: str) -> list[tuple[int, str, str]]:
    return [(v.line, v.code, v.message)
            for v in lint_source(textwrap.dedent(src), select=["TS008", "TS009"])]


def test_ts008_names_the_fully_shard_line_and_the_fix() -> None:
    (hit,) = _found("""
    from torch.distributed.fsdp import fully_shard as shard
    def setup(net):
        shard(net)
        return [p.register_hook(print) for p in net.parameters()]
    """)
    assert hit[:2] == (5, "TS008")
    assert "`net`, which `fully_shard` sharded at line 4" in hit[2]
    assert "register_post_accumulate_grad_hook" in RULES["TS008"].fix


def test_ts008_needs_the_same_function() -> None:
    assert _found("""
    from torch.distributed.fsdp import fully_shard
    def setup(model):
        fully_shard(model)
    def debug(model):
        return [p.register_hook(print) for p in model.parameters()]
    """) == []


def test_ts009_reduced_or_full_tensor_norms_are_global() -> None:
    assert _found("""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    def log(model, writer):
        fully_shard(model)
        local = sum(p.grad.to_local().norm() ** 2 for p in model.parameters())
        dist.all_reduce(local)
        writer.add_scalar("grad_norm", local.sqrt())
        writer.add_scalar("w", model.w.grad.full_tensor().norm())
    """) == []


def test_ts009_a_local_norm_through_two_names_is_still_local() -> None:
    found = _found("""
    from torch.distributed.fsdp import fully_shard
    def log(model, logger):
        fully_shard(model)
        norms = [p.grad.norm() for p in model.parameters()]
        total = sum(n ** 2 for n in norms) ** 0.5
        logger.info("grad norm %s", total)
    """)
    assert [(line, code) for line, code, _ in found] == [(7, "TS009")]
    assert "without a cross-rank reduction" in found[0][2]


def test_ts009_says_nothing_without_ddp_or_fsdp() -> None:
    assert _found("""
    def log(model):
        print([p.grad.norm() for p in model.parameters()])
        for p in model.parameters():
            p.register_hook(lambda g: print(g.norm()))
    """) == []

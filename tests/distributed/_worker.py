"""One rank of a `_launch.run_ranks` job: join the group, run the case, write its answer."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    case, rank, world, store, out, params = sys.argv[1:7]
    import _cases
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(rank),
                            world_size=int(world), timeout=timedelta(seconds=60))
    answer: dict[str, object]
    try:
        answer = getattr(_cases, case)(int(rank), int(world), Path(out), **json.loads(params))
    except Exception as exc:
        answer = {"raised": f"{type(exc).__name__}: {exc}"}
    Path(out, f"rank{rank}.json").write_text(json.dumps(answer))
    if dist.is_initialized():  # a case may have left it, or joined a group of its own
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

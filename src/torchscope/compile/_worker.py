"""Child process of `compile_report`: `python -m torchscope.compile._worker JOB RESULT`.

Reads the job (model, inputs, settings) saved with `torch.save`, measures one mode and
pickles the result (`run_job`'s payload) for the parent, which started this interpreter
on the same torchscope. Any exception becomes a result with a status; only a hard crash
(a signal) or a hang leaves no result, and the parent reports those.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Run one job; returns the process exit code (0 whenever a result was written)."""
    job_path, result_path = argv[0], argv[1]
    import torch

    from torchscope.compile._measure import first_line, run_job

    try:
        job = torch.load(job_path, weights_only=False)
        torch.set_num_threads(int(job["threads"]))
        model = job["model"]
        if model is None:
            from torchscope.models.target import load_target

            model = load_target(job["factory"]).model
    except Exception as exc:
        payload = {"status": "not_sent",
                   "error": f"the child could not load the model ({first_line(exc)})"}
    else:
        payload = run_job(model, job["inputs"], job["job"],
                          log=lambda s: print(f"[torchscope] {s}", flush=True))
        if payload.get("traceback"):
            print(payload["traceback"], file=sys.stderr, flush=True)
    Path(result_path).write_bytes(pickle.dumps(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

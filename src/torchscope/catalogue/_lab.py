"""The catalogue's `lab.*` entries: `torchscope lab` reproduces the lesson's milestones on its
own models and checks each of the lesson's claims on this machine (`LabResult.findings()`)."""

from __future__ import annotations

from torchscope.catalogue._base import INFO, WARNING
from torchscope.findings import Entry, Subject

ENTRIES: tuple[Entry, ...] = (
    Entry(
        code="lab.claim_failed",
        title="A claim of the lesson did not hold here",
        subject=Subject.ENVIRONMENT,
        levels=WARNING,
        severity="warning: what the lesson states was measured otherwise on this machine.",
        meaning="The lab measured one of the lesson's claims (a saved-byte count, a speedup, "
                "a hook's behaviour) on the lesson's own models, and the value measured here "
                "is not the one the lesson states or implies. This torch, this device or this "
                "machine's load behaves differently; the lesson's model is not the user's.",
        criterion="The measured value against the expected one, each claim with its own "
                  "test (equality, a bound, or a ratio's interval through "
                  "torchscope._timing); the note says how it was measured.",
        fix="read the claim's note for how it was measured; rerun on an idle machine for "
            "timing claims.",
        example="checkpoint: checkpointing halves the saved activations (measured 0.62, "
                "expected '≤ 0.5').",
    ),
    Entry(
        code="lab.claim_unchecked",
        title="A claim of the lesson could not be checked here",
        subject=Subject.ENVIRONMENT,
        levels=INFO,
        severity="always info: nothing was measured, so nothing is wrong.",
        meaning="One of the lesson's claims needs something this machine does not have (a "
                "CUDA device, a C++ compiler for inductor), so it was not checked; the note "
                "says why.",
        criterion="The milestone marks the claim unchecked (held is None) with its reason.",
        example="memory: empty_cache() returns cached blocks to the device (not checked).",
    ),
)

"""The labelled run zoo (tests/runzoo/cases.py) measured as precision and recall of the
run-level findings, at warning and above.

A true positive is an expected finding (code and module) among a run's warnings and
errors; a false positive is a warning or error that is neither expected nor a true
consequence of the run's fault (`allowed`). Recall counts the expected findings found at
their code, module, severity and step.
"""

from __future__ import annotations

from torchscope.findings import Severity

from .cases import Diagnosis, Run, precision_recall


def _describe(d: Diagnosis) -> str:
    return "\n".join(f"  {f.severity.label} {f.code} @ {f.module}: {f.summary}"
                     for f in d.findings)


def test_run(run: Run, diagnosis: Diagnosis) -> None:
    fps = diagnosis.false_positives()
    assert not fps, f"{run.name}: unexpected {[(f.code, f.module) for f in fps]}\n" \
        + _describe(diagnosis)
    missed = [e for e in run.expected if not diagnosis.found(e)]
    assert not missed, f"{run.name}: missed {missed}\n{_describe(diagnosis)}"
    if run.healthy:
        assert all(f.severity < Severity.WARNING for f in diagnosis.findings)


def test_precision_and_recall_over_the_run_zoo(zoo_diagnoses: list[Diagnosis]) -> None:
    healthy = [d for d in zoo_diagnoses if d.run.healthy]
    faulted = [d for d in zoo_diagnoses if not d.run.healthy]
    assert len(healthy) >= 12 and len(faulted) >= 10
    precision, recall, tp, fp, expected, found = precision_recall(zoo_diagnoses)
    print(f"\nrun zoo: {len(healthy)} healthy, {len(faulted)} faulted; precision "
          f"{precision:.2f} ({tp} true, {fp} false positives), recall {recall:.2f} "
          f"({found} of {expected} expected)")
    assert precision >= 0.95
    assert recall >= 0.90


def test_a_cause_ranks_before_the_symptoms_it_explains(zoo_diagnoses: list[Diagnosis]
                                                       ) -> None:
    """A missing zero_grad() is named first, and its symptoms say they follow it."""
    (d,) = [d for d in zoo_diagnoses if d.run.name == "mlp-no-zero-grad"]
    flagged = d.flagged()
    assert flagged[0].code == "grads.not_zeroed"
    for f in flagged[1:]:
        if f.code in ("run.grad_grew", "run.weight_scale", "run.dead_units",
                      "grads.exploding"):
            assert f.evidence["follows"] == "grads.not_zeroed", f
            assert "it follows grads.not_zeroed" in f.summary


def test_dead_units_in_many_layers_are_one_finding_dated_at_their_onset(
        zoo_diagnoses: list[Diagnosis]) -> None:
    (d,) = [d for d in zoo_diagnoses if d.run.name == "mlp-no-zero-grad"]
    dead = [f for f in d.findings if f.code == "run.dead_units"]
    assert len(dead) <= 1
    for f in dead:
        assert int(f.evidence["layers"] or 0) >= 1
        onset = f.evidence["onset_step"]
        assert isinstance(onset, int) and f.evidence["first_step"] <= onset


def test_a_layer_frozen_by_mistake_is_told_how_to_unfreeze(zoo_diagnoses: list[Diagnosis]
                                                           ) -> None:
    (d,) = [d for d in zoo_diagnoses if d.run.name == "mlp-frozen-layer"]
    (frozen,) = [f for f in d.findings if f.code == "grads.frozen"]
    assert "requires_grad_(True)" in frozen.fix and "model.2" in frozen.fix

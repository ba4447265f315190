"""The labelled zoo (tests/zoo/conftest.py) measured as precision and recall of findings.

A true positive is an expected finding code at the expected module; a false positive is a
warning-or-worse gradient or activation finding that is neither expected nor a true
consequence of the entry's fault. Healthy initialisations must be silent at warning level;
every broken model must be diagnosed at the right module.
"""

from __future__ import annotations

from torchscope.findings import Severity


def _describe(diagnosis) -> str:
    return "\n".join(f"  {f.severity.label} {f.code} @ {f.module}: {f.summary}"
                     for f in diagnosis.findings)


def test_entry(entry, diagnosis) -> None:
    fps = diagnosis.false_positives()
    assert not fps, f"{entry.name}: unexpected {sorted(map(str, fps))}\n{_describe(diagnosis)}"
    missed = [e for e in entry.expected if not diagnosis.found(e)]
    assert not missed, f"{entry.name}: missed {missed}\n{_describe(diagnosis)}"
    if entry.healthy:
        assert all(f.severity < Severity.WARNING for f in diagnosis.findings)


def precision_recall(diagnoses) -> tuple[float, float, int, int, int]:
    """(precision, recall, true positives, false positives, expected) over `diagnoses`."""
    tp = fp = expected = found = 0
    for d in diagnoses:
        wanted = {(e.code, e.module) for e in d.entry.expected}
        hits = [e for e in d.entry.expected if d.found(e)]
        found += len(hits)
        expected += len(wanted)
        flagged = d.flagged()
        fp += len(d.false_positives())
        # Allowed consequences are neither counted for nor against.
        tp += len({cm for cm in flagged if cm in wanted})
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = found / expected if expected else 1.0
    return precision, recall, tp, fp, expected


def test_precision_and_recall_over_the_zoo(zoo_diagnoses) -> None:
    healthy = [d for d in zoo_diagnoses if d.entry.healthy]
    broken = [d for d in zoo_diagnoses if not d.entry.healthy]
    assert len(healthy) >= 10 and len(broken) >= 6
    p_healthy, _, _, fp_healthy, _ = precision_recall(healthy)
    p_all, r_broken, tp, fp, expected = precision_recall(zoo_diagnoses)
    print(f"\nzoo: {len(healthy)} healthy, {len(broken)} broken; precision {p_all:.2f} "
          f"({tp} true, {fp} false positives), recall {r_broken:.2f} ({expected} expected), "
          f"false warnings on healthy models: {fp_healthy}")
    assert fp_healthy == 0 and p_healthy == 1.0
    assert r_broken == 1.0
    assert p_all == 1.0


def test_efficientnet_drift_is_put_down_to_its_norm_gains(zoo_diagnoses) -> None:
    """The drift's fix names the cause: the BatchNorm gains, first the stem's; the
    gradients that vanish with it are one finding."""
    (d,) = [d for d in zoo_diagnoses if d.entry.name == "hf-efficientnet-bn-init"]
    (drift,) = [f for f in d.findings if f.code == "activations.scale_drift"]
    assert drift.evidence["norm_onset"] == "efficientnet.embeddings.batchnorm"
    assert drift.evidence["norms_small"] == drift.evidence["norms"] > 10
    assert "nn.init.ones_(norm.weight)" in drift.fix
    # Gradients that underflow float32 are one finding that points at the drift, not one
    # "look for dead ReLUs" warning per layer (49 before).
    (dead,) = [f for f in d.findings if f.code == "grads.dead"]
    assert dead.evidence["kind"] == "vanished" and dead.evidence["modules"] > 40
    assert dead.module == "efficientnet.embeddings.convolution"
    assert "activations.scale_drift" in dead.fix
    # So are the seven squeeze-excitation gates stuck at sigmoid(0).
    (gates,) = [f for f in d.findings if f.code == "activations.constant"]
    assert gates.evidence["count"] == 7 and gates.evidence["value"] == 0.5
    assert gates.evidence["at_zero_input"] is True

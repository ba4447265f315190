"""`torchscope lab`: the lesson's milestones reproduced on its own models, each claim checked
by measuring through torchscope's capabilities.

    result = run_lab(skip=("compile",))
    result.claims        # every claim with the expected value, the measured one, a verdict
    result.milestones    # the lesson's comparison tables, refilled with measured values
"""

from torchscope.lab import analyze as _analyze  # registers LabResult's analyzer
from torchscope.lab.milestones import MILESTONES, run_lab
from torchscope.lab.records import LabClaim, LabResult, LabTable

del _analyze

__all__ = ["MILESTONES", "LabClaim", "LabResult", "LabTable", "run_lab"]

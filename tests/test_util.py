"""`torchscope._util`: the shared record builder."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from torchscope._util import frozen_record


@dataclasses.dataclass(frozen=True)
class _Record:
    name: str
    shape: tuple[int, ...]
    norm: float | None = None


def test_frozen_record_is_the_object_init_makes() -> None:
    """Equal, same hash and repr, still frozen, and pickled the same as `__init__`'s."""
    made = _Record("fc", (2, 3), 1.5)
    built = frozen_record(_Record, {"name": "fc", "shape": (2, 3), "norm": 1.5})
    assert built == made and hash(built) == hash(made) and repr(built) == repr(made)
    assert dataclasses.astuple(built) == dataclasses.astuple(made)
    assert pickle.loads(pickle.dumps(built)) == made
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.name = "other"  # type: ignore[misc]
    assert frozen_record(_Record, {"name": "fc", "shape": (2, 3), "norm": 2.0}) != made

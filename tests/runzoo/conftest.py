"""Fixtures of the labelled run zoo (`tests/runzoo/cases.py`): each run trained once per
test session, its diagnosis shared by every test that reads it."""

from __future__ import annotations

import pytest

from .cases import ZOO, Diagnosis, Run, diagnose

_CACHE: dict[str, Diagnosis] = {}


def cached(run: Run) -> Diagnosis:
    """`run`'s diagnosis, computed once per test session."""
    if run.name not in _CACHE:
        _CACHE[run.name] = diagnose(run)
    return _CACHE[run.name]


@pytest.fixture
def diagnosis(run: Run) -> Diagnosis:
    return cached(run)


@pytest.fixture
def zoo_diagnoses() -> list[Diagnosis]:
    """Every run's diagnosis, in zoo order."""
    return [cached(r) for r in ZOO]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "run" in metafunc.fixturenames:
        metafunc.parametrize("run", ZOO, ids=[r.name for r in ZOO])

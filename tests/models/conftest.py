"""The model test matrix's fixtures: each entry's tiny model made once per session, on first use.

The matrix reuses tests/unit/engine's tiny models and greedy comparison, and tests/integration's
stack helpers; pytest puts a test directory on ``sys.path`` only while it collects that directory,
so both are added here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
for _dir in (TESTS / "unit" / "engine", TESTS / "integration"):
    if str(_dir) not in sys.path:
        sys.path.append(str(_dir))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(kind)``: the ``model_matrix.TinyModel`` of the matrix's entry ``kind``, made on the
    session's first call for it."""
    from model_matrix import TinyModel

    made: dict[str, TinyModel] = {}

    def get(kind: str) -> TinyModel:
        if kind not in made:
            made[kind] = TinyModel(kind, tmp_path_factory.mktemp(f"model-{kind}"))
        return made[kind]

    return get

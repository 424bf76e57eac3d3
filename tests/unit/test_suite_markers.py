"""The suite's two steps stay apart: every test module that starts a stack of service processes
(``running_stack``, the ``one_worker_stack`` fixture, ``--start-stack``) or runs the fault drill carries
the ``long`` marker, so a plain ``pytest`` (the first step) starts none and stays short; ``.ci/run``
runs the ``long`` ones in its second step."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
STARTS_A_STACK = re.compile(r"\b(running_stack|run_drill)\(|--start-stack|\bone_worker_stack\b")


def test_every_module_that_starts_a_stack_is_marked_long():
    unmarked = [str(path.relative_to(TESTS)) for path in sorted(TESTS.rglob("test_*.py"))
                if STARTS_A_STACK.search(text := path.read_text()) and "pytest.mark.long" not in text]
    assert not unmarked, f"start a stack but are not marked long: {unmarked}"


def test_ci_runs_the_long_step_too():
    ci = (TESTS.parent / ".ci" / "run").read_text()
    assert re.search(r"pytest -q\b(?! -m)", ci) and "pytest -q -m long" in ci, ci

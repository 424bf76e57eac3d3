"""Running a whole Stack inside a test module (see test_stack.py, test_disagg.py)."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def running_stack(spec, ready_timeout_s: float = 180.0):
    """Start a Stack, wait until it is ready, yield it (its output lines in ``.lines``), stop it.
    ``TANDEM_TEST_STACK_LOG=1`` prints the lines afterwards."""
    from shared.runtime.stack import Stack

    lines: list[str] = []
    stack = Stack(spec, on_line=lambda name, line: lines.append(f"{name}| {line}"))
    stack.lines = lines
    try:
        stack.start()
        stack.wait_ready(timeout_s=ready_timeout_s)
        yield stack
    finally:
        stack.stop()
        if os.environ.get("TANDEM_TEST_STACK_LOG"):
            print("\n".join(lines))

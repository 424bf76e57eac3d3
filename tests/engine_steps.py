"""Driving an ``LLMEngine`` in a test, step by step, as the async engine's loop does."""

from __future__ import annotations


def run_to_completion(engine) -> int:
    """Steps ``engine`` until it has no unfinished request; the number of steps it took."""
    num_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1
    return num_steps

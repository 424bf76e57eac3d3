"""Session-wide fixtures shared by every test directory. Keep it small: fixtures that only one
area needs belong in that directory's own conftest.py.

The ``slow`` marker (declared in pyproject.toml) tags tests that load the real default model or
start processes; deselect them with ``-m "not slow"``. Every test that uses ``smollm2_gguf``
(directly or through another fixture) is marked ``slow`` automatically.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# transformers (the reference implementation in some tests) must not look for a model hub:
# every model here is a local file
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# workers compile their decode step on a background thread by default: minutes of CPU per cold
# process on a small machine, beside the test it would slow down. Tests run them eager unless they
# ask for the compiled step (tests/engine/test_compiled_smollm2.py, tests/unit/engine/test_compiled_decode.py)
os.environ.setdefault("TANDEM_COMPILE", "off")

from shared.model.registry import DEFAULT_MODEL, resolve_model


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the real SmolLM2-135M-Instruct Q4_1 GGUF, fetched once into the default cache
    (``TANDEM_CACHE_DIR`` or ``~/.cache/tandem``) and reused by later runs."""
    return resolve_model(DEFAULT_MODEL).path


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        # fixturenames is the transitive closure, so indirect users are caught too
        if "smollm2_gguf" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def record_logits():
    """``record(engine)`` returns a dict that fills as the engine samples: the logits row of every
    output position, keyed by (the request id's last ``-`` part, output index). Of a speculative
    step, the rows up to its first rejected draft token (those after it had a wrong context)."""
    def record(engine) -> dict:
        sampler, seen = engine.runner.sampler, {}
        sample, verify = sampler.sample, sampler.verify

        def key(request, j: int) -> tuple[str, int]:
            return request.request_id.rsplit("-", 1)[1], len(request.output_token_ids) + j

        def record_sample(logits, requests):
            seen.update((key(r, 0), row.clone()) for r, row in zip(requests, logits))
            return sample(logits, requests)

        def record_verify(logits, request, draft):
            tokens = verify(logits, request, draft)
            seen.update((key(request, j), logits[j].clone()) for j in range(len(tokens)))
            return tokens

        sampler.sample, sampler.verify = record_sample, record_verify
        return seen
    return record

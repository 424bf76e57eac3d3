"""Running a whole Stack inside a test module (see test_stack.py, test_disagg.py), and waiting on
it: every wait has a deadline and fails naming what it waited for."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import time
import uuid
import urllib.request
from pathlib import Path

from loadtest.tools import sse


def tool_missing(reason: str):
    """A tool install.sh provides (chromium, node) is missing: the test skips on a developer's
    machine, and fails under ``.ci/run`` (``TANDEM_TESTS_REQUIRE_TOOLS=1``), where a green skip
    would hide a broken install."""
    import pytest

    if os.environ.get("TANDEM_TESTS_REQUIRE_TOOLS") == "1":
        pytest.fail(f"{reason} (TANDEM_TESTS_REQUIRE_TOOLS=1: required here)")
    pytest.skip(reason)


# Stack tests compare a stack's greedy text with reference_engine's token for token: both run in
# float32 (the automatic CPU default, int8, calibrates per process and so depends on thread count).
EXACT_PRECISION = {"dtype": "float32"}


@contextlib.contextmanager
def running_stack(spec, ready_timeout_s: float = 180.0):
    """Start a Stack, wait until it is ready, yield it (its output lines in ``.lines``), stop it.
    ``TANDEM_TEST_STACK_LOG=1`` prints the lines afterwards. Workers run in ``EXACT_PRECISION``
    unless the spec names a dtype or quantization."""
    from services.stack.stack import Stack

    spec = dataclasses.replace(spec, decode_flags=_exact(spec.decode_flags), prefill_flags=_exact(spec.prefill_flags))

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


def stack_spec(state_dir: Path, prefix: str, nats_server, redis_server, **fields):
    """A ``StackSpec`` on the session's nats-server and redis-server (conftest.py) that serves on a
    free port, in a namespace of its own (``prefix`` and 8 random hex digits); ``fields`` the rest."""
    from services.stack.stack import StackSpec

    return StackSpec(state_dir=state_dir, port=0, namespace=f"{prefix}{uuid.uuid4().hex[:8]}",
                     nats_url=nats_server.url, redis_url=redis_server.url, **fields)


@contextlib.contextmanager
def remote_prefill_pair(state_dir: Path, prefix: str, nats_server, redis_server, model: str,
                        engine_flags: dict[str, object], ready_timeout_s: float = 240.0):
    """A running stack of one decode worker that prefills nothing itself (every prompt goes to the
    prefill worker, its KV written over NIXL) and one prefill worker, both with ``engine_flags``."""
    spec = stack_spec(state_dir, prefix, nats_server, redis_server, num_decode=1, num_prefill=1, model=model,
                      decode_flags={**engine_flags, "max_local_prefill_tokens": 0, "remote_prefill_timeout_s": 60},
                      prefill_flags=engine_flags)
    with running_stack(spec, ready_timeout_s=ready_timeout_s) as stack:
        yield stack


def require_nixl() -> None:
    """At a test module's top: skips the module off Linux, where NIXL (nixl-cu12) is no dependency;
    where it is one, a NIXL that does not import fails the module (TransferUnavailable says why)."""
    import pytest

    if platform.system() != "Linux":
        pytest.skip("NIXL (nixl-cu12) is a dependency on Linux only", allow_module_level=True)
    from shared.transfer.nixl import load_nixl

    load_nixl()


def child_lines(stack, name: str) -> list[str]:
    """The output lines of the stack's child ``name`` so far (as ``running_stack`` keeps them)."""
    return [line for line in stack.lines if line.startswith(f"{name}| ")]


def _exact(flags: dict[str, object]) -> dict[str, object]:
    if "dtype" in flags or "quantization" in flags:
        return flags
    return {**EXACT_PRECISION, **flags}


def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy (which it returns); fail naming ``what``
    at the deadline. Twenty seconds by default: long enough for a worker's load report (about one a
    second) to show a change."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what} (last: {value!r})")
        time.sleep(0.1)


def cluster_status(stack) -> dict:
    with urllib.request.urlopen(stack.base_url + "/status", timeout=10) as resp:
        return json.load(resp)


def decode_states(stack) -> dict[str, str]:
    """worker id → registry state of every listed decode worker."""
    return {w["info"]["worker_id"]: w["info"]["state"] for w in cluster_status(stack)["workers"]
            if w["info"]["role"] == "decode"}


def spawn_ready_decode(stack, name: str, timeout_s: float = 180.0, flags: dict[str, object] | None = None):
    """A new decode worker of the stack (``flags`` over the spec's), once it is listed as ready;
    returns (child, worker id)."""
    child = stack.spawn_decode(name, flags)
    worker_id = f"{stack.spec.namespace}-{name}"[:64]

    def ready():
        assert child.is_running(), f"{name} exited during start-up (rc {child.proc.returncode})"
        return decode_states(stack).get(worker_id) == "ready"

    wait_for(ready, timeout_s, f"{worker_id} ready in /status")
    return child, worker_id


def read_events(resp, num_events: int | None = None, timeout_s: float = 120.0) -> list[dict]:
    """The stream's ``data: {...}`` events: ``num_events`` of them, or (None) all until it ends.
    Fails if the stream ends early or the deadline passes (each read is also bounded by the
    connection's socket timeout)."""
    events: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while num_events is None or len(events) < num_events:
        assert time.monotonic() < deadline, f"{len(events)} events in {timeout_s:g}s, wanted {num_events}"
        line = resp.readline()
        if not line:
            assert num_events is None, f"stream ended after {len(events)} events, wanted {num_events}"
            return events
        if (event := sse.parse_line(line)) not in (None, sse.DONE):
            events.append(event)
    return events


@contextlib.contextmanager
def reference_engine(model: str, max_model_len: int, kv_cache_bytes: int):
    """The aggregated path's reference: the same engine in this process, prefilling locally."""
    from shared.engine import AsyncEngine, EngineConfig

    engine = AsyncEngine.start(EngineConfig(model=model, device="cpu", max_model_len=max_model_len,
                                            kv_cache_memory=kv_cache_bytes, **EXACT_PRECISION))
    try:
        yield engine
    finally:
        engine.shutdown()


def reference_engine_fixture(model: str, max_model_len: int, kv_cache_bytes: int):
    """A module-scoped ``engine`` fixture: ``reference_engine(...)`` once for the test module
    (``engine = reference_engine_fixture(MODEL, MAX_MODEL_LEN, 128 << 20)`` at its top level)."""
    import pytest

    @pytest.fixture(scope="module", name="engine")
    def engine():
        with reference_engine(model, max_model_len, kv_cache_bytes) as e:
            yield e

    return engine


def greedy_text(engine, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = False) -> str:
    """What the in-process engine generates greedily for ``prompt_ids``."""
    import asyncio

    from shared.engine import SamplingParams

    async def run():
        ids = []
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
        async for out in engine.generate(f"ref-{uuid.uuid4().hex}", prompt_ids, params):
            ids += out.new_token_ids
        return engine.tokenizer.decode(ids)

    return asyncio.run(run())


def environ_nats_url(pid: int) -> str:
    """The ``TANDEM_NATS_URL`` a running process was started with (its /proc environment)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"TANDEM_NATS_URL="))

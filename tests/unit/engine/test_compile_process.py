"""The background compile's child process (shared/engine/compiled/child.py): what it is given,
when it is used, and that it never outlives the thread that started it. The compile itself, in a
child, is tests/integration/test_compile_artifacts.py."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys

from shared.engine import EngineConfig
from shared.engine.compiled.child import _die_with_parent, child_config, child_fits, use_child_process


def test_the_child_builds_the_workers_step_with_a_small_pool_and_no_tiers():
    config = EngineConfig(model="m.gguf", device="cpu", dtype="float32", quantization="int8", num_threads=None,
                          kv_cache_memory=1 << 30, kv_host_memory=4 << 30, kv_disk_dir="/var/tiers",
                          speculative_tokens=6, compile="background", block_size=32)
    fields = json.loads(json.dumps(child_config(config, num_threads=3)))
    child = EngineConfig(**fields)
    assert (child.model, child.dtype, child.quantization, child.block_size) == ("m.gguf", "float32", "int8", 32)
    assert (child.compile, child.num_threads, child.device) == ("on", 3, "cpu")
    assert child.kv_cache_memory < config.kv_cache_memory
    assert (child.kv_host_memory, child.kv_disk_dir, child.speculative_tokens) == (0, None, 0)


def test_the_child_process_is_the_default_and_can_be_turned_off(monkeypatch):
    monkeypatch.delenv("TANDEM_COMPILE_PROCESS", raising=False)
    assert use_child_process()
    for off in ("0", "false", "off"):
        monkeypatch.setenv("TANDEM_COMPILE_PROCESS", off)
        assert not use_child_process()


def test_a_model_larger_than_the_free_memory_is_compiled_in_process():
    assert child_fits(0)  # this test process is far smaller than the machine's free memory
    assert not child_fits(-(1 << 50))  # a pool "smaller than nothing" leaves a petabyte to copy


def test_the_child_dies_with_the_thread_that_started_it(tmp_path):
    """A worker killed mid-compile leaves no compile running: the parent here starts a child with
    ``_die_with_parent`` and is killed; the child goes with it, closing the pipe both wrote to."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "from shared.engine.compiled.child import _die_with_parent\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], preexec_fn=_die_with_parent)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE)
    child_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    try:
        # the pipe reads as ended once every process holding it is gone: the child too
        ready, _, _ = select.select([parent.stdout], [], [], 30)
        assert ready and parent.stdout.read() == b"", "the child outlived its parent"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child_pid, signal.SIGKILL)

"""Compile a worker's decode step in a process of its own, at the lowest CPU priority.

A background compile inside the worker's process (``compile_thread.py``) shares the worker's GIL:
dynamo's tracing and inductor's code generation are Python, and every eager step serving meanwhile
needs the GIL for each of its thousands of op calls. At nice 19 the compiling thread is often
descheduled while it holds the GIL, and the engine thread waits for it: on a 2-core Intel Xeon a
profile of the eager steps during such a compile put about 60% of their time in taking the GIL;
timed (``python -m loadtest.bench.compile --during-compile --where thread,process``), a step in
every hundred took over 2 s and the mean step was 3.9x the eager step alone, against 87 ms and
1.6x with the compile in a child process (``loadtest/results/README.md``, the compile benchmark).

A child process has a GIL of its own. It loads the same model with the same settings (an engine
built from the same ``EngineConfig``, ``compile="on"``), compiles the step into this machine's
compile cache (shared/engine/compiled/artifacts.py) and exits; the worker then loads the step from
the cache in seconds. The child runs at the background nice value (``TANDEM_COMPILE_NICE``) with
its compiler processes, so the compile takes only the CPU time serving leaves. The child proves its
work by the artifact key it prints: where it differs from the worker's (another model object than
the one its config names), the worker compiles in its own process as before; so it does where the
machine's free memory cannot hold the child's copy of the model (``child_fits``). The child dies
with the thread that started it (``PR_SET_PDEATHSIG``): no compile outlives its worker.

    python -m shared.engine.compiled.child '<EngineConfig fields as JSON>'
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys

from shared.engine.config import EngineConfig
from shared.process_settings import process_settings

log = logging.getLogger(__name__)

_KV_MEMORY = 64 << 20  # the child's pool: only its dtype and block size matter to the compiled step


def child_config(config: EngineConfig, num_threads: int) -> dict:
    """The fields of the child's ``EngineConfig``: the worker's, compiled now, with a small pool and
    the worker's engine thread count (the compiled loops are built for it)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    # no tiers: the child must not touch the worker's disk tier; drafts do not change the step
    fields.update(compile="on", kv_cache_memory=_KV_MEMORY, num_threads=num_threads, device="cpu",
                  kv_cache_dtype=config.kv_cache_dtype or "auto", kv_host_memory=0, kv_disk_dir=None,
                  speculative_tokens=0)
    return {k: v for k, v in fields.items() if _jsonable(v)}


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def use_child_process() -> bool:
    """``TANDEM_COMPILE_PROCESS``: 1 (default) compiles a worker's background step in a child
    process, 0 on the worker's own compile thread."""
    return process_settings().compile_process


def child_fits(pool_bytes: int) -> bool:
    """Whether this machine has the memory for a second copy of the model: the child needs about
    what this process holds less its KV pool (``pool_bytes``), with room for its load's peak. Where
    /proc says nothing, yes."""
    try:
        rss = _meminfo_kib("/proc/self/status", "VmRSS") << 10
        available = _meminfo_kib("/proc/meminfo", "MemAvailable") << 10
    except (OSError, ValueError, StopIteration):
        return True
    return 2 * max(rss - pool_bytes, 0) < available


def _meminfo_kib(path: str, field: str) -> int:
    with open(path) as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1])


def _die_with_parent() -> None:
    """In the child, before exec: Linux kills it when the thread that started it ends (the worker
    exits or dies mid-compile), so no compile outlives its worker."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def compile_in_child(config: EngineConfig, num_threads: int, nice: int, timeout_s: float | None = None) -> str | None:
    """Run the child and wait for it; the artifact key it compiled (or loaded), or None if it failed."""
    cmd = [sys.executable, "-m", "shared.engine.compiled.child", json.dumps(child_config(config, num_threads))]

    def lower() -> None:
        _die_with_parent()
        if nice <= 0:
            return
        os.nice(nice)
        # SCHED_IDLE: a serving thread that wakes up takes the core from the compile at once; at nice
        # 19 alone it waits out the compile's time slice, once per OpenMP region of every step
        if nice >= 19 and hasattr(os, "SCHED_IDLE"):
            try:
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            except OSError:
                pass

    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, preexec_fn=lower)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("the decode step's compile process did not finish: %s", exc)
        return None
    if done.returncode != 0:
        tail = (done.stderr or "").strip().splitlines()[-3:]
        log.warning("the decode step's compile process failed (exit %d): %s", done.returncode, " | ".join(tail))
        return None
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])["key"]
    except (IndexError, ValueError, KeyError):
        log.warning("the decode step's compile process printed no key")
        return None


def main(argv: list[str] | None = None) -> int:
    from shared.engine import LLMEngine  # noqa: PLC0415 - torch and the model only in the child

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args and args[0] in ("-h", "--help") else 2
    logging.basicConfig(level=logging.WARNING)
    engine = LLMEngine.from_config(EngineConfig(**json.loads(args[0])))
    compiled = engine.runner.compiled
    print(json.dumps({"key": compiled.artifacts.key, "step": compiled.source, "seconds": round(compiled.warm_s, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

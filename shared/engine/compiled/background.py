"""Compile the decode step on a thread of its own while eager steps serve (``--compile background``).

A cold compile of the whole decode step takes minutes on a small CPU (seconds to load where this
machine or its cluster compiled it before: shared/engine/compiled/artifacts.py). A worker that waited
for it would keep its users waiting for nothing: the eager step is correct, only slower. So the
worker registers and serves eagerly, this thread loads or compiles the step and runs it once over
block 0 of the pool (reading, never writing), and then hands it to the runner; requests that start decoding from then on run
their decode rows compiled. A request already decoding at that moment finishes eagerly: the
graph's float sums differ from eager's in the last bits, which could change a near-tie greedy token
later in that request (shared/engine/model_runner.py).

The compiling thread takes the engine thread's intra-op thread count (the one the C++ loops are
built for) and frees its OpenMP team when it is done, so the engine thread is left the only one with a team (see
``cpu_threads``). It runs at nice 19 (``TANDEM_COMPILE_NICE``), and so do the compiler processes
it starts, so that on a machine with few cores the compile takes the CPU time serving leaves
rather than half of it. A compile that fails is logged and the worker stays eager.

Where neither this machine nor the cluster has the step, and the engine's model was loaded from its
config (so that another process can load the same one), the compile itself runs in a child process
(shared/engine/compiled/child.py, ``TANDEM_COMPILE_PROCESS``): in this process the compiling
thread's Python (dynamo, inductor) took the GIL from the engine thread, and at nice 19 it was often
descheduled while holding it. This thread then only loads what the child left in the compile cache.

On a tensor-parallel group (shared/engine/parallel.py) rank 0 compiles or loads its shard's step
on this thread, without running it: its first run makes the group's collectives. The runner keeps
it until the engine thread's next step, which first has every follower load the same step and all
ranks run it once together (``ModelRunner.use_compiled``, ``ParallelModel.share_compiled``); a
compile that fails sends nothing to the followers, and every rank stays eager. A group's compile
stays on this thread (no ``config`` for a child): a child would be a group of its own, whose rank 0
keys its step by a model structure that holds the collectives' running counters (each layer's
``group``), so its key would not be the worker's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from shared.engine import cpu_threads
from shared.engine.compiled.child import child_fits, compile_in_child, use_child_process
from shared.engine.compiled.artifacts import ArtifactStore, CompileArtifacts
from shared.engine.compiled.step import CompiledDecode

log = logging.getLogger(__name__)


class BackgroundCompile:
    def __init__(self, model, block_size: int, kv_cache: torch.Tensor, num_threads: int,
                 on_ready: Callable[[CompiledDecode], None], artifacts: CompileArtifacts | None = None,
                 store: ArtifactStore | None = None, config=None, run_once: bool = True) -> None:
        """``model``: the engine's, or a parallel group's rank 0 shard; there ``run_once=False``:
        the step's first run makes the group's collectives, which the engine thread runs on every
        rank together at the hand-over (``ModelRunner.use_compiled``), not this thread."""
        self.done = threading.Event()  # set when the graph is handed to the runner, or the compile failed
        self.error: BaseException | None = None
        self._args = (model, block_size, kv_cache, num_threads)
        self._run_once = run_once
        self._artifacts, self._store = artifacts, store
        self._config = config  # the engine's EngineConfig: a child process can build the same step from it
        self._on_ready = on_ready
        self._thread = threading.Thread(target=self._run, name="compile-decode", daemon=True)

    def start(self) -> None:
        log.info("compiling (or loading) the decode step on a background thread; eager steps serve until it is ready")
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the compile has ended (``error`` says whether it failed)."""
        return self.done.wait(timeout)

    def _compile_in_child(self, nice: int, num_threads: int) -> None:
        """Where nothing is there to load (this machine's cache, the cluster's store), compile the
        step in a child process first (shared/engine/compiled/child.py): it shares no GIL with
        serving; this thread then loads what it built. Any failure leaves the compile to this thread."""
        artifacts, store = self._artifacts, self._store
        if self._config is None or artifacts is None or not use_child_process():
            return
        if artifacts.complete() is not None or (store is not None and store.has(artifacts.key)):
            return
        kv_cache = self._args[2]
        if not child_fits(kv_cache.numel() * kv_cache.element_size()):
            log.info("no memory for a second copy of the model: the decode step compiles in this process")
            return
        started = time.monotonic()
        key = compile_in_child(self._config, num_threads, nice)
        if key is None:
            return
        if key != artifacts.key:
            log.warning("the compile process built step %s, this engine needs %s: compiling here", key, artifacts.key)
            return
        log.info("decode step compiled in a child process at nice %d in %.1f s", nice, time.monotonic() - started)

    def _run(self) -> None:
        model, block_size, kv_cache, num_threads = self._args
        started = time.monotonic()
        nice = cpu_threads.background_nice()
        if cpu_threads.lower_calling_thread(nice):
            log.info("compile thread at nice %d: serving keeps the CPU first", nice)
        self._compile_in_child(nice, num_threads)
        # dynamo's guards include the intra-op thread count: compiled with another count than the
        # engine thread's, each graph would be compiled again on that thread's first step
        cpu_threads.adopt(num_threads)  # pinned to this thread: the creator drops to one thread later
        try:
            compiled = CompiledDecode(model, block_size, num_threads)
            compiled.warm(kv_cache, self._artifacts, self._store, run_once=self._run_once)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the eager step, which is correct
            self.error = exc
            log.warning("compiling the decode step failed, decode steps stay eager: %s: %s",
                        type(exc).__name__, exc)
        else:
            self._on_ready(compiled)
            log.info("compiled decode step ready after %.1f s: decode-only steps now run compiled",
                     time.monotonic() - started)
        finally:
            cpu_threads.free_team()
            self.done.set()

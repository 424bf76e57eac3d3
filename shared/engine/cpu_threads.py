"""The engine thread owns the process's intra-op (OpenMP) threads.

A worker loads its model in one thread (an executor thread of the event loop, or the main thread
in tests) and steps the engine in another (``AsyncEngine``). Each thread that runs a parallel
torch op gets its own OpenMP team, and once
a process holds more OpenMP threads than the machine has cores, GNU OpenMP stops letting idle team
threads spin and puts them to sleep at once: every parallel op then pays a futex wake-up. Measured
on a 2-core machine, a batch-1 ``torch._int_mm`` of the decode step took 16 µs from the main
thread and 52–74 µs from a second thread once the main thread had a team of its own, and a batch-1
decode step 17 ms against 30 ms.

So the engine thread takes the intra-op thread count the engine was configured with, and the
thread that built the engine drops to one OpenMP thread and frees its OpenMP team
(``omp_pause_resource_all``), so the torch ops it still runs (small copies, bookkeeping) never
start a second team. Served batch-1 inter-token latency went from 34–39 ms to 18–20 ms here.

The drop goes through the OpenMP runtime's own ``omp_set_num_threads``, whose count is the calling
thread's alone, never through ``torch.set_num_threads``: that one sets more than the calling
thread's OpenMP count (torch's thread pools, its MKL and oneDNN settings), and after it the engine
thread's steps were slower. On a 1B-parameter model the compiled batch-1 decode step took 250 ms
in the engine thread against 135 ms in the thread that built the engine; which of those settings
costs it is not pinned down (the engine thread's own torch and MKL counts still read 2, and
``_int_mm`` alone timed there did not slow down).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch

from shared.process_settings import process_settings

log = logging.getLogger(__name__)

_lock = threading.Lock()
_default_threads: int | None = None  # the process's intra-op thread count before any hand-over


def engine_thread_count(configured: int | None) -> int:
    """The intra-op threads an engine thread should use: the configured count, else what the
    process had before any thread was handed over (torch's default, or ``set_num_threads``)."""
    global _default_threads
    with _lock:
        if _default_threads is None:
            _default_threads = torch.get_num_threads()
        return configured or _default_threads


def adopt(num_threads: int) -> None:
    """Called first in the engine thread: use ``num_threads`` there. Reading the count back runs
    torch's per-thread initialisation now, so a later change by another thread cannot reach it."""
    torch.set_num_threads(num_threads)
    torch.get_num_threads()


def release_calling_thread() -> int:
    """Called by the thread that handed the engine over: run on one OpenMP thread and free this
    thread's OpenMP team (where there is an OpenMP runtime). Returns the count it had, for
    ``restore``."""
    before = torch.get_num_threads()
    if before > 1 and _set_openmp_threads(1):
        _pause_openmp()
    return before


def restore(num_threads: int) -> None:
    """Undo ``release_calling_thread`` in that same thread (when its engine is shut down)."""
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)


def background_nice() -> int:
    """The nice value of background work (the decode-step compile): ``TANDEM_COMPILE_NICE``, default
    19, the lowest CPU priority; 0 runs it beside serving as an equal."""
    return process_settings().compile_nice


def lower_calling_thread(nice: int) -> bool:
    """Run the calling thread at ``nice``, and with it the threads and processes it starts later
    (its OpenMP team, inductor's compiler processes), so that its work takes only the CPU time
    serving leaves. Linux keeps nice per thread: ``setpriority`` on the thread's id. False where
    that is not possible."""
    if nice <= 0:
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError) as exc:
        log.debug("cannot lower this thread's priority: %s", exc)
        return False
    return True


def free_team() -> None:
    """Called by a helper thread whose parallel work is done (the background compile): its OpenMP
    team's threads exit, so the engine thread's team is again the only one."""
    _pause_openmp()


def _set_openmp_threads(num_threads: int) -> bool:
    """``omp_set_num_threads``: the calling thread's count only (torch's intra-op count in that
    thread follows it). False where there is no OpenMP runtime to call."""
    return _call_openmp("omp_set_num_threads", num_threads)


def _pause_openmp() -> None:
    """``omp_pause_resource_all(omp_pause_soft)``: the idle team threads exit, and a later parallel
    region makes new ones."""
    _call_openmp("omp_pause_resource_all", 1)


def _call_openmp(function: str, *args: int) -> bool:
    """Call ``function`` of the OpenMP runtime torch loaded; False where there is none or it lacks
    the function."""
    library = _openmp_library()
    if library is None:
        return False
    try:
        rc = getattr(ctypes.CDLL(library), function)(*args)
    except (OSError, AttributeError) as exc:
        log.debug("cannot call %s in %s: %s", function, library, exc)
        return False
    log.debug("%s%s in %s (rc %s)", function, args, library, rc)
    return True


def _openmp_library() -> str | None:
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                name = path.rsplit("/", 1)[-1]
                if name.startswith(("libgomp", "libomp", "libiomp")) and ".so" in name:
                    return path
    except OSError:  # not Linux
        return None
    return None

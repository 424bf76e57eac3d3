"""Tandem itself as a benchmark's target: ``tandem up`` on a free port, ready once its workers run the
decode step they settle on. The benchmarks (loadtest/bench/serving.py, serving_split.py) and the
client checks (loadtest/tools/client_compat) start it from here.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

from loadtest.tools.harness import status
from services.stack.servers import free_port


@contextlib.contextmanager
def tandem_up(args: list[str], timeout_s: float = 900.0, name: str = "tandem"):
    """``tandem up`` on a free port; yields its base URL once it prints that it is ready and its
    workers run the decode step they settle on (compiled, unless ``--compile off``). ``name`` keeps
    the namespace (and state directory) of each stack this process starts apart."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", str(port),
                             "--namespace", f"bench{os.getpid()}-{name}", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        for line in proc.stdout:  # the readiness line, not a sleep
            if line.startswith("up") and "ready: http://" in line:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"tandem up not ready after {timeout_s:.0f}s")
        else:
            raise RuntimeError(f"tandem up exited with {proc.wait()} before it was ready")
        # keep draining its output so the stack never blocks on a full pipe
        import threading
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        url = f"http://127.0.0.1:{port}"
        wait_for_compiled_steps(url, deadline)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def wait_for_compiled_steps(url: str, deadline: float) -> dict[str, str | None]:
    """Workers serve eagerly while they compile their decode step in the background: measure the
    step they settle on, so wait until no worker reports ``compiling`` (``/status``). Returns each
    worker's step."""
    said = False
    while True:
        page = status(url)
        steps = {w["info"]["worker_id"]: (w.get("load") or {}).get("decode_step") for w in page["workers"]}
        if steps and all(step in ("compiled", "eager") for step in steps.values()):
            print(f"tandem decode steps: {', '.join(f'{k} {v}' for k, v in steps.items())}", flush=True)
            return steps
        if time.monotonic() > deadline:
            raise TimeoutError(f"tandem workers still compiling their decode step: {steps}")
        if not said:
            print("waiting for tandem's workers to finish compiling their decode step ...", flush=True)
            said = True
        time.sleep(2)

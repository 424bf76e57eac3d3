"""Build a C++ CPU kernel (``kernels/cpu/*.cpp``) against the installed torch, once per machine.

The compiler is the one inductor uses (``CXX`` or ``c++``). The library goes to
``TANDEM_CACHE_DIR/kernels/<name>-<digest>/`` where the digest covers the source, the headers beside it,
torch's version, Python's and the flags, so a later process loads it in milliseconds and a changed
source or header builds anew.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from kernels.cpu_features import cpu_flags

log = logging.getLogger(__name__)

COMMON_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-w"]


def build(source: Path, flags: list[str]) -> Path:
    """The shared library built from ``source`` with ``flags`` (on top of ``COMMON_FLAGS``)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (set CXX)")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = [*COMMON_FLAGS, *flags, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):  # the headers a source may include ("simd16.h")
        digest.update(header.name.encode() + header.read_bytes())
    digest.update(" ".join([torch.__version__, sys.version, *flags]).encode())
    name = source.stem
    target = cache_dir() / f"{name}-{digest.hexdigest()[:16]}" / f"{name}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    # built beside the target and renamed: processes building at once each finish their own file
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / f"{name}.so"
        command = [compiler, *flags, *(f"-I{p}" for p in include_paths()), str(source),
                   *(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu", "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"building {source.name} failed: {(result.stderr or result.stdout).strip()[-300:]}")
        os.replace(built, target)
    log.info("built the CPU kernel %s in %.1f s: %s", source.name, time.perf_counter() - started, target)
    return target


def cache_dir() -> Path:
    from kernels.cache_dir import cache_dir

    return cache_dir() / "kernels"


def why_not(switch: str, needs: tuple[str, ...]) -> str | None:
    """Why a kernel cannot run here (its ``switch``, a ``KernelSwitches`` field's variable such as
    ``TANDEM_INT8_KERNEL``, set to off; or CPU flags missing), or None."""
    from kernels.cache_dir import KernelSwitches

    if not getattr(KernelSwitches(), switch.removeprefix("TANDEM_").lower()):
        return f"{switch}=off"
    missing = [f for f in needs if f not in cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return None


def load_op(source: Path, flags: list[str], qualified_name: str, fake, switch: str,
            needs: tuple[str, ...]) -> tuple[object | None, str]:
    """Build ``source``, load it and register ``fake`` (shapes for tracing) for ``namespace::op``:
    (the op, the build's name), or (None, why) where ``why_not`` says no or the build or load fails."""
    why = why_not(switch, needs)
    if why is not None:
        return None, why
    try:
        library = build(source, flags)
        torch.ops.load_library(str(library))
        torch.library.register_fake(qualified_name, fake)
    except Exception as exc:  # noqa: BLE001 - each kernel's module has its fallback
        return None, f"{type(exc).__name__}: {exc}"[:300]
    namespace, name = qualified_name.split("::")
    return getattr(getattr(torch.ops, namespace), name), library.parent.name


class CpuKernel:
    """One C++ CPU op, built and loaded the first time ``load`` is called (from any thread, once).
    The op is then ``module["_op"]`` (``module``: the globals of the module that calls it, a global
    being what torch.compile traces a call through), or None where it cannot run: ``identity`` says
    the build's name, or ``fallback`` + ": " + why, and ``say(message, why)`` logs the why once."""

    def __init__(self, source: Path, flags: list[str], qualified_name: str, fake, switch: str,
                 needs: tuple[str, ...], *, module: dict, fallback: str, say: Callable[[str, str], None],
                 message: str) -> None:
        self._args = (source, flags, qualified_name, fake, switch, needs)
        self._module = module
        self._fallback, self._say, self._message = fallback, say, message
        self._lock = threading.Lock()
        self.loaded: bool | None = None
        self.identity = ""

    def load(self) -> bool:
        if self.loaded is None:
            with self._lock:
                if self.loaded is None:
                    op, what = load_op(*self._args)
                    self._module["_op"] = op
                    self.identity = what if op is not None else f"{self._fallback}: {what}"
                    if op is None:
                        self._say(self._message, what)
                    self.loaded = op is not None
        return self.loaded

    def describe(self) -> str:
        """``identity``, loading first."""
        self.load()
        return self.identity

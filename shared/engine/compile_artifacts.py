"""The compiled decode step's artifacts, built once per cluster rather than once per process.

A cold compile of the decode step takes minutes on a small CPU; inductor's disk cache makes the
next compile of the same graph take seconds, but only on the machine (container, host) that holds
that cache. Here every worker keeps inductor's cache for its graph in a directory of its own,
``<cache dir>/compile/<key>/inductor``, where ``key`` names what the compiled code depends on:

* the model file (name and size: the graph's shapes come from it), the precision, the KV block
  size and the engine's thread count (the graph's dtypes, its quantized matmuls, the pool's static
  dimensions, the OpenMP team size its C++ loops are generated for);
* the torch and Python versions (the generated code and its wrapper);
* the CPU's instruction-set flags (inductor compiles its C++ with ``-march=native``: a library
  built on a CPU with AMX or AVX-512 FP16 must not be loaded on one without).

The first worker that compiles a key packs that directory (the FX graph and AOT autograd cache
entries and the compiled libraries, ``.so`` included, so a later worker compiles no C++) into the
NATS Object Store bucket ``<ns>-compile`` under the key; every later worker with the same key,
on any host, fetches and unpacks it before its compile starts, and its compile is a cache hit:
dynamo still traces the step (seconds), inductor loads what the first worker built. Inductor's
own cache entries are content-addressed, so a key that says "same" for graphs that differ only
costs a miss, never a wrong graph.

``tandem model fetch --compile`` builds a key's artifacts ahead of time (and publishes them with
``--nats``).
"""

from __future__ import annotations

import io
import json
import logging
import os
import platform
import shutil
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from shared.model.precision import cpu_flags

log = logging.getLogger(__name__)

# flag families that change the code a C++ compiler emits for -march=native
_ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "sse", "ssse", "bmi", "vnni", "vpclmul", "gfni", "vaes",
                 "popcnt", "movbe", "adx", "sha", "aes")
_SKIP = ("locks",)  # inductor's lock files: of this process, never of the artifacts
_MARKER = "complete.json"


def isa_flags(flags: frozenset[str] | None = None) -> list[str]:
    """The CPU flags that decide which instructions compiled code may use, sorted."""
    return sorted(f for f in (cpu_flags() if flags is None else flags) if f.startswith(_ISA_PREFIXES))


def artifact_key(*, model_name: str, model_bytes: int, dtype: str, quantization: str, block_size: int,
                 threads: int, torch_version: str, flags: frozenset[str] | None = None) -> str:
    """The name of one compiled graph's artifacts (a NATS object name: letters, digits, ``-``)."""
    import hashlib

    identity = {"model": model_name, "bytes": model_bytes, "dtype": dtype, "quantization": quantization,
                "block_size": block_size, "threads": threads, "torch": torch_version, "python": platform.python_version_tuple()[:2],
                "machine": platform.machine(), "isa": isa_flags(flags)}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
    return f"decode-{digest}"


def engine_artifact_key(config) -> str:
    """``artifact_key`` of the decode step an ``EngineConfig`` builds (resolves the model, which may
    fetch the default one; reads no weights)."""
    import torch

    from shared.engine.cpu_threads import engine_thread_count
    from shared.model.registry import resolve_model

    source = resolve_model(config.model)
    precision = config.resolve_precision(config.resolve_device())
    return artifact_key(model_name=source.name, model_bytes=_size(source.path), dtype=precision.dtype,
                        quantization=precision.quantization, block_size=config.block_size,
                        threads=engine_thread_count(config.num_threads), torch_version=torch.__version__)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in sorted(path.iterdir()) if p.is_file())


@dataclass(frozen=True)
class CompileArtifacts:
    """One key's directory: inductor's cache for that graph, and a marker once a compile into it
    (or an unpack) has finished."""

    root: Path  # <cache dir>/compile
    key: str

    @classmethod
    def default_root(cls) -> Path:
        from shared.model.registry import cache_dir

        configured = os.environ.get("TANDEM_COMPILE_CACHE_DIR")
        return Path(configured).expanduser() if configured else cache_dir() / "compile"

    @property
    def dir(self) -> Path:
        return self.root / self.key

    @property
    def inductor_dir(self) -> Path:
        return self.dir / "inductor"

    def complete(self) -> dict | None:
        """What the marker records (where the artifacts came from, when), or None before then."""
        try:
            return json.loads((self.dir / _MARKER).read_text())
        except (OSError, ValueError):
            return None

    def activate(self) -> None:
        """Point inductor's cache at this key's directory: call before the process compiles anything
        (torch reads ``TORCHINDUCTOR_CACHE_DIR`` on each use, but keeps loaded graphs in memory)."""
        self.inductor_dir.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.inductor_dir)

    def mark_complete(self, source: str) -> None:
        """After a successful compile (``source`` "compiled") or an unpack ("cluster")."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{_MARKER}.{os.getpid()}"
        tmp.write_text(json.dumps({"key": self.key, "source": source, "at": time.time()}))
        os.replace(tmp, self.dir / _MARKER)

    def pack(self) -> bytes:
        """The inductor directory as a gzipped tar (lock files left out)."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as tar:
            for path in sorted(self.inductor_dir.rglob("*")):
                rel = path.relative_to(self.inductor_dir)
                if rel.parts[0] in _SKIP or path.name.endswith((".lock", ".tmp")) or not path.is_file():
                    continue
                tar.add(path, arcname=str(rel), recursive=False)
        return buffer.getvalue()

    def unpack(self, data: bytes) -> int:
        """Extract ``data`` (from ``pack``) into the inductor directory, atomically: into a staging
        directory beside it, renamed into place. Returns the number of files. A tar with a path
        outside its root, a link or a device is refused (``tarfile.FilterError``)."""
        staging = self.dir / f".unpack-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
                members = tar.getmembers()
                tar.extractall(staging, filter="data")
            old = self.dir / f".replaced-{os.getpid()}"
            if self.inductor_dir.exists():
                os.rename(self.inductor_dir, old)
            os.rename(staging, self.inductor_dir)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return sum(1 for m in members if m.isfile())


async def fetch_from(bucket, artifacts: CompileArtifacts) -> bool:
    """Unpack the cluster's artifacts for ``artifacts.key`` if the bucket has them; False if not
    (or if they cannot be read: the compile then runs cold, which is only slower)."""
    started = time.monotonic()
    try:
        data = await bucket.get(artifacts.key)
    except Exception as exc:  # noqa: BLE001 - a cold compile is the fallback
        log.warning("reading compile artifacts %s from the cluster failed: %s", artifacts.key, exc)
        return False
    if data is None:
        log.info("the cluster has no compile artifacts for %s yet: this worker compiles them", artifacts.key)
        return False
    import asyncio

    try:
        num_files = await asyncio.to_thread(artifacts.unpack, data)
    except (tarfile.TarError, OSError) as exc:
        log.warning("compile artifacts %s from the cluster are unusable (%s): compiling cold", artifacts.key, exc)
        return False
    artifacts.mark_complete("cluster")
    log.info("compile artifacts %s fetched from the cluster (%.1f MB, %d files) in %.1f s: the decode step "
             "compiles from them", artifacts.key, len(data) / 1e6, num_files, time.monotonic() - started)
    return True


async def publish_to(bucket, artifacts: CompileArtifacts, *, replace: bool = False) -> bool:
    """Store this machine's artifacts for ``artifacts.key`` unless the bucket has them already
    (``replace``: store them anyway). True if stored."""
    import asyncio

    if not replace and await bucket.info(artifacts.key) is not None:
        return False
    data = await asyncio.to_thread(artifacts.pack)
    description = json.dumps({"key": artifacts.key, "host": platform.node(), "at": time.time()})
    await bucket.put(artifacts.key, data, description)
    log.info("compile artifacts %s published to the cluster (%.1f MB): later workers with this model, "
             "precision, torch and CPU compile from them", artifacts.key, len(data) / 1e6)
    return True

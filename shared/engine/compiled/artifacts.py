"""The compiled decode step's artifacts: built once per cluster, loaded in seconds everywhere else.

A cold compile of the decode step takes minutes on a small CPU (about 10 on 2 cores for SmolLM2 in
int8). Even with inductor's disk cache full, ``torch.compile`` traces the Python step again in every
process (dynamo, then AOT autograd: about a minute for 30 layers). So the step is compiled ahead of
time instead (``torch.compile(...).aot_compile``, shared/engine/compiled/step.py), and what comes out is
kept: the compiled function, serialized (``decode.bin``: the traced graph's wrapper, its inputs'
sources, the generated code), and the inductor cache it was built in (``inductor/``: the C++
libraries, so the next process compiles no C++). A later process loads both and calls the step
after a couple of seconds, with no tracing.

Both live in ``<TANDEM_COMPILE_CACHE_DIR>/<key>`` (default ``TANDEM_CACHE_DIR/compile``), where
``key`` names everything the compiled code depends on:

* the model's structure (its config and the shape and dtype of every tensor the step reads: not
  the weights' values, which the step reads from the loaded model at each call), its precision,
  the KV block size and the engine's thread count (the OpenMP team the C++ loops are built for);
* the source of the modules the step is traced from (a change to them is a new key);
* the torch and Python versions, and the CPU's instruction-set flags (inductor compiles its C++
  with ``-march=native``: code built on a CPU with AMX must not run on one without).

A process that has no artifacts for its key asks its ``ArtifactStore`` (a worker's: the NATS
Object Store bucket ``<ns>-compile``, services/worker/compile_share.py) before compiling, and offers
what it built afterwards; the first worker of a cluster to compile a key is the only one that
does. ``tandem model fetch --compile`` builds a key's artifacts ahead of time.
"""

from __future__ import annotations

import dataclasses
import hashlib
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
from typing import Protocol

from kernels.cpu_features import cpu_flags

log = logging.getLogger(__name__)

# flag families that change the code a C++ compiler emits for -march=native
_ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "sse", "ssse", "bmi", "vnni", "vpclmul", "gfni", "vaes",
                 "popcnt", "movbe", "adx", "sha", "aes")
_FUNCTION = "decode.bin"
_MARKER = "complete.json"
_SKIP = ("locks",)  # inductor's lock files belong to the process that made them


def isa_flags(flags: frozenset[str] | None = None) -> list[str]:
    """The CPU flags that decide which instructions compiled code may use, sorted."""
    return sorted(f for f in (cpu_flags() if flags is None else flags) if f.startswith(_ISA_PREFIXES))


def artifact_key(*, structure: object, block_size: int, threads: int, code: str, torch_version: str,
                 flags: frozenset[str] | None = None, int8_kernel: bool = False,
                 block_kernel: bool | None = None, attention_kernel: bool = False,
                 kv_dtype: str | None = None) -> str:
    """The name of one compiled step's artifacts (a NATS object name: letters, digits, ``-``).
    ``int8_kernel``: the graph calls the int8 CPU kernel (kernels/int8_cpu.py), which a process
    that did not load it (no compiler, ``TANDEM_INT8_KERNEL=off``) cannot run. ``block_kernel``
    (gguf models only): the graph calls the block kernel (kernels/blocks_cpu.py), else its torch
    reference, whose sums are rounded differently. ``attention_kernel``: the graph's attention is
    the C++ kernel (kernels/attention_cpu.py), else the written-out softmax. ``kv_dtype``: the KV
    pool's dtype where it is not the model's."""
    identity = {"structure": structure, "block_size": block_size, "threads": threads, "code": code,
                "torch": torch_version, "python": platform.python_version_tuple()[:2],
                "machine": platform.machine(), "isa": isa_flags(flags), "int8_kernel": int8_kernel,
                "attention_kernel": attention_kernel}
    if block_kernel is not None:
        identity["block_kernel"] = block_kernel
    if kv_dtype is not None:
        identity["kv_dtype"] = kv_dtype
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return f"decode-{digest}"


def model_structure(model) -> dict:
    """What the compiled step's graph depends on in a loaded ``LlamaModel``: its config, and the
    shape and dtype of every tensor it holds (quantized weights' fields included), layer by layer."""
    import torch

    from shared.model.parallel import DetachedGroup, ProcessGroupCollectives, SingleRank

    def describe(value):
        if isinstance(value, (SingleRank, DetachedGroup, ProcessGroupCollectives)):
            return {"size": value.size}  # a rank's collectives: its place and connections are not the graph's
        if isinstance(value, torch.Tensor):
            return [list(value.shape), str(value.dtype)]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: describe(getattr(value, f.name)) for f in dataclasses.fields(value)
                    if not f.name.endswith("_t")}  # derived views
        if isinstance(value, (list, tuple)):
            return [describe(v) for v in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, (torch.dtype, torch.device)):
            return str(value)
        if hasattr(value, "__dict__"):
            return {k: describe(v) for k, v in sorted(vars(value).items()) if not k.startswith("_")}
        return type(value).__name__

    return describe(model)


def traced_code_digest() -> str:
    """A digest of the source of every module the compiled step traces through, in a fixed order:
    a change in any of them makes a new step."""
    import kernels
    import shared.model

    here, model_dir, kernel_dir = (Path(__file__).parent, Path(shared.model.__file__).parent,
                                   Path(kernels.__file__).parent)
    digest = hashlib.sha256()
    for path in [here / "step.py", model_dir / "llama.py", model_dir / "quant.py",
                 *(kernel_dir / f"{name}.py" for name in ("cast", "rms_norm", "rotary", "int8_cpu", "blocks_cpu",
                                                                 "attention_cpu"))]:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def engine_artifact_key(model, block_size: int, threads: int, kv_dtype=None) -> str:
    """``kv_dtype``: the pool's, where it is not the model's (a graph reads the pool it was traced with)."""
    import torch

    from kernels import attention_cpu, blocks_cpu, int8_cpu

    gguf = model.quantization == "gguf"
    structure = model_structure(model)
    # a rank's place in its pipeline and split is not the graph's: every rank of a group has the same one
    # (shared/engine/compiled/step.py); its collectives are described by the group's size alone
    for name in ("pipeline", "split"):
        structure.pop(name, None)
    return artifact_key(structure=structure, block_size=block_size, threads=threads,
                        code=traced_code_digest(), torch_version=torch.__version__,
                        int8_kernel=model.quantization.startswith("int8") and int8_cpu.kernel_in_graph(),
                        block_kernel=blocks_cpu.kernel_in_graph() if gguf else None,
                        attention_kernel=attention_cpu.kernel_in_graph(),
                        **({"kv_dtype": str(kv_dtype)} if kv_dtype is not None and kv_dtype != model.dtype else {}))


class ArtifactStore(Protocol):
    """Where a cluster keeps compiled steps by key (called from engine threads: blocking calls)."""

    def get(self, key: str) -> bytes | None: ...

    def has(self, key: str) -> bool: ...

    def put(self, key: str, data: bytes) -> None: ...


@dataclass(frozen=True)
class CompileArtifacts:
    """One key's directory on this machine."""

    root: Path
    key: str

    @classmethod
    def default_root(cls) -> Path:
        from kernels.cache_dir import cache_dir
        from shared.process_settings import process_settings

        configured = process_settings().compile_cache_dir
        return configured.expanduser() if configured else cache_dir() / "compile"

    @property
    def dir(self) -> Path:
        return self.root / self.key

    @property
    def inductor_dir(self) -> Path:
        return self.dir / "inductor"

    @property
    def function_path(self) -> Path:
        return self.dir / _FUNCTION

    def complete(self) -> dict | None:
        """What the marker records (where the artifacts came from, when), or None before then."""
        if not self.function_path.is_file():
            return None
        try:
            return json.loads((self.dir / _MARKER).read_text())
        except (OSError, ValueError):
            return None

    def activate(self) -> None:
        """Point inductor's cache at this key's directory (torch reads ``TORCHINDUCTOR_CACHE_DIR`` on
        each use; graphs already loaded stay loaded)."""
        self.inductor_dir.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.inductor_dir)

    def save_function(self, data: bytes, source: str) -> None:
        """Store the serialized step and mark the directory complete (``source``: where it came from)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.function_path, data)
        _write_atomic(self.dir / _MARKER, json.dumps({"key": self.key, "source": source, "at": time.time()}).encode())

    def pack(self) -> bytes:
        """The serialized step and the inductor directory, as a gzipped tar (lock files left out)."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as tar:
            tar.add(self.function_path, arcname=_FUNCTION, recursive=False)
            for path in sorted(self.inductor_dir.rglob("*")):
                rel = path.relative_to(self.dir)
                if rel.parts[1] in _SKIP or path.name.endswith((".lock", ".tmp")) or not path.is_file():
                    continue
                tar.add(path, arcname=str(rel), recursive=False)
        return buffer.getvalue()

    def unpack(self, data: bytes, source: str = "cluster") -> int:
        """Install ``data`` (from ``pack``) as this key's artifacts: extracted beside the directory,
        then renamed into place, the marker last. Returns the number of files. A tar with a path
        outside its root, a link or a device is refused (``tarfile.FilterError``), and so is one
        without the serialized step."""
        self.dir.mkdir(parents=True, exist_ok=True)
        staging = self.dir / f".unpack-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
                members = tar.getmembers()
                tar.extractall(staging, filter="data")
            if not (staging / _FUNCTION).is_file():
                raise tarfile.TarError(f"no {_FUNCTION} in the artifacts")
            if (staging / "inductor").is_dir():
                old = self.dir / f".replaced-{os.getpid()}"
                if self.inductor_dir.exists():
                    os.rename(self.inductor_dir, old)
                os.rename(staging / "inductor", self.inductor_dir)
                shutil.rmtree(old, ignore_errors=True)
            self.save_function((staging / _FUNCTION).read_bytes(), source)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return sum(1 for m in members if m.isfile())

    def fetch(self, store: ArtifactStore) -> bool:
        """Install the store's artifacts for this key if it has them; False if not, or if they
        cannot be read or used (the step is then compiled here, which is only slower)."""
        started = time.monotonic()
        try:
            data = store.get(self.key)
        except Exception as exc:  # noqa: BLE001 - a compile here is the fallback
            log.warning("reading compile artifacts %s from the cluster failed: %s", self.key, exc)
            return False
        if data is None:
            log.info("the cluster has no compile artifacts for %s yet: this process compiles them", self.key)
            return False
        try:
            num_files = self.unpack(data)
        except (tarfile.TarError, OSError) as exc:
            log.warning("compile artifacts %s from the cluster are unusable (%s): compiling here", self.key, exc)
            return False
        log.info("compile artifacts %s fetched from the cluster (%.1f MB, %d files) in %.1f s",
                 self.key, len(data) / 1e6, num_files, time.monotonic() - started)
        return True

    def offer(self, store: ArtifactStore) -> bool:
        """Publish this machine's artifacts unless the store has the key already. True if stored."""
        try:
            if store.has(self.key):
                return False
            data = self.pack()
            store.put(self.key, data)
        except Exception as exc:  # noqa: BLE001 - the next process compiles for itself, nothing else is lost
            log.warning("publishing compile artifacts %s failed: %s", self.key, exc)
            return False
        log.info("compile artifacts %s published to the cluster (%.1f MB): later workers with this model, "
                 "precision, torch and CPU load them instead of compiling", self.key, len(data) / 1e6)
        return True


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)

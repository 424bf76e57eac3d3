"""Engine configuration and the derived KV cache size.

The fields are defined once, in ``shared/engine_settings.py`` (``EngineOptions``); the workers'
``TANDEM_*`` settings and the engine commands' flags are derived from the same definition, and
``engine_config()`` turns any of those settings into an ``EngineConfig``.
"""

from __future__ import annotations

import torch
from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

from kernels.cpu_features import cpu_flags
from shared.engine_settings import ENGINE_FIELDS, EngineOptions, parse_size  # noqa: F401 — re-exported
from shared.kvcache.layout import KvCacheSpec
from shared.model.precision import Precision, choose_precision

DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass(config=ConfigDict(extra="forbid"))
class EngineConfig(EngineOptions):
    """The engine's settings as ``shared/engine_settings.py`` defines them (fields, defaults,
    validation: checked on construction), and how they resolve on a device. Sizes are bytes here."""

    @property
    def local_ranks(self) -> int:
        """The parallel group's ranks on this host, rank 0 included: ``group_local_ranks``, else all tp x pp."""
        return self.group_local_ranks or self.tensor_parallel_size * self.pipeline_parallel_size

    def resolve_kv_dtype(self, model_dtype: torch.dtype, device: torch.device,
                         quantization: str = "none") -> torch.dtype:
        """The KV pool's dtype: ``kv_cache_dtype`` where given (another than the model's on the CPU
        only: the CUDA kernels read the pool in the model's dtype); else float16 under a gguf model on
        the CPU (llama.cpp's default cache for the same files: as close to float32 on SmolLM2, twice
        the blocks, a faster decode step), and the model's dtype otherwise."""
        if self.kv_cache_dtype is None:
            return torch.float16 if quantization == "gguf" and device.type == "cpu" else model_dtype
        dtype = getattr(torch, self.kv_cache_dtype)
        if dtype != model_dtype and device.type != "cpu":
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} differs from the model's {model_dtype}: "
                             f"only the CPU kernels read a pool of another dtype")
        return dtype

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_precision(self, device: torch.device) -> Precision:
        """The given dtype/quantization, or the fastest one for the device when neither is given."""
        flags = cpu_flags() if device.type == "cpu" else frozenset()
        return choose_precision(device.type, self.dtype, self.quantization, flags)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        return torch_dtype(self.resolve_precision(device).dtype)


def engine_config(settings, **overrides) -> EngineConfig:
    """The engine config of any settings object derived from ``EngineOptions`` (a worker's, a
    command's): its value of every engine field it has, then ``overrides``."""
    given = {name: getattr(settings, name) for name in ENGINE_FIELDS if hasattr(settings, name)}
    return EngineConfig(**{**given, **overrides})


def torch_dtype(name: str) -> torch.dtype:
    try:
        dtype = getattr(torch, name)
    except AttributeError:
        dtype = None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (choose float32, bfloat16 or float16)")
    return dtype


def kv_cache_bytes(config: EngineConfig, device: torch.device) -> int:
    """The KV pool's memory budget: explicit, else 1 GiB on CPU or a share of free GPU memory."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return max(0, int(total * config.gpu_memory_utilization) - used)
    return DEFAULT_CPU_KV_BYTES


def num_kv_blocks(spec: KvCacheSpec, budget_bytes: int) -> int:
    num_blocks = spec.num_blocks_for_budget(budget_bytes)
    if num_blocks < 1:
        raise ValueError(
            f"KV cache memory {budget_bytes} B holds no block of {spec.bytes_per_block} B: raise --kv-cache-memory")
    return num_blocks

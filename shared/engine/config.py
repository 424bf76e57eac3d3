"""Engine configuration and the derived KV cache size."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kernels.cpu_features import cpu_flags
from shared.kvcache.layout import KvCacheSpec
from shared.model.compile_mode import compile_mode
from shared.model.precision import KV_CACHE_DTYPES, Precision, choose_precision
from shared.model.quant import quantization_name

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)\s*$", re.IGNORECASE)
DEFAULT_CPU_KV_BYTES = 1 << 30


def parse_size(text: str | int) -> int:
    """'2GiB', '512MB', '1.5G' or a plain byte count → bytes (binary units)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"cannot parse size {text!r} (examples: 2GiB, 512MiB, 1073741824)")
    scale = 1024 ** " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * scale)


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"
    device: str = "auto"  # auto: cuda if available, else cpu
    dtype: str | None = None  # None with quantization None: the device's fastest (shared/model/precision.py)
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; default 1 GiB on CPU, a fraction of free GPU memory
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    # the seed of the generator that unseeded requests draw from; None: one from the OS at start, so
    # an unseeded request at temperature > 0 differs across restarts and workers (a request's own
    # ``seed`` has its own generator and gives the same tokens on any worker either way)
    seed: int | None = None
    num_threads: int | None = None  # torch CPU threads for this process (default: torch's choice)
    # ranks of a tensor-parallel group (shared/model/parallel.py, shared/engine/parallel.py): this
    # process is rank 0 and starts the others, each a process with its shard of weights and KV
    tensor_parallel_size: int = 1
    # pipeline stages, each of tensor_parallel_size ranks with a contiguous share of the layers (and
    # their KV); stage 0's first rank is this process
    pipeline_parallel_size: int = 1
    quantization: str | None = None  # "int8" / "int8-precise": W8A8 linear layers (CPU), shared/model/quant.py; None: as dtype
    # the KV pool's dtype: None or "auto" = the model's; on a CPU, float16 or bfloat16 under a float32
    # model halves the pool's bytes (twice the blocks in a budget, half the reads per decode step)
    kv_cache_dtype: str | None = None
    # tiers below the KV pool (shared/kvcache/tiers.py): host memory and a local disk directory
    kv_host_memory: int = 0  # bytes; 0: no host tier
    kv_disk_dir: str | None = None
    kv_disk_size: int = 10 << 30  # bytes
    kv_disk_min_uses: int = 2  # a block goes to disk once computed or hit this many times
    # speculative decoding with n-gram drafts from the request's own tokens (shared/engine/speculative.py)
    speculative_tokens: int = 0  # draft tokens per step; 0: off
    speculative_max_batch: int = 4  # speculate only while this many requests or fewer run
    # decode-only steps as one compiled graph (shared/model/compiled.py; CPU): "on" compiles before the
    # engine is returned, "background" on a thread while eager steps serve, "off" (or False) eager only;
    # on CUDA, "on" and "background" capture CUDA graphs before the engine is returned (shared/model/cuda_graph.py)
    compile: str | bool = "off"
    step_trace: str | None = None  # a file that gets one JSON line per step (shared/engine/step_trace.py)
    # a step's prefill of a lower priority stops between two layers when a more urgent request
    # arrives, and goes on once that one's prompt is computed (LLMEngine.step)
    prefill_yield: bool = True
    # while a more urgent request decodes, a step's prefill of a lower priority (with prefill_yield)
    # also stops after this many milliseconds, a step of decode rows alone runs, and the prefill goes
    # on: those rows wait about this long per token for it, not for the whole prompt (0: never)
    prefill_slice_ms: float = 50.0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.quantization is not None:
            self.quantization = quantization_name(self.quantization)
        self.compile = compile_mode(self.compile)
        if self.kv_cache_dtype == "auto":
            self.kv_cache_dtype = None
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(KV_CACHE_DTYPES[1:])}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size}) and pipeline_parallel_size "
                             f"({self.pipeline_parallel_size}) must be at least 1")
        if self.kv_host_memory < 0 or self.kv_disk_size < 1 or self.kv_disk_min_uses < 1:
            raise ValueError(f"kv_host_memory ({self.kv_host_memory}) must be >= 0, kv_disk_size "
                             f"({self.kv_disk_size}) and kv_disk_min_uses ({self.kv_disk_min_uses}) positive")

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

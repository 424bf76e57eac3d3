"""Decode attention straight from the paged KV pool on an AVX2 or AVX-512 CPU:
``kernels/cpu/decode_attention.cpp``, called by the compiled decode step (shared/engine/compiled/step.py) once
per layer.

Without it the graph gathers each sequence's past out of the pool and inductor writes the softmax
out as generated C++ loops over the longest sequence's length, masked: at batch 32 with 128-token
prompts that loop took about 40% of a served SmolLM2-135M decode step on a 2-core AVX2 CPU. The
kernel reads the pool in place, skips the positions a sequence does not have, and reads each key
once for the query heads that share it.

Each (sequence, KV head) runs the same instructions in the same order whatever the batch, so a
sequence gets the same bits alone and in any batch. The sums differ from the written-out softmax's
(``shared/engine/compiled/step.py`` ``_decode_attention``, the reference here) in the last bits of
float32, so the compiled step's artifact key says which of the two a graph calls
(``kernel_in_graph``). Built on first use (``kernels/cpu_build.py``); with
``TANDEM_ATTENTION_KERNEL=off``, without a compiler or without AVX2, FMA and F16C, the graph keeps
the written-out softmax (a log line says why). Where the CPU has AVX-512F (read from its flags, as
the other kernels' builds do) the build adds it for the weighted sums over the values, which then
run 16 lanes wide for all of a KV head's queries at once: lane for lane the same operations, so the
same bits as the AVX2 build (``test_the_avx2_build_gives_the_bits_of_this_build``).

It takes no sliding window: each row attends over its whole past (``past_valid``), so a model with
windowed layers must not reach the compiled step (``compiled.unsupported_reason``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kernels.cpu_build import CpuKernel, why_not

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "cpu" / "decode_attention.cpp"
_FLAGS = ["-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"]
AVX512_FLAGS = ("avx512f",)  # the weighted sums in 16 lanes, all of a group's queries at once (the same bits)
if why_not("TANDEM_ATTENTION_KERNEL", AVX512_FLAGS) is None:
    _FLAGS += ["-mavx512f"]
_NEEDS = ("avx2", "fma", "f16c")
POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_op = None  # torch.ops.tandem_attn.decode_attention once loaded (a global: torch.compile traces the call)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                     past_blocks: torch.Tensor, past_valid: torch.Tensor, step_src: torch.Tensor) -> torch.Tensor:
    """q [B, H, D], k and v [B, Hkv, D] float32 (the step's own K/V as the pool will hold them);
    ``kv_cache`` [blocks, layers, 2, block_size, Hkv, D]; ``past_blocks`` [B * nblk] the block tables
    flattened; ``past_valid`` [B, nblk * block_size] the past positions each row has; ``step_src``
    [B, nblk * block_size] -1 or the row of this step that computes the position. Returns [B, H, D]
    float32. Call only where ``usable`` says so."""
    return _op(q, k, v, kv_cache, layer, past_blocks, past_valid, step_src)


def usable(kv_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether the kernel serves this pool: loaded already (``load``; this is read while a graph is
    traced), a CPU pool of a dtype it reads, whole vectors a head."""
    return _op is not None and kv_cache.device.type == "cpu" and kv_cache.dtype in POOL_DTYPES and head_dim % 8 == 0


def identity() -> str:
    """What decode attention runs here: the kernel's build name, or "off: " and why."""
    return _KERNEL.describe()


def kernel_in_graph() -> bool:
    """Whether a step compiled in this process calls the kernel (for a pool it serves)."""
    return load()


def _fake(q, k, v, kv_cache, layer, past_blocks, past_valid, step_src):
    return q.new_empty(q.shape, dtype=torch.float32)


def load() -> bool:
    """Build (once per machine) and load the kernel; False (and why, logged once) where it cannot run."""
    return _KERNEL.load()


_KERNEL = CpuKernel(SOURCE, _FLAGS, "tandem_attn::decode_attention", _fake, "TANDEM_ATTENTION_KERNEL", _NEEDS,
                    module=globals(), fallback="off", say=log.warning,
                    message="compiled decode steps write attention out as C++ loops (%s)")

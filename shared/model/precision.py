"""The precision an engine runs in when the user names none: chosen from what the CPU can do.

The default must be fast and stay close to float32: at least 97% teacher-forced top-1 agreement with
float32 on the shipped corpus (``python -m loadtest.quality``, ``loadtest/results/quality/``). On a
CPU a decode step is bound by reading the weights and by per-op overhead, so the fastest precision
is the one whose matmuls the CPU has instructions for. int8 W8A8 linear layers are the fastest
wherever VNNI exists, but they miss the bound: 92.6% (SmolLM2-135M, KL 0.014 nats). Most of that is
the int8 weights themselves: on the corpus's first 1,024 tokens W8A8 agrees 91.6%, and with the
activations left unquantized the int8 per-channel weights alone still reach only 94.2% (96.2% without
SmoothQuant's smoothing, 96.8% with the LM head in float32 as well), so no activation scheme (SmoothQuant, per-token
scales, a second int8 pass for the rounding residual) closes the gap. bfloat16 reaches 97.2% (KL 0.001),
float32 is exact. So the default is bfloat16 where the CPU multiplies bf16 natively (AVX512-BF16 or
AMX), float32 otherwise; int8 is there for whoever asks (``--quantization int8``).

Speed, SmolLM2-135M, decode tokens/s (``loadtest.bench_decode``, 2 threads): on the Intel Xeon
with AMX, batch 1 / 8: int8 32.4 / 190, bfloat16 25.6 / 152 (0.79x / 0.80x); batch 8 in another
round: int8 192-203, bfloat16 140-168, float32 97-103.
On an AVX-512 CPU with VNNI and AVX512-BF16 but no AMX (one decode worker, aggregate output tokens/s
at 1 / 8 / 32 streams): float32 31 / 109 / 193, bfloat16 41 / 216 / 312, int8 W8A8 69 / 245 / 420.

An explicit dtype or quantization is always kept as given: ``--dtype float32`` is the precision
that matches transformers exactly, ``--quantization int8`` the fastest on a CPU with VNNI (and the
only one whose linear layers give a row the same bits whatever shares its step).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class Precision:
    dtype: str  # float32, bfloat16 or float16: weights other than int8 ones, activations, KV cache
    quantization: str  # none or int8 (the linear layers)
    reason: str  # why: for the start-up log


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo is not readable, e.g. not on Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def choose_precision(device_type: str, dtype: str | None, quantization: str | None,
                     flags: frozenset[str] = frozenset()) -> Precision:
    """The given dtype/quantization when either is given (the other at its plain default), else the
    fastest precision for the device that stays within the quality bound: bfloat16 on a GPU; on a
    CPU bfloat16 with native bf16 instructions, float32 otherwise (int8 only when asked for)."""
    if dtype is not None or quantization is not None:
        default_dtype = "bfloat16" if device_type == "cuda" else "float32"
        return Precision(dtype or default_dtype, quantization or "none", "given")
    if device_type != "cpu":
        return Precision("bfloat16", "none", f"default on {device_type}")
    bf16 = [f for f in BF16_FLAGS if f in flags]
    if bf16:
        return Precision("bfloat16", "none", f"CPU has {bf16[0]}: bfloat16 is the fastest precision within "
                                             "the quality bound (--quantization int8 is faster, less exact; "
                                             "--dtype float32 is exact)")
    vnni = [f for f in VNNI_FLAGS if f in flags]
    if vnni:
        return Precision("float32", "none", f"CPU has {vnni[0]} but no native bfloat16: float32 "
                                            "(--quantization int8 is faster, below the quality bound)")
    return Precision("float32", "none", "CPU has neither VNNI nor native bfloat16")

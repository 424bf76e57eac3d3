"""The precision an engine runs in when the user names none: chosen from what the CPU can do.

On a CPU a decode step is bound by reading the weights and by per-op overhead, so the fastest
precision is the one whose matmuls the CPU has instructions for. Measured on an AVX-512 CPU with
VNNI and AVX512-BF16 but no AMX (SmolLM2-135M, one decode worker, aggregate output tokens/s at
1 / 8 / 32 streams): float32 31 / 109 / 193, bfloat16 41 / 216 / 312, int8 W8A8 69 / 245 / 420.
One batch-1 decode step, configurations interleaved in one run on a busy machine (load average
7-14 on 2 cores): with 1 thread int8 115 ms median / 68 ms min against float32 205 / 160; with 2
threads the least disturbed steps (min) int8 71 ms, bfloat16 107, float32 132, while the medians
were even (int8's many small parallel ops wait longest on descheduled threads). So int8 wins
wherever VNNI exists; bfloat16 is next where the CPU multiplies bf16 natively;
float32 otherwise. int8's error against float32 stays within the bounds that
tests/engine/test_quantization_smollm2.py checks on the real model, but its top-1 agreement with
float32 is 93.4% on SmolLM2, below the 97% the project holds the default to.

So where the CPU has AVX-512 VNNI, the default is ``gguf`` (weight-only blocks of 32 times 8-bit
block activations, llama.cpp's arithmetic, kernels/blocks_cpu.py), on the panel kernel that the
same VNNI instructions make fast: on the Intel Xeon (family 6 model 167, 2 threads), the compiled
SmolLM2 step decodes 99.6 / 432 / 674 tok/s at batch 1 / 8 / 32 against int8's 84 / 354 / 611 in
the same session, with 97.3% top-1 agreement against int8's 93.4% (loadtest/bench/quality.py). On a
Q8_0 1B-shaped model, eager, it is 0.98x / 0.91x int8 at batch 1 / 8, on a Q4_0 one 1.23x / 1.27x. With another kind of VNNI
(AVX-VNNI without AVX-512) there is no panel kernel, and int8 stays. Without VNNI,
``--quantization gguf`` decodes 2.2x float32 at batch 1 on an AVX2-only Zen 3 and serves 1.05x
llama-server at one stream, but 0.94x float32 at 32 streams, so it is offered, not chosen
(docs/engine.md).

An explicit dtype or quantization is always kept as given: ``--dtype float32`` is the precision
that matches transformers exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernels.cpu_features import AVX512_VNNI_FLAGS

# --quantization's values, here without torch so that the CLI and settings can list them:
# "int8": one int8 level of weights and activations, SmoothQuant-calibrated (93.4% top-1 agreement
# with float32 on SmolLM2, the fastest); "int8-precise": activations and the LM head's weight in two
# int8 levels (97%), at up to twice the matmul work; "gguf": weight-only, in ggml's blocks of 32
# values (4-bit where the weights are on a 4-bit grid, as a GGUF file's Q4 formats are, else
# 8-bit), activations in 8-bit blocks as llama.cpp's (two levels for the LM head; 97% top-1, the
# default with AVX-512 VNNI; shared/model/quant.py's BlockWeight, kernels/blocks_cpu.py)
QUANTIZATION_METHODS = ("none", "int8", "int8-precise", "gguf")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # --kv-cache-dtype; auto: shared/engine/config.py

VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class Precision:
    dtype: str  # float32, bfloat16 or float16: weights other than int8 ones, activations, KV cache
    quantization: str  # none, int8, int8-precise or gguf (the linear layers)
    reason: str  # why: for the start-up log


def choose_precision(device_type: str, dtype: str | None, quantization: str | None,
                     flags: frozenset[str] = frozenset()) -> Precision:
    """The given dtype/quantization when either is given (the other at its plain default), else the
    fastest precision for the device: bfloat16 on a GPU; on a CPU gguf with AVX-512 VNNI, int8 with
    another VNNI, bfloat16 with native bf16 instructions, float32 otherwise."""
    if dtype is not None or quantization is not None:
        default_dtype = "bfloat16" if device_type == "cuda" else "float32"
        return Precision(dtype or default_dtype, quantization or "none", "given")
    if device_type != "cpu":
        return Precision("bfloat16", "none", f"default on {device_type}")
    if all(f in flags for f in AVX512_VNNI_FLAGS):
        return Precision("float32", "gguf", "CPU has avx512_vnni: 4-bit and 8-bit weight blocks on the panel "
                                            "kernel are the fastest, 97% top-1 agreement with float32 "
                                            "(pass --dtype float32 for exact float32)")
    vnni = [f for f in VNNI_FLAGS if f in flags]
    if vnni:
        return Precision("float32", "int8", f"CPU has {vnni[0]}: int8 matmuls are the fastest "
                                            "(pass --dtype float32 for exact float32)")
    bf16 = [f for f in BF16_FLAGS if f in flags]
    if bf16:
        return Precision("bfloat16", "none", f"CPU has {bf16[0]} but no VNNI")
    return Precision("float32", "none", "CPU has neither VNNI nor native bfloat16")

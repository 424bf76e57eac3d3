"""Compile every Triton kernel of this package for a GPU target, without a GPU.

    python -m kernels.compile_check [--arch 90]

The interpreter (the CPU tests) checks what the kernels compute, not that they compile: shapes
``tl.dot`` rejects, casts a GPU lacks, or register spills only show up in the compiler. Triton's
NVIDIA backend ships ptxas, so the full pipeline (TTIR -> PTX -> cubin) runs on any machine.
Prints registers, spills and shared memory per kernel, at shapes the engine uses (Llama-3-8B:
head_dim 128, GQA 4, bf16, 16-token blocks); exits 1 if a kernel fails to compile or spills
registers (a spilling tile configuration is a performance bug on a memory-bound kernel).
Must run without ``TRITON_INTERPRET`` (then kernels are interpreted, not compiled).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

_FLOAT_ARGS = {"scale_log2", "eps"}
_ALIGNED_INTS = {"split_len", "row_numel", "hidden"}  # multiples of 16 at the shapes the engine uses


@dataclass
class KernelCase:
    name: str
    kernel: Callable  # a triton.runtime.jit.JITFunction
    pointers: dict[str, str]  # pointer argument -> element type ("bf16", "fp32", "i32", ...)
    constexprs: dict[str, object]
    options: dict[str, int] = field(default_factory=lambda: {"num_warps": 4, "num_stages": 2})


def _cases() -> list[KernelCase]:
    import torch

    from kernels import (
        decode_attention_triton as decode, kv_gather_triton as gather,
        kv_write_triton as write, prefill_attention_triton as prefill, rms_norm_triton as norm,
        rotary_triton as rotary,
    )

    attention_ptrs = {"q_ptr": "bf16", "k_ptr": "bf16", "v_ptr": "bf16", "block_tables_ptr": "i32",
                      "seq_lens_ptr": "i32", "query_start_loc_ptr": "i32"}
    attention_consts = {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_D": 128,
                        "BLOCK_N": decode._BLOCK_N, "DOT_PRECISION": "tf32", "EMULATE_BF16": False}
    cases = []
    for num_splits in (1, 8):
        out = "bf16" if num_splits == 1 else "fp32"
        cases.append(KernelCase(
            f"decode_split[splits={num_splits}]", decode._decode_split_kernel,
            {**attention_ptrs, "out_ptr": out, "lse_ptr": "fp32" if num_splits > 1 else "bf16"},
            {**attention_consts, "WRITE_PARTIAL": num_splits > 1, "BLOCK_G": 16}))
    cases.append(KernelCase(
        "decode_split[fp32]", decode._decode_split_kernel,
        {**{k: "fp32" for k in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "lse_ptr")},
         "block_tables_ptr": "i32", "seq_lens_ptr": "i32"},
        {**attention_consts, "WRITE_PARTIAL": False, "BLOCK_G": 16, "DOT_PRECISION": "ieee"}))
    cases.append(KernelCase(
        "decode_reduce", decode._decode_reduce_kernel,
        {"partial_ptr": "fp32", "lse_ptr": "fp32", "out_ptr": "bf16"},
        {"HEAD_DIM": 128, "BLOCK_S": 16, "BLOCK_D": 128, "EMULATE_BF16": False}))
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        tiles = prefill.tile_config(dtype)
        cases.append(KernelCase(
            f"prefill[{name}]", prefill._prefill_kernel,
            {**attention_ptrs, **{k: name for k in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}},
            {**attention_consts, "BLOCK_M": tiles["BLOCK_M"], "BLOCK_N": tiles["BLOCK_N"],
             "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32"},
            {"num_warps": tiles["num_warps"], "num_stages": 2}))
    cases.append(KernelCase(
        "write_kv", write._write_kv_kernel,
        {"key_ptr": "bf16", "value_ptr": "bf16", "k_cache_ptr": "bf16", "v_cache_ptr": "bf16",
         "slot_mapping_ptr": "i64"},
        {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_H": 8, "BLOCK_D": 128,
         "EMULATE_BF16": False}))
    for gathering in (True, False):
        cases.append(KernelCase(
            f"copy_rows[gather={gathering}]", gather._copy_rows_kernel,
            {"src_ptr": "i16", "dst_ptr": "i16", "block_ids_ptr": "i64"},
            {"GATHER": gathering, "BLOCK": gather._BLOCK}))
    for has_residual in (True, False):
        cases.append(KernelCase(
            f"add_rms_norm[residual={has_residual}]", norm._add_rms_norm_kernel,
            {name: "bf16" for name in ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "sum_ptr")},
            {"HAS_RESIDUAL": has_residual, "BLOCK": 4096, "EMULATE_BF16": False},
            {"num_warps": 8, "num_stages": 2}))
    cases.append(KernelCase(
        "rotary", rotary._rotary_kernel,
        {"q_ptr": "bf16", "k_ptr": "bf16", "cos_ptr": "bf16", "sin_ptr": "bf16", "q_out_ptr": "bf16",
         "k_out_ptr": "bf16"},
        {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": 8, "HALF": 64, "BLOCK_QH": 32, "BLOCK_KH": 8, "BLOCK_HALF": 64,
         "COMPUTE_BF16": True, "EMULATE_BF16": False}))
    return cases


def compile_case(case: KernelCase, arch: int):
    """Compile one kernel to a cubin; returns the compiled kernel (``n_regs``, ``n_spills``, ...)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in case.kernel.arg_names:
        if name in case.constexprs:
            signature[name] = "constexpr"
        elif name in case.pointers:
            signature[name] = "*" + case.pointers[name]
        else:
            signature[name] = "fp32" if name in _FLOAT_ARGS else "i32"
    # What the launcher infers at run time: torch allocations are 16-byte aligned, and strides of
    # [.., Hkv, D] views and the sizes in _ALIGNED_INTS are multiples of 16 (the block-table width
    # need not be).
    aligned = [i for i, name in enumerate(case.kernel.arg_names)
               if signature[name].startswith("*")
               or (name.startswith("stride_") and name != "stride_bt") or name in _ALIGNED_INTS]
    source = ASTSource(fn=case.kernel, signature=signature,
                       constexprs={k: v for k, v in case.constexprs.items() if k in case.kernel.arg_names},
                       attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=case.options)


def ptxas_usage(compiled, arch: int) -> dict[str, int]:
    """Registers, spill bytes and static shared memory that ptxas reports for the kernel's PTX."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        report = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a" if arch >= 90 else
                                 f"--gpu-name=sm_{arch}", ptx.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    numbers = {key: re.search(pattern, report) for key, pattern in
               {"regs": r"Used (\d+) registers", "spill_stores": r"(\d+) bytes spill stores",
                "spill_loads": r"(\d+) bytes spill loads"}.items()}
    usage = {key: int(m.group(1)) if m else 0 for key, m in numbers.items()}
    usage["shared"] = compiled.metadata.shared
    return usage


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100")
    parser.add_argument("--allow-spills", action="store_true", help="do not fail on register spills")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET (interpreted kernels are not compiled)", file=sys.stderr)
        return 2
    failures = []
    print(f"{'kernel':<32} {'regs':>5} {'spill B':>8} {'smem B':>7}")
    for case in _cases():
        try:
            usage = ptxas_usage(compile_case(case, args.arch), args.arch)
        except Exception as exc:  # report every kernel, then fail
            failures.append(case.name)
            print(f"{case.name:<32} FAILED: {type(exc).__name__}: {str(exc)[:500]}")
            continue
        spills = usage["spill_stores"] + usage["spill_loads"]
        if spills and not args.allow_spills:
            failures.append(case.name)
        print(f"{case.name:<32} {usage['regs']:>5} {spills:>8} {usage['shared']:>7}")
    if failures:
        print(f"failed (compile error or register spills): {', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

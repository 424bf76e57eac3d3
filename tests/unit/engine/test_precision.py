"""The automatic precision: chosen from the CPU's flags when neither dtype nor quantization is given."""

import pytest
import torch

from shared.engine import EngineConfig
from kernels.cpu_features import cpu_flags
from shared.model.precision import choose_precision

SAPPHIRE = frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"})
COOPER = frozenset({"avx2", "avx512f", "avx512_bf16"})  # bf16 without VNNI (a made-up mix)
OLD = frozenset({"sse4_2", "avx2"})


@pytest.mark.parametrize("flags, want", [
    (SAPPHIRE | {"avx512bw", "avx512vl"}, ("float32", "gguf")),  # the panel kernel's instructions
    (SAPPHIRE, ("float32", "int8")),  # VNNI, but not all of them
    (frozenset({"avx2", "avx_vnni"}), ("float32", "int8")),
    (COOPER, ("bfloat16", "none")),
    (OLD, ("float32", "none")),
    (frozenset(), ("float32", "none")),
])
def test_cpu_default_follows_the_flags(flags, want):
    p = choose_precision("cpu", None, None, flags)
    assert (p.dtype, p.quantization) == want
    assert p.reason and p.reason != "given"


@pytest.mark.parametrize("dtype, quantization, want", [
    ("float32", None, ("float32", "none")),
    ("bfloat16", None, ("bfloat16", "none")),
    (None, "none", ("float32", "none")),
    (None, "int8", ("float32", "int8")),
])
def test_a_given_dtype_or_quantization_is_kept_on_any_cpu(dtype, quantization, want):
    p = choose_precision("cpu", dtype, quantization, SAPPHIRE)
    assert (p.dtype, p.quantization, p.reason) == (*want, "given")


def test_gpu_default_is_bfloat16():
    assert (choose_precision("cuda", None, None).dtype, choose_precision("cuda", None, "none").dtype) == \
        ("bfloat16", "bfloat16")


def test_cpu_flags_parses_cpuinfo(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_vnni\nbogomips\t: 1\n")
    assert cpu_flags(f) == frozenset({"fpu", "avx2", "avx512_vnni"})
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_engine_config_resolves_the_machine_default_and_keeps_float32_when_pinned():
    cpu = torch.device("cpu")
    auto = EngineConfig().resolve_precision(cpu)
    assert auto == choose_precision("cpu", None, None, cpu_flags())
    assert EngineConfig(dtype="float32").resolve_dtype(cpu) == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        EngineConfig(dtype="float8").resolve_dtype(cpu)

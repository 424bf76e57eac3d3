"""What this CPU can do: its feature flags, and the flags the C++ CPU kernels need.

Here, below ``shared/``, because the kernels (``int8_cpu.py``, ``blocks_cpu.py``, ``cpu_build.py``)
decide from these whether they can run; the precision an engine picks by default
(``shared/model/precision.py``) reads the same flags. No torch, so the CLI can import it cheaply.
"""

from __future__ import annotations

from pathlib import Path

AVX512_VNNI_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")  # the int8 kernel and the gguf panel kernel


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

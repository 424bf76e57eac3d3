"""Tandem's cache root, where fetched models (``shared/model/registry.py``), built CPU kernels
(``cpu_build.py``), compiled decode steps and ``tandem up``'s state live, and the switches of the
CPU kernels. Here, below ``shared/``, because the kernels are their lowest user."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class CacheSettings(BaseSettings):
    """``TANDEM_CACHE_DIR``: the kernels' one path (``shared.process_settings`` holds the library's
    other settings; this layer imports nothing of ``shared``)."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="forbid", env_ignore_empty=True)

    cache_dir: Path | None = Field(None, description="cache root: fetched models, built CPU kernels, "
                                   "compiled decode steps and tandem up's state (default: ~/.cache/tandem)")


def cache_dir() -> Path:
    """The cache root: ``$TANDEM_CACHE_DIR`` or ``~/.cache/tandem`` (read on every call, so tests
    can point it elsewhere)."""
    configured = CacheSettings().cache_dir
    return configured.expanduser() if configured else Path.home() / ".cache" / "tandem"


class KernelSwitches(BaseSettings):
    """``TANDEM_<NAME>=off`` keeps a CPU kernel from loading (its module's fallback runs, and a log
    line says why): read where ``cpu_build.why_not`` decides, so a test may set them."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="forbid", env_ignore_empty=True)

    attention_kernel: bool = Field(True, description="the compiled decode step's attention "
                                   "(kernels/cpu/decode_attention.cpp); off: inductor's loops")
    prefill_attention_kernel: bool = Field(True, description="the eager steps' attention "
                                           "(kernels/cpu/prefill_attention.cpp); off: SDPA tiles and the padded "
                                           "decode reference")
    block_kernel: bool = Field(True, description="gguf blocks' matrix products (kernels/cpu/block_mm.cpp); "
                               "off: the torch reference")
    block_panels: bool = Field(True, description="block_mm's repacked panels where the CPU has AVX-512 VNNI; "
                               "off: the tiles kernel")
    fused_ops_kernel: bool = Field(True, description="the eager steps' residual add + RMSNorm, rotary and SiLU x "
                                   "up (kernels/cpu/fused_ops.cpp); off: torch's ops")
    int8_kernel: bool = Field(True, description="int8 products of few rows (kernels/cpu/int8_mm.cpp); off: "
                              "torch._int_mm")

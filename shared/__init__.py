"""Tandem's library: protocol, bus, engine, KV cache, transfer, telemetry."""

from kernels.reproducible import pin_mkl_branch

pin_mkl_branch()  # before any matmul: see kernels/reproducible.py

__version__ = "0.1.0"

"""MKL's conditional numerical reproducibility, switched on before MKL's first call.

torch's CPU attention (the flash kernel behind ``scaled_dot_product_attention``) runs each
(sequence, head) on one of the intra-op threads and hands MKL's sgemm a per-thread scratch buffer
whose alignment differs from thread to thread. Which thread a sequence lands on depends on how many
sequences share the call, so a decode row computed alone and in a batch reaches MKL at different
alignments. On Intel CPUs MKL's kernels give the same bits either way; on other CPUs (AMD Zen 4
measured) MKL takes code paths whose results depend on the alignment, and the row's last bits —
and with int8 layers, now and then a greedy token — depend on its batch-mates.

``MKL_CBWR=AUTO`` asks MKL for results that do not depend on alignment (for a given CPU and thread
count) while it keeps the fastest code path the CPU has. MKL reads the variable once, at its first
call, so it must be set before any matmul: ``kernels`` and ``shared`` set it when imported, and a
value already in the environment is kept. (Setting it later has no effect: MKL refuses a mode
change once it is initialised.) ``tests/unit/engine/test_batch_invariance.py`` checks it on an
Intel CPU by making MKL believe it runs on another vendor's.
"""

from __future__ import annotations

import os

MKL_BRANCH = "AUTO"


def pin_mkl_branch() -> None:
    os.environ.setdefault("MKL_CBWR", MKL_BRANCH)

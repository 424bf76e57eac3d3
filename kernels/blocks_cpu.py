"""Weight-only block matmuls for ``--quantization gguf`` (``shared/model/quant.py``'s ``BlockWeight``):
``kernels/cpu/block_mm.cpp`` on a CPU with AVX2, FMA and F16C, else the torch reference below.

Both compute, for activations x [M, K] in float32 and a weight in blocks of 32 (4-bit levels q in
0..15 with float16 scale d and offset m, w = d * q + m; or 8-bit levels in [-127, 127] with d):
each row of x rounded per block to int8 as ggml's Q8_0 does (dx = max|x| / 127, xq = round(x / dx)),
the block's integer sum of q * xq exact, then
``out[m, n] = sum_b dx[m, b] * (d[n, b] * sum_k q * xq + m[n, b] * sum_k xq)`` in float32. This is
llama.cpp's arithmetic for Q4 x Q8_0; the kernel's instructions are its AVX2 ones (vpmaddubsw,
vpmaddwd), and it reads the 4-bit weights as they are, about 0.6 bytes a weight.

The kernel and the reference agree to float32 rounding, not bit for bit (they add the block sums in
different orders), so every process of a cluster that serves gguf must run the same one: the
compiled decode step's artifact key names which (``kernel_in_graph``), and so does the log line at
load. Each computes a row's output by the same arithmetic whatever its batch-mates: a row gets the
same bits alone and in any batch, in the eager and the compiled step (the graph calls
``tandem_blocks::block_mm``, the same kernel). The kernel has two loop nests that give the same bits:
one for a few rows (a decode step of one or two sequences), and from three rows on an int8 GEMM over
panels of 16 weight rows unpacked once per call (prompts, larger decode batches: about twice as fast).

Where the CPU has AVX-512 VNNI the same source is built with it, and each weight is also repacked
once at load (``pack``) into panels of 16 weight rows in vpdpbusd's order, its float16 scales beside
its levels (``BlockWeight.panels``): ``panel_mm`` then multiplies any number of rows with one loop
nest that unpacks nothing but nibbles and adds nothing across lanes, and gives the same bits as the
AVX2 loops (the same exact integer block sums, then the same float instructions per output), so a
cluster may mix the two. The panels hold the weight a second time in memory (the kernel reads only
them); ``TANDEM_BLOCK_PANELS=off`` keeps the AVX2 loops.

Built on first use (``kernels/cpu_build.py``) into ``TANDEM_CACHE_DIR/kernels/``; with
``TANDEM_BLOCK_KERNEL=off``, without a compiler or without the instructions it is the reference
(slower by an order of magnitude, and a log line says why).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from kernels.cpu_build import CpuKernel, why_not
from kernels.cpu_features import AVX512_VNNI_FLAGS

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "cpu" / "block_mm.cpp"
BLOCK = 32  # values of one input row a block scale covers, as in ggml's Q4_0 / Q4_1 / Q8_0
_FLAGS = ["-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"]
if why_not("TANDEM_BLOCK_PANELS", AVX512_VNNI_FLAGS) is None:  # the panel kernel, unless switched off
    _FLAGS += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
_NEEDS = ("avx2", "fma", "f16c")
_op = None  # torch.ops.tandem_blocks.block_mm once loaded (a global: torch.compile traces the call)
_panel_op = None  # torch.ops.tandem_blocks.panel_mm where the build has it
_panels_checked = False
_panel_lock = threading.Lock()


def block_mm(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
             act_levels: int = 1, panels: torch.Tensor | None = None) -> torch.Tensor:
    """x float32 [M, K] times the block weight (qs, d, m) transposed: float32 [M, N]. With
    ``act_levels=2`` each activation gets a second int8 level for what the first rounded off.
    ``panels`` (``pack``'s, where there are any) go to the panel kernel: the same bits, faster."""
    if x.device.type == "cpu":
        if panels is not None and _panel_op is not None:
            return _panel_op(x, panels, qs.shape[0], m is not None, act_levels)
        if _op is not None:
            return _op(x, qs, d, m, act_levels)
    return reference(x, qs, d, m, act_levels)


def packs() -> bool:
    """Whether weights are repacked into panels here (the kernel built with AVX-512 VNNI)."""
    return load() and _panel_op is not None


def pack(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, k: int) -> torch.Tensor | None:
    """The weight's panels for ``panel_mm`` (uint8 [ceil(N / 16), K / 32, record bytes]), or None
    where this build has no panel kernel."""
    if qs.device.type != "cpu" or not packs():
        return None
    return torch.ops.tandem_blocks.pack_panels(qs, d, m, k)


def quantize_activations(x: torch.Tensor, act_levels: int = 1) -> tuple[torch.Tensor, ...]:
    """x float32 [M, K] as int8 levels (float32 [M, K / 32, 32]; with two levels, the second's too,
    in 256ths of the first's step) and the first level's block steps dx [M, K / 32]."""
    xb = x.float().reshape(x.shape[0], -1, BLOCK)
    dx = xb.abs().amax(-1) / 127.0
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))[..., None]
    q = torch.round(xb * inv)
    if act_levels == 1:
        return q, dx
    return q, torch.round((xb - q * dx[..., None]) * inv * 256.0).clamp_(-127, 127), dx


def levels(qs: torch.Tensor, k: int, four_bit: bool) -> torch.Tensor:
    """A weight's integer levels as float32 [N, K / 32, 32] (ggml's order: byte j of a 4-bit block
    holds level j in its low nibble and level j + 16 in its high one)."""
    n = qs.shape[0]
    if not four_bit:
        return qs.float().view(n, k // BLOCK, BLOCK)
    b = qs.view(n, k // BLOCK, BLOCK // 2)
    return torch.cat([b & 15, b >> 4], dim=-1).float()


def reference(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
              act_levels: int = 1) -> torch.Tensor:
    """The kernel's arithmetic in torch: each level's block sums are integers below 2^24, exact in float32."""
    rows, k = x.shape
    n = qs.shape[0]
    out = x.new_empty((rows, n), dtype=torch.float32)
    if rows == 0 or n == 0:
        return out
    w = levels(qs, k, m is not None).transpose(0, 1)  # [nb, N, 32]
    df = d.float()[None]
    mf = m.float()[None] if m is not None else None
    *xq, dx = quantize_activations(x, act_levels)

    def block_sums(q: torch.Tensor) -> torch.Tensor:  # [rows, N, nb], exact
        return torch.bmm(q.transpose(0, 1), w.transpose(1, 2)).permute(1, 2, 0)

    if act_levels == 2:
        dx = dx / 256.0
    chunk = max(1, (1 << 24) // (n * (k // BLOCK)))
    for r in range(0, rows, chunk):
        s = dx[r:r + chunk]
        if act_levels == 1:
            q = xq[0][r:r + chunk]
            sums = block_sums(q)
        else:
            q1, q2 = xq[0][r:r + chunk], xq[1][r:r + chunk]
            sums, q = block_sums(q1) * 256.0 + block_sums(q2), q1 * 256.0 + q2
        part = sums * df
        if mf is not None:
            part = part + mf * q.sum(-1)[:, None, :]
        out[r:r + chunk] = (part * s[:, None, :]).sum(-1)
    return out


def identity() -> str:
    """What ``block_mm`` runs here: the kernel's build name, or "reference: " and why."""
    return _KERNEL.describe()


def kernel_in_graph() -> bool:
    """Whether a step compiled in this process calls the kernel (else the reference)."""
    return load()


def _fake_block_mm(x, qs, d, m, act_levels):
    return x.new_empty((x.shape[0], qs.shape[0]), dtype=torch.float32)


def _fake_panel_mm(x, panels, n, four_bit, act_levels):
    return x.new_empty((x.shape[0], n), dtype=torch.float32)


def load() -> bool:
    """Build (once per machine) and load the kernel; False (and why, logged once) where it cannot run."""
    global _panel_op, _panels_checked
    if not _KERNEL.load():
        return False
    with _panel_lock:
        if not _panels_checked:
            _panels_checked = True
            if torch.ops.tandem_blocks.has_panels():
                torch.library.register_fake("tandem_blocks::panel_mm", _fake_panel_mm)
                _panel_op = torch.ops.tandem_blocks.panel_mm
                log.info("gguf block weights are repacked into panels for the AVX-512 VNNI kernel")
    return True


_KERNEL = CpuKernel(SOURCE, _FLAGS, "tandem_blocks::block_mm", _fake_block_mm, "TANDEM_BLOCK_KERNEL", _NEEDS,
                    module=globals(), fallback="reference", say=log.warning,
                    message="gguf block matmuls use the torch reference, an order of magnitude slower (%s)")

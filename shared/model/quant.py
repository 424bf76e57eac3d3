"""Int8 weight-and-activation (W8A8) linear layers for the CPU.

On a CPU the engine's time goes to matmuls that read fp32 weights. With ``quantization="int8"``
every linear layer (fused q/k/v, o, fused gate/up, down and the LM head) keeps its weight as int8
with one scale per output channel, and each step's activations are quantized per token (a scale and
a zero point per row, ``quantize_rows``) just before the matmul. The int8 x int8 product accumulates exactly in int32
(``torch._int_mm``, VNNI on x86), so a row's result depends only on that row; with attention that
is batch-invariant too (``kernels/decode_attention.py``, ``kernels/prefill_attention.py``) the
output of a request does not change with its batch-mates. The embedding lookup, norms, attention
and the KV cache stay in the model dtype.

The error against float32 is small but not zero; ``tests/engine/test_quantization_smollm2.py`` measures
it on the real model. ``quantization="int8-precise"`` quantizes each activation row in two int8
levels (the second holding what the first rounded off) and keeps the LM head's weight in two levels
too: 97% top-1 agreement with float32 on SmolLM2 instead of 93.4%, for up to twice the matmul work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.cast import cast
from kernels.blocks_cpu import BLOCK, block_mm, levels, pack
from kernels.int8_cpu import int8_mm, row_sums
from shared.model.precision import QUANTIZATION_METHODS


# What the float model reads once to measure each linear layer's input range (SmoothQuant
# calibration): a chat turn, prose, code and numbers, so that the special tokens, punctuation and
# digits that real traffic has are all seen.
CALIBRATION_MESSAGES = [
    {"role": "user", "content": "Explain in a few sentences why the sky is blue, then write a Python function "
                                "that returns the n-th Fibonacci number, and list three prime numbers above 100."},
    {"role": "assistant", "content": (
        "Sunlight is made of many colours. When it passes through the atmosphere, the short blue wavelengths "
        "are scattered by nitrogen and oxygen molecules far more than the long red ones (Rayleigh scattering, "
        "which grows as 1/wavelength^4), so blue light reaches our eyes from every direction of the sky.\n\n"
        "```python\ndef fibonacci(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
        "    return a\n```\n\nThree primes above 100: 101, 103 and 107. In 2024, about 8.1 billion people lived "
        "on Earth; the distance to the Moon is roughly 384,400 km.")},
    {"role": "user", "content": "Merci ! Et en français, quelle est la capitale de l'Italie ? Réponds en JSON: "
                                "{\"capitale\": ...}"},
]


@dataclass(frozen=True)
class Int8Weight:
    """A linear weight [N, K] as int8 with a float32 scale per output channel, after smoothing:
    w ≈ (qweight * scale) / smooth, where ``smooth`` [K] moved part of the activations' range into
    the weight (SmoothQuant); the activations are divided by it before they are quantized.

    With ``residual`` (``qweight2``, ``scale2``) the weight is stored in two int8 levels, the second
    quantizing what the first missed: w ≈ (qweight * scale + qweight2 * scale2) / smooth, about 15
    bits of precision for twice the bytes (the LM head, where rounding costs the most agreement)."""

    qweight: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N] float32
    inv_smooth: torch.Tensor | None = None  # [K] float32: activations are multiplied by it
    qweight2: torch.Tensor | None = None  # [N, K] int8: the residual level
    scale2: torch.Tensor | None = None  # [N] float32
    act_levels: int = 1  # int8 levels each activation row is quantized in (1 or 2)
    # row sums of the int8 levels, for kernels/int8_cpu.py's unsigned-by-signed products; made once
    qsums: torch.Tensor = field(init=False, repr=False, compare=False)  # [N] int32
    qsums2: torch.Tensor | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "qsums", row_sums(self.qweight))
        object.__setattr__(self, "qsums2", None if self.qweight2 is None else row_sums(self.qweight2))

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.qweight, self.scale, self.inv_smooth, self.qweight2, self.scale2)
                   if t is not None)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = self.qweight.float() * self.scale[:, None]
        if self.qweight2 is not None:
            w = w + self.qweight2.float() * self.scale2[:, None]
        if self.inv_smooth is not None:
            w = w * self.inv_smooth[None, :]
        return w.to(dtype)


@dataclass
class ObservedWeight:
    """A float weight whose inputs' per-channel max |x| is recorded: the calibration pass."""

    weight: torch.Tensor  # [N, K]
    act_amax: torch.Tensor  # [K] float32, running max over every token seen


def observe(weight: torch.Tensor) -> ObservedWeight:
    return ObservedWeight(weight, torch.zeros(weight.shape[1], dtype=torch.float32, device=weight.device))


def _per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per row: each row's largest |value| maps to 127."""
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous(), scale.contiguous()


def quantize_int8(weight: torch.Tensor, act_amax: torch.Tensor | None = None, alpha: float = 0.5,
                  residual: bool = False, act_levels: int = 1) -> Int8Weight:
    """Symmetric per-output-channel quantization: each row's largest |value| maps to 127; with
    ``residual`` a second int8 level quantizes the first one's rounding error. ``act_levels``: how
    many int8 levels the activations get (``quantize_rows``).

    With ``act_amax`` (per input channel, from calibration), input channel k is first scaled by
    s_k = act_amax_k^alpha / wmax_k^(1 - alpha) (SmoothQuant), which evens out the outlier
    channels that per-token activation quantization handles badly."""
    w = weight.float()
    inv_smooth = None
    if act_amax is not None:
        w_amax = w.abs().amax(dim=0).clamp_min(1e-5)
        smooth = (act_amax.float().clamp_min(1e-5).pow(alpha) / w_amax.pow(1 - alpha)).clamp_min(1e-5)
        w = w * smooth[None, :]
        inv_smooth = (1.0 / smooth).contiguous()
    q, scale = _per_row(w)
    if not residual:
        return Int8Weight(q, scale, inv_smooth, act_levels=act_levels)
    q2, scale2 = _per_row(w - q.float() * scale[:, None])
    return Int8Weight(q, scale, inv_smooth, q2, scale2, act_levels)


def quantize_rows(x: torch.Tensor, inv_smooth: torch.Tensor | None = None,
                  levels: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row (per-token) int8 quantization of x [M, K] (times ``inv_smooth`` [K] first).

    One level (``int8``) is asymmetric: each row's range [min(x, 0), max(x, 0)] is cut into 255 steps,
    x ≈ scale * (q - zero) with an integer ``zero`` per row in [-128, 127]. A row whose values lean
    to one side (the SiLU-gated input of ``down``, whose negatives stop at -0.28) keeps nearly twice
    the resolution that a range symmetric about zero would give it: on SmolLM2 the top token moved
    at 6.3% of positions instead of 7.7% (KL 0.010 instead of 0.014). Zero stays exact, and the
    product needs only ``zero * row_sum(w)`` subtracted from the exact int32 sums (``int8_linear``).

    ``levels=2`` (``int8-precise``) is symmetric, the first level's scale mapping each row's largest
    |value| to 127, and a second level quantizes what the first rounded off, with its own per-row
    scale; together they hold about 15 bits of each value, so activations cost next to nothing in
    agreement with float.

    Returns (int8 [levels*M, K]: the M first-level rows, then the M second-level rows; float32 scales
    [levels*M, 1]; the zero points, int32 [M, 1], or None for two levels)."""
    # every op here runs once per linear layer and step, so casts that would be no-ops are skipped
    # and scales are finished in place: at batch 1 the dispatch of an op costs about what its work does
    xf = cast(x, torch.float32)
    if inv_smooth is not None:
        xf = xf * inv_smooth
    if levels == 1:
        lo, hi = torch.aminmax(xf, dim=1, keepdim=True)  # one pass over the row for both ends
        lo = lo.clamp_max_(0.0)
        scale = hi.clamp_min_(0.0).sub_(lo).clamp_min_(1e-12).div_(255.0)
        # lo maps to -128; lo / scale is in [-255, 0], so zero is in [-128, 127]
        zero = torch.round(lo / scale).neg_().sub_(128.0)
        q = torch.round(xf / scale).add_(zero).clamp_(-128, 127)
        return q.to(torch.int8), scale, zero.to(torch.int32)
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12).div_(127.0)
    q = torch.round(xf / scale).clamp_(-127, 127)
    rest = xf - q * scale
    scale2 = rest.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30).div_(127.0)
    q2 = torch.round(rest / scale2).clamp_(-127, 127)
    return torch.cat([q, q2]).to(torch.int8), torch.cat([scale, scale2]), None


def int8_linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w.T with int8 operands and int32 accumulation; returns x's dtype.

    One activation level: the exact int32 sums less each row's zero point times the weight's row
    sums (exact in int32: each term stays below 128 * 127 * K), then scaled. Two levels go
    through one int8 matmul ([2M, K] rows); a residual weight's second level meets the first
    activation level only (the product of the two residuals is below float32's rounding of the
    sum). Every op after a matmul is per row, so a row's result does not depend on the other rows."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    m, n = x2.shape[0], w.shape[0]
    if m == 0:
        return x.new_zeros(*x.shape[:-1], n)
    xq, xs, zero = quantize_rows(x2, w.inv_smooth, w.act_levels)
    acc = int8_mm(xq, w.qweight, w.qsums)
    if zero is not None:
        acc = acc.sub_(zero * w.qsums)
    # int32 [levels*M, N], exact; times a float32 scale it is converted to float32 first, as .to() would
    acc = torch.mul(acc, xs)
    if w.act_levels == 2:
        acc = acc[:m].add_(acc[m:])
    out = acc.mul_(w.scale)
    if w.qweight2 is not None:
        acc2 = int8_mm(xq[:m], w.qweight2, w.qsums2)
        if zero is not None:
            acc2 = acc2.sub_(zero * w.qsums2)
        out.add_(torch.mul(acc2, xs[:m]).mul_(w.scale2))
    if bias is not None:
        out.add_(cast(bias, torch.float32))
    out = cast(out, x.dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


@dataclass(frozen=True)
class BlockWeight:
    """A linear weight [N, K] in ggml-style blocks of ``BLOCK`` input values, multiplied by
    ``kernels/blocks_cpu.py``: each activation row is rounded per block to 8 bits (as ggml's Q8_0:
    a float32 scale max|x| / 127 and int8 levels), each block's product is an exact integer sum,
    and the block sums are scaled and added in float32. A row's result depends on that row alone.

    ``bits=4``: the weight was already on a 4-bit grid in every block (a GGUF file's Q4_0, Q4_1 or
    Q4_K layers): w = d * q + m with its own 16 levels q in 0..15, ``qs`` uint8 [N, K / 2] holding
    byte j of a block as q[j] (low nibble) and q[j + 16] (high), as ggml does; d and m float16
    (exact for Q4_0 / Q4_1, whose files hold float16). ``bits=8``: symmetric 8-bit blocks as Q8_0
    (``qs`` int8 [N, K] in [-127, 127], d = max|w| / 127, no m). ``act_levels=2`` gives the
    activations a second int8 level (what the first rounded off): the LM head's, where rounding
    the last hidden state to 8 bits cost about half of the top-1 agreement lost. ``panels``: the same
    weight repacked for the AVX-512 VNNI kernel where this CPU has one (``kernels/blocks_cpu.py``'s
    ``pack``; the same bits, and what a step reads instead of ``qs``), else None."""

    qs: torch.Tensor  # uint8 [N, K / 2] (4-bit) or int8 [N, K] (8-bit)
    d: torch.Tensor  # float16 [N, K / BLOCK]
    m: torch.Tensor | None  # float16 [N, K / BLOCK] (4-bit) or None
    bits: int  # 4 or 8
    in_features: int  # K
    act_levels: int = 1
    panels: torch.Tensor | None = None  # uint8 [ceil(N / 16), K / BLOCK, record bytes]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.qs.shape[0], self.in_features))

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes + (self.m.nbytes if self.m is not None else 0)

    def levels(self) -> torch.Tensor:
        """The integer levels q as float32 [N, K / BLOCK, BLOCK]."""
        return levels(self.qs, self.in_features, self.bits == 4)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        w = self.levels() * self.d.float()[..., None]
        if self.m is not None:
            w = w + self.m.float()[..., None]
        return w.reshape(n, k).to(dtype)


def four_bit_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """If every block of 32 values along each row of ``w`` [N, K] lies on 16 evenly spaced levels
    (w = lo + q * step, q in 0..15), as a GGUF Q4 layer dequantized is: (q int32 [N, K], step and
    lo float32 [N, K / 32]); else None. The step is the smallest gap between a block's distinct
    values, so a block that never uses two neighbouring levels fails and the weight is kept at 8 bits."""
    n, k = w.shape
    g = w.float().reshape(n, k // BLOCK, BLOCK)
    lo, hi = g.amin(-1), g.amax(-1)
    span = hi - lo
    gaps = g.sort(-1).values.diff(dim=-1)
    gaps = torch.where(gaps > span[..., None] * 1e-4, gaps, torch.full_like(gaps, float("inf")))
    step = gaps.amin(-1)
    flat = span == 0  # every value the same: q = 0 and the offset is the value
    step = torch.where(flat, torch.zeros_like(step), step)
    pos = (g - lo[..., None]) / torch.where(flat, torch.ones_like(step), step)[..., None]
    q = pos.round()
    if not bool(((pos - q).abs() <= 1e-3).all()) or float(q.amax()) > 15:
        return None
    return q.to(torch.int32).reshape(n, k), step, lo


def quantize_blocks(weight: torch.Tensor) -> BlockWeight | None:
    """``weight`` [N, K] as a ``BlockWeight``: 4-bit when it is on a 4-bit grid already, else 8-bit;
    None where K is not a whole number of blocks."""
    n, k = weight.shape
    if k % BLOCK:
        return None
    grid = four_bit_grid(weight)
    if grid is not None:
        q, step, lo = grid
        b = q.to(torch.uint8).view(n, k // BLOCK, BLOCK)
        qs = (b[..., :BLOCK // 2] | (b[..., BLOCK // 2:] << 4)).reshape(n, k // 2).contiguous()
        d, m = step.half().contiguous(), lo.half().contiguous()
        return BlockWeight(qs, d, m, 4, k, panels=pack(qs, d, m, k))
    g = weight.float().reshape(n, k // BLOCK, BLOCK)
    d = g.abs().amax(-1) / 127.0
    q8 = torch.round(g / torch.where(d > 0, d, 1.0)[..., None]).clamp_(-127, 127)
    qs, d = q8.to(torch.int8).reshape(n, k).contiguous(), d.half().contiguous()
    return BlockWeight(qs, d, None, 8, k, panels=pack(qs, d, None, k))


def block_linear(x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w.T with x rounded to 8-bit blocks (``kernels/blocks_cpu.py``); returns x's dtype."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    n = w.shape[0]
    out = cast(block_mm(cast(x2, torch.float32), w.qs, w.d, w.m, w.act_levels, w.panels), x.dtype)
    if bias is not None:
        out = out + bias
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def linear(x: torch.Tensor, weight: torch.Tensor | Int8Weight | BlockWeight | ObservedWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a plain weight, the int8 path for an ``Int8Weight``, the block kernel for a
    ``BlockWeight``; an ``ObservedWeight`` records its input's range and computes in float."""
    if isinstance(weight, Int8Weight):
        return int8_linear(x, weight, bias)
    if isinstance(weight, BlockWeight):
        return block_linear(x, weight, bias)
    if isinstance(weight, ObservedWeight):
        amax = x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        torch.maximum(weight.act_amax, amax, out=weight.act_amax)
        return F.linear(x, weight.weight, bias)
    return F.linear(x, weight, bias)


def calibration_token_ids(tokenizer, max_tokens: int = 512) -> list[int]:
    """The calibration text in the model's own chat format (plain text without a template)."""
    try:
        text = tokenizer.apply_chat_template(CALIBRATION_MESSAGES, add_generation_prompt=True)
    except ValueError:  # no chat template: the same words as plain text
        text = "\n\n".join(m["content"] for m in CALIBRATION_MESSAGES)
    return tokenizer.encode(text)[:max_tokens]


def quantization_name(method: str | None) -> str:
    """The canonical name of a ``--quantization`` value (None and "" mean none)."""
    method = (method or "none").lower()
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r} (choose {', '.join(QUANTIZATION_METHODS)})")
    return method


def check_quantization(method: str, device: torch.device) -> str:
    """Validate a ``--quantization`` value for a device; returns the canonical name."""
    method = quantization_name(method)
    if method != "none" and device.type != "cpu":
        raise ValueError(f"quantization {method!r} runs on the CPU only, not on {device.type}")
    return method


# A held-out passage (not the calibration text) on which a quantized model is compared with float.
EVAL_PASSAGE = (
    "The lighthouse stood at the end of a narrow spit of rock, and for more than a century its keepers had "
    "climbed the one hundred and twelve steps every evening to light the lamp. In the winter of 1911 the "
    "storms came early. Ships that had left the harbour in October were still missing in December, and the "
    "village waited for news that did not come. The keeper's daughter, who was eleven, kept a notebook in "
    "which she wrote the direction of the wind, the height of the waves and the names of the boats she saw. "
    "Years later a historian found the notebook in a box of old tide tables and used it to work out where "
    "the missing ships had most likely gone down. Her careful entries, written in pencil by the light of the "
    "great lamp, turned out to be more accurate than the official records kept in the harbour office. "
    "Today the lighthouse is automatic, and the notebook is on display in the small museum beside the pier."
)


def compare_models(reference, model, token_ids: list[int]) -> dict[str, float]:
    """Teacher-forced on ``token_ids``: how often ``model``'s top token is ``reference``'s, their mean
    KL divergence (reference || model) per position, and both perplexities."""
    ref = reference.prefill_logits(token_ids).log_softmax(-1)
    got = model.prefill_logits(token_ids).log_softmax(-1)
    target = torch.tensor(token_ids[1:], device=ref.device)

    def ppl(lp: torch.Tensor) -> float:
        return math.exp(-float(lp[:-1].gather(1, target[:, None]).mean()))

    return {"tokens": len(token_ids), "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
            "kl": float((ref.exp() * (ref - got)).sum(-1).mean()),
            "perplexity_reference": ppl(ref), "perplexity": ppl(got)}

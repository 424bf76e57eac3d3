"""A mixture of experts in place of a decoder layer's MLP (Mixtral, Qwen3-MoE, gpt-oss, DeepSeek-V3).

The experts' weights are stacked, one tensor per projection ([E, ...], expert e at row e), so a
rank of an expert-parallel group can hold a range of them and a fused grouped-GEMM kernel can
take them as they are, with no change here. On a tensor-parallel rank every expert holds its
slice of the intermediate channels, as the dense MLP does (shared/model/parallel.py), and the
block's output is a partial sum that the layer's all-reduce completes (gpt-oss's down biases are
rank 0's alone, so the sum holds them once; the gate_up biases are cut with the channels).

With ``quantization="int8"`` the experts are ``Int8Experts``: the same stack in int8 with a scale
per expert and output channel, each expert's rows multiplied by the dense layers' int8 linear. With
``quantization="gguf"`` they are ``BlockExperts``: a block weight per expert, multiplied by the dense
layers' block kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache, partial
from typing import Literal

import torch
import torch.nn.functional as F

from kernels.moe_grouped import grouped_linear_ref
from shared.model.config import ClampedSwiglu, Moe
from shared.model.quant import (BlockWeight, Int8Weight, block_linear, int8_linear, linear, quantize_blocks,
                                quantize_int8)

MoeKernel = Literal["auto", "torch", "triton"]
# (x [R, K], weight [E, N, K], counts [E], rows [P] | None, scale [P] | None) -> [P, N]: the
# contract of kernels/moe_grouped.py's grouped_linear_ref
GroupedLinear = Callable[..., torch.Tensor]
Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) [N, I] each -> [N, I]


@dataclass(frozen=True)
class Int8Experts:
    """A projection's experts [E, N, K] in int8, each expert's weight quantized as a dense layer's
    (``quantize_int8``: symmetric, a float32 scale per output channel). Not smoothed: a calibration
    pass routes too few tokens to some experts to measure their inputs' range.

    Stacked as the float experts are, so that a range of experts is ``experts[e0:e1]`` (expert
    parallelism); ``experts[e]`` is expert e's ``Int8Weight``, views of the stack with its row sums
    made once, which ``int8_linear`` multiplies as it multiplies a dense layer's."""

    qweight: torch.Tensor  # [E, N, K] int8
    scale: torch.Tensor  # [E, N] float32
    act_levels: int = 1  # as ``Int8Weight.act_levels``
    weights: tuple[Int8Weight, ...] = field(init=False, repr=False, compare=False)  # E of them

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", tuple(Int8Weight(q, s, act_levels=self.act_levels)
                                                  for q, s in zip(self.qweight, self.scale)))

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scale.nbytes

    def __getitem__(self, index: int | slice) -> Int8Weight | Int8Experts:
        if isinstance(index, slice):
            return Int8Experts(self.qweight[index], self.scale[index], self.act_levels)
        return self.weights[index]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [E, N, K]
        return torch.stack([w.dequantize(dtype) for w in self.weights])


def quantize_experts(weight: torch.Tensor, act_levels: int = 1) -> Int8Experts:
    """Each expert of ``weight`` [E, N, K] through ``quantize_int8``, written into one int8 stack (the
    peak is the float stack, the int8 stack and one expert's copy)."""
    qweight = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
    for expert, w in enumerate(weight.unbind(0)):
        q = quantize_int8(w, act_levels=act_levels)
        qweight[expert], scale[expert] = q.qweight, q.scale
    return Int8Experts(qweight, scale, act_levels)


# int8 experts' grouped path: kernels/moe_grouped.py's loop over the experts' row groups, each group
# through the dense layers' int8 linear (per-row activation scales: a row's result is its own)
_int8_grouped_linear = partial(grouped_linear_ref, linear=int8_linear)


@dataclass(frozen=True)
class BlockExperts:
    """A projection's experts [E, N, K] in GGUF-style blocks of 32 (``--quantization gguf``): one
    ``BlockWeight`` per expert, as ``quantize_blocks`` makes a dense layer's (4-bit where the expert is on
    a 4-bit grid already, as a GGUF file's Q4 experts dequantized are, else 8-bit), each multiplied by
    the dense layers' block kernel, panels included. ``experts[e0:e1]`` is a range of them (expert
    parallelism), ``experts[e]`` expert e's weight."""

    weights: tuple[BlockWeight, ...]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.weights), *self.weights[0].shape))

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights)

    def __getitem__(self, index: int | slice) -> BlockWeight | BlockExperts:
        if isinstance(index, slice):
            return BlockExperts(self.weights[index])
        return self.weights[index]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [E, N, K]
        return torch.stack([w.dequantize(dtype) for w in self.weights])


def block_experts(weight: torch.Tensor) -> BlockExperts | None:
    """Each expert of ``weight`` [E, N, K] through ``quantize_blocks``; None where K is not whole blocks."""
    blocks = [quantize_blocks(w) for w in weight.unbind(0)]
    return None if any(b is None for b in blocks) else BlockExperts(tuple(blocks))


# gguf experts' grouped path: the same loop, each group through the dense layers' block linear (a row's
# activation blocks are rounded on their own, so a row's result is its own here too)
_block_grouped_linear = partial(grouped_linear_ref, linear=block_linear)


@dataclass(frozen=True)
class ExpertBiases:
    """The biases of a block whose router and experts have them (gpt-oss); None where one has none."""

    router: torch.Tensor | None = None  # [E]
    gate_up: torch.Tensor | None = None  # [E, 2 * I]: gate's, then up's, as ``MoeBlock.gate_up``'s rows
    down: torch.Tensor | None = None  # [E, hidden]


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, swiglu: ClampedSwiglu) -> torch.Tensor:
    """gpt-oss's expert activation, in transformers' order of operations (``Moe.clamped_swiglu``)."""
    gate = gate.clamp(max=swiglu.limit)
    up = up.clamp(min=-swiglu.limit, max=swiglu.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * swiglu.alpha))


def expert_glu(moe: Moe, act: Callable[[torch.Tensor], torch.Tensor]) -> Glu:
    """The experts' gated activation: the family's clamped SwiGLU, else the model's act(gate) * up."""
    if moe.clamped_swiglu is not None:
        return partial(clamped_swiglu, swiglu=moe.clamped_swiglu)
    return lambda gate, up: act(gate) * up


def moe_block(moe: Moe, weights: dict[str, torch.Tensor], act: Callable[[torch.Tensor], torch.Tensor]) -> MoeBlock:
    """The block of a layer's weights (``shared.model.loader.build_model``'s names)."""
    if moe.group_limited is not None:
        return group_limited_block(moe, weights, act)
    biases = ExpertBiases(weights.get("router_bias"), weights.get("experts_gate_up_bias"),
                          weights.get("experts_down_bias"))
    return MoeBlock(moe, weights["router"], weights["experts_gate_up"], weights["experts_down"], act,
                    biases=biases)


class MoeBlock:
    """Routing as Mixtral and Qwen3-MoE define it: softmax over the router's logits (in float32),
    the top k probabilities, renormalised to sum 1 where ``Moe.renormalize`` (always in Mixtral,
    ``norm_topk_prob`` in Qwen3-MoE), or as gpt-oss does, the softmax over the top k logits
    (``Moe.softmax_after_topk``); each chosen expert's gated output (``expert_glu``) weighted by its
    probability (in float32, or rounded to the model's dtype first where ``Moe.round_weights``:
    Qwen3-MoE, gpt-oss) and summed in float32, rounded to the model's dtype once, as transformers does.
    The router and experts take ``biases`` where the family has them (gpt-oss)."""

    def __init__(self, moe: Moe, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 act: Callable[[torch.Tensor], torch.Tensor], kernel: MoeKernel = "auto",
                 biases: ExpertBiases = ExpertBiases()):
        self.top_k, self.renormalize, self.round_weights = moe.top_k, moe.renormalize, moe.round_weights
        self.softmax_after_topk = moe.softmax_after_topk
        self.router = router  # [E, hidden]: whole on every rank, so every rank routes alike
        # [E, 2 * I, hidden]: each expert's gate rows, then its up rows; Int8Experts or BlockExperts once quantized
        self.gate_up: torch.Tensor | Int8Experts | BlockExperts = gate_up
        self.down: torch.Tensor | Int8Experts | BlockExperts = down  # [E, hidden, I]
        self.biases = biases
        self.glu = expert_glu(moe, act)
        self.kernel = kernel  # how ``forward`` runs the experts: see ``grouped_linear``
        # (token, expert) pairs routed to each expert so far, on the host: the expert load a worker
        # reports (``expert_load``); a CUDA graph's replays are not counted
        self.expert_tokens = torch.zeros(router.shape[0], dtype=torch.int64)

    def quantize_int8(self, act_levels: int = 1) -> None:
        """Replace both projections' experts by ``Int8Experts`` (the router and biases stay float)."""
        self.gate_up = quantize_experts(self.gate_up, act_levels)
        self.down = quantize_experts(self.down, act_levels)

    def quantize_gguf(self) -> bool:
        """Replace both projections' experts by ``BlockExperts`` (the router and biases stay float);
        False, and both kept float, where either's input width is not whole blocks of 32."""
        gate_up, down = block_experts(self.gate_up), block_experts(self.down)
        if gate_up is None or down is None:
            return False
        self.gate_up, self.down = gate_up, down
        return True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts [T, k] (int64) and their weights [T, k] (float32, or x's dtype
        where ``round_weights``)."""
        logits = F.linear(x, self.router, self.biases.router).float()  # [T, E]
        if self.softmax_after_topk:
            top, experts = logits.topk(self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1)
            return experts, weights.to(x.dtype) if self.round_weights else weights
        weights, experts = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype) if self.round_weights else weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        """The (token, expert) pairs grouped by expert (a stable sort), each expert run once over
        its tokens, the weighted outputs added back at their tokens' rows: by the grouped-GEMM
        kernel where ``grouped_linear`` gives one, else by a loop over the experts. The loop needs
        the counts on the host, which a CUDA graph's capture (shared/engine/compiled/cuda_graph.py)
        cannot wait for: without the kernel a capture runs every expert over every token instead."""
        experts, weights = self.route(x)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        grouped_linear = self.grouped_linear(x)
        if grouped_linear is not None:
            return self.forward_grouped(x, experts, weights, grouped_linear, count=not capturing)
        if capturing:
            return self.forward_every_expert(x, experts, weights)
        return self.forward_each_expert(x, experts, weights)

    def grouped_linear(self, x: torch.Tensor) -> GroupedLinear | None:
        """The grouped-GEMM kernel ``forward`` runs, None for the torch loop over the experts. The
        one place the choice is made: ``kernel`` "auto" takes Triton's (kernels/moe_grouped_triton.py)
        for CUDA tensors where triton is installed, "torch" never, "triton" always (on the CPU too,
        where tests run it under ``TRITON_INTERPRET=1``). Int8 experts (``Int8Experts``, CPU) take
        the int8 loop over the expert groups whatever the kernel but "torch"."""
        if isinstance(self.gate_up, Int8Experts):
            return None if self.kernel == "torch" else _int8_grouped_linear
        if isinstance(self.gate_up, BlockExperts):
            return None if self.kernel == "torch" else _block_grouped_linear
        if self.kernel == "torch" or (self.kernel == "auto" and not x.is_cuda):
            return None
        kernel = _triton_grouped_linear()
        if kernel is None and self.kernel == "triton":
            raise RuntimeError("MoeBlock kernel 'triton' is not available: triton is not installed")
        return kernel

    def forward_each_expert(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``forward`` in torch: one F.linear per expert and projection over the expert's tokens."""
        order = experts.flatten().argsort(stable=True)  # [T * k]: the pairs, expert by expert
        tokens = order // self.top_k
        pair_weights = weights.flatten()[order]
        counted = torch.bincount(experts.flatten(), minlength=self.gate_up.shape[0]).cpu()
        self.expert_tokens += counted
        counts = counted.tolist()
        out = torch.zeros_like(x, dtype=torch.float32)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start:start + count]
            y = self.expert(x.index_select(0, rows), expert)  # [count, hidden]
            out.index_add_(0, rows, (y * pair_weights[start:start + count, None]).float())
            start += count
        return out.to(x.dtype)

    def forward_grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                        grouped_linear: GroupedLinear, count: bool) -> torch.Tensor:
        """``forward`` with one grouped-GEMM launch per projection and no host sync (so a CUDA graph
        can capture it), but where ``count`` adds the counts to ``expert_tokens`` (eager steps); or,
        for int8 experts on the CPU, one int8 linear per expert group and projection."""
        flat = experts.flatten()  # [T * k]
        order = flat.argsort(stable=True)  # the pairs, expert by expert
        tokens = order // self.top_k
        # bincount would sync on CUDA (it sizes its output from the largest value)
        counts = torch.zeros(self.gate_up.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # [E]
        if count:
            self.expert_tokens += counts.cpu()
        pair_experts, pair_weights = flat[order], weights.flatten()[order]
        gate_up = grouped_linear(x, self.gate_up, counts, rows=tokens)  # [T * k, 2I]
        if self.biases.gate_up is not None:
            gate_up = gate_up + self.biases.gate_up[pair_experts]
        # [T * k, hidden]
        y = grouped_linear(self.glu(*gate_up.chunk(2, dim=-1)), self.down, counts, scale=pair_weights)
        if self.biases.down is not None:  # the kernel scales its product only: the bias's share added here
            y = y + self.biases.down[pair_experts] * pair_weights[:, None].to(y.dtype)
        return torch.zeros_like(x, dtype=torch.float32).index_add_(0, tokens, y.float()).to(x.dtype)

    def forward_every_expert(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``forward`` with no host sync: each expert over all T tokens, weighted 0 where a token did
        not choose it (E / k times the work: for a decode step's few rows, under a CUDA graph)."""
        dense = torch.zeros(x.shape[0], self.gate_up.shape[0], dtype=weights.dtype, device=x.device)
        dense.scatter_(1, experts, weights)  # [T, E]
        out = torch.zeros_like(x, dtype=torch.float32)
        for expert in range(self.gate_up.shape[0]):
            out += self.expert(x, expert) * dense[:, expert, None]
        return out.to(x.dtype)

    def expert(self, x: torch.Tensor, expert: int) -> torch.Tensor:  # [N, hidden] -> [N, hidden]
        """One expert's gated MLP over rows ``x``, with its biases where the block has them."""
        b = self.biases
        # quant.py's linear: F.linear for a float expert, int8_linear for an int8 one
        gate_up = linear(x, self.gate_up[expert], None if b.gate_up is None else b.gate_up[expert])
        down_bias = None if b.down is None else b.down[expert]
        return linear(self.glu(*gate_up.chunk(2, dim=-1)), self.down[expert], down_bias)


def group_limited_block(moe: Moe, weights: dict[str, torch.Tensor],
                        act: Callable[[torch.Tensor], torch.Tensor]) -> GroupLimitedMoeBlock:
    """DeepSeek-V3's block of a layer's weights: its router's correction bias (``router_correction``, zeros
    where the checkpoint has none) and its shared experts' fused ``shared_gate_up`` and ``shared_down``."""
    router = weights["router"]
    correction = weights.get("router_correction")
    if correction is None:
        correction = torch.zeros(router.shape[0], dtype=torch.float32, device=router.device)
    return GroupLimitedMoeBlock(moe, router, weights["experts_gate_up"], weights["experts_down"], act, correction,
                                weights.get("shared_gate_up"), weights.get("shared_down"))


class GroupLimitedMoeBlock(MoeBlock):
    """DeepSeek-V3's mixture (``GroupLimitedRouting``), as transformers' ``DeepseekV3TopkRouter`` and
    ``DeepseekV3MoE`` compute it: the router in float32, sigmoid scores; for the choice only, each score plus
    the expert's correction bias, the experts of the ``topk_groups`` groups with the best two-score sums, the
    top k of those; the chosen experts weighted by their unbiased scores, renormalised (+1e-20) where
    ``Moe.renormalize``, times ``routed_scaling_factor``. The routed experts run as ``MoeBlock``'s (every
    kernel path), and the shared experts' SwiGLU over every token is added to their sum. On a tensor-parallel
    rank the shared experts hold their slice of the channels as a dense MLP does, so theirs is a partial sum
    too, completed by the layer's all-reduce (shared/model/parallel.py)."""

    def __init__(self, moe: Moe, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 act: Callable[[torch.Tensor], torch.Tensor], correction: torch.Tensor,
                 shared_gate_up: torch.Tensor | None, shared_down: torch.Tensor | None, kernel: MoeKernel = "auto"):
        super().__init__(moe, router, gate_up, down, act, kernel)
        self.routing = moe.group_limited
        self.correction = correction.float()  # [E]: e_score_correction_bias, kept in float32 as transformers does
        self.shared_gate_up = shared_gate_up  # [2 * shared width, hidden]; None without shared experts
        self.shared_down = shared_down  # [hidden, shared width]
        self.act = act

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts [T, k] (int64) and their weights [T, k] (float32)."""
        r = self.routing
        scores = F.linear(x.float(), self.router.float()).sigmoid()  # [T, E]
        biased = scores + self.correction
        num_tokens, num_experts = biased.shape
        groups = biased.view(num_tokens, r.num_groups, -1)  # [T, G, E / G]
        best = groups.topk(2, dim=-1).values.sum(-1).topk(r.topk_groups, dim=-1, sorted=False).indices  # [T, g]
        keep = torch.zeros(num_tokens, r.num_groups, dtype=torch.bool, device=x.device).scatter_(1, best, True)
        biased = biased.masked_fill(~keep[:, :, None].expand_as(groups).reshape(num_tokens, num_experts), float("-inf"))
        experts = biased.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * r.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        routed = super().forward(x)
        if self.shared_gate_up is None:
            return routed
        gate, up = linear(x, self.shared_gate_up).chunk(2, dim=-1)
        return routed + linear(self.act(gate) * up, self.shared_down)


@cache
def _triton_grouped_linear() -> GroupedLinear | None:
    """kernels/moe_grouped_triton.py's kernel, None where triton is not installed (imported on first
    use: nothing imports triton before a test has chosen between interpreter and compiler)."""
    try:
        from kernels.moe_grouped_triton import grouped_linear_triton
    except ImportError:
        return None
    return grouped_linear_triton


@dataclass(frozen=True)
class ExpertLoad:
    """How the routed tokens spread over the experts of the layers one process holds."""

    tokens: tuple[int, ...]  # (token, expert) pairs each expert took, summed over the layers
    imbalance: float  # the worst layer's busiest expert against that layer's mean (1.0: even)


def expert_load(layers) -> ExpertLoad | None:
    """The expert load of ``layers`` (a model's), None without experts or before any token."""
    counts = [layer.moe.expert_tokens for layer in layers if getattr(layer, "moe", None) is not None]
    if not counts:
        return None
    per_layer = torch.stack(counts).double()  # [layers, E]
    means = per_layer.mean(dim=1)
    if not bool((means > 0).any()):
        return None
    imbalance = (per_layer.max(dim=1).values[means > 0] / means[means > 0]).max().item()
    return ExpertLoad(tuple(int(t) for t in per_layer.sum(dim=0).tolist()), imbalance)

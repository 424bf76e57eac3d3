"""The cost model: how long prefill, a decode step and a KV transfer take on a group of GPUs.

Everything the planner and the simulator predict comes from the functions here, so the model is
stated once:

* **Prefill is compute-bound.** A prompt of ``T`` tokens costs ``2·P·T`` FLOPs for the weights plus
  ``2·L·h·T²`` for causal attention. It runs at ``tp · TFLOP/s · eff.compute`` (the slowest GPU of a
  mixed group sets the pace), plus two ring all-reduces per layer over the slowest link inside the
  tensor-parallel group, plus one activation hop per pipeline boundary. With ``pp`` stages, requests
  overlap across stages, so throughput is ``pp / latency`` discounted by the pipeline bubble.
* **Decode is memory-bound.** One step reads the group's share of the weights and of every running
  sequence's KV at ``HBM GB/s · eff.hbm``; it is never faster than its FLOPs allow; TP adds the same
  all-reduces per layer (with the batch's activations), PP adds hops and a bubble.
* **KV transfer** moves ``kv_bytes_per_token · T`` bytes over the slowest link of the route,
  striped over as many parallel lanes as the smaller group has GPUs.
* **Capacity** of a group in a phase is the request rate it sustains *while meeting the SLOs*:
  prefill is loaded only up to the utilisation at which an M/D/1 queue (mean prompt) still meets
  TTFT for a long prompt (the workload's longest class or 90th percentile); decode
  runs the largest batch whose step time meets TPOT and whose KV fits in HBM.

Efficiency factors live in :class:`Efficiency` and are parameters; :func:`calibrate` fits
``compute`` and ``hbm`` from measured prefill and decode step times.

Two optional terms (0 by default, so GPU plans are unchanged) cover what a roofline leaves out
on a small model or a CPU, where the fixed and per-sequence costs of a step are not hidden:
``prefill_overhead_s`` is added to every prefill (framework overhead and, for short prompts,
reading the weights once), and ``decode_seq_s`` is added per running sequence to every decode
step (sampling, per-sequence attention and bookkeeping). ``calibrate(..., fit_overheads=True)``
fits them together with the efficiencies by least squares on relative error.

A third, ``step_overhead_s``, is what tensor parallelism does not divide: every rank of a group
runs every operator of a decode step (a TP=2 rank makes as many calls as one process, each on half
the data), so on a CPU, where an eager step's operator dispatch is a large share of its time, a
group's step is not half of one process's. It is measured apart (a model of the same depth and
operators with almost no arithmetic: ``loadtest.calibrate.parallel``), added to every decode step
undivided and taken out of the step times before ``calibrate`` fits the rest.

Two more describe devices that are cores of one CPU (both off by default): with
``prefill_reads_weights`` a prefill also reads its share of the weights once (a short prompt on a
CPU is bound by that read, which tensor parallelism divides, not by a fixed cost), and a group's
``node_hbm_gbps`` caps what its devices read together per second (cores share a socket's memory
channels: two of them read less than twice what one reads).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from shared.planner.config import GpuType, ModelSpec, Slo

GB = 1e9
GIB = 1024**3


@dataclass(frozen=True)
class Efficiency:
    compute: float = 0.55          # achieved fraction of dense bf16 FLOP/s in prefill
    hbm: float = 0.75              # achieved fraction of HBM bandwidth in decode
    link: float = 0.7              # achieved fraction of link bandwidth (collectives, KV transfer)
    comm_latency_s: float = 15e-6  # fixed cost of one collective or hop
    pp_bubble: float = 0.15        # throughput lost per extra pipeline stage (fraction of 1/pp)
    mem_fraction: float = 0.9      # share of HBM usable for weights + KV
    max_decode_batch: int = 512
    prefill_overhead_s: float = 0.0  # fixed seconds added to every prefill (calibrated; see above)
    decode_seq_s: float = 0.0        # seconds per running sequence added to every decode step
    step_overhead_s: float = 0.0     # seconds every decode step costs on each rank, TP or not (see above)
    # seconds per running sequence that tensor parallelism divides among the ranks (its attention over
    # its heads, on a CPU), beside decode_seq_s, which every step pays whole (sampling, bookkeeping)
    decode_seq_tp_s: float = 0.0
    prefill_reads_weights: bool = False  # a prefill also reads the weights once (see above)


@dataclass(frozen=True)
class GroupHardware:
    """What the cost model needs to know about a group: its slowest GPU and slowest links."""

    gpu: GpuType                 # per-GPU figures, the minimum over the group's GPUs
    tp_link_gbps: float          # slowest link inside a tensor-parallel subgroup
    pp_link_gbps: float          # slowest link between pipeline stages
    price_per_hour: float        # whole group
    node_hbm_gbps: float | None = None  # what the group's devices read together per second (CPU cores), if capped


@dataclass(frozen=True)
class Parallel:
    tp: int
    pp: int

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp


def _allreduce_s(num_bytes: float, tp: int, link_gbps: float, eff: Efficiency) -> float:
    if tp == 1:
        return 0.0
    return eff.comm_latency_s + 2 * (tp - 1) / tp * num_bytes / (link_gbps * GB * eff.link)


def _hops_s(num_bytes: float, pp: int, link_gbps: float, eff: Efficiency) -> float:
    return (pp - 1) * (eff.comm_latency_s + num_bytes / (link_gbps * GB * eff.link))


def _bubble(pp: int, eff: Efficiency) -> float:
    return 1.0 + eff.pp_bubble * (pp - 1) / pp


def _read_s(total_bytes: float, hw: GroupHardware, par: Parallel, eff: Efficiency) -> float:
    """Seconds to read ``total_bytes`` spread evenly over the group's tensor-parallel ranks (each
    stage's share read by its ``tp`` ranks at once)."""
    per_device = total_bytes / par.tp / (hw.gpu.hbm_gbps * GB * eff.hbm)
    if hw.node_hbm_gbps is None:
        return per_device
    return max(per_device, total_bytes / (hw.node_hbm_gbps * GB * eff.hbm))


def kv_capacity_tokens(model: ModelSpec, hw: GroupHardware, par: Parallel, eff: Efficiency) -> float:
    """Tokens of KV the group can hold after the weights; <= 0 means the weights do not fit."""
    per_gpu = hw.gpu.hbm_gib * GIB * eff.mem_fraction - model.weight_bytes / par.num_gpus
    # KV heads shard over TP only up to the number of KV heads; beyond that they are replicated.
    kv_shards = min(par.tp, model.num_kv_heads) * par.pp
    return per_gpu * kv_shards / model.kv_bytes_per_token()


def prefill_latency_s(model: ModelSpec, hw: GroupHardware, par: Parallel, eff: Efficiency,
                      num_tokens: float) -> float:
    """Time for one prompt of ``num_tokens`` uncached tokens to pass through the whole group."""
    flops = 2 * model.num_params * num_tokens + 2 * model.num_layers * model.hidden_size * num_tokens**2
    compute = flops / (par.tp * hw.gpu.tflops_bf16 * 1e12 * eff.compute)
    if eff.prefill_reads_weights:
        compute += _read_s(model.weight_bytes, hw, par, eff)
    act_bytes = num_tokens * model.hidden_size * model.act_bytes_per_elem
    comm = 2 * model.num_layers * _allreduce_s(act_bytes, par.tp, hw.tp_link_gbps, eff)
    return compute + comm + _hops_s(act_bytes, par.pp, hw.pp_link_gbps, eff) + eff.prefill_overhead_s


def prefill_service_s(model: ModelSpec, hw: GroupHardware, par: Parallel, eff: Efficiency,
                      num_tokens: float) -> float:
    """Mean time between prefill completions when busy (pipeline stages overlap requests)."""
    return prefill_latency_s(model, hw, par, eff, num_tokens) / par.pp * _bubble(par.pp, eff)


def decode_step_s(model: ModelSpec, hw: GroupHardware, par: Parallel, eff: Efficiency,
                  batch: float, context_len: float) -> float:
    """Time per decode step for ``batch`` sequences of mean ``context_len`` tokens (= TPOT)."""
    kv_shards = min(par.tp, model.num_kv_heads) * par.pp
    # Per step each stage reads its weights once per micro-batch (pp micro-batches): W/tp in all.
    read_bytes = model.weight_bytes / par.tp + batch * context_len * model.kv_bytes_per_token() / kv_shards
    memory = read_bytes / (hw.gpu.hbm_gbps * GB * eff.hbm)
    if hw.node_hbm_gbps is not None:  # every rank's reads through the memory they share
        memory = max(memory, read_bytes * par.tp / (hw.node_hbm_gbps * GB * eff.hbm))
    compute = 2 * model.num_params * batch / (par.num_gpus * hw.gpu.tflops_bf16 * 1e12 * eff.compute)
    act_bytes = batch * model.hidden_size * model.act_bytes_per_elem
    comm = 2 * model.num_layers * _allreduce_s(act_bytes / par.pp, par.tp, hw.tp_link_gbps, eff)
    return ((max(memory, compute) + comm + _hops_s(act_bytes, par.pp, hw.pp_link_gbps, eff)) * _bubble(par.pp, eff)
            + (eff.decode_seq_s + eff.decode_seq_tp_s / par.tp) * batch + eff.step_overhead_s)


def kv_transfer_s(model: ModelSpec, num_tokens: float, route_gbps: float, eff: Efficiency) -> float:
    """KV of ``num_tokens`` over a route whose total (all lanes) bandwidth is ``route_gbps``."""
    return eff.comm_latency_s + num_tokens * model.kv_bytes_per_token() / (route_gbps * GB * eff.link)


@dataclass(frozen=True)
class PhaseCapacity:
    rate: float          # requests/s the group sustains within SLO; 0 when it cannot serve the phase
    latency_s: float     # prefill latency (TTFT share) or decode step time (TPOT)
    batch: int = 1       # decode batch at that rate


NO_CAPACITY = PhaseCapacity(rate=0.0, latency_s=math.inf, batch=0)


def prefill_capacity(model: ModelSpec, hw: GroupHardware, par: Parallel, eff: Efficiency,
                     input_len: float, slo: Slo, transfer_s: float = 0.0,
                     tail_input_len: float | None = None, tail_transfer_s: float | None = None) -> PhaseCapacity:
    """Rate at which an M/D/1 prefill queue still meets TTFT for a long prompt:
    L(tail) + transfer(tail) + ρ/(2μ(1-ρ)) <= TTFT, with μ from the mean prompt."""
    tail = max(tail_input_len or input_len, input_len)
    if kv_capacity_tokens(model, hw, par, eff) < tail:
        return NO_CAPACITY
    latency = prefill_latency_s(model, hw, par, eff, input_len)
    slack = slo.ttft_s - prefill_latency_s(model, hw, par, eff, tail) - max(tail_transfer_s or 0.0, transfer_s)
    if slack <= 0:
        return NO_CAPACITY
    mu = 1.0 / prefill_service_s(model, hw, par, eff, input_len)
    rho = 2 * mu * slack / (1 + 2 * mu * slack)
    return PhaseCapacity(rate=rho * mu, latency_s=latency)


def decode_capacity(model: ModelSpec, hw: GroupHardware, par: Parallel, eff: Efficiency,
                    input_len: float, output_len: float, slo: Slo) -> PhaseCapacity:
    """Largest batch meeting TPOT whose KV (input + output per sequence) fits; rate = B / (TPOT·out)."""
    kv_tokens = kv_capacity_tokens(model, hw, par, eff)
    max_batch = min(eff.max_decode_batch, int(kv_tokens // (input_len + output_len)))
    ctx = input_len + output_len / 2
    if max_batch < 1 or decode_step_s(model, hw, par, eff, 1, ctx) > slo.tpot_s:
        return NO_CAPACITY
    lo, hi = 1, max_batch  # decode_step_s is increasing in batch: binary search the largest feasible
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if decode_step_s(model, hw, par, eff, mid, ctx) <= slo.tpot_s:
            lo = mid
        else:
            hi = mid - 1
    step = decode_step_s(model, hw, par, eff, lo, ctx)
    return PhaseCapacity(rate=lo / (step * output_len), latency_s=step, batch=lo)


def parallel_options(num_gpus: int, gpus_per_node: int, model: ModelSpec | None = None) -> list[Parallel]:
    """TP x PP factorisations of a group; TP stays within a node (power-of-two degrees). With
    ``model``, only the shapes a worker can start with (shared/model/parallel.py's rules): TP divides
    the attention heads and divides the KV heads or is a multiple of them, PP is at most the layers."""
    opts = []
    tp = 1
    while tp <= num_gpus:
        if num_gpus % tp == 0 and tp <= gpus_per_node and (model is None or _splits(model, tp, num_gpus // tp)):
            opts.append(Parallel(tp=tp, pp=num_gpus // tp))
        tp *= 2
    return opts


def _splits(model: ModelSpec, tp: int, pp: int) -> bool:
    kv = model.num_kv_heads
    return model.num_heads % tp == 0 and (kv % tp == 0 or tp % kv == 0) and pp <= model.num_layers


@dataclass(frozen=True)
class PrefillSample:
    num_tokens: int
    seconds: float


@dataclass(frozen=True)
class DecodeSample:
    batch: int
    context_len: int
    seconds: float


def _weighted_lstsq(features: list[list[float]], seconds: list[float]) -> list[float]:
    """Coefficients x minimising sum(((features_i . x) - t_i) / t_i)^2 (relative error)."""
    import numpy as np  # noqa: PLC0415 — only calibration needs it

    a = np.array(features, dtype=float) / np.array(seconds, dtype=float)[:, None]
    x, *_ = np.linalg.lstsq(a, np.ones(len(seconds)), rcond=None)
    return [float(v) for v in x]


def calibrate(model: ModelSpec, gpu: GpuType, prefill: Sequence[PrefillSample],
              decode: Sequence[DecodeSample], base: Efficiency = Efficiency(),
              fit_overheads: bool = False, seq_undivided_s: float | None = None,
              prefill_overhead_s: float | None = None) -> Efficiency:
    """Fit ``compute`` and ``hbm`` so single-GPU predictions match measured step times (median ratio).

    The measurements come from running the real engine on one device (e.g. SmolLM2 on this
    machine); communication factors are left as given since one device cannot measure them.

    With ``fit_overheads`` (and at least two distinct prompt lengths / batch sizes), fit instead
    ``prefill = prefill_overhead_s + ideal_prefill / compute`` and
    ``decode = ideal_weights_and_kv_read / hbm + decode_seq_s * batch`` by least squares on
    relative error (the decode intercept is the weight read, so it sets ``hbm``). Efficiencies
    are capped at 1 and the added terms at >= 0, refitting the rest when a cap binds.

    ``base.step_overhead_s`` (measured apart) is taken out of every decode time before the fit, and
    kept in the result, so that the fitted model adds it back. With ``base.prefill_reads_weights``
    the decode steps are fitted first, and the weights' read at the bandwidth they give is taken out
    of every prefill time before its fit. ``seq_undivided_s`` (measured apart): of the fitted cost per
    sequence, at most this much is ``decode_seq_s``, paid whole on a group; the rest is
    ``decode_seq_tp_s``, which tensor parallelism divides. ``prefill_overhead_s`` (measured apart) is
    kept as given, and the prefill fit finds the compute efficiency alone.
    """
    hw = GroupHardware(gpu=gpu, tp_link_gbps=1.0, pp_link_gbps=1.0, price_per_hour=gpu.price_per_hour)
    ideal = replace(base, compute=1.0, hbm=1.0, prefill_overhead_s=0.0, decode_seq_s=0.0, decode_seq_tp_s=0.0,
                    step_overhead_s=0.0,
                    prefill_reads_weights=False)
    eff = base
    if decode:
        eff = _fit_decode(model, hw, ideal, eff, decode, fit_overheads, seq_undivided_s)
    if prefill:
        eff = _fit_prefill(model, hw, ideal, eff, prefill, fit_overheads, prefill_overhead_s)
    return eff


def _fit_decode(model: ModelSpec, hw: GroupHardware, ideal: Efficiency, eff: Efficiency,
                decode: Sequence[DecodeSample], fit_overheads: bool, seq_undivided_s: float | None) -> Efficiency:
    """``eff`` with ``hbm`` (and, fitting overheads, the per-sequence cost) fitted to the decode steps."""
    one = Parallel(1, 1)
    mem_s = [decode_step_s(model, hw, one, replace(ideal, compute=math.inf), s.batch, s.context_len)
             for s in decode]
    secs = [max(s.seconds - eff.step_overhead_s, 1e-9) for s in decode]
    if not (fit_overheads and len({s.batch for s in decode}) >= 2):
        ratios = sorted(decode_step_s(model, hw, one, ideal, s.batch, s.context_len) / t
                        for s, t in zip(decode, secs))
        return replace(eff, hbm=min(1.0, ratios[len(ratios) // 2]))
    inv_hbm, per_seq = _weighted_lstsq([[m, s.batch] for m, s in zip(mem_s, decode)], secs)
    if per_seq < 0:
        per_seq, inv_hbm = 0.0, _weighted_lstsq([[m] for m in mem_s], secs)[0]
    if inv_hbm < 1.0:
        inv_hbm = 1.0
        per_seq = max(0.0, _weighted_lstsq([[s.batch] for s in decode],
                                           [t - m for t, m in zip(secs, mem_s)])[0])
    eff = replace(eff, hbm=1.0 / inv_hbm, decode_seq_s=per_seq, decode_seq_tp_s=0.0)
    if seq_undivided_s is not None:
        whole = min(per_seq, seq_undivided_s)
        eff = replace(eff, decode_seq_s=whole, decode_seq_tp_s=per_seq - whole)
    return eff


def _fit_prefill(model: ModelSpec, hw: GroupHardware, ideal: Efficiency, eff: Efficiency,
                 prefill: Sequence[PrefillSample], fit_overheads: bool,
                 prefill_overhead_s: float | None) -> Efficiency:
    """``eff`` with ``compute`` (and, fitting overheads, the fixed prefill cost) fitted to the prefills."""
    one = Parallel(1, 1)
    flops_s = [prefill_latency_s(model, hw, one, ideal, s.num_tokens) for s in prefill]
    # a prefill's read of the weights (prefill_reads_weights) at the bandwidth the decode fit found
    read_s = _read_s(model.weight_bytes, hw, one, eff) if eff.prefill_reads_weights else 0.0
    secs = [max(s.seconds - read_s, 1e-9) for s in prefill]
    if prefill_overhead_s is not None:
        slope = _weighted_lstsq([[f] for f in flops_s], [max(t - prefill_overhead_s, 1e-9) for t in secs])[0]
        return replace(eff, compute=1.0 / max(1.0, slope), prefill_overhead_s=prefill_overhead_s)
    if fit_overheads and len({s.num_tokens for s in prefill}) >= 2:
        overhead, slope = _weighted_lstsq([[1.0, f] for f in flops_s], secs)
        if slope < 1.0:      # faster than the nominal peak: cap the efficiency, refit the overhead
            slope = 1.0
            overhead = _weighted_lstsq([[1.0] for _ in secs], [t - f for t, f in zip(secs, flops_s)])[0]
        if overhead < 0:     # no fixed cost: the plain ratio fit through the origin
            overhead, slope = 0.0, max(1.0, _weighted_lstsq([[f] for f in flops_s], secs)[0])
        return replace(eff, compute=1.0 / slope, prefill_overhead_s=overhead)
    ratios = sorted(f / t for f, t in zip(flops_s, secs))
    return replace(eff, compute=min(1.0, ratios[len(ratios) // 2]))

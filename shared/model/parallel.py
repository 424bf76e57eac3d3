"""Tensor parallelism: how a Llama-family model's weights split over the ranks of a group, and the
collectives a rank's forward calls.

The split (Megatron's, as vLLM and SGLang make it):

* q/k/v and gate/up are column-parallel: rank r holds the output rows of its attention heads (its
  KV heads' rows of k and v) and its slice of the MLP's intermediate channels, so attention and the
  gated activation run on local data with no communication;
* o_proj and down are row-parallel: rank r holds the input columns that its heads and channels
  produce, each rank's product is a partial sum of the full output, and one all-reduce per layer
  (two per decoder layer) adds them up;
* what acts per head goes with its head (q/k/v biases as their rows, gpt-oss's sinks by query head);
  a bias after a row-parallel product is added once: o_proj's after the all-reduce on every rank,
  the experts' down biases (inside the MoE block's partial sum) by rank 0 alone;
* where there are fewer KV heads than ranks (``tp`` a multiple of ``num_kv_heads``), each KV head is
  replicated on the ``tp / num_kv_heads`` ranks whose query heads read it;
* latent attention (DeepSeek-V3, shared/model/mla.py) splits its query heads as above (q_proj or q_b_proj
  and kv_b_proj's per-head W_UK / W_UV rows column-parallel, o_proj row-parallel); the latent is its one
  KV head, so its projection and norm (and q's low-rank q_a_proj and norm) are whole on every rank, each
  of which computes and caches the same latent;
* the embedding and the LM head are split by vocabulary rows (vocab-parallel), not replicated: on a
  small model they are a large share of the weights (SmolLM2-135M's tied embedding is 21% of its
  parameters), and a replicated copy on every rank would keep a rank's weights far above 1/tp of
  the whole. A token's embedding row lives on one rank; the others contribute zeros and an
  all-reduce gives every rank the row, bit for bit (one addend is non-zero). The LM head's logits
  are gathered in vocabulary order. A vocabulary that ``tp`` does not divide is padded with zero
  rows on the last rank; the padded logits are cut off after the gather.

Every rank holds its shard of the KV pool (its KV heads, every layer), so a group's pool holds
``tp`` times the tokens of one process's pool of the same per-rank bytes, less where heads are
replicated. A split is refused before any weight is loaded when the shape does not allow it
(``check_tensor_parallel``).

Collectives go through ``Collectives`` (gloo on a CPU, NCCL on CUDA, the same code; on a CPU with
every rank on one host, a shared-memory segment instead of gloo: ``shm_collectives``); a model made
without one is a group of one, whose collectives do nothing.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from typing import Protocol

import torch
import torch.distributed as dist

from shared.model.config import ModelConfig
from shared.model.shm_collectives import join_shared_memory

log = logging.getLogger(__name__)

GGUF_BLOCK = 32  # input values per block of a gguf weight (kernels/blocks_cpu.py's BLOCK)


class Collectives(Protocol):
    """The collectives of one rank of a tensor-parallel group. Every rank calls each one in the
    same order with tensors of the same shape and dtype; a call returns once the group has done it,
    or raises (``RuntimeError``) when a rank is gone."""

    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` [..., N] side by side in rank order: [..., size * N]."""

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``tensor`` into every rank's ``tensor`` (same shape and dtype), in place."""


class SingleRank:
    """A group of one: every collective is the identity."""

    rank, size = 0, 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor


@dataclasses.dataclass(frozen=True)
class DetachedGroup:
    """A group's place without its connections: what a serialized compiled step holds of it."""
    rank: int
    size: int


class ProcessGroupCollectives:
    """The collectives over a torch.distributed process group of its own (not the process's default
    group, so one process can hold several, as a test does): gloo for CPU tensors, NCCL for CUDA.
    CPU ranks that are all on one host meet in shared memory instead (~100x faster than gloo over
    loopback for a decode step's all-reduce); the gloo group is made all the same."""

    def __init__(self, rank: int, size: int, host: str, port: int, device: torch.device,
                 timeout_s: float = 120.0, shared_memory: bool = True, idle_timeout_s: float = 7 * 86400.0,
                 *, store: dist.Store | None = None, prefix: str = "tp", bind_host: str | None = None) -> None:
        """Join the group whose rank 0 listens on ``host:port`` (rank 0 opens that TCP store), every
        rank within ``timeout_s``. ``shared_memory=False`` keeps gloo even on one host (to compare
        them). Gloo's collectives wait up to ``idle_timeout_s``: a follower waits in a broadcast for
        rank 0's next step for as long as the worker has no request (a dead rank breaks the wait
        at once, its connections closed). ``store`` and ``prefix``: a subgroup's (``subgroup``), or rank
        0's own store. ``bind_host``: this rank's address for gloo's connections where it is not on
        rank 0's host (default ``host``)."""
        self.rank, self.size, self.device = rank, size, device
        self.host, self.timeout_s, self.shared_memory, self.idle_timeout_s = host, timeout_s, shared_memory, idle_timeout_s
        self.bind_host = bind_host or host
        self.num_calls, self.seconds = 0, 0.0  # collectives made on this rank, and the time they took
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = store if store is not None else dist.TCPStore(host, port, size, is_master=rank == 0,
                                                                   timeout=timeout, wait_for_workers=True)
        timeout = datetime.timedelta(seconds=idle_timeout_s)
        if device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(dist.PrefixStore(prefix, self.store), rank, size)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.bind_host)]
            self.group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, self.store), rank, size, options)
        self.shm = None
        if shared_memory and device.type == "cpu":
            self.shm = join_shared_memory(dist.PrefixStore(f"shm-{prefix}", self.store), rank, size, timeout_s)
        if rank == 0 and store is None:
            log.info("parallel group of %d: collectives over %s", size,
                     "shared memory" if self.shm else "nccl" if device.type == "cuda" else "gloo")

    def __reduce__(self):
        """The compiled decode step (shared/engine/compiled/step.py) serializes what it traced through,
        the model and its layers with their group among them; a group's connections cannot travel,
        and the step reaches its group at run time, not through what it serialized."""
        return (DetachedGroup, (self.rank, self.size))

    def subgroup(self, ranks: list[int]) -> "Collectives":
        """The group of ``ranks`` (this rank among them; every one of them asks for it, and no
        other rank needs to): a pipeline stage's tensor-parallel ranks."""
        if len(ranks) == self.size:
            return self
        if len(ranks) == 1:
            return SingleRank()
        return ProcessGroupCollectives(ranks.index(self.rank), len(ranks), self.host, 0, self.device, self.timeout_s,
                                       self.shared_memory, self.idle_timeout_s, store=self.store,
                                       prefix="g" + "-".join(map(str, ranks)), bind_host=self.bind_host)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        if self.shm is not None:
            self.shm.all_reduce(tensor)
        else:
            self.group.allreduce([tensor]).wait()
        self._count(started)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        if self.shm is not None:
            out = self.shm.all_gather(tensor)
        else:
            tensor = tensor.contiguous()
            parts = [torch.empty_like(tensor) for _ in range(self.size)]
            self.group.allgather([parts], [tensor]).wait()
            out = torch.cat(parts, dim=-1)
        self._count(started)
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """(A follower's wait for rank 0's next step is counted in ``seconds`` too.)"""
        started = time.perf_counter()
        if self.shm is not None:
            self.shm.broadcast(tensor, src)
        else:
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = src, 0
            self.group.broadcast([tensor], opts).wait()
        self._count(started)
        return tensor

    def _count(self, started: float) -> None:
        self.num_calls += 1
        self.seconds += time.perf_counter() - started


@dataclasses.dataclass(frozen=True)
class PipelineStage:
    """Where a process sits in a pipeline of ``num_stages`` stages, each of ``tp`` ranks: the
    stage's layers, and the whole worker's ranks (``world``) over which stages hand their hidden
    states on. World rank ``stage * tp + r`` is rank r of stage ``stage``.

    Stage 0 holds the embedding, the final norm and the LM head (tied in SmolLM2 and Llama-3.2-1B:
    one tensor), so the last stage hands its hidden states back to stage 0, where rank 0 samples."""

    world: Collectives
    stage: int
    num_stages: int
    tp: int
    layers: range  # the model's layers this stage runs

    def hand_over(self, src_stage: int, hidden: torch.Tensor | None, residual: torch.Tensor | None,
                  shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage ``src_stage``'s (hidden, residual) [T, H] each, to every rank of the worker (every
        rank calls it, in the same order): a broadcast from that stage's first rank."""
        buf = torch.stack([hidden, residual]) if self.stage == src_stage else torch.empty(2, *shape, dtype=dtype,
                                                                                           device=device)
        self.world.broadcast(buf, src=src_stage * self.tp)
        return buf[0], buf[1]


# A prefill step of one prompt on a pipeline runs in chunks of its tokens, stage s + 1 running chunk
# m while stage s runs chunk m + 1: with P stages and M chunks the step takes M + P - 1 chunk-times
# of one stage instead of P whole-prompt stage-times. Chunks of at least PIPELINE_MIN_CHUNK tokens
# (a matmul of fewer rows wastes more than the overlap wins on a CPU), at most
# PIPELINE_CHUNKS_PER_STAGE per stage.
PIPELINE_MIN_CHUNK = 64
PIPELINE_CHUNKS_PER_STAGE = 2


def pipeline_chunks(num_tokens: int, num_decodes: int, num_seqs: int, num_stages: int) -> list[tuple[int, int]]:
    """The token ranges a step runs in, one after another through the stages: several for a
    prefill of one sequence long enough to split, else the whole step. The same on every rank
    (it depends on the step alone)."""
    if num_stages == 1 or num_decodes or num_seqs != 1 or num_tokens < 2 * PIPELINE_MIN_CHUNK:
        return [(0, num_tokens)]
    count = min(PIPELINE_CHUNKS_PER_STAGE * num_stages, num_tokens // PIPELINE_MIN_CHUNK)
    bounds = [num_tokens * i // count for i in range(count + 1)]
    return list(zip(bounds, bounds[1:]))


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    """Stage ``stage``'s share of ``num_layers`` layers: contiguous, the first stages one longer
    where they do not divide."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def check_pipeline_parallel(cfg: ModelConfig, pp: int) -> None:
    if pp < 1:
        raise ValueError(f"pipeline parallel size must be at least 1, got {pp}")
    if pp > cfg.num_layers:
        raise ValueError(f"pipeline parallel size {pp} is larger than the model's {cfg.num_layers} layers: "
                         f"every stage needs one")


def kv_heads_of(rank: int, tp: int, num_kv_heads: int) -> range:
    """The KV heads tensor rank ``rank`` of ``tp`` holds: a share of them, or, where tp exceeds
    them, the one replicated head its query heads read."""
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank // (tp // num_kv_heads)
    return range(head, head + 1)


@dataclasses.dataclass(frozen=True)
class TensorSplit:
    """What one rank of ``tp`` holds of a model of config ``cfg``."""

    cfg: ModelConfig
    rank: int
    tp: int

    @property
    def num_heads(self) -> int:
        return self.cfg.num_heads // self.tp

    @property
    def num_kv_heads(self) -> int:
        """KV heads on this rank: a share of them, or one replicated head where tp exceeds them."""
        return len(kv_heads_of(self.rank, self.tp, self.cfg.num_kv_heads))

    @property
    def kv_head_start(self) -> int:
        return kv_heads_of(self.rank, self.tp, self.cfg.num_kv_heads).start

    @property
    def intermediate_size(self) -> int:
        return self.cfg.intermediate_size // self.tp

    @property
    def vocab_shard(self) -> int:
        """Vocabulary rows per rank (the last rank's padded with zero rows)."""
        return -(-self.cfg.vocab_size // self.tp)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard


def check_tensor_parallel(cfg: ModelConfig, tp: int, quantization: str = "none") -> None:
    """Refuse, naming the numbers, a degree ``tp`` that the model's shape does not split into."""
    if tp < 1:
        raise ValueError(f"tensor parallel size must be at least 1, got {tp}")
    if tp == 1:
        return
    if cfg.num_heads % tp:
        latent = " (latent attention splits its query heads over the ranks)" if cfg.mla is not None else ""
        raise ValueError(f"tensor parallel size {tp} does not divide the model's {cfg.num_heads} attention "
                         f"heads{latent}")
    kv = cfg.num_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(f"tensor parallel size {tp} must divide the model's {kv} KV heads or be a multiple "
                         f"of them (to replicate each KV head)")
    if cfg.intermediate_size % tp:
        raise ValueError(f"tensor parallel size {tp} does not divide the model's MLP width "
                         f"{cfg.intermediate_size}")
    if cfg.moe is not None and cfg.moe.intermediate_size % tp:
        raise ValueError(f"tensor parallel size {tp} does not divide the model's expert width "
                         f"{cfg.moe.intermediate_size}")
    if quantization == "gguf":
        # the row-parallel layers' input axis is cut between ranks: on block boundaries only
        value_dim = cfg.mla.v_head_dim if cfg.mla is not None else cfg.head_dim
        for name, k in (("o_proj", cfg.num_heads * value_dim), ("down", cfg.intermediate_size)):
            if k % GGUF_BLOCK == 0 and (k // tp) % GGUF_BLOCK:
                raise ValueError(f"tensor parallel size {tp} would cut the gguf blocks of {name}: its {k} inputs "
                                 f"make {k // GGUF_BLOCK} blocks of {GGUF_BLOCK}, which {tp} ranks cannot share")


def shard_top(cfg: ModelConfig, top: dict[str, torch.Tensor], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s part of the model's embedding, final norm and LM head (``build_model``'s names):
    copies, so the full tensors can be freed."""
    if tp == 1:
        return top
    split = TensorSplit(cfg, rank, tp)
    out = {"norm": top["norm"], "embed": _vocab_rows(top["embed"], split)}
    if "lm_head" in top:
        out["lm_head"] = _vocab_rows(top["lm_head"], split)
    return out


def shard_layer(cfg: ModelConfig, w: dict[str, torch.Tensor], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s part of one decoder layer's float weights (fused qkv and gate_up): copies."""
    return w if tp == 1 else _shard_layer(w, TensorSplit(cfg, rank, tp))


# a layer's tensors that act on a sublayer's input or on its all-reduced output, [hidden] or [E]: whole
# on every rank (the norms; gpt-oss's o_proj bias, added after the all-reduce; its router's bias and
# DeepSeek-V3's correction bias, so every rank routes alike)
_WHOLE = ("attn_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm", "o_bias", "router", "router_bias",
          "router_correction")
# the bias of a row-parallel product inside a partial sum (gpt-oss's experts' down [E, hidden]): on rank 0
# alone, so the all-reduce adds it once
_ONCE = ("experts_down_bias",)


def _shard_layer(w: dict[str, torch.Tensor], split: TensorSplit) -> dict[str, torch.Tensor]:
    out = _shard_attention(w, split) | _shard_mlp(w, split)
    out.update({name: w[name] for name in _WHOLE if name in w})
    if split.rank == 0:
        out.update({name: w[name] for name in _ONCE if name in w})
    unsplit = set(w) - set(out) - set(_ONCE)
    if unsplit:  # a tensor a family adds that no rule here cuts would be dropped, and the split model wrong
        raise RuntimeError(f"no tensor-parallel split for the layer tensors {sorted(unsplit)}")
    return out


def _shard_attention(w: dict[str, torch.Tensor], split: TensorSplit) -> dict[str, torch.Tensor]:
    """This rank's attention heads: the rows of q/k/v (and their biases) and of gpt-oss's sinks,
    o_proj's input columns, the q/k norms."""
    if split.cfg.mla is not None:
        return _shard_latent_attention(w, split)
    cfg, d = split.cfg, split.cfg.head_dim
    heads = _rows(split.rank * split.num_heads, split.num_heads)
    q_rows = _rows(heads.start * d, split.num_heads * d)
    kv_rows = _rows(split.kv_head_start * d, split.num_kv_heads * d)
    q_size, kv_size = cfg.num_heads * d, cfg.num_kv_heads * d

    def qkv(t: torch.Tensor) -> torch.Tensor:  # [(Hq + 2 Hkv) D, ...] -> this rank's heads' rows
        q, k, v = t.split([q_size, kv_size, kv_size])
        return torch.cat([q[q_rows], k[kv_rows], v[kv_rows]]).clone()

    out = {"qkv": qkv(w["qkv"]), "o_proj": w["o_proj"][:, q_rows].contiguous()}
    if "qkv_bias" in w:
        out["qkv_bias"] = qkv(w["qkv_bias"])
    if "sinks" in w:  # [Hq]: one logit per query head, in the softmax of that head alone
        out["sinks"] = w["sinks"][heads].clone()
    if cfg.qk_norm == "head":  # [D]: the same for every head, so whole on every rank
        out["q_norm"], out["k_norm"] = w["q_norm"], w["k_norm"]
    elif cfg.qk_norm == "whole":  # [H * D]: this rank's heads' part, as the rows of q and k
        out["q_norm"], out["k_norm"] = w["q_norm"][q_rows].clone(), w["k_norm"][kv_rows].clone()
    return out


# latent attention's tensors ahead of the heads (shared/model/mla.py): whole on every rank, which computes
# and caches the same latent (the one "KV head", replicated as KV heads are where fewer than the ranks)
_LATENT_WHOLE = ("q_a", "q_a_norm", "kv_a", "kv_a_norm")


def _shard_latent_attention(w: dict[str, torch.Tensor], split: TensorSplit) -> dict[str, torch.Tensor]:
    """Latent attention's query heads on this rank: the rows of q_proj or q_b_proj [H * qk, in] and of
    kv_b_proj [H * (nope + v), kv_lora_rank] (each head's W_UK and W_UV), o_proj's input columns [hidden,
    H * v]; the latent's projection and norm, and q's low-rank projection and norm, whole."""
    mla, start, count = split.cfg.mla, split.rank * split.num_heads, split.num_heads

    def heads(t: torch.Tensor, per_head: int, dim: int = 0) -> torch.Tensor:
        return t.narrow(dim, start * per_head, count * per_head).clone(memory_format=torch.contiguous_format)

    out = {name: w[name] for name in _LATENT_WHOLE if name in w}
    out.update({name: heads(w[name], mla.qk_head_dim) for name in ("q", "q_b") if name in w})
    out["kv_b"] = heads(w["kv_b"], mla.qk_nope_head_dim + mla.v_head_dim)
    out["o_proj"] = heads(w["o_proj"], mla.v_head_dim, dim=1)
    return out


def _shard_mlp(w: dict[str, torch.Tensor], split: TensorSplit) -> dict[str, torch.Tensor]:
    """This rank's intermediate channels of the dense MLP, or of every expert (gate_up's bias cut as
    its rows; the router and the down bias are ``_WHOLE`` and ``_ONCE``'s) and of DeepSeek-V3's shared
    experts."""
    if "router" not in w:
        gate_up, down = _mlp_columns(w["gate_up"], w["down"], split.cfg.intermediate_size, split)
        return {"gate_up": gate_up, "down": down}
    width = split.cfg.moe.intermediate_size
    gate_up, down = _mlp_columns(w["experts_gate_up"], w["experts_down"], width, split)
    out = {"experts_gate_up": gate_up, "experts_down": down}
    if "experts_gate_up_bias" in w:  # [E, 2 * width]
        out["experts_gate_up_bias"] = _gate_up_channels(w["experts_gate_up_bias"], width, split, dim=-1)
    if "shared_gate_up" in w:  # DeepSeek-V3's shared experts: one dense SwiGLU [2 * width, hidden], cut as the MLP
        out["shared_gate_up"], out["shared_down"] = _mlp_columns(w["shared_gate_up"], w["shared_down"],
                                                                 w["shared_gate_up"].shape[0] // 2, split)
    return out


def _mlp_columns(gate_up: torch.Tensor, down: torch.Tensor, width: int,
                 split: TensorSplit) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's intermediate channels of a gated MLP of ``width`` channels: gate_up [..., 2 * width,
    hidden] (gate rows, then up rows) column-parallel, down [..., hidden, width] row-parallel; with a
    leading expert axis, every expert's."""
    per = width // split.tp
    return _gate_up_channels(gate_up, width, split, dim=-2), down[..., _rows(split.rank * per, per)].contiguous()


def _gate_up_channels(t: torch.Tensor, width: int, split: TensorSplit, dim: int) -> torch.Tensor:
    """This rank's gate channels, then its up channels, of ``t``, whose axis ``dim`` holds a gated MLP's
    2 * ``width`` channels (gate's, then up's)."""
    per = width // split.tp
    start = split.rank * per
    return torch.cat([t.narrow(dim, start, per), t.narrow(dim, width + start, per)], dim=dim)


def _rows(start: int, count: int) -> slice:
    return slice(start, start + count)


def _vocab_rows(weight: torch.Tensor, split: TensorSplit) -> torch.Tensor:
    """This rank's vocabulary rows of an embedding or LM head [V, hidden], zero-padded to the shard."""
    rows = weight[split.vocab_start:split.vocab_start + split.vocab_shard]
    if rows.shape[0] < split.vocab_shard:
        rows = torch.cat([rows, rows.new_zeros(split.vocab_shard - rows.shape[0], weight.shape[1])])
    return rows.clone()

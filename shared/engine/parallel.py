"""A tensor-parallel engine: rank 0 runs the whole engine (scheduler, KV block manager, sampler,
grammars, speculation) on its shard of the model, and tells the other ranks what to run each step,
as vLLM's executor broadcasts its scheduler output. The other ranks (followers) hold their shards of
the weights and of the KV pool and run nothing but forwards and LM-head products, in the order rank
0 sends them.

What rank 0 sends is small: a header of eight integers, then one int64 tensor with the step's token
ids, positions, KV slots and attention metadata (or, for logits, the hidden rows to score). Every
rank then runs the same forward, meeting the others in the two all-reduces of each layer.

A step's forward is not interrupted between two layers on a group (``prefill_yield``: every rank
would have to stop at the same layer): a group's step runs whole. A rank that dies breaks the
group's next collective on every other rank, which raises: rank 0's engine fails its step and its
worker exits (its requests migrate as for any worker that dies), followers exit.
"""

from __future__ import annotations

import dataclasses
import logging
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable

import torch

from shared.model.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from shared.model.llama import LayerState, LlamaModel
from shared.model.parallel import Collectives, PipelineStage, stage_layers

log = logging.getLogger(__name__)

HEADER = 8
ALLOCATE, FORWARD, LOGITS, STOP = 1, 2, 3, 4
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass
class _WholeStep(LayerState):
    """``start_layers`` on a group: the step's inputs, kept until ``run_layers`` has its metadata."""

    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None


class ParallelModel:
    """Rank 0's model in a tensor-parallel group: the engine calls it as it calls ``LlamaModel``,
    and each call that computes is first sent to the followers (``follow``), which make the same
    call on their shards. Every other attribute is the shard's."""

    def __init__(self, model: LlamaModel, world: Collectives, followers: list | None = None) -> None:
        """``world``: every rank of the worker (its stages' too); ``model.group``: rank 0's stage."""
        self.model, self.world, self.followers = model, world, followers or []
        self.closed = False

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    @property
    def parallel_shape(self) -> dict[str, int]:
        return {"tp": self.model.group.size, "pp": self.model.pipeline.num_stages}

    def attach_kv(self, kv_cache: torch.Tensor, block_size: int) -> None:
        """The followers make their shards of the pool: as many blocks as rank 0's, same dtype."""
        self._send(ALLOCATE, kv_cache.shape[0], DTYPES.index(kv_cache.dtype), block_size)

    def forward(self, input_ids, positions, kv_cache, meta: AttentionMetadata, backend: AttentionBackend):
        self._send_forward(input_ids, positions, meta)
        return self.model.forward(input_ids, positions, kv_cache, meta, backend)

    def start_layers(self, input_ids: torch.Tensor, positions: torch.Tensor) -> LayerState:
        return _WholeStep(None, None, None, None, 0, input_ids, positions)

    def run_layers(self, state: LayerState, kv_cache, meta, backend, stop: Callable[[], bool] | None = None) -> bool:
        """The whole forward at once (a group's step is not stopped between layers); always True."""
        if state.hidden is None:
            state.hidden = self.forward(state.input_ids, state.positions, kv_cache, meta, backend)
            state.next_layer = len(self.model.layers)
        return True

    def finish_layers(self, state: LayerState, backend) -> torch.Tensor:
        return state.hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.contiguous()
        self._send(LOGITS, hidden.shape[0], hidden.shape[1], DTYPES.index(hidden.dtype))
        self.world.broadcast(hidden)
        return self.model.compute_logits(hidden)

    def close(self, timeout_s: float = 30.0) -> None:
        """Tell the followers to exit and wait for them (killed past ``timeout_s``)."""
        if self.closed:
            return
        self.closed = True
        try:
            self._send(STOP)
        except RuntimeError as exc:  # a follower is gone already: the others exit on their own
            log.warning("tensor-parallel group: could not tell every rank to stop (%s)", exc)
        for proc in self.followers:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _send(self, op: int, *args: int) -> None:
        header = torch.zeros(HEADER, dtype=torch.long, device=self.model.device)
        header[:1 + len(args)] = torch.tensor((op, *args))
        self.world.broadcast(header)

    def _send_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        tables = meta.block_tables
        starts = meta.step_starts
        self._send(FORWARD, input_ids.shape[0], tables.shape[0], tables.shape[1], meta.num_decodes,
                   meta.max_seq_len, meta.max_query_len, 0 if starts is None else 1)
        parts = [input_ids, positions, meta.slot_mapping, tables.reshape(-1), meta.seq_lens, meta.query_start_loc]
        if starts is not None:
            parts.append(starts)
        self.world.broadcast(torch.cat([p.to(torch.long) for p in parts]))


def follow(model: LlamaModel, world: Collectives, backend: AttentionBackend | None = None) -> None:
    """A follower's loop: run what rank 0 sends over ``world`` (``ParallelModel``) until it says stop."""
    dev = model.device
    backend = backend or get_attention_backend("auto", dev)
    kv_cache = None
    while True:
        header = world.broadcast(torch.zeros(HEADER, dtype=torch.long, device=dev)).tolist()
        op, args = header[0], header[1:]
        if op == STOP:
            return
        if op == ALLOCATE:
            num_blocks, dtype, block_size = args[:3]
            from shared.kvcache.layout import KvCacheSpec

            spec = KvCacheSpec(len(model.layers), model.num_kv_heads, model.cfg.head_dim, block_size, DTYPES[dtype])
            kv_cache = spec.allocate(num_blocks, dev)
            log.info("rank %d: KV shard of %d blocks (%.0f MiB)", world.rank, num_blocks,
                     kv_cache.nbytes / 2**20)
        elif op == FORWARD:
            ids, pos, meta = _receive_forward(world, args, dev)
            model.forward(ids, pos, kv_cache, meta, backend)
        elif op == LOGITS:
            rows, width, dtype = args[:3]
            hidden = world.broadcast(torch.empty(rows, width, dtype=DTYPES[dtype], device=dev))
            model.compute_logits(hidden)  # on stage 0's ranks; past it, nothing
        else:
            raise RuntimeError(f"rank {world.rank}: unknown operation {op} from rank 0")


def _receive_forward(group: Collectives, args: list[int], dev: torch.device):
    num_tokens, num_seqs, width, num_decodes, max_seq_len, max_query_len, has_starts = args
    sizes = [num_tokens, num_tokens, num_tokens, num_seqs * width, num_seqs, num_seqs + 1]
    if has_starts:
        sizes.append(num_decodes)
    flat = group.broadcast(torch.empty(sum(sizes), dtype=torch.long, device=dev))
    ids, pos, slots, tables, seq_lens, qsl, *rest = flat.split(sizes)
    meta = AttentionMetadata(num_decodes, slots, tables.view(num_seqs, width).to(torch.int32),
                             seq_lens.to(torch.int32), qsl.to(torch.int32), max_seq_len, max_query_len,
                             step_starts=rest[0] if rest else None)
    return ids, pos, meta


def join_stage(world: Collectives, tp: int, pp: int, num_layers: int) -> tuple[Collectives, PipelineStage]:
    """This rank's stage of a worker of ``pp`` stages of ``tp`` ranks: its tensor-parallel group (every
    rank of the stage makes it together) and its place in the pipeline."""
    stage = world.rank // tp
    group = world.subgroup(list(range(stage * tp, stage * tp + tp)))
    return group, PipelineStage(world, stage, pp, tp, stage_layers(num_layers, pp, stage))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_followers(config, size: int, host: str, port: int) -> list[subprocess.Popen]:
    """Ranks 1 .. size-1 of a group, each a process of its own (``python -m shared.engine.tp_rank``)
    that loads its shard of ``config``'s model and follows rank 0 (which the caller is, joining at
    ``host:port``). On Linux a follower is killed when the process that started it dies."""
    blob = json.dumps(dataclasses.asdict(config))
    procs = []
    for rank in range(1, size):
        cmd = [sys.executable, "-m", "shared.engine.tp_rank", "--rank", str(rank), "--size", str(size),
               "--host", host, "--port", str(port), "--config", blob]
        procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent))
    return procs


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

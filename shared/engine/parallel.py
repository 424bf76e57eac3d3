"""A tensor-parallel engine: rank 0 runs the whole engine (scheduler, KV block manager, sampler,
grammars, speculation) on its shard of the model, and tells the other ranks what to run each step,
as vLLM's executor broadcasts its scheduler output. The other ranks (followers) hold their shards of
the weights and of the KV pool and run nothing but forwards and LM-head products, in the order rank
0 sends them.

What rank 0 sends is small: a header of eight integers, then one int64 tensor with the step's token
ids, positions, KV slots and attention metadata (or, for logits, the hidden rows to score). Every
rank then runs the same forward, meeting the others in the two all-reduces of each layer.

KV moves between workers as each rank's part (``shared.transfer.relayout``): at ``open_transfer``
every rank makes a NIXL agent over its shard of the pool (followers keep theirs polled by a
thread, since a one-sided write into a rank needs that rank's agent to make progress) and rank 0
publishes the group's metadata; ``send_kv`` has every rank write its pieces of a transfer into
the target's ranks, then rank 0 notifies the target once every rank says its writes landed.

A step's forward may stop between two layers (``prefill_yield``) on a group of one stage: rank 0
sends the step as ``LAYERS`` instead of ``FORWARD``, and after each layer but the last it asks its
engine whether to stop and broadcasts the answer, which every follower waits for before its next
layer, so all ranks stop after the same layer. Followers keep the stopped forward's state (one at a
time, as rank 0's runner keeps one suspended part) through the steps that run meanwhile, and go on
with it at ``RESUME``. A broadcast of one integer per layer costs a few microseconds in shared
memory against the milliseconds of a prompt's layer. A group of several stages runs each step
whole: its layers are on different ranks, and a stage past the first cannot stop on its own.

A rank that dies breaks the group's next collective on every other rank, which raises: rank 0's
engine fails its step and its worker exits (its requests migrate as for any worker that dies),
followers exit.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import json
import math
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from shared.model.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from shared.model.llama import LayerState, LlamaModel
from shared.model.parallel import Collectives, PipelineStage, stage_layers

log = logging.getLogger(__name__)

HEADER = 8
ALLOCATE, FORWARD, LOGITS, STOP, READ_BLOCKS, WRITE_BLOCKS, OPEN_TRANSFER, SEND_KV = 1, 2, 3, 4, 5, 6, 7, 8
LAYERS, RESUME = 9, 10  # a forward a layer at a time, and going on with a stopped one (prefill_yield)
COMPILED_LOAD, COMPILED = 11, 12  # load rank 0's compiled decode step, and run a decode-only forward through it
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CompiledStepUnavailable(RuntimeError):
    """A follower could not load rank 0's compiled decode step (``ParallelModel.share_compiled``)."""


@dataclasses.dataclass
class _GroupStep(LayerState):
    """``start_layers`` on a group: the step's inputs, kept until ``run_layers`` has its metadata;
    then rank 0's own forward between two layers (``inner``), when the group may stop one."""

    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    inner: LayerState | None = None


class ParallelModel:
    """Rank 0's model in a tensor-parallel group: the engine calls it as it calls ``LlamaModel``,
    and each call that computes is first sent to the followers (``follow``), which make the same
    call on their shards. Every other attribute is the shard's."""

    def __init__(self, model: LlamaModel, world: Collectives, followers: list | None = None) -> None:
        """``world``: every rank of the worker (its stages' too); ``model.group``: rank 0's stage."""
        self.model, self.world, self.followers = model, world, followers or []
        self.closed = False
        self.transfer = None  # rank 0's NIXL agent, once ``open_transfer`` made the group's

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    @property
    def parallel_shape(self) -> dict[str, int]:
        return {"tp": self.model.group.size, "pp": self.model.pipeline.num_stages}

    def attach_kv(self, kv_cache: torch.Tensor, block_size: int) -> None:
        """The followers make their shards of the pool: as many blocks as rank 0's, same dtype."""
        self._kv_cache = kv_cache
        self._send(ALLOCATE, kv_cache.shape[0], DTYPES.index(kv_cache.dtype), block_size)

    def forward(self, input_ids, positions, kv_cache, meta: AttentionMetadata, backend: AttentionBackend):
        self._send_forward(input_ids, positions, meta)
        return self.model.forward(input_ids, positions, kv_cache, meta, backend)

    def start_layers(self, input_ids: torch.Tensor, positions: torch.Tensor) -> LayerState:
        return _GroupStep(None, None, None, None, 0, input_ids, positions)

    def run_layers(self, state: _GroupStep, kv_cache, meta, backend, stop: Callable[[], bool] | None = None) -> bool:
        """The forward's remaining layers; with ``stop`` on a group of one stage, stopping where
        ``stop()`` says so on every rank (see the module's docstring), else all at once."""
        if state.inner is None and (stop is None or self.model.pipeline.num_stages > 1):
            if state.hidden is None:
                state.hidden = self.forward(state.input_ids, state.positions, kv_cache, meta, backend)
                state.next_layer = len(self.model.layers)
            return True
        if state.inner is None:
            self._send_forward(state.input_ids, state.positions, meta, LAYERS)
            state.inner = self.model.start_layers(state.input_ids, state.positions)
        else:
            self._send(RESUME)
        done = self.model.run_layers(state.inner, kv_cache, meta, backend, lambda: self._decide(stop))
        state.next_layer = state.inner.next_layer
        return done

    def _decide(self, stop: Callable[[], bool] | None) -> bool:
        """Rank 0's answer between two layers, told to every follower."""
        halt = stop is not None and stop()
        self.world.broadcast(torch.tensor([int(halt)], dtype=torch.long, device=self.model.device))
        return halt

    def finish_layers(self, state: _GroupStep, backend) -> torch.Tensor:
        if state.inner is not None:
            return self.model.finish_layers(state.inner, backend)
        return state.hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.contiguous()
        self._send(LOGITS, hidden.shape[0], hidden.shape[1], DTYPES.index(hidden.dtype))
        self.world.broadcast(hidden)
        return self.model.compute_logits(hidden)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Whole blocks [n, L, 2, bs, Hkv, D] on the CPU, every rank's part put in its place (for the
        KV tiers: ``GroupBlocks``)."""
        layout = ShardLayout(self.model.cfg, self.model.group.size, self.model.pipeline.num_stages)
        self._send(READ_BLOCKS, len(block_ids))
        self.world.broadcast(torch.tensor(block_ids, dtype=torch.long, device=self.model.device))
        gathered = self.world.all_gather(layout.flatten(self._kv_cache[block_ids], self.world.rank))
        return layout.assemble(gathered.to("cpu"), len(block_ids))

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Whole blocks [n, L, 2, bs, Hkv, D] into the pool: every rank takes its layers and heads."""
        self._send(WRITE_BLOCKS, len(block_ids))
        self.world.broadcast(torch.tensor(block_ids, dtype=torch.long, device=self.model.device))
        data = self.world.broadcast(data.to(self.model.device).contiguous())
        _write_part(self.model, self._kv_cache, block_ids, data)

    def open_transfer(self, name: str):
        """Every rank's NIXL agent over its shard (rank 0's named ``name``, rank r's ``name-rankR``);
        returns rank 0's agent and the group's metadata, or raises ``TransferUnavailable`` naming the
        ranks that could not make one. Runs in the engine thread, between steps."""
        from shared.transfer.base import TransferUnavailable

        self._send_bytes(OPEN_TRANSFER, name.encode())
        self.transfer, metadata, errors = _open_rank_transfer(self.model, self.world, self._kv_cache, name)
        if errors:
            raise TransferUnavailable("; ".join(errors))
        return self.transfer, metadata

    def send_kv(self, target: bytes, local_ids: list[int], remote_ids: list[int], notify: bytes,
                timeout_s: float) -> tuple[int, int]:
        """Every rank writes its pieces of ``local_ids`` into ``remote_ids`` of the worker whose
        metadata is ``target`` (``GroupMetadata`` bytes); once every rank's writes landed, rank 0
        sends ``notify`` to the target's rank 0. Returns (bytes, descriptors) of the whole group;
        raises ``KVTransferFailed`` when any rank's part failed (the target then never hears of
        it: it treats the blocks as unwritten). Runs in the engine thread, between steps."""
        from shared.transfer.base import KVTransferFailed

        order = json.dumps({"target": target.decode(), "local": local_ids, "remote": remote_ids,
                            "timeout_s": timeout_s}).encode()
        self._send_bytes(SEND_KV, order)
        failures, num_bytes, num_descriptors, name = _send_rank_part(self.model, self.world, self._kv_cache,
                                                                     self.transfer, order)
        if failures:
            raise KVTransferFailed(f"{failures} of the {self.world.size} ranks could not write their part")
        self.transfer.notify(name, num_bytes, notify)
        return num_bytes, num_descriptors

    def share_compiled(self, compiled, artifacts, threads: int) -> "GroupCompiled":
        """Every follower loads the compiled decode step rank 0 keeps in ``artifacts`` (compiled or
        loaded there by ``compiled.warm``), then every rank runs it once together (its collectives
        are the group's); returns rank 0's step, which tells the followers to run theirs each time.
        Runs in the engine thread, between steps: before traffic (``compile="on"``) or where the
        background compile hands its step over. Raises ``CompiledStepUnavailable`` when a follower
        could not load it: every rank then drops it (they decide together, before any runs it), and
        the group's steps run as before."""
        order = {"root": str(artifacts.root), "key": artifacts.key, "threads": threads,
                 "block_size": compiled.block_size}
        self._send_bytes(COMPILED_LOAD, json.dumps(order).encode())
        num_failed, num_loaded = _count_loaded(self.world, failed=False, loaded=False)
        if num_failed:
            raise CompiledStepUnavailable(f"{num_failed} of the {self.world.size - 1} followers could not load "
                                          f"the compiled decode step {artifacts.key}")
        compiled.run_once(self._kv_cache)
        return GroupCompiled(self, compiled, num_loaded)

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

    def _send_bytes(self, op: int, data: bytes) -> None:
        """``op`` with ``data`` (the follower reads it with ``_receive_bytes``)."""
        self._send(op, len(data))
        self.world.broadcast(_bytes_tensor(data, self.model.device))

    def _send(self, op: int, *args: int) -> None:
        header = torch.zeros(HEADER, dtype=torch.long, device=self.model.device)
        header[:1 + len(args)] = torch.tensor((op, *args))
        self.world.broadcast(header)

    def _send_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      op: int = FORWARD) -> None:
        tables = meta.block_tables
        starts = meta.step_starts
        self._send(op, input_ids.shape[0], tables.shape[0], tables.shape[1], meta.num_decodes,
                   meta.max_seq_len, meta.max_query_len, 0 if starts is None else 1)
        parts = [input_ids, positions, meta.slot_mapping, tables.reshape(-1), meta.seq_lens, meta.query_start_loc]
        if starts is not None:
            parts.append(starts)
        self.world.broadcast(torch.cat([p.to(torch.long) for p in parts]))


class GroupCompiled:
    """Rank 0's compiled decode step on a group: each forward is first sent to the followers
    (``COMPILED``), which run the same step on their shards; every other attribute is the step's.
    ``num_followers_loaded``: the followers that loaded rank 0's step from its artifacts (the others
    compiled the same step again, where loading it failed)."""

    def __init__(self, group: ParallelModel, compiled, num_followers_loaded: int = 0) -> None:
        self.group, self.compiled, self.num_followers_loaded = group, compiled, num_followers_loaded

    def __getattr__(self, name: str):
        return getattr(self.compiled, name)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        self.group._send_forward(input_ids, positions, meta, COMPILED)
        return self.compiled.forward(input_ids, positions, kv_cache, meta)


def _load_compiled(model: LlamaModel, world: Collectives, kv_cache: torch.Tensor, order: dict):
    """A follower's compiled decode step: rank 0's (``ParallelModel.share_compiled``), run once with
    the others once every rank has it; None (the follower's steps stay eager, as every rank's) when
    any follower could not load it."""
    from shared.engine.compiled.artifacts import CompileArtifacts
    from shared.engine.compiled.step import CompiledDecode

    compiled = None
    try:
        compiled = CompiledDecode(model, order["block_size"], order["threads"])
        compiled.warm(kv_cache, CompileArtifacts(Path(order["root"]), order["key"]), run_once=False)
    except Exception as exc:  # noqa: BLE001 - counted over the group below: every rank must get there
        log.warning("rank %d: cannot load the compiled decode step %s: %s: %s", world.rank, order["key"],
                    type(exc).__name__, exc)
        compiled = None
    num_failed, _ = _count_loaded(world, compiled is None, compiled is not None and compiled.source == "loaded")
    if num_failed:
        log.warning("rank %d: %d followers have no compiled decode step: decode steps stay eager", world.rank,
                    num_failed)
        return None
    compiled.run_once(kv_cache)
    log.info("rank %d: compiled decode step %s", model.group.rank, compiled.source)
    return compiled


def _count_loaded(world: Collectives, failed: bool, loaded: bool) -> tuple[int, int]:
    """Over the group (rank 0 counts as neither): how many followers could not get the compiled step,
    and how many loaded it from rank 0's artifacts."""
    dev = getattr(world, "device", torch.device("cpu"))
    counts = world.all_reduce(torch.tensor([int(failed), int(loaded)], dtype=torch.long, device=dev)).tolist()
    return counts[0], counts[1]


def follow(model: LlamaModel, world: Collectives, backend: AttentionBackend | None = None) -> None:
    """A follower's loop: run what rank 0 sends over ``world`` (``ParallelModel``) until it says stop."""
    dev = model.device
    backend = backend or get_attention_backend("auto", dev)
    kv_cache = transfer = progress = stopped = compiled = None
    try:
        while True:
            header = world.broadcast(torch.zeros(HEADER, dtype=torch.long, device=dev)).tolist()
            op, args = header[0], header[1:]
            if op == STOP:
                return
            if op in (LAYERS, RESUME):
                stopped = _follow_layers(model, world, backend, kv_cache, args if op == LAYERS else None, stopped)
                continue
            if op == COMPILED:
                ids, pos, meta = _receive_forward(world, args, dev)
                compiled.forward(ids, pos, kv_cache, meta)
                continue
            if op in (OPEN_TRANSFER, SEND_KV, COMPILED_LOAD):
                blob = world.broadcast(torch.empty(args[0], dtype=torch.uint8, device=dev)).cpu().numpy().tobytes()
                if op == COMPILED_LOAD:
                    compiled = _load_compiled(model, world, kv_cache, json.loads(blob))
                elif op == OPEN_TRANSFER:
                    transfer, _, _ = _open_rank_transfer(model, world, kv_cache, blob.decode())
                    if transfer is not None and progress is None:
                        progress = _Progress(transfer)
                else:
                    _send_rank_part(model, world, kv_cache, transfer, blob)
                continue
            kv_cache = _follow_op(model, world, backend, kv_cache, op, args)
    finally:
        if progress is not None:
            progress.stop()
        if transfer is not None:
            transfer.close()


def _follow_op(model: LlamaModel, world: Collectives, backend: AttentionBackend, kv_cache, op: int, args: list[int]):
    """One operation of rank 0's on this follower; returns the KV pool (made by ALLOCATE)."""
    dev = model.device
    if op == ALLOCATE:
        num_blocks, dtype, block_size = args[:3]
        kv_cache = _shard_spec(model, block_size, DTYPES[dtype]).allocate(num_blocks, dev)
        log.info("rank %d: KV shard of %d blocks (%.0f MiB)", world.rank, num_blocks,
                 kv_cache.nbytes / 2**20)
    elif op == FORWARD:
        ids, pos, meta = _receive_forward(world, args, dev)
        model.forward(ids, pos, kv_cache, meta, backend)
    elif op in (READ_BLOCKS, WRITE_BLOCKS):
        ids = world.broadcast(torch.empty(args[0], dtype=torch.long, device=dev)).tolist()
        if op == READ_BLOCKS:
            layout = ShardLayout(model.cfg, model.group.size, model.pipeline.num_stages)
            world.all_gather(layout.flatten(kv_cache[ids], world.rank))
        else:
            shape = (len(ids), model.cfg.num_layers, 2, kv_cache.shape[3], model.cfg.num_kv_heads, model.cfg.head_dim)
            _write_part(model, kv_cache, ids, world.broadcast(torch.empty(shape, dtype=kv_cache.dtype, device=dev)))
    elif op == LOGITS:
        rows, width, dtype = args[:3]
        hidden = world.broadcast(torch.empty(rows, width, dtype=DTYPES[dtype], device=dev))
        model.compute_logits(hidden)  # on stage 0's ranks; past it, nothing
    else:
        raise RuntimeError(f"rank {world.rank}: unknown operation {op} from rank 0")
    return kv_cache


def _follow_layers(model: LlamaModel, world: Collectives, backend: AttentionBackend, kv_cache,
                   args: list[int] | None, stopped: tuple | None) -> tuple | None:
    """A forward a layer at a time: a new one (``args``: ``LAYERS``'s) or the ``stopped`` one going
    on, stopping after the layer where rank 0 says so. Returns the stopped forward (state, metadata)
    after it: this one if it stopped, else the one stopped before (a step that ran whole meanwhile,
    such as decode rows, leaves it as it was), None when none is."""
    current = stopped
    if args is not None:
        ids, pos, meta = _receive_forward(world, args, model.device)
        current = (model.start_layers(ids, pos), meta)
    if current is None:
        raise RuntimeError(f"rank {world.rank}: told to go on with a forward it does not have")
    state, meta = current
    flag = torch.zeros(1, dtype=torch.long, device=model.device)
    if not model.run_layers(state, kv_cache, meta, backend, lambda: bool(world.broadcast(flag).item())):
        return current
    return stopped if args is not None else None


def _shard_spec(model: LlamaModel, block_size: int, dtype: torch.dtype):
    """The layout of this rank's KV pool: its layers and KV heads."""
    from shared.kvcache.layout import KvCacheSpec

    return KvCacheSpec(len(model.layers), model.num_kv_heads, model.cfg.head_dim, block_size, dtype)


def kv_shape(model: LlamaModel):
    from shared.transfer.relayout import KvShape

    return KvShape(model.group.size, model.pipeline.num_stages, model.cfg.num_layers, model.cfg.num_kv_heads)


def _open_rank_transfer(model: LlamaModel, world: Collectives, kv_cache: torch.Tensor, name: str):
    """This rank's agent over its shard, and every rank's metadata gathered: (agent or None,
    ``GroupMetadata`` on rank 0 when every rank made one, else None; the ranks' errors)."""
    from shared.transfer.base import AgentMetadata
    from shared.transfer.relayout import GroupMetadata

    transfer, data = None, b""
    try:
        from shared.transfer.nixl import NixlTransfer

        transfer = NixlTransfer(name if world.rank == 0 else f"{name}-rank{world.rank}", thread_safe=True)
        spec = _shard_spec(model, kv_cache.shape[3], kv_cache.dtype)
        transfer.register_kv_pool(kv_cache, spec, shape=kv_shape(model), rank=world.rank)
        data = transfer.local_metadata().to_bytes()
    except Exception as exc:  # noqa: BLE001 - NIXL missing or broken on this rank: every rank must hear it
        log.warning("rank %d: no KV transfer: %s", world.rank, exc)
        data = f"error: rank {world.rank}: {exc}".encode()
        if transfer is not None:
            transfer.close()
        transfer = None
    parts = _all_gather_bytes(world, data)
    errors = [p.decode()[len("error: "):] for p in parts if p.startswith(b"error: ")]
    if errors or world.rank != 0:
        return transfer, None, errors
    return transfer, GroupMetadata(kv_shape(model), tuple(AgentMetadata.from_bytes(p) for p in parts)), []


def _send_rank_part(model: LlamaModel, world: Collectives, kv_cache: torch.Tensor, transfer, order: bytes):
    """This rank's part of a ``send_kv``: gather the stage's heads if the plan needs them, write
    this rank's pieces and wait for them, then count over the group. Returns (ranks failed, the
    group's bytes, its descriptors, the peer name)."""
    from shared.transfer.relayout import load_target, plan_pieces, stages_gathering

    d = json.loads(order)
    target = load_target(d["target"].encode())
    local_ids, remote_ids = d["local"], d["remote"]
    shape = kv_shape(model)
    gathered = None
    pieces = plan_pieces(shape, target.shape)
    if world.rank // shape.tp in stages_gathering(pieces, shape) and local_ids:
        gathered = _stage_heads(model.group, kv_cache, local_ids, shape, world.rank, pieces, transfer)
    num_bytes = num_descriptors = 0
    try:
        if transfer is None:
            raise RuntimeError("this rank has no KV transfer")
        name = transfer.add_peer(target)
        handle = transfer.write_pieces(name, local_ids, remote_ids, gathered=gathered)
        transfer.wait(handle, float(d["timeout_s"]))
        failed, num_bytes, num_descriptors = 0, handle.num_bytes, handle.num_descriptors
    except Exception as exc:  # noqa: BLE001 - counted over the group below: every rank must get there
        log.warning("rank %d: KV write into %s failed: %s", world.rank, target.name, exc)
        failed = 1
    counts = world.all_reduce(torch.tensor([failed, num_bytes, num_descriptors], dtype=torch.long,
                                           device=model.device)).tolist()
    return counts[0], counts[1], counts[2], target.name


def _stage_heads(group: Collectives, kv_cache: torch.Tensor, block_ids: list[int], shape, rank: int, pieces: list,
                 transfer):
    """The stage's heads put together for this rank's gathered pieces (``Gathered``; None where it
    writes none): in the stage's shared staging (``kv_staging``) where its ranks share memory, each
    rank copying its own heads there, else over the stage's collectives (``gather_heads``)."""
    from shared.engine.kv_staging import stage_staging
    from shared.transfer.relayout import Gathered

    stage = rank // shape.tp
    covered = [p.layers for p in pieces if p.gathered and p.src // shape.tp == stage]
    lo, hi = min(r.start for r in covered), max(r.stop for r in covered)
    out_shape = (len(block_ids), hi - lo, 2, kv_cache.shape[3], shape.num_kv_heads, kv_cache.shape[-1])
    staging = None
    if kv_cache.device.type == "cpu":
        staging = stage_staging(group, math.prod(out_shape) * kv_cache.element_size())
    if staging is None:
        return gather_heads(group, kv_cache, block_ids, shape, rank, pieces)
    blocks = staging.blocks(out_shape, kv_cache.dtype)
    mine = shape.heads(rank)
    if all(shape.heads(r) != mine for r in shape.stage_ranks(stage) if r < rank):  # replicated: one copy
        first = shape.layers(rank).start
        source, into = kv_cache[:, lo - first:hi - first], blocks[:, :, :, :, mine.start:mine.stop]
        for i, block in enumerate(block_ids):  # one strided copy per block, no temporary
            into[i].copy_(source[block])
    group.all_reduce(torch.zeros(1, device=kv_cache.device))  # every rank's heads are in
    if not any(p.src == rank and p.gathered for p in pieces):
        return None
    return Gathered(blocks, lo, registered=staging.registered_with(transfer))


def gather_heads(group: Collectives, kv_cache: torch.Tensor, block_ids: list[int], shape, rank: int,
                 pieces: list):
    """For the ``gathered`` pieces of a transfer (``plan_pieces``): each rank of this stage in turn
    receives, from every rank of the stage (``group``), its heads of the layers that rank's pieces
    cover. Returns this rank's: (blocks [n, those layers, 2, bs, all KV heads, D], the model's
    number of the first of those layers: ``Gathered``), or None when it writes no gathered piece.
    A round per writing rank moves only the layers it writes, not the stage's whole blocks to
    every rank."""
    from shared.transfer.relayout import Gathered

    stage = rank // shape.tp
    first_of_stage = shape.layers(rank).start
    mine = None
    for k in shape.stage_ranks(stage):
        covered = [p.layers for p in pieces if p.src == k and p.gathered]
        if not covered:
            continue
        lo, hi = min(r.start for r in covered), max(r.stop for r in covered)
        part = kv_cache[:, lo - first_of_stage:hi - first_of_stage][block_ids].contiguous()  # [n, l, 2, bs, h, D]
        parts = group.all_gather(part.reshape(-1)).reshape(shape.tp, *part.shape)
        if k != rank:
            continue
        n, layers, _, bs, _, head_dim = part.shape
        whole = torch.empty(n, layers, 2, bs, shape.num_kv_heads, head_dim, dtype=part.dtype, device=part.device)
        for r in range(shape.tp):
            heads = shape.heads(stage * shape.tp + r)
            whole[:, :, :, :, heads.start:heads.stop] = parts[r]
        mine = Gathered(whole, lo)
    return mine


def _bytes_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else \
        torch.empty(0, dtype=torch.uint8, device=device)


def _all_gather_bytes(world: Collectives, data: bytes) -> list[bytes]:
    dev = getattr(world, "device", torch.device("cpu"))
    sizes = world.all_gather(torch.tensor([len(data)], dtype=torch.long, device=dev)).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=dev)
    padded[:len(data)] = _bytes_tensor(data, dev)
    gathered = world.all_gather(padded).reshape(world.size, -1).cpu()
    return [gathered[r, :sizes[r]].numpy().tobytes() for r in range(world.size)]


class _Progress:
    """Polls a follower's agent every few milliseconds from a thread of its own: a peer's write into
    this rank's pool (UCX's connection set-up, then the write) completes only while it is polled."""

    def __init__(self, transfer, interval_s: float = 0.005) -> None:
        import threading

        self.transfer, self.interval_s = transfer, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.transfer.get_notifications()
            except Exception as exc:  # noqa: BLE001 - keep polling: a broken agent shows in the writes
                log.debug("polling the KV agent: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class ShardLayout:
    """Where each rank's part of a block sits in the whole block [L, 2, bs, Hkv, D]: world rank
    ``stage * tp + r`` holds its stage's layers and tensor rank r's KV heads (a replicated head:
    every replica, the same values)."""

    def __init__(self, cfg, tp: int, pp: int) -> None:
        from shared.transfer.relayout import KvShape

        self.cfg, self.tp, self.pp = cfg, tp, pp
        self.shape = KvShape(tp, pp, cfg.num_layers, cfg.num_kv_heads)
        self.num_heads = len(self.shape.heads(0))
        self.max_layers = len(self.shape.layers(0))  # the first stages are the longest

    def place(self, world_rank: int) -> tuple[range, slice]:
        heads = self.shape.heads(world_rank)
        return self.shape.layers(world_rank), slice(heads.start, heads.stop)

    def flatten(self, part: torch.Tensor, world_rank: int) -> torch.Tensor:
        """A rank's part [n, its layers, 2, bs, its heads, D], flat and padded to the longest stage's
        size, so that every rank gives the all-gather the same shape."""
        n, layers = part.shape[0], part.shape[1]
        flat = part.contiguous().reshape(n, -1)
        pad = (self.max_layers - layers) * flat.shape[1] // max(1, layers)
        return torch.nn.functional.pad(flat, (0, pad)).reshape(-1)

    def assemble(self, gathered: torch.Tensor, n: int) -> torch.Tensor:  # [world * padded] -> [n, L, 2, bs, H, D]
        cfg = self.cfg
        size = self.tp * self.pp
        parts = gathered.reshape(size, n, -1)
        bs = parts.shape[-1] // (self.max_layers * 2 * self.num_heads * cfg.head_dim)
        whole = torch.empty(n, cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim, dtype=gathered.dtype)
        for w in range(size):
            layers, heads = self.place(w)
            part = parts[w].reshape(n, self.max_layers, 2, bs, self.num_heads, cfg.head_dim)[:, :len(layers)]
            whole[:, layers.start:layers.stop, :, :, heads] = part
        return whole


def _write_part(model: LlamaModel, kv_cache: torch.Tensor, block_ids: list[int], whole: torch.Tensor) -> None:
    """This rank's layers and heads of whole blocks ``whole`` into its pool's ``block_ids``."""
    layers = model.pipeline.layers
    start = model.split.kv_head_start
    part = whole[:, layers.start:layers.stop, :, :, start:start + model.num_kv_heads]
    kv_cache.index_copy_(0, torch.tensor(block_ids, device=kv_cache.device), part.to(kv_cache.dtype).contiguous())


class GroupBlocks:
    """Whole blocks of a parallel worker's sharded pool, for the KV tiers (``PoolBlocks``' twin):
    a read gathers every rank's part, a write gives each rank its part."""

    def __init__(self, model: ParallelModel) -> None:
        self.model = model

    def read(self, block_ids) -> torch.Tensor:
        return self.model.read_blocks(list(block_ids))

    def write(self, block_ids, data: torch.Tensor) -> None:
        self.model.write_blocks(list(block_ids), data)


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


CONFIG_KEY = "engine-config"  # in rank 0's store: the config a rank from another host loads
REMOTE_JOIN_TIMEOUT_S = 900.0  # how long rank 0 waits for the ranks other hosts start by hand


def open_group_store(config, size: int, host: str, port: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on ``host:port``, holding the engine config (``CONFIG_KEY``) for the
    ranks that join from other hosts (``tandem rank``), which have nothing but its address."""
    remote = config.local_ranks < size
    timeout = datetime.timedelta(seconds=REMOTE_JOIN_TIMEOUT_S if remote else 120.0)
    store = dist.TCPStore(host, port, size, is_master=True, timeout=timeout, wait_for_workers=False)
    store.set(CONFIG_KEY, json.dumps(dataclasses.asdict(config)))
    return store


def start_followers(config, num_local: int, host: str, port: int, size: int | None = None) -> list[subprocess.Popen]:
    """Ranks 1 .. num_local-1 of a group of ``size`` (default ``num_local``), each a process of its
    own (``python -m shared.engine.tp_rank``) that loads its shard of ``config``'s model and follows
    rank 0 (which the caller is, joining at ``host:port``). On Linux a follower is killed when the
    process that started it dies."""
    size = size or num_local
    blob = json.dumps(dataclasses.asdict(config))
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())  # rank 0's, however it was set
    procs = []
    for rank in range(1, num_local):
        cmd = [sys.executable, "-m", "shared.engine.tp_rank", "--rank", str(rank), "--size", str(size),
               "--host", host, "--port", str(port), "--config", blob, "--log-level", level]
        procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent))
    return procs


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

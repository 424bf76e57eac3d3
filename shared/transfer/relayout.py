"""KV between workers of different parallel shapes: which rank writes which layers and heads to
which rank, and the metadata a group publishes so that a writer can plan it.

A worker of shape (tp, pp) has ``tp * pp`` ranks; world rank ``stage * tp + r`` holds the layers
of pipeline stage ``stage`` (``stage_layers``) and the KV heads of tensor rank ``r`` (a share of
them, or one replicated head where tp exceeds the KV heads), each rank in a pool of its own,
``[blocks, its layers, 2, block_size, its heads, head_dim]``. Block ids are the group's: block b
of every rank's pool holds a part of the same tokens.

A transfer from a source group into a target group is a list of ``Piece``: one source rank
writes one contiguous range of layers, with *all* of the target rank's heads, into one target
rank. In the target's block those bytes are one contiguous run (``[layers, 2, bs, heads, D]``
with every head is a contiguous slice of the block), so a piece is one descriptor per block,
merged where consecutive blocks are contiguous on both sides (``region_runs``). Where the piece
takes every head the source rank holds, its bytes are one run of the source's block too and are
written from the pool; where the source holds more heads than the target rank, it gathers the
piece's heads into a staging slab laid out as the target's block first (a strided copy of every
byte: what makes such a write cost more than a same-shape one).

When no source rank of a stage holds all of a target rank's heads (a prefill at TP=3 writing
into a decode at TP=1: each prefill rank holds one of the three heads), the stage first gathers
its heads over its own tensor-parallel ranks (shared memory on one host), and its ranks then split
the target's layers between them: each writes a contiguous share, with every head. The other
choice, each rank writing its own heads straight into the target's block, would be one
descriptor per (block, layer, K/V, token), each a head's ``head_dim`` values: tens of thousands of
256-byte writes for a long prompt (see docs/protocol.md and loadtest/bench/parallel.py).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import numpy as np

from shared.model.parallel import kv_heads_of, stage_layers
from shared.transfer.base import AgentMetadata, KVTransferFailed, KvLayoutMismatch


@dataclass(frozen=True)
class KvShape:
    """The parallel shape of a worker's KV: ``tp * pp`` ranks over a model's layers and KV heads."""

    tp: int
    pp: int
    num_layers: int
    num_kv_heads: int

    @property
    def size(self) -> int:
        return self.tp * self.pp

    def layers(self, rank: int) -> range:
        return stage_layers(self.num_layers, self.pp, rank // self.tp)

    def heads(self, rank: int) -> range:
        """The KV heads world rank ``rank`` holds (its tensor rank's, as the model places them)."""
        return kv_heads_of(rank % self.tp, self.tp, self.num_kv_heads)

    def stage_ranks(self, stage: int) -> range:
        return range(stage * self.tp, (stage + 1) * self.tp)

    def describe(self) -> str:
        return f"TP={self.tp} x PP={self.pp}"

    def to_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads}

    @classmethod
    def from_dict(cls, d: dict) -> "KvShape":
        return cls(int(d["tp"]), int(d["pp"]), int(d["num_layers"]), int(d["num_kv_heads"]))


@dataclass(frozen=True)
class Piece:
    """Source rank ``src`` writes ``layers`` (the model's layer numbers) of every block, with the
    KV heads ``heads`` (all of target rank ``dst``'s), into target rank ``dst``. ``gathered``: the
    source takes them from its stage's gathered heads, not from its own pool alone."""

    src: int
    dst: int
    layers: range
    heads: range
    gathered: bool = False


@dataclass(frozen=True)
class Gathered:
    """A stage's KV heads of some layers, put together for this rank's gathered pieces: ``blocks``
    ``[n, layers, 2, bs, every KV head, D]`` (the transfer's blocks in order), ``first_layer`` the
    model's number of the first of those layers. ``registered``: ``blocks`` lies in memory this
    rank's agent registered (the stage's shared staging), so a piece with every head is written
    from where it lies, not copied into a slab first."""

    blocks: "torch.Tensor"  # noqa: F821 - no torch import here: this module plans, it moves nothing
    first_layer: int
    registered: bool = False


def plan_pieces(src: KvShape, dst: KvShape) -> list[Piece]:
    """Every piece of a transfer from a ``src``-shaped group into a ``dst``-shaped one, in target
    rank order. Each (target rank, layer, head) is written exactly once; a replicated head (tp
    above the KV heads) is read from one of its holders and written to every rank that holds it."""
    if (src.num_layers, src.num_kv_heads) != (dst.num_layers, dst.num_kv_heads):
        raise KvLayoutMismatch(f"a model of {src.num_layers} layers and {src.num_kv_heads} KV heads cannot "
                               f"write into one of {dst.num_layers} layers and {dst.num_kv_heads} KV heads")
    pieces: list[Piece] = []
    for d in range(dst.size):
        want_layers, want_heads = dst.layers(d), dst.heads(d)
        for stage in range(src.pp):
            have = src.layers(stage * src.tp)
            layers = range(max(have.start, want_layers.start), min(have.stop, want_layers.stop))
            if not layers:
                continue
            holders = [s for s in src.stage_ranks(stage)
                       if src.heads(s).start <= want_heads.start and want_heads.stop <= src.heads(s).stop]
            if holders:  # spread the targets over the holders of a replicated head
                pieces.append(Piece(holders[d % len(holders)], d, layers, want_heads))
                continue
            ranks = src.stage_ranks(stage)
            shares = min(len(ranks), len(layers))
            for k in range(shares):
                share = stage_layers(len(layers), shares, k)
                pieces.append(Piece(ranks[k], d, range(layers.start + share.start, layers.start + share.stop),
                                    want_heads, gathered=True))
    return pieces


def region_runs(local_addrs: np.ndarray, remote_addrs: np.ndarray, num_bytes: int) -> np.ndarray:
    """Regions of ``num_bytes`` each, region i from ``local_addrs[i]`` to ``remote_addrs[i]``, merged
    where one ends exactly where the next begins on *both* sides: ``[runs, 3]`` uint64 rows
    (local address, remote address, bytes), one descriptor each, in order. The bytes each remote
    address receives are unchanged; only the number of descriptors falls."""
    local = np.asarray(local_addrs, dtype=np.uint64)
    remote = np.asarray(remote_addrs, dtype=np.uint64)
    if local.shape != remote.shape or local.ndim != 1:
        raise ValueError(f"{local.shape} local regions for {remote.shape} remote ones")
    if not len(local):
        return np.empty((0, 3), dtype=np.uint64)
    step = np.uint64(num_bytes)
    joins = (local[1:] == local[:-1] + step) & (remote[1:] == remote[:-1] + step)
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    counts = np.diff(np.append(starts, len(local))).astype(np.uint64)
    return np.stack([local[starts], remote[starts], counts * step], axis=1)


def stages_gathering(pieces: list[Piece], src: KvShape) -> set[int]:
    """The source stages whose ranks gather their heads before writing (every rank of such a stage
    takes part in the gather, whether or not it then writes a piece)."""
    return {p.src // src.tp for p in pieces if p.gathered}


@dataclass(frozen=True)
class GroupMetadata:
    """What a worker publishes so that others can write into its KV: its shape and one NIXL agent's
    metadata per rank (index: world rank). A single-process worker is a group of one, and publishes
    its ``AgentMetadata`` alone, as before groups existed; ``load_target`` reads both."""

    shape: KvShape
    ranks: tuple[AgentMetadata, ...]

    @classmethod
    def single(cls, metadata: AgentMetadata) -> "GroupMetadata":
        """A single process's agent as a group of one, its shape from its pool's spec."""
        return cls(KvShape(1, 1, metadata.spec.num_layers, metadata.spec.num_kv_heads), (metadata,))

    @property
    def name(self) -> str:
        """The group's name as a peer: its rank 0's agent (which takes the notifications)."""
        return self.ranks[0].agent_name

    def to_bytes(self) -> bytes:
        if self.shape.size == 1:
            return self.ranks[0].to_bytes()
        return json.dumps({"group": self.shape.to_dict(),
                           "ranks": [base64.b64encode(r.to_bytes()).decode() for r in self.ranks]}).encode()


def load_target(data: bytes) -> GroupMetadata:
    """A worker's published transfer metadata: a group's, or a single process's ``AgentMetadata``
    (a group of one whose shape its pool's spec gives)."""
    try:
        d = json.loads(data)
        if "group" not in d:
            return GroupMetadata.single(AgentMetadata.from_bytes(data))
        shape = KvShape.from_dict(d["group"])
        ranks = tuple(AgentMetadata.from_bytes(base64.b64decode(r)) for r in d["ranks"])
    except (ValueError, KeyError, TypeError) as exc:
        raise KVTransferFailed(f"malformed transfer metadata: {exc}") from exc
    if len(ranks) != shape.size:
        raise KVTransferFailed(f"group metadata of {shape.describe()} lists {len(ranks)} ranks")
    return GroupMetadata(shape, ranks)

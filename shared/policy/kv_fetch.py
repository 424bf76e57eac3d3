"""Cross-worker prefix reuse (pure: no I/O, no clock of its own).

Admission routes on overlap and load, so a prompt whose prefix worker A holds may still go to
worker B (A is busy, or A was excluded). Then two questions:

* admission: is there a worker holding clearly more of the prefix than the chosen one?
  (``choose_kv_source``: the one holding the most leading blocks in any tier, when that beats the
  chosen worker's own hit by ``min_blocks``; a holder reads its disk blocks in before it writes);
* the chosen worker: is fetching those blocks cheaper than computing them?
  (``decide_fetch``: transfer time = a fixed round trip + bytes / bandwidth, against the missing
  tokens / the worker's measured prefill rate; with no rate measured yet, fetch: recomputing a
  block costs far more than copying it on any machine we know of.)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class FetchConfig:
    min_blocks: int = 2  # fewer missing blocks are not worth a round trip
    bytes_per_s: float = 1e9  # assumed transfer bandwidth until fetches have measured one
    round_trip_s: float = 0.01  # ask, lend (waits for the holder's step), notify


@dataclass(frozen=True)
class HeldPrefix:
    """A worker's hit on the prompt's leading blocks, by tier (from kv-index)."""

    worker_id: str
    num_blocks: int  # in any tier
    num_host_blocks: int = 0  # of those, only in host memory
    num_disk_blocks: int = 0  # of those, only on disk



@dataclass(frozen=True)
class KvSourceChoice:
    worker_id: str
    num_blocks: int


def choose_kv_source(held: Iterable[HeldPrefix], chosen: str, candidates: set[str],
                     cfg: FetchConfig = FetchConfig()) -> KvSourceChoice | None:
    """The worker among ``candidates`` (ready, same model) other than ``chosen`` that holds the
    longest run of the prompt's leading blocks (any tier), if it beats ``chosen``'s own hit by at
    least ``min_blocks``; ties go to the worker with fewer blocks on disk, then the lower id."""
    held = list(held)
    own = next((h.num_blocks for h in held if h.worker_id == chosen), 0)
    best = min((h for h in held if h.worker_id != chosen and h.worker_id in candidates),
               key=lambda h: (-h.num_blocks, h.num_disk_blocks, h.worker_id), default=None)
    if best is None or best.num_blocks - own < cfg.min_blocks:
        return None
    return KvSourceChoice(best.worker_id, best.num_blocks)


@dataclass(frozen=True)
class FetchDecision:
    fetch: bool
    reason: str
    transfer_s: float
    recompute_s: float | None


def decide_fetch(num_missing_blocks: int, block_size: int, block_bytes: int, prefill_tokens_per_s: float | None,
                 measured_bytes_per_s: float | None = None, cfg: FetchConfig = FetchConfig()) -> FetchDecision:
    """Fetch ``num_missing_blocks`` from a peer, or compute them here?"""
    bandwidth = measured_bytes_per_s or cfg.bytes_per_s
    transfer_s = cfg.round_trip_s + num_missing_blocks * block_bytes / bandwidth
    recompute_s = (num_missing_blocks * block_size / prefill_tokens_per_s) if prefill_tokens_per_s else None
    if num_missing_blocks < cfg.min_blocks:
        return FetchDecision(False, f"{num_missing_blocks} missing blocks (< {cfg.min_blocks})", transfer_s,
                             recompute_s)
    if recompute_s is not None and recompute_s <= transfer_s:
        return FetchDecision(False, f"recomputing {num_missing_blocks} blocks (~{recompute_s * 1e3:.0f} ms) is no "
                             f"slower than fetching them (~{transfer_s * 1e3:.0f} ms)", transfer_s, recompute_s)
    why = "no prefill rate measured yet" if recompute_s is None else f"~{recompute_s * 1e3:.0f} ms to recompute"
    return FetchDecision(True, f"fetch {num_missing_blocks} blocks (~{transfer_s * 1e3:.0f} ms; {why})",
                         transfer_s, recompute_s)

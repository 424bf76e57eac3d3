"""The trace side of a replay: the slice of a Mooncake trace, its scaling to this machine, each
block's prompt text, and the slice's ideal prefix-cache hit ratio (see the package docstring)."""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass, replace
from fractions import Fraction
from functools import lru_cache
from pathlib import Path

from loadtest.tools.workload import WORDS
from shared.sim.traces import MOONCAKE_BLOCK_SIZE, TraceRecord, read_mooncake

TRACE_BLOCK_TOKENS = MOONCAKE_BLOCK_SIZE   # Mooncake's prefix block
ENGINE_BLOCK_TOKENS = 16      # the engine's KV block (shared.engine.config.EngineConfig.block_size)
DEFAULT_TIER = "default"


# --- the trace ---------------------------------------------------------------------------------

def conversation_key(hash_ids: tuple[int, ...]) -> int:
    """Requests that share two leading blocks share this key (the first block alone is, in the
    Mooncake trace, common to every request)."""
    return hash_ids[1] if len(hash_ids) > 1 else hash_ids[0] if hash_ids else -1


def read_trace(path: str | Path, max_requests: int | None = None, skip: int = 0,
               sample_conversations: float = 1.0, seed: int = 0) -> list[TraceRecord]:
    """The slice ``[skip, skip + max_requests)`` of the trace in timestamp order, its times counted
    from its first request. A record without ``hash_ids`` gets ids of its own (no sharing).
    ``sample_conversations`` < 1 first keeps that fraction of the conversations (whole, by
    ``conversation_key``, seeded): fewer requests over the same span, their prefix sharing kept."""
    recs = sorted(read_mooncake(path), key=lambda r: r.at_s)   # stable: equal timestamps keep the file's order
    if sample_conversations < 1.0:
        recs = [r for r in recs if random.Random(f"conversation/{seed}/{conversation_key(r.hash_ids)}").random()
                < sample_conversations]
    recs = recs[skip:skip + max_requests if max_requests is not None else None]
    next_own = -1
    out = []
    t0 = recs[0].at_s if recs else 0.0
    for r in recs:
        ids = r.hash_ids
        if not ids:
            num = -(-r.input_len // TRACE_BLOCK_TOKENS)
            ids = tuple(range(next_own, next_own - num, -1))
            next_own -= num
        out.append(replace(r, at_s=r.at_s - t0, hash_ids=ids))
    return out


def parse_scale(text: str) -> float:
    """``0.25``, ``1/16`` or ``4``."""
    try:
        value = float(Fraction(text))
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or a fraction like 1/16") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


# --- scaling -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ReplayRequest:
    index: int
    at_s: float                      # when it is sent, after the start of the run
    hash_ids: tuple[int, ...]        # its prompt blocks (after any truncation)
    block_tokens: tuple[int, ...]    # scaled tokens of each block
    output_tokens: int
    tier: str = DEFAULT_TIER
    api_key: str | None = None
    truncated: bool = False

    @property
    def input_tokens(self) -> int:
        return sum(self.block_tokens)


def scaled_block_tokens(length_scale: float) -> int:
    return max(1, round(TRACE_BLOCK_TOKENS * length_scale))


def scale_blocks(input_len: int, num_blocks: int, length_scale: float) -> list[int]:
    """Scaled tokens of each of a prompt's blocks: full blocks ``B``, the last one its share."""
    full = scaled_block_tokens(length_scale)
    rest = input_len - TRACE_BLOCK_TOKENS * (num_blocks - 1)
    last = min(full, max(1, round(rest * length_scale)))
    return [full] * (num_blocks - 1) + [last]


@dataclass(frozen=True)
class TierSpec:
    name: str
    api_key: str | None
    share: float
    ttft_slo_s: float
    tpot_slo_s: float | None = None


def parse_tiers(api_keys: str | None, slo_ttft_ms: str, slo_tpot_ms: str | None) -> list[TierSpec]:
    """``KEY:TIER:SHARE,...`` (``KEY:SHARE`` names the tier after the key) in priority order, highest
    first; without keys one tier, ``default``. SLOs: one value for every tier or ``TIER=MS,...``."""
    raw: list[tuple[str | None, str, float]] = []
    if api_keys:
        for part in api_keys.split(","):
            bits = part.strip().split(":")
            try:
                if len(bits) == 3:
                    raw.append((bits[0], bits[1], float(bits[2])))
                elif len(bits) == 2:
                    raw.append((bits[0], bits[0], float(bits[1])))
                else:
                    raise ValueError
            except ValueError:
                raise ValueError(f"--api-keys: {part!r} is not KEY:TIER:SHARE") from None
            if raw[-1][2] <= 0:
                raise ValueError(f"--api-keys: {part!r}: the share must be > 0")
    else:
        raw.append((None, DEFAULT_TIER, 1.0))
    names = [t for _, t, _ in raw]
    if len(set(names)) != len(names):
        raise ValueError(f"--api-keys: a tier appears twice in {names}")

    def per_tier(text: str | None, what: str) -> dict[str, float | None]:
        if text is None:
            return dict.fromkeys(names)
        if "=" not in text:
            return dict.fromkeys(names, float(text) / 1000)
        out: dict[str, float | None] = dict.fromkeys(names)
        for part in text.split(","):
            name, _, ms = part.partition("=")
            if name.strip() not in out:
                raise ValueError(f"{what}: {name.strip()!r} is not one of the tiers {names}")
            out[name.strip()] = float(ms) / 1000
        return out

    ttft, tpot = per_tier(slo_ttft_ms, "--slo-ttft-ms"), per_tier(slo_tpot_ms, "--slo-tpot-ms")
    missing = [n for n in names if ttft[n] is None]
    if missing:
        raise ValueError(f"--slo-ttft-ms: no TTFT SLO for {missing}")
    total = sum(s for _, _, s in raw)
    return [TierSpec(t, k, s / total, ttft[t], tpot[t]) for k, t, s in raw]


def build_requests(records: list[TraceRecord], *, time_scale: float = 1.0, rate_scale: float = 1.0,
                   length_scale: float = 1.0, output_scale: float | None = None,
                   max_output_tokens: int | None = None, max_input_tokens: int | None = None,
                   tiers: list[TierSpec] | None = None, seed: int = 0) -> list[ReplayRequest]:
    tiers = tiers or [TierSpec(DEFAULT_TIER, None, 1.0, math.inf)]
    output_scale = length_scale if output_scale is None else output_scale
    rng = random.Random(seed)
    cum, acc = [], 0.0
    for t in tiers:
        acc += t.share
        cum.append(acc)
    out = []
    for i, r in enumerate(records):
        blocks = scale_blocks(r.input_len, len(r.hash_ids), length_scale)
        ids = list(r.hash_ids)
        truncated = False
        while max_input_tokens and len(blocks) > 1 and sum(blocks) > max_input_tokens:
            blocks.pop()
            ids.pop()
            truncated = True
        if max_input_tokens and sum(blocks) > max_input_tokens:   # one block over the cap: shorten it
            blocks[0] = max_input_tokens
            truncated = True
        out_tokens = max(1, round(r.output_len * output_scale))
        if max_output_tokens:
            out_tokens = min(out_tokens, max_output_tokens)
        u = rng.random() * acc
        tier = tiers[next((k for k, c in enumerate(cum) if u < c), len(tiers) - 1)]
        out.append(ReplayRequest(i, r.at_s * time_scale / rate_scale, tuple(ids), tuple(blocks), out_tokens,
                                 tier.name, tier.api_key, truncated))
    return out


# --- prompt text -------------------------------------------------------------------------------

@lru_cache(maxsize=1 << 16)
def block_words(hash_id: int, num_tokens: int, seed: int = 0) -> tuple[str, ...]:
    """The words of block ``hash_id`` cut to ``num_tokens`` (a prefix of the longer cut)."""
    rng = random.Random(f"replay/{seed}/{hash_id}")
    n = len(WORDS)
    return tuple(WORDS[int(rng.random() * n)] for _ in range(num_tokens))


def block_text(hash_id: int, num_tokens: int, seed: int = 0) -> str:
    return "".join(" " + w for w in block_words(hash_id, num_tokens, seed))


def prompt_text(req: ReplayRequest, seed: int = 0) -> str:
    return "".join(block_text(h, n, seed) for h, n in zip(req.hash_ids, req.block_tokens))


# --- the ideal hit ratio -----------------------------------------------------------------------

def _chain_keys(ids: tuple[int, ...], chain: dict[tuple[int, int], int]) -> list[int]:
    key, keys = 0, []
    for h in ids:
        key = chain.setdefault((key, h), len(chain) + 1)
        keys.append(key)
    return keys


def ideal_hits(hash_lists: list[tuple[int, ...]]) -> list[int]:
    """Per request (in arrival order), its leading blocks whose id chain an earlier request had:
    an infinite cache that starts empty."""
    chain: dict[tuple[int, int], int] = {}
    seen: set[int] = set()
    hits = []
    for ids in hash_lists:
        keys = _chain_keys(ids, chain)
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        hits.append(n)
        seen.update(keys)
    return hits


def ideal_ratios(requests: list[ReplayRequest]) -> dict:
    """The infinite cache's hit ratio, by blocks and by (scaled) tokens. By tokens a hit block
    counts the tokens an earlier request had of it (a block that was some prompt's partial last
    block holds only that many), and a prompt's last token is never a hit (its logits are needed)."""
    hits = ideal_hits([r.hash_ids for r in requests])
    chain: dict[tuple[int, int], int] = {}
    held: dict[int, int] = {}     # chain key -> most tokens of that block any request had
    hit_tokens = 0
    for r, n in zip(requests, hits):
        keys = _chain_keys(r.hash_ids, chain)
        hit_tokens += min(sum(min(held[k], t) for k, t in zip(keys[:n], r.block_tokens)), r.input_tokens - 1)
        for k, t in zip(keys, r.block_tokens):
            held[k] = max(held.get(k, 0), t)
    blocks = sum(len(r.hash_ids) for r in requests)
    tokens = sum(r.input_tokens for r in requests)
    return {"ideal_hit_ratio": sum(hits) / blocks if blocks else 0.0,
            "ideal_token_hit_ratio": hit_tokens / tokens if tokens else 0.0,
            "num_blocks": blocks, "num_ideal_hit_blocks": sum(hits)}

"""Replay a Mooncake-format request trace: live against a running stack, or in the simulator.

    # live, open loop by timestamp, against a stack already up
    python -m loadtest.tools.replay --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
        --max-requests 150 --length-scale 1/16 --time-scale 4 --url http://127.0.0.1:8000 \\
        --api-keys key-premium:premium:0.3,key-batch:batch:0.7 --slo-ttft-ms premium=2000,batch=8000 \\
        --out loadtest/results/replay/live.json

    # the whole hour at the paper's lengths and rates, simulated on a GPU cluster (planner models)
    python -m loadtest.tools.replay --trace ... --simulate gpu --out loadtest/results/replay/sim-gpu.json

    # the same scaled slice as the live run, simulated on this machine's calibrated CPU model
    python -m loadtest.tools.replay --trace ... --max-requests 150 --length-scale 1/16 --time-scale 4 \\
        --simulate cpu --decode 2 --kv-cache-memory 64MiB --out loadtest/results/replay/sim-cpu.json

**The trace.** One JSON object a line: ``timestamp`` (ms), ``input_length``, ``output_length``
(tokens) and ``hash_ids``, one id per 512-token prompt block; requests that share leading ids
share that prompt prefix. The replayed slice is ``--skip`` requests in, ``--max-requests`` long
(in timestamp order), its times counted from its first request. A short slice of the Mooncake
trace shares little beyond the first block (150 requests: 4.5% ideal hits; turns of a conversation
come minutes apart): ``--sample-conversations 1/40`` keeps whole conversations (requests sharing
their first two blocks) over the hour instead, ~250 requests with ~25% ideal hits, to be
compressed with ``--time-scale``.

**Scaling.** A request due at ``t`` in the trace is sent at ``t * time_scale / rate_scale`` after
the start (``--time-scale 4``: the slice takes four times as long; ``--rate-scale 2``: twice the
offered rate — the two multiply; one stretches the timeline to fit a slow machine, the other sets
the load relative to it). Every full block becomes ``B = round(512 * length_scale)`` tokens
(1/16: 32 tokens); a prompt's last block is partial in the trace (``input_length`` is not a
multiple of 512) and becomes ``round(rest * length_scale)`` tokens, at least 1 and at most ``B``.
Outputs become ``round(output_length * output_scale)`` tokens (default: the length scale), at
least 1, sent with ``ignore_eos``. ``--max-input-tokens`` drops a long prompt's trailing blocks
(its prefix, and so its sharing, is kept).

**Prompt text, and why block boundaries do not drift.** Block ``h`` of ``n`` tokens is ``n``
words, each preceded by one space, drawn from ``WORDS`` by ``random.Random("replay/<seed>/<h>")``
(seeded by the id: the same id always gives the same words, and a partial block is a prefix of
the full one). A prompt is its blocks' text concatenated. Two properties make the token sequence
exactly the blocks' token sequences one after another, at any scale: every word of ``WORDS`` is
a single SmolLM2 token when preceded by a space (checked with the real tokenizer in
``tests/unit/test_replay.py``), and the tokenizer's pre-tokenizer splits text before every space,
so no BPE merge crosses a word, let alone a block. A block of ``n`` words is therefore exactly
``n`` tokens, and prompts that share leading ids share exactly that many leading tokens (with
``B`` a multiple of the engine's 16-token KV block, the shared prefix is whole KV blocks; 1/16 and
1/32 are).

**Ideal hit ratio.** Infinite cache, starting empty at the slice: a prompt block is a hit when its
id chain (its id and every id before it in the prompt) was in an earlier request of the slice.
``ideal_hit_ratio`` is the fraction of blocks (the trace README's 36.6% for the whole hour);
``ideal_token_hit_ratio`` weighs each hit block by the scaled tokens an earlier request had of it
(a partial last block holds only its part) and never counts a prompt's last token, the unit of the achieved
``hit_ratio`` (the completed requests' ``usage.prompt_tokens_details.cached_tokens`` over their
``prompt_tokens``); ``hit_ratio_vs_ideal`` is the one over the other.

**Tiers.** ``--api-keys KEY:TIER:SHARE,...`` draws each request's tier (seeded) by share and sends
it with that key; ``--slo-ttft-ms`` (one value, or ``TIER=MS,...``) and optionally
``--slo-tpot-ms`` give each tier's SLO. A request attains its SLO when it completes within its
tier's TTFT (and TPOT, if given) budget; ``attainment`` counts over everything the tier sent (a
429 is a miss), ``attainment_admitted`` over what was admitted. Goodput: such requests per second
of the run.

**429s.** By default a 429 is the request's result: counted in ``rejected`` (its Retry-After
recorded, mean and max reported), not sent again — the schedule stays the trace's. With
``--retry-429 N`` a 429 is sent again after its Retry-After, up to N times, its latency still
counted from the first send.

**Simulation** (``--simulate``) runs ``shared.sim.Simulator`` — the live routing
(``shared.policy.kv_routing``), admission and disaggregation code — on the same scaled requests
with their hash ids as the prefix-cache keys (block size ``B``), and writes the same summary:

* ``gpu``: a GPU cluster (``--cluster``, default ``examples/clusters/mooncake-h100x32.yaml``) and a
  model preset (``--model``, default llama-2-70b), planned by ``shared.planner`` for the slice's
  rate and mean lengths (or ``--plan``), prefill pool and decode pool disaggregated;
* ``cpu``: this machine as ``tandem up --decode N`` runs here: N decode workers that prefill
  locally, timed by the cost model fitted to this machine's measured step times
  (``loadtest/results/calibration``, from ``loadtest.calibrate.sim``), each with a KV pool of
  ``--kv-cache-memory`` and the engine's sequence and chunked-prefill limits; the N workers share
  the CPU, so each is modelled at 1/N of its speed (``--cpu-share``).

The simulator has no per-token times: its ITL is each request's TPOT (``itl_is_tpot``).
``--routing load`` sets the overlap weight to 0 (load only), ``round-robin`` cycles through the
decode workers (live: the admission service's ``--routing round-robin``). ``--prefix-cache-blocks``
lets each simulated decode worker keep more prefix blocks than its KV pool holds (a host tier; the
copy back is not timed). Simulated decode workers fetch a prompt's cached prefix from the worker
holding more of it, as the engine's peer fetch does (off with ``--no-kv-peer-fetch``).
``--admission`` gives the simulated tiers their TTFT SLOs (predicted misses are rejected, lowest
priority first, as the admission service does with a QoS file; a request the routing's choice would
serve late is tried on ``--fallback-workers`` others first); without it every request is admitted.

``--start-stack`` starts ``tandem up`` here for the live run (``--decode``, ``--kv-cache-memory``,
``--kv-host-memory``, ``--no-kv-peer-fetch``, ``--routing``; the tiers and, with ``--admission``,
their SLOs in a QoS file) and stops it after; ``--compare-sim`` also simulates the slice (``cpu``)
and reports the simulator's error. ``--simulate cpu --compare-with LIVE_JSON`` compares a simulation
with a live run of the same slice recorded earlier (with another ``--calibration-dir``, say).
``--prefill-workers N`` adds prefill workers beside the decode workers (live and ``cpu``; decode
workers still prefill prompts of up to 512 uncached tokens), and
``--autoscale`` lets the autoscaler flip any worker between the roles as long as one decodes
(``--autoscale-*`` set its interval, window, cooldown, stabilization window and decode capacity);
a live run then records the split over time and the autoscaler's decisions.

Writes ``--out`` (JSON: the summary's fields at the top level, then ``config`` and every request
unless ``--no-per-request``, live ones with the decode worker that served them) and a PNG next to
it (TTFT and ITL CDFs per tier, TTFT over the run, hit ratio against ideal).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from functools import lru_cache
from pathlib import Path

from loadtest.tools.harness import SplitSampler, status
from loadtest.tools.stats import RequestResult, percentile
from loadtest.tools.workload import WORDS

TRACE_BLOCK_TOKENS = 512      # Mooncake's prefix block
ENGINE_BLOCK_TOKENS = 16      # the engine's KV block (shared.engine.config.EngineConfig.block_size)
DEFAULT_TIER = "default"
DEFAULT_GPU_CLUSTER = Path("examples/clusters/mooncake-h100x32.yaml")
CALIBRATION_DIR = Path("loadtest/results/calibration")


# --- the trace ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class TraceRecord:
    at_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]


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
    recs: list[TraceRecord] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                inp = int(rec["input_length"])
                ids = tuple(int(h) for h in rec.get("hash_ids") or ())
                recs.append(TraceRecord(float(rec["timestamp"]) / 1000.0, inp, int(rec["output_length"]), ids))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({exc!r})") from exc
            if recs[-1].input_len < 1:
                raise ValueError(f"{path}:{lineno}: input_length must be >= 1")
    recs.sort(key=lambda r: r.at_s)   # stable: equal timestamps keep the file's order
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


# --- outcomes and the summary (one form for live and simulated runs) ---------------------------

@dataclass
class Outcome:
    index: int
    tier: str
    status: str                       # "ok", "rejected" (429) or "failed"
    scheduled_s: float
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    finished_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int = 0
    retry_after_s: float | None = None
    num_retries: int = 0
    predicted_ttft_s: float | None = None
    error: str | None = None
    worker: str | None = None         # live: the decode worker admission chose (X-Tandem-Worker)
    error_message: str | None = None  # live: the error body's message (a 429's reason)


def outcome_of(req: ReplayRequest, r: RequestResult) -> Outcome:
    ok = r.error is None and r.finished_s is not None
    status = "ok" if ok else ("rejected" if r.error == "HTTP 429" else "failed")
    return Outcome(req.index, req.tier, status, r.scheduled_s, r.ttft_s if ok else None, r.tpot_s if ok else None,
                   r.e2e_s if ok else None, r.finished_s, r.itls_s() if ok else [], r.prompt_tokens,
                   r.cached_tokens, r.num_output_tokens, r.retry_after_s, r.num_retries, r.predicted_ttft_s,
                   r.error, r.worker_id, r.error_message)


def _dist(values: list[float]) -> dict:
    return {"mean": sum(values) / len(values) if values else None,
            **{f"p{q}": percentile(values, q) for q in (50, 90, 99)}}


def meets_slo(status: str, ttft_s: float | None, tpot_s: float | None, ttft_slo_s: float,
              tpot_slo_s: float | None) -> bool:
    """A request served within its tier's TTFT SLO and, where the tier has one, its TPOT SLO:
    what goodput and attainment count."""
    return (status == "ok" and ttft_s is not None and ttft_s <= ttft_slo_s
            and (tpot_slo_s is None or (tpot_s or 0.0) <= tpot_slo_s))


def _good(o: Outcome, t: TierSpec) -> bool:
    return meets_slo(o.status, o.ttft_s, o.tpot_s, t.ttft_slo_s, t.tpot_slo_s)


def summarize(outcomes: list[Outcome], requests: list[ReplayRequest], tiers: list[TierSpec],
              itl_is_tpot: bool = False) -> dict:
    """``itl_is_tpot``: the outcomes have no inter-token times (simulated): ITL percentiles are
    those of the requests' TPOT."""

    def itls(os_: list[Outcome]) -> list[float]:
        if itl_is_tpot:
            return [o.tpot_s for o in os_ if o.tpot_s is not None and o.output_tokens > 1]
        return [x for o in os_ for x in o.itls_s]

    by_tier = {t.name: t for t in tiers}
    ok = [o for o in outcomes if o.status == "ok"]
    start = min((o.scheduled_s for o in outcomes), default=0.0)
    end = max((o.finished_s for o in ok if o.finished_s is not None), default=start)
    duration = max(end - start, 1e-9)
    good = [o for o in ok if _good(o, by_tier[o.tier])]
    with_usage = [o for o in ok if o.prompt_tokens]
    prompt = sum(o.prompt_tokens for o in with_usage)
    cached = sum(o.cached_tokens or 0 for o in with_usage)
    expected = {r.index: r.input_tokens for r in requests}
    ideal = ideal_ratios(requests)
    hit_ratio = cached / prompt if prompt else None
    retry_after = [o.retry_after_s for o in outcomes if o.retry_after_s is not None]
    summary = {
        "requests": len(outcomes), "completed": len(ok),
        "rejected": sum(1 for o in outcomes if o.status == "rejected"),
        "failed": sum(1 for o in outcomes if o.status == "failed"),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
        "retried": sum(o.num_retries for o in outcomes),
        "retry_after_s": {"mean": sum(retry_after) / len(retry_after), "max": max(retry_after)} if retry_after else None,
        "hit_ratio": hit_ratio, **ideal,
        "hit_ratio_vs_ideal": hit_ratio / ideal["ideal_token_hit_ratio"]
        if hit_ratio is not None and ideal["ideal_token_hit_ratio"] else None,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "prompt_tokens_mismatched": sum(1 for o in with_usage if o.prompt_tokens != expected.get(o.index)),
        "duration_s": duration,
        "throughput_rps": len(ok) / duration,
        "output_tokens_per_s": sum(o.output_tokens for o in ok) / duration,
        "goodput_rps": len(good) / duration,
        "attainment": len(good) / len(outcomes) if outcomes else None,
        "ttft_s": _dist([o.ttft_s for o in ok if o.ttft_s is not None]),
        "itl_s": _dist(itls(ok)), "itl_is_tpot": itl_is_tpot,
        "tpot_s": _dist([o.tpot_s for o in ok if o.tpot_s is not None]),
        "e2e_s": _dist([o.e2e_s for o in ok if o.e2e_s is not None]),
        "tiers": {},
    }
    for t in tiers:
        mine = [o for o in outcomes if o.tier == t.name]
        mine_ok = [o for o in mine if o.status == "ok"]
        mine_good = [o for o in mine_ok if _good(o, t)]
        predicted = [o.ttft_s / o.predicted_ttft_s for o in mine_ok if o.ttft_s is not None and o.predicted_ttft_s]
        summary["tiers"][t.name] = {
            "requests": len(mine), "completed": len(mine_ok),
            "rejected": sum(1 for o in mine if o.status == "rejected"),
            "failed": sum(1 for o in mine if o.status == "failed"),
            "slo_ttft_s": t.ttft_slo_s, "slo_tpot_s": t.tpot_slo_s,
            "attainment": len(mine_good) / len(mine) if mine else None,
            "attainment_admitted": len(mine_good) / len(mine_ok) if mine_ok else None,
            "goodput_rps": len(mine_good) / duration,
            "ttft_s": _dist([o.ttft_s for o in mine_ok if o.ttft_s is not None]),
            "itl_s": _dist(itls(mine_ok)),
            "ttft_over_predicted_p50": percentile(predicted, 50),
        }
    return summary


def format_summary(label: str, s: dict) -> str:
    def ms(d: dict, k: str) -> str:
        return "-" if d.get(k) is None else f"{d[k] * 1000:.0f}"

    def pct(x) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    lines = [f"{label}: {s['completed']}/{s['requests']} completed, {s['rejected']} rejected (429), "
             f"{s['failed']} failed; {s['throughput_rps']:.2f} req/s, goodput {s['goodput_rps']:.2f} req/s "
             f"over {s['duration_s']:.1f} s",
             f"  TTFT p50/p90/p99 {ms(s['ttft_s'], 'p50')}/{ms(s['ttft_s'], 'p90')}/{ms(s['ttft_s'], 'p99')} ms, "
             f"ITL p50/p90/p99 {ms(s['itl_s'], 'p50')}/{ms(s['itl_s'], 'p90')}/{ms(s['itl_s'], 'p99')} ms",
             f"  prefix hit ratio {pct(s['hit_ratio'])} (ideal: {pct(s['ideal_token_hit_ratio'])} of tokens, "
             f"{pct(s['ideal_hit_ratio'])} of blocks; achieved/ideal {pct(s['hit_ratio_vs_ideal'])})"]
    for name, t in s["tiers"].items():
        lines.append(f"  {name}: {t['completed']}/{t['requests']} completed, {t['rejected']} rejected, "
                     f"TTFT p50/p90 {ms(t['ttft_s'], 'p50')}/{ms(t['ttft_s'], 'p90')} ms, attainment "
                     f"{pct(t['attainment'])} (admitted: {pct(t['attainment_admitted'])}, "
                     f"SLO {t['slo_ttft_s'] * 1000:.0f} ms)")
    return "\n".join(lines)


# --- live --------------------------------------------------------------------------------------

def run_live(url: str, model: str, requests: list[ReplayRequest], *, seed: int = 0, max_retries: int = 0,
             progress: bool = True, timeout_s: float = 600.0) -> list[Outcome]:
    import asyncio

    from loadtest.tools.runner import run_openai
    from loadtest.tools.workload import RequestSpec

    keys = {r.index: r.api_key for r in requests}
    if any(k is None for k in keys.values()) and any(k is not None for k in keys.values()):
        raise ValueError("either every tier has an API key or none does")
    key_of = None if all(k is None for k in keys.values()) else (lambda s: keys[s.index])
    specs = [RequestSpec(r.index, r.at_s, prompt_text(r, seed), r.output_tokens) for r in requests]
    results = asyncio.run(run_openai(url, model, specs, key_of=key_of, progress=progress, timeout_s=timeout_s,
                                     max_retries=max_retries))
    by_index = {r.index: r for r in requests}
    return [outcome_of(by_index[res.index], res) for res in results]


def qos_yaml(tiers: list[TierSpec], with_slos: bool) -> str:
    lines = [f"default_tier: {tiers[-1].name}", "tiers:"]
    for priority, t in enumerate(tiers):
        slo = f", ttft_slo_ms: {t.ttft_slo_s * 1000:g}" if with_slos else ""
        lines.append(f"  {t.name}: {{priority: {priority}{slo}}}")
    return "\n".join(lines) + "\n"


def decode_flags(args) -> dict[str, object]:
    """The decode workers' flags for ``--start-stack`` (their KV pool, host tier, peer fetch)."""
    flags: dict[str, object] = {"device": "cpu"}
    if args.kv_cache_memory:
        flags["kv_cache_memory"] = args.kv_cache_memory
    if args.kv_host_memory:
        flags["kv_host_memory"] = args.kv_host_memory
    if not args.kv_peer_fetch:
        flags["kv_peer_fetch"] = False
    return flags


def autoscaler_flags(args) -> dict[str, object]:
    """The autoscaler's flags for ``--start-stack --autoscale`` (none: it only serves the cluster view).
    Every worker may flip, as long as one decodes."""
    if not args.autoscale:
        return {}
    flags: dict[str, object] = {"autoscale": True, "min_prefill_workers": 0, "min_decode_workers": 1,
                                "autoscale_interval_s": args.autoscale_interval_s,
                                "autoscale_window_s": args.autoscale_window_s,
                                "autoscale_cooldown_s": args.autoscale_cooldown_s,
                                "autoscale_stabilization_s": args.autoscale_stabilization_s}
    if args.autoscale_decode_capacity is not None:
        flags["decode_capacity_tokens_per_s"] = args.autoscale_decode_capacity
    return flags


def start_stack(args, tiers: list[TierSpec], state_dir: Path, log):
    from shared.stack.stack import Stack, StackSpec

    gateway_flags: dict[str, object] = {}
    admission_flags: dict[str, object] = {"overlap_weight": 0.0 if args.routing == "load" else 1.0,
                                          "routing": "round-robin" if args.routing == "round-robin" else "kv",
                                          "fallback_workers": args.fallback_workers}
    if any(t.api_key for t in tiers):
        qos = state_dir / "qos.yaml"
        qos.write_text(qos_yaml(tiers, args.admission))
        gateway_flags |= {"qos": str(qos), "api_keys": ",".join(f"{t.api_key}:{t.name}" for t in tiers)}
        admission_flags["qos"] = str(qos)
    stack = Stack(StackSpec(state_dir=state_dir / "stack", num_decode=args.decode, model=args.model_live, port=0,
                            namespace=f"replay{os.getpid()}", log_level="WARNING", decode_flags=decode_flags(args),
                            num_prefill=args.prefill_workers or 0, prefill_flags=decode_flags(args),
                            gateway_flags=gateway_flags, admission_flags=admission_flags,
                            autoscaler_flags=autoscaler_flags(args)),
                  on_line=lambda name, line: log.write(f"{name:<12}| {line}\n"))
    stack.start()
    return stack


# --- simulated ---------------------------------------------------------------------------------

def parse_bytes(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    for u, m in units.items():
        if t.endswith(u):
            return int(float(t[:-len(u)]) * m)
    return int(float(t))


def _trace_of(requests: list[ReplayRequest], block_tokens: int):
    import numpy as np

    from shared.sim.traces import Trace

    return Trace(np.array([r.at_s for r in requests], dtype=float),
                 np.array([r.input_tokens for r in requests], dtype=np.int64),
                 np.array([r.output_tokens for r in requests], dtype=np.int64),
                 [list(r.hash_ids) for r in requests], block_tokens, tiers=[r.tier for r in requests])


def _admission(tiers: list[TierSpec], with_slos: bool):
    from shared.policy.admission import AdmissionConfig
    from shared.policy.qos import QosConfig, QosTier

    return AdmissionConfig(QosConfig(default_tier=tiers[-1].name, tiers={
        t.name: QosTier(priority=k, ttft_slo_ms=t.ttft_slo_s * 1000 if with_slos else None)
        for k, t in enumerate(tiers)}), min_retry_after_s=0.0)


def _routing(mode: str):
    from shared.policy.kv_routing import RoutingWeights

    return RoutingWeights(overlap_weight=0.0) if mode == "load" else RoutingWeights()


def _workload(requests: list[ReplayRequest], tiers: list[TierSpec]):
    import numpy as np

    from shared.planner.config import Slo, WorkloadSpec

    inp = np.array([r.input_tokens for r in requests], dtype=float)
    span = max(requests[-1].at_s - requests[0].at_s, 1e-3) if len(requests) > 1 else 1.0
    tpot = min((t.tpot_slo_s for t in tiers if t.tpot_slo_s), default=None)
    return WorkloadSpec(request_rate=max(len(requests) / span, 1e-6), input_len=max(1, round(inp.mean())),
                        output_len=max(1, round(float(np.mean([r.output_tokens for r in requests])))),
                        length_cv=float(inp.std() / inp.mean()) if inp.mean() else 0.0,
                        slo=Slo(ttft_s=min(t.ttft_slo_s for t in tiers) if all(math.isfinite(t.ttft_slo_s)
                                                                                for t in tiers) else 60.0,
                                tpot_s=tpot or 1.0))


def gpu_setup(requests, tiers, args):
    """(Evaluator, Plan, SimConfig) for the GPU cluster, planned for the slice."""
    from shared.planner.config import load_cluster, load_model
    from shared.planner.costmodel import Efficiency
    from shared.planner.devices import Cluster
    from shared.planner.flow import Evaluator
    from shared.planner.plan import Plan, make_plan
    from shared.sim.simulator import SimConfig

    cluster, model, workload = load_cluster(args.cluster), load_model(args.model), _workload(requests, tiers)
    eff = Efficiency()
    plan = (Plan.model_validate_json(Path(args.plan).read_text()) if args.plan
            else make_plan(cluster, model, workload, eff, seed=args.seed))
    if args.prefill_workers is not None:
        plan = with_prefill_workers(plan, args.prefill_workers)
    cfg = SimConfig(routing=_routing(args.routing), admission=_admission(tiers, args.admission),
                    round_robin=args.routing == "round-robin", seed=args.seed,
                    prefix_cache_blocks=args.prefix_cache_blocks, fallback_workers=args.fallback_workers,
                    peer_fetch=_peer_fetch(args),
                    autoscale=_autoscale(args), autoscale_window_s=args.autoscale_window_s)
    return Evaluator(Cluster(cluster), model, workload, eff), plan, cfg


def _autoscale(args, **bounds):
    """The simulated autoscaler's policy settings (None: roles stay as set), as the service's flags."""
    from shared.policy.autoscale import AutoscaleConfig

    if not args.autoscale:
        return None
    return AutoscaleConfig(cooldown_s=args.autoscale_cooldown_s, stabilization_s=args.autoscale_stabilization_s,
                           **bounds)


def _peer_fetch(args):
    """The simulated decode workers' peer fetch: on, as the engine's default, unless --no-kv-peer-fetch."""
    from shared.policy.kv_fetch import FetchConfig

    return FetchConfig() if args.kv_peer_fetch else None


def cpu_setup(requests, tiers, args):
    """(Evaluator, Plan, SimConfig): ``args.decode`` decode workers on this machine, as ``tandem up``
    runs them, timed by the fitted CPU cost model."""
    from dataclasses import replace as dc_replace

    from shared.planner.config import GpuType, load_calibration, load_model
    from shared.planner.costmodel import DecodeSample, PrefillSample, calibrate
    from shared.planner.config import ClusterSpec
    from shared.planner.devices import Cluster
    from shared.planner.flow import Evaluator
    from shared.planner.plan import Plan, WorkerPlan
    from shared.policy.disagg import DisaggConfig
    from shared.sim.simulator import SimConfig

    cal = load_calibration(Path(args.calibration_dir) / "smollm2-cpu.yaml")
    model = load_model(cal.model)
    eff = calibrate(model, cal.gpu, [PrefillSample(m.num_tokens, m.seconds) for m in cal.prefill],
                    [DecodeSample(m.batch, m.context_len, m.seconds) for m in cal.decode], fit_overheads=True)
    num_prefill = args.prefill_workers or 0
    num_workers = args.decode + num_prefill
    share = args.cpu_share if args.cpu_share is not None else 1.0 / num_workers
    # the workers split the CPU: each runs at ``share`` of the measured speed (overheads included)
    eff = dc_replace(eff, compute=eff.compute * share, hbm=eff.hbm * share,
                     prefill_overhead_s=eff.prefill_overhead_s / share, decode_seq_s=eff.decode_seq_s / share)
    kv_bytes = parse_bytes(args.kv_cache_memory or "1GiB")
    hbm_gib = (kv_bytes + model.weight_bytes) / eff.mem_fraction / (1 << 30)
    gpu = GpuType(tflops_bf16=cal.gpu.tflops_bf16, hbm_gib=hbm_gib, hbm_gbps=cal.gpu.hbm_gbps, price_per_hour=0.0)
    spec = ClusterSpec(gpu_types={"cpu": gpu}, inter_node_gbps=1.0,
                       nodes=[{"name": "local", "gpu_type": "cpu", "num_gpus": num_workers, "intra_gbps": 1.0}])
    workload = _workload(requests, tiers)
    any_prefill = bool(num_prefill or args.autoscale)   # a worker prefills now, or may after a flip
    if any_prefill:
        # a worker's prefill capacity is taken at the loosest tier's TTFT: at its share of the CPU a
        # long prompt of the slice misses the tightest one alone, and the cost model then gives a
        # worker no prefill capacity at all (it could neither prefill nor flip to it)
        loosest = max(t.ttft_slo_s for t in tiers)
        if math.isfinite(loosest):
            workload = workload.model_copy(update={"slo": workload.slo.model_copy(update={"ttft_s": loosest})})
    rate = workload.request_rate
    roles = ["decode"] * args.decode + ["prefill"] * num_prefill
    numbers = {"decode": iter(range(1, args.decode + 1)), "prefill": iter(range(1, num_prefill + 1))}
    plan = Plan(model=model.name, num_gpus=num_workers, request_rate=rate, mean_input_len=workload.input_len,
                mean_output_len=workload.output_len, slo=workload.slo,
                workers=[WorkerPlan(worker_id=f"{role}-{next(numbers[role])}", role=role, gpu_type="cpu",
                                    gpus=[f"local/gpu{k}"], tp=1, pp=1, capacity_rps=0.0,
                                    assigned_rps=rate / num_workers, latency_s=0.0, price_per_hour=0.0)
                         for k, role in enumerate(roles)],
                routes=[], capacity_rps=0.0, throughput_rps=rate, output_tokens_per_s=rate * workload.output_len,
                predicted_ttft_s=None, predicted_tpot_s=None, cost_per_hour=0.0,
                cost_per_million_output_tokens=None, planning_time_s=0.0, search_history=[])
    # decode workers prefill locally up to the engine's threshold, as live (with no prefill worker, all)
    disagg = DisaggConfig() if any_prefill else DisaggConfig(max_local_prefill_tokens=1 << 30)
    cfg = SimConfig(disagg=disagg, routing=_routing(args.routing),
                    admission=_admission(tiers, args.admission), round_robin=args.routing == "round-robin",
                    fallback_workers=args.fallback_workers, peer_fetch=_peer_fetch(args),
                    max_num_seqs=args.max_num_seqs, local_prefill_batch_tokens=args.max_num_batched_tokens,
                    seed=args.seed, prefix_cache_blocks=cpu_prefix_cache_blocks(args, model, kv_bytes),
                    autoscale=_autoscale(args, min_prefill=0, min_decode=1), autoscale_window_s=args.autoscale_window_s)
    return Evaluator(Cluster(spec), model, workload, eff), plan, cfg


def cpu_prefix_cache_blocks(args, model, pool_bytes: int) -> int | None:
    """The simulated prefix cache per worker: ``--prefix-cache-blocks``, or with ``--kv-host-memory``
    the pool's blocks and the host tier's together, as a cache of its own beside the running
    requests (the live pool sends what it evicts to the host tier and copies it back on a hit, so
    what it can hold is about both; the copy back is not timed; ``pool_bytes``: the pool's size).
    None: the pool's free part."""
    if args.prefix_cache_blocks is not None or not args.kv_host_memory:
        return args.prefix_cache_blocks
    block_bytes = model.kv_bytes_per_token() * scaled_block_tokens(args.length_scale)
    return int((pool_bytes + parse_bytes(args.kv_host_memory)) // block_bytes)


def with_prefill_workers(plan, num_prefill: int):
    """``plan`` with ``num_prefill`` of its groups prefilling and the rest decoding (a fixed split):
    planned prefill groups stay prefill first, then planned decode groups are added (or, for fewer,
    planned prefill groups decode, the last first). The groups and their GPUs stay as planned."""
    active = [w for w in plan.workers if w.role != "idle"]
    if not 1 <= num_prefill < len(active):
        raise SystemExit(f"--prefill-workers {num_prefill}: the plan has {len(active)} groups (at least one "
                         "must decode)")
    order = [w for w in active if w.role == "prefill"] + [w for w in reversed(active) if w.role == "decode"]
    prefill = {w.worker_id for w in order[:num_prefill]}
    workers = [w if w.role == "idle" else w.model_copy(update={"role": "prefill" if w.worker_id in prefill
                                                                else "decode"}) for w in plan.workers]
    return plan.model_copy(update={"workers": workers})


def run_sim(requests: list[ReplayRequest], tiers: list[TierSpec], args) -> tuple[list[Outcome], dict]:
    """Simulate ``requests``; their outcomes and what the run was (setup, workers, wall time)."""
    import numpy as np

    from shared.sim.simulator import Simulator

    ev, plan, cfg = (gpu_setup if args.simulate == "gpu" else cpu_setup)(requests, tiers, args)
    block = scaled_block_tokens(args.length_scale)
    trace = _trace_of(requests, block)
    t0 = time.perf_counter()
    sim = Simulator(ev, plan, cfg, block_size=block)
    res = sim.run(trace)
    wall = time.perf_counter() - t0
    outcomes = []
    for k, r in enumerate(requests):
        if res.rejected[k]:
            outcomes.append(Outcome(r.index, r.tier, "rejected", r.at_s))
            continue
        ttft, tpot, fin = float(res.ttft_s[k]), float(res.tpot_s[k]), float(res.finish_s[k])
        done = not np.isnan(fin)
        outcomes.append(Outcome(r.index, r.tier, "ok" if done else "failed", r.at_s, ttft, tpot, fin - r.at_s, fin,
                                [],
                                r.input_tokens, int(res.cached_tokens[k]), r.output_tokens,
                                error=None if done else "not finished"))
    workers = [{"name": w.worker_id, "role": w.role, "gpus": w.gpus, "tp": w.tp, "pp": w.pp} for w in plan.workers]
    info = {"setup": args.simulate, "wall_s": wall, "num_events": res.num_events, "workers": workers,
            "num_gpus": plan.num_gpus, "rejections": dict(res.rejections), "itl_is_tpot": True,
            "admitted_elsewhere": res.admitted_elsewhere, "peer_fetches": res.num_fetches,
            "flips": res.flips, "num_prefill_over_time": [[t, n] for t, n in zip(res.tick_s, res.num_prefill)],
            "model": ev.model.name, "block_tokens": block,
            "kv_capacity_tokens": [float(w.kv_capacity) for w in sim.workers]}
    return outcomes, info


# --- report ------------------------------------------------------------------------------------

def plot(path: Path, outcomes: list[Outcome], summary: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from loadtest.tools.report import _cdf

    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    for tier in summary["tiers"]:
        ok = [o for o in outcomes if o.tier == tier and o.status == "ok"]
        _cdf(axes[0], [o.ttft_s * 1000 for o in ok if o.ttft_s is not None], tier)
        _cdf(axes[1], [x * 1000 for o in ok for x in o.itls_s] if not summary.get("itl_is_tpot")
             else [o.tpot_s * 1000 for o in ok if o.tpot_s is not None and o.output_tokens > 1], tier)
        axes[2].scatter([o.scheduled_s for o in ok], [o.ttft_s for o in ok], s=4, label=tier)
    rej = [o for o in outcomes if o.status == "rejected"]
    if rej:
        axes[2].scatter([o.scheduled_s for o in rej], [0.0] * len(rej), marker="x", s=8, color="red",
                        label="rejected (429)")
    bars = {"achieved (tokens)": summary["hit_ratio"] or 0.0, "ideal (tokens)": summary["ideal_token_hit_ratio"],
            "ideal (blocks)": summary["ideal_hit_ratio"]}
    axes[3].bar(list(bars), [100 * v for v in bars.values()], color=["tab:blue", "tab:grey", "tab:grey"])
    for ax, t, xl in zip(axes, ("TTFT (ms)", "inter-token latency (ms)", "TTFT (s) by send time",
                                "prefix-cache hit ratio (%)"), ("ms", "ms", "sent at (s)", "")):
        ax.set_title(t)
        ax.set_xlabel(xl)
        ax.grid(alpha=0.3)
    for ax in axes[:3]:
        ax.legend(fontsize=7)
    axes[0].set_ylabel("CDF")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_out(path: Path, summary: dict, config: dict, outcomes: list[Outcome], title: str,
              extra: dict | None = None, per_request: bool = True) -> tuple[Path, Path]:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {**summary, **(extra or {}), "config": config}
    if per_request:
        payload["per_request"] = [asdict(o) for o in outcomes]
    path.write_text(json.dumps(payload, indent=1, default=str))
    png = path.with_suffix(".png")
    plot(png, outcomes, summary, title)
    return path, png


def relative_error(sim: float | None, live: float | None) -> float | None:
    if sim is None or live is None or live == 0:
        return None
    return (sim - live) / live


def format_sim_vs_live(rows: dict) -> str:
    """``compare``'s rows on one line."""
    return "sim vs live: " + "; ".join(
        f"{k} {'-' if r['rel_error'] is None else format(r['rel_error'], '+.0%')}" for k, r in rows.items())


def compare(sim: dict, live: dict) -> dict:
    """The simulator against the live run: goodput, hit ratio, each tier's attainment, TTFT p50/p90."""
    rows = {"goodput_rps": (sim["goodput_rps"], live["goodput_rps"]),
            "hit_ratio": (sim["hit_ratio"], live["hit_ratio"]),
            "ttft_p50_s": (sim["ttft_s"]["p50"], live["ttft_s"]["p50"]),
            "ttft_p90_s": (sim["ttft_s"]["p90"], live["ttft_s"]["p90"])}
    for tier in live["tiers"]:
        rows[f"{tier}_attainment"] = (sim["tiers"][tier]["attainment"], live["tiers"][tier]["attainment"])
    return {k: {"sim": s, "live": v, "rel_error": relative_error(s, v)} for k, (s, v) in rows.items()}


# --- command line ------------------------------------------------------------------------------

def parse_args(argv=None):
    from shared.policy.autoscale import AutoscaleConfig

    p = argparse.ArgumentParser(prog="python -m loadtest.tools.replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, type=Path, help="Mooncake-format JSONL trace")
    p.add_argument("--max-requests", type=int, default=None, help="replay this many requests (default: all)")
    p.add_argument("--skip", type=int, default=0, help="start this many requests into the trace")
    p.add_argument("--sample-conversations", type=parse_scale, default=1.0, metavar="FRACTION",
                   help="keep this fraction of the conversations (whole; requests sharing their first two "
                        "blocks), before --skip/--max-requests: a long span at a low rate with its reuse kept")
    p.add_argument("--time-scale", type=parse_scale, default=1.0,
                   help="multiply the trace's times by this (4: the slice takes 4x as long)")
    p.add_argument("--rate-scale", type=parse_scale, default=1.0,
                   help="multiply the offered rate by this (divides the times; combines with --time-scale)")
    p.add_argument("--length-scale", type=parse_scale, default=1.0,
                   help="prompt lengths: a 512-token block becomes round(512 * this) tokens (e.g. 1/16)")
    p.add_argument("--output-scale", type=parse_scale, default=None,
                   help="output lengths: multiplied by this (default: --length-scale)")
    p.add_argument("--max-output-tokens", type=int, default=None, help="cap on each output (after scaling)")
    p.add_argument("--max-input-tokens", type=int, default=None,
                   help="drop a prompt's trailing blocks past this many tokens (after scaling)")
    p.add_argument("--api-keys", default=None,
                   help="tiers by API key, highest priority first: KEY:TIER:SHARE,... "
                        "(e.g. key-premium:premium:0.3,key-batch:batch:0.7); none: one tier, no key")
    p.add_argument("--slo-ttft-ms", default="5000", help="TTFT SLO: one value, or TIER=MS,... (default 5000)")
    p.add_argument("--slo-tpot-ms", default=None, help="TPOT SLO: one value, or TIER=MS,... (default: none)")
    p.add_argument("--retry-429", type=int, default=0, metavar="N",
                   help="send a 429 again after its Retry-After, N times at most (default 0: count it)")
    p.add_argument("--seed", type=int, default=0, help="tier draw and block text")
    p.add_argument("--out", type=Path, default=None, help="JSON summary (a PNG is written next to it)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-per-request", action="store_true", help="leave the per-request list out of --out")
    live = p.add_argument_group("live")
    live.add_argument("--url", default="http://127.0.0.1:8000", help="the stack's gateway")
    live.add_argument("--model-name", dest="model_live", default="smollm2-135m",
                      help="the model the stack serves (the request's model field)")
    live.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    live.add_argument("--start-stack", action="store_true",
                      help="start tandem up here for the run (--decode, --kv-cache-memory, --routing, --admission)")
    live.add_argument("--compare-with", type=Path, default=None, metavar="LIVE_JSON",
                      help="with --simulate: compare with a live run of the same slice recorded earlier (its --out)")
    live.add_argument("--compare-sim", action="store_true",
                      help="also simulate the slice on this machine's model (as --simulate cpu) and compare")
    sim = p.add_argument_group("simulated / stack shape")
    sim.add_argument("--simulate", choices=["gpu", "cpu"], default=None,
                     help="simulate instead of sending: gpu (a planned GPU cluster) or cpu (this machine)")
    sim.add_argument("--routing", choices=["kv", "load", "round-robin"], default="kv",
                     help="kv: overlap + load (default); load: overlap weight 0; round-robin: the workers in turn")
    sim.add_argument("--admission", action="store_true",
                     help="tiers get their TTFT SLOs in admission (predicted misses rejected)")
    sim.add_argument("--fallback-workers", type=int, default=3,
                     help="with --admission: where the routing's choice would miss a request's SLO, try this many "
                          "next-cheapest decode workers before rejecting it (0: reject; admission's flag)")
    sim.add_argument("--prefix-cache-blocks", type=int, default=None,
                     help="simulated: prefix-cache blocks per decode worker (default: what its KV pool holds; "
                          "more stands for a host-memory tier, its copy-back untimed)")
    sim.add_argument("--prefill-workers", type=int, default=None,
                     help="gpu: a fixed split: this many of the plan's groups prefill, the rest decode "
                          "(default: as planned); cpu / --start-stack: prefill workers beside --decode "
                          "(default 0; decode workers prefill prompts of up to 512 uncached tokens themselves)")
    sim.add_argument("--autoscale", action="store_true",
                     help="the autoscaler flips workers between prefill and decode as the load shifts (gpu: the "
                          "plan's groups; cpu / --start-stack: any worker, as long as one decodes)")
    sim.add_argument("--autoscale-interval-s", type=float, default=10.0,
                     help="--start-stack: how often the autoscaler decides (simulated: every tick)")
    sim.add_argument("--autoscale-window-s", type=float, default=30.0, help="the autoscaler's demand window")
    sim.add_argument("--autoscale-cooldown-s", type=float, default=60.0, help="the autoscaler's cooldown")
    sim.add_argument("--autoscale-stabilization-s", type=float, default=AutoscaleConfig.stabilization_s,
                     help="flip only once every tick of this long asked for it (0: at the first)")
    sim.add_argument("--autoscale-decode-capacity", type=float, default=None,
                     help="--start-stack: one decode worker's output tokens/s for the autoscaler (default: its own)")
    sim.add_argument("--cluster", default=str(DEFAULT_GPU_CLUSTER), help="gpu: cluster YAML")
    sim.add_argument("--model", default="llama-2-70b", help="gpu: model preset or YAML")
    sim.add_argument("--plan", default=None, help="gpu: plan JSON (default: plan the cluster for the slice)")
    sim.add_argument("--decode", type=int, default=2, help="cpu / --start-stack: decode workers")
    sim.add_argument("--kv-cache-memory", default=None,
                     help="cpu / --start-stack: each decode worker's KV pool, e.g. 64MiB (default: the engine's 1GiB)")
    sim.add_argument("--kv-host-memory", default=None,
                     help="cpu / --start-stack: each decode worker's host-memory KV tier, e.g. 2GiB (default: "
                          "none; simulated as a prefix cache of the pool's and the tier's blocks)")
    sim.add_argument("--no-kv-peer-fetch", dest="kv_peer_fetch", action="store_false",
                     help="--start-stack and simulated: decode workers do not fetch cached prefixes from each other "
                          "(live: over NIXL)")
    sim.add_argument("--calibration-dir", default=str(CALIBRATION_DIR), help="cpu: calibrate_sim's output")
    sim.add_argument("--cpu-share", type=float, default=None,
                     help="cpu: each worker's share of the machine (default 1/(--decode + --prefill-workers))")
    sim.add_argument("--max-num-seqs", type=int, default=64, help="cpu: the engine's sequence slots")
    sim.add_argument("--max-num-batched-tokens", type=int, default=512, help="cpu: the engine's step budget")
    args = p.parse_args(argv)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        tiers = parse_tiers(args.api_keys, args.slo_ttft_ms, args.slo_tpot_ms)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    records = read_trace(args.trace, args.max_requests, args.skip, args.sample_conversations, args.seed)
    if not records:
        print("error: no requests in the slice", file=sys.stderr)
        return 2
    requests = build_requests(records, time_scale=args.time_scale, rate_scale=args.rate_scale,
                              length_scale=args.length_scale, output_scale=args.output_scale,
                              max_output_tokens=args.max_output_tokens, max_input_tokens=args.max_input_tokens,
                              tiers=tiers, seed=args.seed)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config |= {"host": platform.node(), "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
               "block_tokens": scaled_block_tokens(args.length_scale),
               "retry_policy": f"429 retried after Retry-After, up to {args.retry_429} times"
               if args.retry_429 else "429 counted as rejected, not retried (Retry-After recorded)",
               "truncated_requests": sum(r.truncated for r in requests)}
    extra: dict = {}
    if args.simulate:
        outcomes, info = run_sim(requests, tiers, args)
        summary = summarize(outcomes, requests, tiers, itl_is_tpot=True)
        extra["sim"] = info
        label = f"simulated ({args.simulate}, {info['num_gpus']} devices, {args.routing} routing)"
        print(format_summary(label, summary))
        print(f"simulated {len(requests):,} requests ({info['num_events']:,} events) in {info['wall_s']:.2f} s")
        if args.compare_with:
            live = json.loads(args.compare_with.read_text())
            if live.get("requests") != summary["requests"]:
                print(f"error: {args.compare_with} has {live.get('requests')} requests, this slice "
                      f"{summary['requests']}: not the same slice", file=sys.stderr)
                return 2
            extra["sim_vs_live"] = compare(summary, live)
            extra["compared_with"] = str(args.compare_with)
            print(format_sim_vs_live(extra["sim_vs_live"]))
    else:
        stack = None
        log = None
        import tempfile
        tmp = tempfile.TemporaryDirectory(prefix="tandem-replay-")
        try:
            url = args.url
            if args.start_stack:
                log_path = (args.out.with_suffix(".stack.log") if args.out else Path(tmp.name) / "stack.log")
                log_path.parent.mkdir(parents=True, exist_ok=True)
                log = open(log_path, "w")
                stack = start_stack(args, tiers, Path(tmp.name), log)
                stack.wait_ready(timeout_s=300)
                url = stack.base_url
                print(f"stack ready at {url} ({args.decode} decode workers, {args.routing} routing)", flush=True)
            t0 = time.perf_counter()
            with SplitSampler(url) as split:
                outcomes = run_live(url, args.model_live, requests, seed=args.seed, max_retries=args.retry_429,
                                    progress=not args.no_progress, timeout_s=args.timeout_s)
            extra["wall_s"] = time.perf_counter() - t0
            # ready workers per role over the run, and the autoscaler's decisions that acted
            extra["split_over_time"] = [list(s) for s in split.samples]
            extra["scaling"] = _scaling_status(url)
        finally:
            if stack is not None:
                stack.stop()
            if log is not None:
                log.close()
            tmp.cleanup()
        summary = summarize(outcomes, requests, tiers)
        label = f"live ({url if not args.start_stack else 'tandem up'}, {args.routing} routing)"
        print(format_summary(label, summary))
        if args.compare_sim:
            sim_args = argparse.Namespace(**{**vars(args), "simulate": "cpu"})
            sim_outcomes, info = run_sim(requests, tiers, sim_args)
            sim_summary = summarize(sim_outcomes, requests, tiers, itl_is_tpot=True)
            print(format_summary("simulated (cpu)", sim_summary))
            extra["sim"] = {"summary": sim_summary, **info}
            extra["sim_vs_live"] = compare(sim_summary, summary)
            print(format_sim_vs_live(extra["sim_vs_live"]))
    load = os.getloadavg()[0]
    extra["load_average_1m_at_end"] = load
    if args.out:
        title = (f"{args.trace.name}: {len(requests)} requests, length x{args.length_scale:g}, "
                 f"time x{args.time_scale:g}, rate x{args.rate_scale:g} — "
                 + (f"simulated ({args.simulate})" if args.simulate else "live") + f", {args.routing} routing")
        paths = write_out(args.out, summary, config, outcomes, title, extra, per_request=not args.no_per_request)
        print("wrote", *paths)
    return 0 if summary["failed"] == 0 else 1


def _scaling_status(url: str) -> dict | None:
    try:
        return status(url).get("scaling")
    except OSError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    raise SystemExit(main())

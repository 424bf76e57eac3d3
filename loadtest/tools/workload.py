"""Open-loop workloads: when each request arrives and what it asks for (pure, seeded).

Arrivals are a gamma renewal process: ``burstiness`` 1 is Poisson, below 1 burstier, above 1
more regular; the mean rate is ``rate`` either way. Prompts are text built from a fixed word
list, optionally starting with one of ``num_prefixes`` shared prefixes (the prefix-cache
workload). Output lengths are enforced with ``max_tokens`` and ``ignore_eos``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = ("time year people way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend father "
         "power hour game line end member law car city community name president team minute idea "
         "kid body information back parent face others level office door health person art war "
         "history party result change morning reason research girl guy moment air teacher force").split()


@dataclass(frozen=True)
class RequestSpec:
    index: int
    at_s: float          # arrival time, seconds after the start of the run
    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class WorkloadConfig:
    num_requests: int = 64
    rate: float = 4.0                 # requests per second (mean)
    burstiness: float = 1.0           # gamma shape: 1 = Poisson
    prompt_words: int = 64            # mean prompt length in words (~1.3 tokens each)
    output_tokens: int = 32           # mean output length
    spread: float = 0.5               # lengths uniform in mean × [1 - spread, 1 + spread]
    shared_prefix_words: int = 0      # > 0: every prompt starts with one of the shared prefixes
    num_prefixes: int = 4
    seed: int = 0


def arrival_times(num: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    assert rate > 0 and burstiness > 0, (rate, burstiness)
    t, times = 0.0, []
    for _ in range(num):
        times.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


def _length(mean: int, spread: float, rng: random.Random) -> int:
    low, high = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    return rng.randint(low, high)


def _text(num_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def build_workload(cfg: WorkloadConfig) -> list[RequestSpec]:
    rng = random.Random(cfg.seed)
    prefixes = [_text(cfg.shared_prefix_words, rng) for _ in range(cfg.num_prefixes)] \
        if cfg.shared_prefix_words else [""]
    specs = []
    for i, at in enumerate(arrival_times(cfg.num_requests, cfg.rate, cfg.burstiness, rng)):
        prefix = rng.choice(prefixes)
        body = _text(_length(cfg.prompt_words, cfg.spread, rng), rng)
        prompt = f"{prefix} {body}".strip()
        specs.append(RequestSpec(i, at, prompt, _length(cfg.output_tokens, cfg.spread, rng)))
    return specs

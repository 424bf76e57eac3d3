"""Per-request timings and their summary: TTFT, ITL, TPOT, end-to-end, throughput, goodput."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from shared.telemetry.measure import distribution, meets_slo


@dataclass
class RequestResult:
    index: int
    scheduled_s: float                 # when it was due, relative to the run's start
    started_s: float                   # when it was sent
    first_token_s: float | None = None
    finished_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # arrival of each text chunk
    num_output_tokens: int = 0
    error: str | None = None
    error_message: str | None = None   # the error body's message (a 429's: why admission refused)
    retry_after_s: float | None = None  # a rejection's Retry-After header
    predicted_ttft_s: float | None = None  # admission's prediction (X-Tandem-Predicted-TTFT-Ms)
    prompt_tokens: int | None = None       # the usage the server returned
    cached_tokens: int | None = None       # its prompt_tokens_details.cached_tokens (prefix-cache hit)
    num_retries: int = 0                   # 429s retried after their Retry-After (run_openai's max_retries)
    worker_id: str | None = None           # the decode worker that served it (X-Tandem-Worker)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.started_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.started_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_s is None or self.finished_s is None or self.num_output_tokens < 2:
            return None
        return (self.finished_s - self.first_token_s) / (self.num_output_tokens - 1)

    def itls_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]

    def to_json(self) -> dict:
        return {**asdict(self), "ttft_s": self.ttft_s, "e2e_s": self.e2e_s, "tpot_s": self.tpot_s}


def summarize(results: list[RequestResult], *, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    ok = [r for r in results if r.error is None and r.finished_s is not None]
    start = min((r.started_s for r in results), default=0.0)
    end = max((r.finished_s for r in ok), default=start)
    duration = max(end - start, 1e-9)
    good = [r for r in ok if meets_slo(r.ttft_s, r.tpot_s, slo_ttft_s, slo_tpot_s)]
    num_tokens = sum(r.num_output_tokens for r in ok)
    return {
        "num_requests": len(results), "num_ok": len(ok), "num_errors": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": num_tokens / duration,
        "goodput": len(good) / duration, "num_good": len(good),
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s},
        "ttft_s": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": distribution([x for r in ok for x in r.itls_s()]),
        "tpot_s": distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": distribution([r.e2e_s for r in ok if r.e2e_s is not None]),
    }

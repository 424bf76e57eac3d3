"""Open-loop runners: send each request at its arrival time whether or not earlier ones finished.

``run_openai`` drives any OpenAI-compatible endpoint (``/v1/completions``, streaming, usage);
``run_in_process`` drives an ``AsyncEngine`` directly with the same schedule (the baseline the
service path is measured against).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import aiohttp
from tqdm import tqdm

from loadtest.tools import sse
from loadtest.tools.stats import RequestResult
from loadtest.tools.workload import RequestSpec


async def _open_loop(specs: list[RequestSpec], one: Callable, progress: bool, label: str) -> list[RequestResult]:
    bar = tqdm(total=len(specs), desc=label, unit="req", disable=not progress, leave=False)
    start = time.perf_counter()

    async def scheduled(spec: RequestSpec) -> RequestResult:
        await asyncio.sleep(max(0.0, start + spec.at_s - time.perf_counter()))
        result = RequestResult(spec.index, spec.at_s, time.perf_counter() - start)
        try:
            await one(spec, result, lambda: time.perf_counter() - start)
        except Exception as exc:  # noqa: BLE001 — recorded per request, the run goes on
            result.error = f"{type(exc).__name__}: {exc}"[:200]
        bar.update(1)
        return result

    try:
        return list(await asyncio.gather(*(scheduled(s) for s in specs)))
    finally:
        bar.close()


async def run_openai(base_url: str, model: str, specs: list[RequestSpec], *, api_key: str | None = None,
                     timeout_s: float = 600.0, progress: bool = True, ignore_eos: bool = True,
                     key_of: Callable[[RequestSpec], str] | None = None,
                     max_retries: int = 0) -> list[RequestResult]:
    """``key_of``: each request's own API key (e.g. its QoS tier's), instead of ``api_key``.
    ``max_retries``: a 429 is sent again after its Retry-After (1 s without one), this many times at
    most; the request's times still count from its first send. 0: a 429 is the request's result."""
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:

        async def one(spec: RequestSpec, result: RequestResult, now: Callable[[], float]) -> None:
            body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "stream": True,
                    "temperature": 0.0, "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}}
            own = {"Authorization": f"Bearer {key_of(spec)}"} if key_of else None
            while True:
                async with session.post(url, json=body, headers=own) as resp:
                    if resp.status != 200:
                        result.error = f"HTTP {resp.status}"
                        if "Retry-After" in resp.headers:
                            result.retry_after_s = float(resp.headers["Retry-After"])
                        result.error_message = _error_message(await resp.read())
                        if resp.status == 429 and result.num_retries < max_retries:
                            result.num_retries += 1
                            await asyncio.sleep(result.retry_after_s if result.retry_after_s is not None else 1.0)
                            continue
                        return
                    result.error = None
                    if await _stream(resp, result, now):
                        result.finished_s = now()
                    return

        async def _stream(resp, result: RequestResult, now: Callable[[], float]) -> bool:
            """Read a 200's event stream into ``result``; False on an error event."""
            result.worker_id = resp.headers.get("X-Tandem-Worker") or None
            if "X-Tandem-Predicted-TTFT-Ms" in resp.headers:
                result.predicted_ttft_s = float(resp.headers["X-Tandem-Predicted-TTFT-Ms"]) / 1000
            async for event in sse.aevents(resp.content):
                if event == sse.DONE:
                    continue
                if "error" in event:
                    result.error = event["error"].get("message", "stream error")
                    return False
                if event.get("usage"):
                    usage = event["usage"]
                    result.num_output_tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage.get("prompt_tokens")
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                if event.get("choices") and event["choices"][0].get("text"):
                    t = now()
                    result.first_token_s = result.first_token_s or t
                    result.token_times_s.append(t)
            return True

        return await _open_loop(specs, one, progress, "openai")


async def run_in_process(engine, specs: list[RequestSpec], *, progress: bool = True,
                         ignore_eos: bool = True) -> list[RequestResult]:
    from shared.engine import SamplingParams  # noqa: PLC0415 — torch only for this runner

    tokenizer = engine.tokenizer

    async def one(spec: RequestSpec, result: RequestResult, now: Callable[[], float]) -> None:
        # Same work as the gateway does before it admits: tokenization.
        ids = tokenizer.encode(spec.prompt)
        params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=ignore_eos)
        async for out in engine.generate(f"load-{spec.index}-{time.monotonic_ns()}", ids, params):
            if out.new_token_ids:
                t = now()
                result.first_token_s = result.first_token_s or t
                result.token_times_s.append(t)
                result.num_output_tokens += len(out.new_token_ids)
        result.finished_s = now()

    return await _open_loop(specs, one, progress, "in-process")


def _error_message(body: bytes) -> str | None:
    """An error response's message: OpenAI's ``{"error": {"message": ...}}``, else the body's start."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace").strip()
    return str(message)[:300] or None

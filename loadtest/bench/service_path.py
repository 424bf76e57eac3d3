"""The service path's own latency, engine excluded: gateway, admission, kv-index, NATS and Redis
in front of the documented echo worker, which answers at once. Requests go one at a time, so the
time to first token is exactly what the stack adds before an engine would start (HTTP, parsing,
chat-free tokenization, block hashing, admission with its kv-index lookup, the NATS hops, SSE).

    python -m loadtest.bench.service_path [--num-requests 200] [--prompt-words 64] [--out loadtest/results]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from loadtest.tools import sse
from loadtest.tools.harness import log_to
from loadtest.tools.workload import WorkloadConfig, build_workload
from shared.telemetry.measure import percentile

ECHO_WORKER = Path(__file__).resolve().parents[2] / "docs" / "examples" / "echo_worker.py"


async def measure(base_url: str, model: str, prompts: list[str]) -> list[float]:
    ttfts = []
    async with aiohttp.ClientSession() as session:
        for prompt in prompts:
            body = {"model": model, "prompt": prompt, "max_tokens": 2, "stream": True}
            started = time.perf_counter()
            async with session.post(base_url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                async for event in sse.aevents(resp.content):
                    if event != sse.DONE and any(c.get("text") for c in event.get("choices") or ()):
                        ttfts.append(time.perf_counter() - started)
                        break
                await resp.read()
    return ttfts


def add_echo_worker(stack, model: str, on_line) -> None:
    """The echo worker as the decode worker of ``stack`` (started, with no engine workers)."""
    from services.stack.children import Child, child_env  # noqa: PLC0415

    stack.children["echo"] = Child("echo", [
        sys.executable, str(ECHO_WORKER), "--namespace", stack.spec.namespace, "--model", model,
        "--ttl", str(stack.spec.registry_ttl_s)],
        child_env({"TANDEM_NATS_URL": stack.nats_url}),  # it carries the stack's password
        on_line)


def main(argv: list[str] | None = None) -> int:
    from services.stack.stack import Stack, StackSpec  # noqa: PLC0415
    from shared.tokenizer import load_tokenizer  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = p.parse_args(argv)
    prompts = [s.prompt for s in build_workload(WorkloadConfig(num_requests=args.num_requests + 10,
                                                               prompt_words=args.prompt_words))]
    tokenizer = load_tokenizer(args.model)
    started = time.perf_counter()
    for prompt in prompts:
        tokenizer.encode(prompt)
    tokenize_s = (time.perf_counter() - started) / len(prompts)

    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "service_path_stack.log", "w") as log, tempfile.TemporaryDirectory() as state:
        stack = Stack(StackSpec(state_dir=Path(state), num_decode=0, model=args.model, port=0,
                                namespace=f"path{os.getpid()}"),
                      on_line=log_to(log))
        try:
            stack.start()
            add_echo_worker(stack, args.model, log_to(log))
            stack.wait_ready(timeout_s=120, num_decode=1)
            asyncio.run(measure(stack.base_url, args.model, prompts[:10]))  # warm-up
            ttfts = asyncio.run(measure(stack.base_url, args.model, prompts[10:]))
        finally:
            stack.stop()
    result = {"num_requests": len(ttfts), "prompt_words": args.prompt_words, "cpu_count": os.cpu_count(),
              "load_average_1m": os.getloadavg()[0], "tokenize_ms_mean": tokenize_s * 1000,
              **{f"ttft_ms_p{q}": percentile(ttfts, q) * 1000 for q in (50, 90, 99)}}
    (args.out / "service_path.json").write_text(json.dumps(result, indent=2))
    print(f"service path TTFT (engine excluded) p50/p90/p99: {result['ttft_ms_p50']:.2f}/"
          f"{result['ttft_ms_p90']:.2f}/{result['ttft_ms_p99']:.2f} ms over {len(ttfts)} requests; "
          f"in-process tokenization alone {result['tokenize_ms_mean']:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

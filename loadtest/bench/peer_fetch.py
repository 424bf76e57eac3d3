"""Cross-worker prefix fetch against recompute: TTFT of a request whose long prefix (2,000 tokens by
default) another decode worker holds, on a real stack of two decode workers (NATS, kv-index, NIXL
over UCX), both paths in one run.

    python -m loadtest.bench.peer_fetch [--prefix-tokens 2000 --trials 5] [--out loadtest/results/peer_fetch]

Per trial, two fresh random prefixes. For each, worker A computes it first (a request of its own),
then worker B gets the prefix plus a new question: for the first prefix with the hint admission
would attach (``kv_source``: A holds it), so B fetches the blocks from A over NIXL; for the second
without it, so B computes the prefix itself. Requests go straight to the workers' subjects over
NATS, one at a time; TTFT is from sending to the first token chunk. For the fetched request the
greedy text is checked against A's answer to the same prompt (A holds its prefix: the reference).
Reported: TTFT p50/p90 of both paths and the ratio recompute / fetch, the fetch's own time from B's
log, bytes moved. Writes ``peer_fetch.json`` and ``peer_fetch.png`` under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from loadtest.tools.harness import status
from loadtest.tools.report import bar_chart
from shared.telemetry.measure import percentile


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default=None, help="workers' dtype (default: the device's fastest)")
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--question-tokens", type=int, default=24)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--kv-cache-memory", default="512MiB", help="per worker")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/peer_fetch"))
    return p.parse_args(argv)


class Client:
    """Requests to one stack's workers over NATS."""

    def __init__(self, stack, model: str, namespace_hex: str, output_tokens: int) -> None:
        from shared.protocol import Subjects

        self.stack, self.model, self.output_tokens = stack, model, output_tokens
        self.namespace = bytes.fromhex(namespace_hex)
        self.subjects = Subjects(stack.spec.namespace)

    async def generate(self, worker_id: str, prompt: list[int], kv_source=None) -> tuple[float, list[int], int]:
        """(TTFT s, output ids, cached prompt tokens)."""
        from shared.bus import Bus
        from shared.kvcache.hashing import hash_blocks
        from shared.protocol import GenerateRequest, SamplingParams

        request = GenerateRequest(
            request_id=f"bench-{uuid.uuid4().hex[:12]}", model=self.model, prompt_token_ids=prompt,
            block_hashes=hash_blocks(prompt, 16, self.namespace), kv_source=kv_source,
            sampling=SamplingParams(max_tokens=self.output_tokens, temperature=0.0, ignore_eos=True))
        bus = await Bus.connect(self.stack.nats_url, "bench-client")
        try:
            await bus.flush()
            started, ttft, ids, cached = time.perf_counter(), None, [], 0
            async for chunk in bus.stream(self.subjects.decode_generate(worker_id), request, first_timeout_s=300,
                                          idle_timeout_s=120):
                ttft = time.perf_counter() - started if ttft is None else ttft
                ids += chunk.token_ids
                cached = max(cached, chunk.num_cached_tokens)
            return ttft, ids, cached
        finally:
            await bus.close()


def fetch_times_ms(lines: list[str]) -> list[float]:
    return [float(m.group(1)) for line in lines if (m := re.search(r"fetched \d+ KV blocks from \S+ in ([\d.]+) ms", line))]


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def run_trial(client: Client, args, holder: str, taker: str, rng: random.Random, trial: int) -> dict:
    """One trial: a fresh prefix fetched from the holder, another recomputed, both TTFTs."""
    from shared.protocol import KvSource

    row = {"trial": trial}
    for path in ("fetch", "recompute"):
        prefix, question = random_tokens(rng, args.prefix_tokens), random_tokens(rng, args.question_tokens)
        asyncio.run(client.generate(holder, prefix + random_tokens(rng, args.question_tokens)))
        source = KvSource(worker_id=holder, num_blocks=args.prefix_tokens // 16) if path == "fetch" else None
        ttft, ids, cached = asyncio.run(client.generate(taker, prefix + question, source))
        row[path] = {"ttft_s": ttft, "cached_tokens": cached}
        if path == "fetch":
            _, reference, _ = asyncio.run(client.generate(holder, prefix + question))
            row[path]["same_text_as_holder"] = ids == reference
    print(f"trial {trial}: fetch {row['fetch']['ttft_s'] * 1e3:.0f} ms ({row['fetch']['cached_tokens']} "
          f"cached, same text {row['fetch']['same_text_as_holder']}), recompute "
          f"{row['recompute']['ttft_s'] * 1e3:.0f} ms", flush=True)
    return row


def run_trials(stack, args, rng: random.Random) -> tuple[list[dict], dict, str, str]:
    """Every trial on a ready stack: the kept rows, the workers' loads after, the holder's and taker's ids."""
    holder, taker = stack.worker_id("decode-1"), stack.worker_id("decode-2")
    info = next(w["info"] for w in status(stack.base_url)["workers"] if w["info"]["worker_id"] == taker)
    client = Client(stack, args.model, info["kv_namespace_hex"], args.output_tokens)
    asyncio.run(client.generate(taker, random_tokens(rng, 64)))  # a first prefill measures B's prefill rate
    rows: list[dict] = []
    for trial in range(args.trials + 1):  # the first trial warms both paths up and is dropped
        row = run_trial(client, args, holder, taker, rng, trial)
        if trial:
            rows.append(row)
    loads = {w["info"]["worker_id"]: w["load"] for w in status(stack.base_url)["workers"]}
    return rows, loads, holder, taker


def ttft_stats(rows: list[dict], path: str) -> dict:
    values = [r[path]["ttft_s"] for r in rows]
    return {"p50_ms": statistics.median(values) * 1e3, "p90_ms": percentile(values, 90) * 1e3,
            "all_ms": [v * 1e3 for v in values]}


def summarize(args, rows: list[dict], loads: dict, holder: str, taker: str, lines: list[str]) -> dict:
    result = {"config": {k: str(v) for k, v in vars(args).items()}, "cpu_count": os.cpu_count(),
              "fetch": ttft_stats(rows, "fetch"), "recompute": ttft_stats(rows, "recompute"),
              "fetch_times_ms": fetch_times_ms(lines)[1:],
              "same_text": all(r["fetch"]["same_text_as_holder"] for r in rows),
              "taker_kv_fetch": loads[taker].get("kv_fetch"), "holder_kv_fetch": loads[holder].get("kv_fetch"),
              "kv_bytes_received": loads[taker].get("kv_bytes_received"), "trials": rows}
    result["ttft_p50_speedup"] = result["recompute"]["p50_ms"] / result["fetch"]["p50_ms"]
    print(f"TTFT p50: fetch {result['fetch']['p50_ms']:.0f} ms, recompute {result['recompute']['p50_ms']:.0f} ms: "
          f"{result['ttft_p50_speedup']:.2f}x; fetch itself p50 "
          f"{statistics.median(result['fetch_times_ms'] or [float('nan')]):.1f} ms; same text {result['same_text']}")
    return result


def main(argv=None) -> int:
    from services.stack.stack import Stack, StackSpec

    args = parse_args(argv)
    rng = random.Random(0)
    flags = {"device": "cpu", "kv_cache_memory": args.kv_cache_memory, "max_model_len": args.prefix_tokens + 512,
             "num_warmup_requests": 1, **({"dtype": args.dtype} if args.dtype else {})}
    lines: list[str] = []
    with tempfile.TemporaryDirectory() as state:
        stack = Stack(StackSpec(state_dir=Path(state), model=args.model, port=0, num_decode=2,
                                namespace=f"fetch{os.getpid()}", decode_flags=flags),
                      on_line=lambda name, line: lines.append(f"{name}| {line}"))
        try:
            stack.start()
            stack.wait_ready(timeout_s=300)
            rows, loads, holder, taker = run_trials(stack, args, rng)
        finally:
            stack.stop()
    result = summarize(args, rows, loads, holder, taker, lines)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peer_fetch.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "peer_fetch.png", args.prefix_tokens)
    (args.out / "peer_fetch_stack.log").write_text("\n".join(lines) + "\n")
    print("wrote", args.out / "peer_fetch.json", args.out / "peer_fetch.png")
    return 0


def plot(result: dict, path: Path, prefix_tokens: int) -> None:
    paths = ("fetch", "recompute")
    bar_chart(path, ["fetch from peer", "recompute"],
              {q: [result[p][f"{q}_ms"] for p in paths] for q in ("p50", "p90")}, ylabel="TTFT (ms)",
              title=f"{prefix_tokens}-token prefix held by another worker: {result['ttft_p50_speedup']:.1f}x")


if __name__ == "__main__":
    raise SystemExit(main())

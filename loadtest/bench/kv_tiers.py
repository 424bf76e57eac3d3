"""KV tiers benchmark: a multi-turn conversation workload whose working set is several times the KV
pool, run with tiers off, a host tier, and host + disk tiers, in one run on the same engine settings.

    python -m loadtest.bench.kv_tiers [--conversations 8 --turns 4] [--out loadtest/results/kv_tiers]

Each turn resends the conversation so far (the previous turns' prompts and answers) plus a new
user message, so every turn's prompt starts with a prefix the worker computed before; turns go
round-robin over the conversations, so by the time a conversation comes back its blocks have been
pushed out of a pool that holds only a fraction of the working set. Requests run one at a time on
one engine (in process, no network): TTFT is from ``add_request`` to the first token.

Configurations: ``off`` (pool only), ``host`` (a host tier of ``--host-pool-multiple`` x the
pool) and ``host+disk`` (the same host tier, and a disk tier in a temporary directory). Then a
restart: a new engine on the disk directory of ``host+disk`` replays every conversation's last
turn, against a cold engine with no tiers. Reported: TTFT p50/p90, requests/s, prompt tokens found
cached, blocks offloaded and onboarded per tier, and the engine-thread time spent copying evicted
blocks out as a share of step time (the offload's cost). Ratios are against ``off`` measured in the
same run. Writes ``kv_tiers.json`` and ``kv_tiers.png`` under --out.

Fetching a prefix from another worker is measured by ``loadtest.bench.peer_fetch``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from shared.model.precision import QUANTIZATION_METHODS
from shared.telemetry.measure import percentile
from shared.telemetry.plot import figure


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default=None, help="engine dtype (default: the device's fastest)")
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--user-tokens", type=int, default=64, help="new user tokens per turn")
    p.add_argument("--output-tokens", type=int, default=32, help="answer tokens per turn (ignore_eos)")
    p.add_argument("--pool-blocks", type=int, default=48, help="KV pool size in blocks of 16 tokens")
    p.add_argument("--host-pool-multiple", type=float, default=2.0, help="host tier size / pool size")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--out", default="loadtest/results/kv_tiers")
    return p.parse_args(argv)


def conversation_tokens(args, vocab: int) -> list[list[list[int]]]:
    """Per conversation, per turn: the new user message's token ids (fixed seed)."""
    rng = random.Random(0)
    return [[[rng.randrange(100, vocab - 100) for _ in range(args.user_tokens)] for _ in range(args.turns)]
            for _ in range(args.conversations)]


def make_engine(base, args, **tier_kw):
    """An engine on ``base``'s loaded model with a pool of ``--pool-blocks`` and the given tiers."""
    from shared.engine import LLMEngine

    config = dataclasses.replace(base.config, kv_cache_memory=args.pool_blocks * base.kv_spec.bytes_per_block,
                                 max_num_seqs=4, **tier_kw)
    return LLMEngine(base.model, config, tokenizer=base.tokenizer, model_id=base.model_id)


def serve(engine, prompt: list[int], max_tokens: int, request_id: str) -> tuple[float, list[int], int]:
    """One request alone: (TTFT s, output ids, prompt tokens found cached)."""
    from shared.engine import SamplingParams

    started = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    ttft, out, cached = None, [], 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id != request_id:
                continue
            if ttft is None:
                ttft = time.perf_counter() - started
                cached = o.num_cached_tokens
            out.extend(o.new_token_ids)
    return ttft, out, cached


def run_config(label: str, engine, convs, args) -> dict:
    step_s = [0.0]
    engine.step_stats.add_observer(lambda _seqs, _tokens, elapsed: step_s.__setitem__(0, step_s[0] + elapsed))
    history: list[list[int]] = [[] for _ in convs]
    ttfts, cached, outputs = [], [], []
    started = time.perf_counter()
    for turn in range(args.turns):
        for c, conv in enumerate(convs):
            prompt = history[c] + conv[turn]
            ttft, out, num_cached = serve(engine, prompt, args.output_tokens, f"{label}-{c}-{turn}")
            history[c] = prompt + out
            if turn > 0:  # first turns have nothing to reuse in any configuration
                ttfts.append(ttft)
                cached.append(num_cached)
            outputs.append(out)
    elapsed = time.perf_counter() - started
    tiers = engine.tiers.stats() if engine.tiers is not None else {}
    if engine.tiers is not None:
        engine.tiers.flush()
    return {"ttft_s": ttfts, "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": percentile(ttfts, 90),
            "requests_per_s": len(outputs) / elapsed, "prompt_tokens_cached": sum(cached),
            "step_seconds": step_s[0], "tiers": tiers,
            "offload_share_of_step_time": tiers.get("offload_seconds", 0.0) / step_s[0] if step_s[0] else 0.0,
            "outputs": outputs, "histories": history}


def load_base(args):
    """Loads the model once (precision chosen and logged as a worker does); the engines of the run share it."""
    from shared.engine import EngineConfig, LLMEngine

    base = LLMEngine.from_config(EngineConfig(model=args.model, device="cpu", dtype=args.dtype,
                                              quantization=args.quantization, num_threads=args.num_threads,
                                              kv_cache_memory=64 << 20))
    print(f"precision {base.config.dtype}+{base.config.quantization}")
    return base


def run_configs(base, args, convs, disk_dir: Path, host_bytes: int) -> dict[str, dict]:
    """The conversations with tiers off, a host tier, and host + disk tiers, by label."""
    import torch
    from tqdm import tqdm

    results: dict[str, dict] = {}
    configs = [("off", {}), ("host", {}), ("host+disk", {"kv_disk_dir": str(disk_dir), "kv_disk_min_uses": 1})]
    for label, tier_kw in tqdm(configs, desc="configurations", unit="config"):
        host = {} if label == "off" else {"kv_host_memory": host_bytes}
        engine = make_engine(base, args, **host, **tier_kw)
        with torch.inference_mode():
            serve(engine, list(range(200, 264)), 2, f"warmup-{label}")  # first-run costs out of the way
            results[label] = run_config(label, engine, convs, args)
        engine.close()
        r = results[label]
        print(f"{label:>10}: TTFT p50 {r['ttft_p50_s'] * 1000:.1f} ms, p90 {r['ttft_p90_s'] * 1000:.1f} ms, "
              f"{r['requests_per_s']:.2f} req/s, {r['prompt_tokens_cached']} prompt tokens cached, "
              f"offload {r['offload_share_of_step_time'] * 100:.2f}% of step time, tiers {r['tiers'] or '-'}")
    for label in ("host", "host+disk"):
        same = results[label]["outputs"] == results["off"]["outputs"]
        results[label]["same_outputs_as_off"] = same
        print(f"{label}: outputs {'identical to' if same else 'DIFFER from'} off")
    return results


def run_restart(base, args, histories: list[list[int]], disk_dir: Path) -> dict[str, dict]:
    """Restart: a fresh engine on host+disk's directory replays each conversation's last turn, against a
    cold engine with no tiers."""
    import torch

    last_prompts = [h[:len(h) - args.output_tokens] for h in histories]
    restart = {}
    for label, tier_kw in (("cold", {}), ("restart on disk", {"kv_disk_dir": str(disk_dir), "kv_disk_min_uses": 1})):
        engine = make_engine(base, args, **tier_kw)
        with torch.inference_mode():
            runs = [serve(engine, p, 1, f"{label}-{i}") for i, p in enumerate(last_prompts)]
        engine.close()
        ttfts = [t for t, _, _ in runs]
        restart[label] = {"ttft_s": ttfts, "ttft_p50_s": statistics.median(ttfts),
                          "prompt_tokens_cached": sum(c for _, _, c in runs)}
        print(f"{label:>16}: last-turn TTFT p50 {restart[label]['ttft_p50_s'] * 1000:.1f} ms, "
              f"{restart[label]['prompt_tokens_cached']} prompt tokens cached")
    return restart


def speedups(results: dict, restart: dict) -> dict[str, float]:
    """TTFT p50 against tiers off, and of the restart on disk against a cold engine."""
    ratios = {label: results["off"]["ttft_p50_s"] / results[label]["ttft_p50_s"] for label in ("host", "host+disk")}
    ratios["restart"] = restart["cold"]["ttft_p50_s"] / restart["restart on disk"]["ttft_p50_s"]
    print("TTFT p50 speed-up vs off: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    return ratios


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    base = load_base(args)
    precision = f"{base.config.dtype}+{base.config.quantization}"
    convs = conversation_tokens(args, base.model.cfg.vocab_size)
    working_blocks = sum(args.turns * (args.user_tokens + args.output_tokens) for _ in convs) // 16
    host_bytes = int(args.host_pool_multiple * args.pool_blocks) * base.kv_spec.bytes_per_block
    disk_dir = Path(tempfile.mkdtemp(prefix="tandem-kv-bench-"))
    results = run_configs(base, args, convs, disk_dir, host_bytes)
    restart = run_restart(base, args, results["host+disk"]["histories"], disk_dir)
    ratios = speedups(results, restart)
    print(f"working set {working_blocks} blocks = {working_blocks / args.pool_blocks:.1f}x the pool of "
          f"{args.pool_blocks} blocks; host tier {int(args.host_pool_multiple * args.pool_blocks)} blocks")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for r in results.values():
        r.pop("histories")
        r.pop("outputs")
    payload = {"config": {**vars(args), "precision": precision,
                          "working_set_blocks": working_blocks, "host_tier_bytes": host_bytes,
                          "torch_threads": torch.get_num_threads()},
               "runs": results, "restart": restart, "ttft_p50_speedup_vs_off": ratios}
    (out / "kv_tiers.json").write_text(json.dumps(payload, indent=2))
    _plot(out / "kv_tiers.png", results, restart)
    print(f"wrote {out / 'kv_tiers.json'} and {out / 'kv_tiers.png'}")
    return 0


def _plot(path: Path, results: dict, restart: dict) -> None:
    with figure(path, 1, 2, figsize=(11, 4)) as (fig, axes):
        for label, r in {**results, **{f"last turn: {k}": v for k, v in restart.items()}}.items():
            xs = sorted(t * 1000 for t in r["ttft_s"])
            axes[0 if not label.startswith("last") else 1].plot(xs, [(i + 1) / len(xs) for i in range(len(xs))],
                                                                 label=label)
        axes[0].set_title("multi-turn TTFT (turns 2+), ms")
        axes[1].set_title("last turn after a restart, TTFT ms")
        for ax in axes:
            ax.set_ylabel("CDF")
            ax.grid(alpha=0.3)
            ax.legend()


if __name__ == "__main__":
    raise SystemExit(main())

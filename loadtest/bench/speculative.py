"""Speculative decoding (n-gram drafts from the request's own tokens) against plain decoding, one
engine in process, the same model and precision, both in one run.

    python -m loadtest.bench.speculative [--draft-tokens 6] [--compile on] [--batch 1] [--dtype float32]
                                         [--device cpu|cuda]
                                         [--out loadtest/results/speculative]

Workloads, greedy, ``--batch`` requests at a time (default 1, where a step is all overhead and
weights), with the decode step compiled (``--compile on``, the workers' default) or eager:

* ``edit``: the answer mostly repeats the prompt: fix a typo in code and print it whole, rewrite
  a paragraph with one change, continue a list that repeats (what the drafts are for);
* ``chat``: open questions whose answers do not repeat the prompt (speculation finds few drafts
  and must not slow them down).

Per workload and mode: output tokens/s over the decode phase (first token to last), the mean
inter-token latency, steps per output token, the share of draft tokens accepted, and whether the
greedy text equals plain decoding's token for token. Ratios are speculative / plain. Writes
``speculative.json`` and ``speculative.png`` under --out (the committed results: ``speculative_int8.*`` at
the default precision, ``speculative_float32.*`` with ``--dtype float32 --quantization none``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from loadtest.tools.report import bar_chart
from shared.model.precision import QUANTIZATION_METHODS

CODE = '''import json


def load_users(path):
    with open(path) as f:
        users = json.load(f)
    active = []
    for user in users:
        if user.get("active"):
            active.append({"name": user["name"], "email": user["emial"], "age": user.get("age", 0)})
    return active


def average_age(users):
    if not users:
        return 0.0
    return sum(u["age"] for u in users) / len(users)
'''
PARAGRAPH = ("The boiler heats the water until it turns to steam. The steam flows through a valve into the "
             "cylinder, where it pushes the piston forward. When the piston reaches the end of the cylinder, the "
             "valve switches and the steam pushes it back. A rod connects the piston to a crank, and the crank "
             "turns the wheel. The faster the steam flows, the faster the wheel turns.")
WORKLOADS = {
    "edit": [
        "There is a typo in this Python code. Print the whole corrected code and nothing else:\n\n" + CODE,
        "Repeat this paragraph word for word, but replace 'steam' with 'vapour' everywhere:\n\n" + PARAGRAPH,
        "Copy this code exactly, adding a docstring to each function:\n\n" + CODE,
    ],
    "chat": [
        "What are three good reasons to learn a second language?",
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how a rainbow forms.",
    ],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (the decode step from CUDA graphs with --compile on)")
    p.add_argument("--dtype", default=None, help="engine dtype (default: the device's fastest)")
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS)
    p.add_argument("--draft-tokens", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeats", type=int, default=2, help="runs per prompt and mode (best kept)")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--compile", choices=["off", "on"], default="on",
                   help="the decode step compiled (the workers' default) or eager")
    p.add_argument("--batch", type=int, default=1, help="requests run at once (the workload's prompts, cycled)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="speculate only while this many requests or fewer run (default: the engine's)")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/speculative"))
    return p.parse_args(argv)


def run_batch(engine, prompts: list[list[int]], max_tokens: int, request_id: str) -> dict:
    """The prompts run together; decode time is from the first token of any to the last of all."""
    from shared.engine import SamplingParams

    steps_before = engine.stats().num_steps
    ids: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        ids[f"{request_id}-{i}"] = []
        engine.add_request(f"{request_id}-{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    first = last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            first = now if first is None else first
            last = now
            ids[out.request_id] += out.new_token_ids
    tokens = sum(len(t) for t in ids.values())
    decode_s = last - first if tokens > len(prompts) else float("nan")
    return {"ids": list(ids.values()), "decode_s": decode_s, "steps": engine.stats().num_steps - steps_before}


def main(argv=None) -> int:
    from shared.engine import EngineConfig, LLMEngine, SamplingParams

    args = parse_args(argv)
    base = LLMEngine.from_config(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                              quantization=args.quantization, num_threads=args.num_threads,
                                              kv_cache_memory=256 << 20, compile=args.compile))
    tok = base.tokenizer
    spec_config = dataclasses.replace(base.config, speculative_tokens=args.draft_tokens)
    if args.max_batch is not None:
        spec_config = dataclasses.replace(spec_config, speculative_max_batch=args.max_batch)
    modes = {"plain": base,
             "speculative": LLMEngine(base.model, spec_config, tokenizer=tok, model_id=base.model_id,
                                      eos_token_ids=base.eos_token_ids)}
    for engine in modes.values():  # warm both up
        engine.generate([tok.encode("Hello there, hello there")], SamplingParams(max_tokens=8, temperature=0.0))
    results: dict = {}
    for workload, texts in WORKLOADS.items():
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
        results[workload] = {}
        for mode, engine in modes.items():
            stats_before = engine.stats()
            runs = []
            for i in range(0, len(prompts), args.batch):
                group = [prompts[(i + j) % len(prompts)] for j in range(args.batch)]
                best = min((run_batch(engine, group, args.max_tokens, f"{workload}-{mode}-{i}-{r}")
                            for r in range(args.repeats)), key=lambda r: r["decode_s"])
                runs.append(best)
            stats = engine.stats()
            tokens = sum(len(ids) - 1 for r in runs for ids in r["ids"] if ids)
            seconds = sum(r["decode_s"] for r in runs)
            drafted = stats.num_draft_tokens - stats_before.num_draft_tokens
            results[workload][mode] = {
                "output_tokens_per_s": tokens / seconds, "itl_ms": seconds / tokens * 1e3,
                # steps per output token of one request (the batch's requests share steps)
                "steps_per_token": sum(r["steps"] for r in runs) * args.batch
                / sum(len(ids) for r in runs for ids in r["ids"]),
                "acceptance": (stats.num_accepted_tokens - stats_before.num_accepted_tokens) / drafted
                if drafted else None,
                "outputs": [ids for r in runs for ids in r["ids"]]}
        plain, spec = results[workload]["plain"], results[workload]["speculative"]
        spec["same_text"] = spec["outputs"] == plain["outputs"]
        spec["speedup"] = spec["output_tokens_per_s"] / plain["output_tokens_per_s"]
        print(f"{workload}: plain {plain['output_tokens_per_s']:.1f} tok/s ({plain['itl_ms']:.1f} ms/token), "
              f"speculative {spec['output_tokens_per_s']:.1f} tok/s ({spec['itl_ms']:.1f} ms/token, "
              f"{spec['steps_per_token']:.2f} steps/token, acceptance "
              f"{spec['acceptance'] if spec['acceptance'] is not None else float('nan'):.0%}): "
              f"{spec['speedup']:.2f}x; same greedy text: {spec['same_text']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"config": {k: str(v) for k, v in vars(args).items()},
               "precision": f"{base.config.dtype}/{base.config.quantization}",
               "decode_step": base.stats().decode_step,
               "results": {w: {m: {k: v for k, v in r.items() if k != "outputs"} for m, r in modes_.items()}
                           for w, modes_ in results.items()},
               "texts": {w: [tok.decode(ids) for ids in results[w]["speculative"]["outputs"]] for w in results}}
    (args.out / "speculative.json").write_text(json.dumps(payload, indent=2))
    plot(payload["results"], args.out / "speculative.png")
    print("wrote", args.out / "speculative.json", args.out / "speculative.png")
    return 0


def plot(results: dict, path: Path) -> None:
    workloads = list(results)
    bar_chart(path, [f"{w} ({results[w]['speculative']['speedup']:.2f}x)" for w in workloads],
              {mode: [results[w][mode]["output_tokens_per_s"] for w in workloads] for mode in ("plain", "speculative")},
              ylabel="output tokens/s", title="n-gram speculative decoding")


if __name__ == "__main__":
    raise SystemExit(main())

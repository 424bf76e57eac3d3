"""Decode throughput with a JSON-schema grammar vs unconstrained, same engine, same run.

    python -m loadtest.bench.structured [--concurrency 8,32] [--output-len 64] [--repeats 3]

N requests with the same chat prompt run at once; only engine steps in which all N decode are
counted, so a constrained request that ends early does not shrink the batch being measured.
Unconstrained and constrained runs alternate (best of --repeats each), which keeps a load that
changes over the run from favouring either side. The ratio is constrained / unconstrained.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid

from loadtest.tools.harness import take_turns

SCHEMA = {"type": "object", "properties": {"story": {"type": "string"}, "moral": {"type": "string"}},
          "required": ["story", "moral"], "additionalProperties": False}


def decode_tokens_per_s(engine, prompt: list[int], concurrency: int, output_len: int, grammar) -> float:
    from shared.engine import SamplingParams

    for _ in range(concurrency):
        engine.add_request(f"b-{uuid.uuid4().hex}", prompt,
                           SamplingParams(max_tokens=output_len, temperature=0.8, grammar=grammar))
    num_tokens, elapsed = 0, 0.0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        took = time.perf_counter() - start
        decoded = [o for o in outputs if o.new_token_ids and o.num_output_tokens > 1]
        if len(decoded) == concurrency:
            num_tokens += concurrency
            elapsed += took
    return num_tokens / elapsed if elapsed else 0.0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--concurrency", default="8")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    from shared.engine import EngineConfig, LLMEngine
    from shared.grammar import GrammarSpec

    engine = LLMEngine.from_config(EngineConfig(model=args.model, device="cpu", max_model_len=512,
                                                kv_cache_memory=256 << 20, enable_prefix_caching=False))
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell a long story as JSON."}]))
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
    decode_tokens_per_s(engine, prompt, 8, 8, grammar)  # warm-up: first-call costs on both paths
    results = {}
    for n in (int(c) for c in args.concurrency.split(",")):
        runs = take_turns({"unconstrained": lambda _: decode_tokens_per_s(engine, prompt, n, args.output_len, None),
                           "json_schema": lambda _: decode_tokens_per_s(engine, prompt, n, args.output_len, grammar)},
                          args.repeats)
        best = {k: max(v) for k, v in runs.items()}
        results[n] = {**best, "ratio": best["json_schema"] / best["unconstrained"], "runs": runs}
        print(f"{n} streams: unconstrained {best['unconstrained']:.1f} tok/s, json_schema "
              f"{best['json_schema']:.1f} tok/s, ratio {results[n]['ratio']:.2f}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()

"""Decode speed of one in-process engine on a given model, against the memory-bandwidth limit.

    python -m loadtest.tools.synth_model --shape llama-1b --format gguf-q8_0 --out /tmp/llama-1b-q8_0.gguf
    python -m loadtest.bench.decode --model /tmp/llama-1b-q8_0.gguf --batch-sizes 1,8

For each batch size B: B greedy requests of ``--prompt-len`` tokens are prefilled, then
``--steps`` decode-only steps are timed (best of ``--repeats``); decode tokens/s = B * steps / time.
At batch 1 a decode step reads every weight once, so its floor is (bytes of the weights read per
step) / (the machine's memory bandwidth): the bandwidth here is a large torch tensor copy, counted
as bytes read plus bytes written per second, with the same threads. The fraction printed is
(weight bytes / step time) / that bandwidth. Precision: the engine's default for the device unless
``--dtype`` / ``--quantization`` say otherwise; eager decode steps unless ``--compile on`` (the
CPU's compiled step, or CUDA graphs on a GPU). Each batch size's row also records the hypervisor's
share of the machine's CPU while it was measured (``cpu_steal_share``; ``loadtest/tools/cpu_steal.py``).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from loadtest.tools.cpu_steal import cpu_times, steal_share
from shared.model.precision import KV_CACHE_DTYPES


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="alias, .gguf file or Hugging Face directory")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    p.add_argument("--repeats", type=int, default=2, help="runs per batch size; the fastest is kept")
    p.add_argument("--dtype", default=None)
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV pool's dtype (default: %(default)s = float16 under gguf, else the model's)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda if there is one)")
    p.add_argument("--attention-backend", default="auto", help="auto, torch or triton")
    p.add_argument("--compile", default="off", choices=["off", "on"],
                   help="on: the CPU's compiled decode step, or CUDA graphs on a GPU (default: eager)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="the engine's token budget per step")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    return p.parse_args(argv)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes read + written per second by the fastest of ``repeats`` copies of an ``nbytes`` tensor
    on ``device`` (the CPU's memory, or a GPU's)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dst.copy_(src)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / best


def _nbytes(weight) -> int:
    return weight.nbytes if weight is not None else 0  # a tensor's, or an Int8Weight's levels and scales


def weight_bytes_per_step(model) -> int:
    """Bytes of every weight a decode step reads (the embedding: only its rows, left out)."""
    per_layer = ("attn_norm", "qkv", "qkv_bias", "o_proj", "mlp_norm", "gate_up", "down")
    layers = sum(_nbytes(getattr(layer, name)) for layer in model.layers for name in per_layer)
    return layers + _nbytes(model.norm) + _nbytes(model.lm_head)


def decode_tok_s(engine, batch: int, args) -> float:
    """Prefill ``batch`` prompts, then time ``args.steps`` steps in which all of them decode."""
    from shared.engine import SamplingParams

    vocab = engine.model.cfg.vocab_size
    params = SamplingParams(max_tokens=args.steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [(time.monotonic_ns() + i * 7919 + j * 31) % (vocab - 100) + 50 for j in range(args.prompt_len)]
        engine.add_request(f"decode-{time.monotonic_ns()}-{i}", prompt, params)
    started: set[str] = set()
    while len(started) < batch:  # prefill (in as many steps as the token budget needs)
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    elapsed = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step()
    return batch * args.steps / elapsed


def main(argv=None) -> int:
    args = parse_args(argv)
    from shared.engine import EngineConfig, LLMEngine, warmup

    batches = [int(b) for b in args.batch_sizes.split(",")]
    engine = LLMEngine.from_config(EngineConfig(
        model=args.model, max_num_seqs=max(batches), dtype=args.dtype, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, num_threads=args.threads, device=args.device,
        attention_backend=args.attention_backend, compile=args.compile,
        max_num_batched_tokens=max(args.max_num_batched_tokens, args.prompt_len)))
    warmup(engine)
    bandwidth = copy_bandwidth(engine.device)
    weights = weight_bytes_per_step(engine.model)
    rows = []
    for b in batches:
        cpu0 = cpu_times()
        tok_s = max(decode_tok_s(engine, b, args) for _ in range(args.repeats))
        steal = steal_share(cpu0, cpu_times())  # the hypervisor's share of the CPU meanwhile (cpu_steal.py)
        step_s = b / tok_s
        rows.append({"batch": b, "decode_tok_s": tok_s, "step_ms": step_s * 1e3,
                     "weight_read_gb_s": weights / step_s / 1e9,
                     "fraction_of_copy_bandwidth": weights / step_s / bandwidth, "cpu_steal_share": steal})
        print(f"batch {b:3d}: {tok_s:7.2f} decode tok/s, {step_s * 1e3:7.1f} ms/step, weights read at "
              f"{weights / step_s / 1e9:5.1f} GB/s = {weights / step_s / bandwidth:.0%} of copy bandwidth"
              + ("" if steal is None else f"; CPU steal {steal:.0%}"), flush=True)
    result = {"model": args.model, "precision": f"{engine.config.dtype} + {engine.config.quantization}",
              "kv_cache_dtype": str(engine.kv_cache.dtype).removeprefix("torch."),
              "weight_bytes_per_step": weights, "copy_bandwidth_gb_s": bandwidth / 1e9,
              "threads": torch.get_num_threads(), "host": platform.node(), "processor": platform.processor(),
              "device": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu",
              "attention_backend": engine.backend.name, "decode_step": engine.decode_step(),
              "config": vars(args) | {"out": str(args.out)}, "rows": rows}
    print(f"weights read per step {weights / 1e9:.2f} GB; copy bandwidth {bandwidth / 1e9:.1f} GB/s "
          f"(read + write); {torch.get_num_threads()} threads; precision {result['precision']}; device "
          f"{result['device']}, attention {result['attention_backend']}, decode step {result['decode_step']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

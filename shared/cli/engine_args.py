"""Engine flags shared by every command that runs an engine; each has a TANDEM_* env default."""

from __future__ import annotations

import argparse
import os

from shared.model.compile_mode import compile_mode
from shared.model.precision import KV_CACHE_DTYPES, QUANTIZATION_METHODS


def _env(name: str, default=None):
    return os.environ.get(f"TANDEM_{name}", default)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine (env: TANDEM_<FLAG>, e.g. TANDEM_MODEL)")
    g.add_argument("--model", default=_env("MODEL", "smollm2-135m"),
                   help="model alias, .gguf file or Hugging Face directory (default: %(default)s)")
    g.add_argument("--device", default=_env("DEVICE", "auto"), help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    g.add_argument("--dtype", default=_env("DTYPE"), help="float32, bfloat16, float16; float32 matches transformers exactly (default with no "
                        "--quantization: the fastest for the device, logged at start: int8 on a CPU with VNNI, "
                        "bfloat16 with native bf16, else float32; bfloat16 on CUDA)")
    g.add_argument("--block-size", type=int, default=int(_env("BLOCK_SIZE", 16)), help="KV block size in tokens (default: %(default)s)")
    g.add_argument("--kv-cache-memory", default=_env("KV_CACHE_MEMORY"),
                   help="KV pool budget, e.g. 2GiB (default: 1GiB on CPU, --gpu-memory-utilization of the GPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=float(_env("GPU_MEMORY_UTILIZATION", 0.9)),
                   help="share of GPU memory for weights + KV when --kv-cache-memory is not given (default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=_env("MAX_MODEL_LEN"), help="context limit (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=int(_env("MAX_NUM_SEQS", 64)), help="max concurrent sequences (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=int(_env("MAX_NUM_BATCHED_TOKENS", 512)),
                   help="token budget per step; longer prompts are prefilled in chunks (default: %(default)s)")
    g.add_argument("--attention-backend", default=_env("ATTENTION_BACKEND", "auto"), choices=["auto", "torch", "triton"],
                   help="attention kernels (default: auto = triton on CUDA, torch elsewhere)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--num-threads", type=int, default=_env("NUM_THREADS"),
                   help="torch CPU threads (default: torch's, usually one per core)")
    g.add_argument("--tensor-parallel-size", "--tp", type=int, default=int(_env("TENSOR_PARALLEL_SIZE", 1)),
                   help="ranks of a tensor-parallel group: this process is rank 0 and starts the others, each a "
                        "process holding its shard of the weights and of the KV pool (gloo on a CPU, NCCL on CUDA; "
                        "--num-threads per rank, default 1 in a group) (default: %(default)s)")
    g.add_argument("--pipeline-parallel-size", "--pp", type=int, default=int(_env("PIPELINE_PARALLEL_SIZE", 1)),
                   help="pipeline stages, each of --tensor-parallel-size ranks holding a contiguous share of the "
                        "layers and their KV; stages run one after another in a step (default: %(default)s)")
    g.add_argument("--quantization", default=_env("QUANTIZATION"), choices=QUANTIZATION_METHODS,
                   help="int8: int8 weights and per-token int8 activations in every linear layer, CPU only; "
                        "about 2x the decode throughput, slightly different outputs (default: see --dtype). "
                        "int8-precise: activations and the LM head's weights in two int8 levels, closer to "
                        "float32 (97%% top-1 agreement on SmolLM2, int8 93%%) at up to 2x int8's matmul time. "
                        "gguf: weight-only blocks of 32 as in the GGUF file (its 4-bit layers kept 4-bit, others "
                        "8-bit) with 8-bit block activations as llama.cpp, for CPUs with AVX2 but no VNNI")

    g.add_argument("--kv-cache-dtype", default=_env("KV_CACHE_DTYPE", "auto"), choices=KV_CACHE_DTYPES,
                   help="the KV pool's dtype (CPU): float16 under a float32 or gguf model halves the pool's bytes, "
                        "so a budget holds twice the blocks and a decode step reads half as much, as llama.cpp's "
                        "default f16 cache (default: %(default)s = float16 under --quantization gguf, else the "
                        "model's dtype)")
    g.add_argument("--speculative-tokens", type=int, default=int(_env("SPECULATIVE_TOKENS", 0)),
                   help="speculative decoding: up to this many draft tokens per step, looked up in the request's "
                        "own prompt and output (n-gram) and verified in the same forward; greedy text is unchanged, "
                        "sampling keeps its distribution (default: %(default)s = off)")
    g.add_argument("--speculative-max-batch", type=int, default=int(_env("SPECULATIVE_MAX_BATCH", 4)),
                   help="speculate only while this many requests or fewer are running (default: %(default)s)")
    g.add_argument("--compile", type=compile_mode, default=compile_mode(_env("COMPILE", "off")),
                   metavar="{off,on,background}",
                   help="CPU: run decode-only steps as one torch.compile graph (inductor): on = compiled before the "
                        "first request, background = compiled on a thread while eager steps answer; minutes the "
                        "first time, seconds once inductor's disk cache has it; prefill stays eager. CUDA: on or "
                        "background capture decode steps as CUDA graphs, one per batch bucket, before the first "
                        "request (default: %(default)s; workers default to background)")

    t = parser.add_argument_group("KV tiers under the pool (env: TANDEM_KV_HOST_MEMORY, TANDEM_KV_DISK_DIR, ...)")
    t.add_argument("--kv-host-memory", default=_env("KV_HOST_MEMORY"),
                   help="host-memory tier, e.g. 4GiB: blocks evicted from the pool are kept there and copied "
                        "back on a prefix hit (default: off)")
    t.add_argument("--kv-disk-dir", default=_env("KV_DISK_DIR"),
                   help="disk tier directory; it outlives the process, so a restart on it starts warm (default: off)")
    t.add_argument("--kv-disk-size", default=_env("KV_DISK_SIZE", "10GiB"), help="disk tier budget (default: %(default)s)")
    t.add_argument("--kv-disk-min-uses", type=int, default=int(_env("KV_DISK_MIN_USES", 2)),
                   help="a block goes to disk once computed or hit this many times (default: %(default)s)")


def engine_config_from_args(args: argparse.Namespace, seed: int = 0):
    from shared.engine import EngineConfig, parse_size

    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
        kv_cache_memory=parse_size(args.kv_cache_memory) if args.kv_cache_memory else None,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=int(args.max_model_len) if args.max_model_len else None,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend, enable_prefix_caching=not args.no_prefix_caching, seed=seed,
        num_threads=int(args.num_threads) if args.num_threads else None, quantization=args.quantization,
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        kv_cache_dtype=args.kv_cache_dtype, kv_host_memory=parse_size(args.kv_host_memory) if args.kv_host_memory else 0,
        kv_disk_dir=args.kv_disk_dir, kv_disk_size=parse_size(args.kv_disk_size),
        kv_disk_min_uses=args.kv_disk_min_uses, speculative_tokens=args.speculative_tokens,
        speculative_max_batch=args.speculative_max_batch, compile=args.compile)

"""Settings of every service that runs an engine (decode and prefill workers)."""

from __future__ import annotations

import os
import re
import socket
from typing import Literal

from pydantic import Field, field_validator, model_validator

from shared.model.compile_mode import compile_mode
from shared.model.precision import KV_CACHE_DTYPES, QUANTIZATION_METHODS
from shared.service.settings import ServiceSettings


# the workers' draft length: on the CPU 2.36x at 1 stream, 1.02x / 0.98x at 8 / 32 on bench.serving
# (where more than --speculative-max-batch requests run, nobody speculates); on an H200 (CUDA graphs)
# bench.speculative gives 2.35x / 1.65x on edits and 1.02x / 0.97x on chat at batch 1 / 4
SPECULATIVE_TOKENS = 6


def default_worker_id(role: str) -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40]
    return f"{role}-{host}-{os.getpid()}"


class EngineWorkerSettings(ServiceSettings):
    model: str = Field("smollm2-135m", description="model alias, .gguf file or Hugging Face directory")
    device: str = Field("auto", description="cpu, cuda, cuda:N or auto")
    dtype: str | None = Field(None, description="float32, bfloat16, float16 (default with no quantization: "
                              "the fastest for the device, see shared/model/precision.py)")
    block_size: int = Field(16, ge=1, description="KV block size in tokens")
    kv_cache_memory: str | None = Field(None, description="KV pool budget, e.g. 512MiB")
    max_model_len: int | None = Field(None, ge=16, description="context limit (default: the model's)")
    max_num_seqs: int = Field(64, ge=1, description="max concurrent sequences")
    max_num_batched_tokens: int = Field(512, ge=16, description="token budget per engine step")
    attention_backend: str = Field("auto", description="auto, torch or triton")
    seed: int | None = Field(None, description="seed of the generator for requests without a seed of their own "
                             "(default: one from the OS at start, so unseeded sampling differs between workers and "
                             "restarts; a request's own seed gives the same tokens on any worker)")
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's, one per core)")
    tensor_parallel_size: int = Field(1, ge=1, description="ranks of a tensor-parallel group: this worker is rank 0 "
                                      "and starts the others, each a process with its shard of the weights and KV "
                                      "(threads per rank: num_threads, default 1 for a group)")
    pipeline_parallel_size: int = Field(1, ge=1, description="pipeline stages of tensor_parallel_size ranks each, "
                                        "every stage a contiguous share of the layers and their KV")
    quantization: Literal[QUANTIZATION_METHODS] | None = Field(
        None, description="int8: int8 weights and per-token int8 activations in the linear layers (CPU only); "
                          "int8-precise: activations and the LM head's weights in two int8 levels, closer to "
                          "float32, slower; gguf: weight-only blocks of 32 as a GGUF file's (its own 4-bit layers kept "
                          "4-bit, others 8-bit), 8-bit block activations, for CPUs with AVX2 but no VNNI; default: see dtype")
    kv_cache_dtype: Literal[KV_CACHE_DTYPES] = Field(
        "auto", description="the KV pool's dtype (CPU): float16 under a float32 or gguf model halves the pool's "
                            "bytes, so a budget holds twice the blocks and a decode step reads half as much, as "
                            "llama.cpp's default f16 cache; auto = float16 under gguf, else the model's dtype")
    kv_host_memory: str | None = Field(None, description="host-memory KV tier under the pool, e.g. 4GiB "
                                       "(evicted blocks are kept there; default: off)")
    kv_disk_dir: str | None = Field(None, description="disk KV tier directory; it outlives the worker, so a "
                                    "restart on the same directory starts warm (default: off)")
    kv_disk_size: str = Field("10GiB", description="disk KV tier budget")
    kv_disk_min_uses: int = Field(2, ge=1, description="a block goes to disk once it was computed or hit "
                                  "this many times")
    speculative_tokens: int = Field(
        SPECULATIVE_TOKENS, ge=0, description="speculative decoding: up to this many n-gram draft tokens per "
        "step from the request's own tokens, verified in the same forward (0: off). Greedy text is unchanged "
        "on the CPU; on CUDA it can move as it does with the batch size (another graph bucket)")
    speculative_max_batch: int = Field(4, ge=1, description="speculate only while this many requests or fewer run")
    compile: Literal["off", "on", "background"] = Field(
        "background", description="CPU: decode-only steps as one torch.compile graph: background = compiled on a "
        "thread while the worker already serves eagerly (minutes the first time on a small CPU, seconds once "
        "inductor's disk cache has it), on = before the worker registers, off = eager only")
    step_trace: str | None = Field(None, description="append one JSON line per engine step to this file: its "
                                   "start, duration and rows (python -m loadtest.tools.step_trace sums it up)")
    prefill_yield: bool = Field(True, description="a step computing a lower priority's prompt stops between two "
                                "layers when a more urgent request arrives, and goes on once that one's prompt is "
                                "computed (off: the step runs to its end first)")
    prefill_slice_ms: float = Field(50.0, ge=0, description="with prefill yield, while a more urgent request "
                                    "decodes, a step computing a lower priority's prompt also stops after this many "
                                    "milliseconds for a step of decode rows alone, then goes on: an online stream "
                                    "waits about this long per token for a batch prompt, not its whole prefill "
                                    "(0: never)")
    num_warmup_requests: int = Field(4, ge=0, description="warm-up requests before registering ready")
    warmup_prefill_rate: bool = Field(True, description="end warm-up by measuring the prefill rate on a "
                                      "512-token prompt, which admission predicts TTFT from until real prompts "
                                      "measure one (off: requests are admitted unpredicted until then)")
    load_interval_s: float = Field(1.0, gt=0, description="WorkerLoad publish period")
    drain_timeout_s: float = Field(120.0, ge=0, description="on SIGTERM, how long to finish in-flight work")
    events_max_age_s: float = Field(3600.0, gt=0, description="KV event stream retention (seconds)")
    events_max_msgs: int = Field(1_000_000, gt=0, description="KV event stream retention (messages)")
    host_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$", description="the joined host's id "
                                "(tandem join passes the one kept in its state directory), carried in the registry "
                                "entry so that two hosts under one host name are told apart")

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_mode(cls, value):
        return compile_mode(value) if isinstance(value, (bool, str)) else value

    @model_validator(mode="after")
    def _batch_covers_a_block(self):
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"block_size ({self.block_size})")
        return self

    def engine_config(self):
        from shared.engine import EngineConfig, parse_size

        return EngineConfig(
            model=self.model, device=self.device, dtype=self.dtype, block_size=self.block_size,
            kv_cache_memory=parse_size(self.kv_cache_memory) if self.kv_cache_memory else None,
            max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            attention_backend=self.attention_backend, seed=self.seed, num_threads=self.num_threads,
            tensor_parallel_size=self.tensor_parallel_size, pipeline_parallel_size=self.pipeline_parallel_size,
            quantization=self.quantization, kv_cache_dtype=self.kv_cache_dtype,
            kv_host_memory=parse_size(self.kv_host_memory) if self.kv_host_memory else 0,
            kv_disk_dir=self.kv_disk_dir, kv_disk_size=parse_size(self.kv_disk_size),
            kv_disk_min_uses=self.kv_disk_min_uses, speculative_tokens=self.speculative_tokens,
            speculative_max_batch=self.speculative_max_batch, compile=self.compile, step_trace=self.step_trace,
            prefill_yield=self.prefill_yield, prefill_slice_ms=self.prefill_slice_ms)

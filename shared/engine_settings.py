"""Every engine setting, defined once: name, type, default, help text and validation.

``EngineOptions`` below is the one definition. Everything else is derived from its fields:

- ``shared.engine.config.EngineConfig`` subclasses it (same fields, validated on construction) and
  adds how the settings resolve on a device;
- ``engine_settings()`` turns the fields into a pydantic-settings class (``TANDEM_<FIELD>``
  variables): the workers' ``EngineWorkerSettings`` (``services.worker.settings``) and the engine
  commands' settings (``tandem complete`` / ``chat``) are made by it, with other defaults where a
  command wants them (workers compile in the background and speculate);
- ``services.framework.command.add_settings_arguments`` gives each field of such a class its
  ``--flag`` with the field's description as ``--help`` (``cli_flags`` below: extra spellings).

So a field added here is at once an engine config field, a ``TANDEM_`` variable and a flag of every
command that runs an engine. The module imports neither torch nor the engine (it lives outside
``shared/engine``, whose package imports the engine), so that ``tandem --help`` stays fast.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from copy import copy
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, create_model
from pydantic.dataclasses import dataclass
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.model.precision import KV_CACHE_DTYPES, QUANTIZATION_METHODS

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """'2GiB', '512MB', '1.5G' or a plain byte count → bytes (binary units)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"cannot parse size {text!r} (examples: 2GiB, 512MiB, 1073741824)")
    scale = 1024 ** " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * scale)


def _size(value: Any) -> Any:
    return parse_size(value) if isinstance(value, str) else value


def _power_of_two(value: int) -> int:
    if value & (value - 1):
        raise ValueError(f"block_size must be a power of two, got {value}")
    return value


def _quantization(value: Any) -> Any:
    """Canonical spelling (any case); "none" stays a choice, None means: as dtype."""
    if not isinstance(value, str):
        return value
    method = value.lower()
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {value!r} (choose {', '.join(QUANTIZATION_METHODS)})")
    return method


def _kv_cache_dtype(value: Any) -> Any:
    """"auto" (or unset) means the model's dtype: None."""
    if value is None or value == "auto":
        return None
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(KV_CACHE_DTYPES[1:])}, got {value!r}")
    return value


def _compile(value: Any) -> Any:
    return compile_mode(value) if isinstance(value, (bool, str)) else value


# a byte count, given as one or as a size such as 512MiB (env variables and flags are strings)
Bytes = Annotated[int, BeforeValidator(_size)]



COMPILE_MODES = ("off", "on", "background")  # the ``compile`` setting's values
_BOOLEAN_SPELLINGS = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}


def compile_mode(value: str | bool) -> str:
    """The canonical ``compile`` setting: off, on or background (True and False, and the strings an
    environment variable would hold for them, mean on and off)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    mode = _BOOLEAN_SPELLINGS.get(value.lower(), value.lower())
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {value!r} (choose {', '.join(COMPILE_MODES)})")
    return mode


def cli_flags(*flags: str) -> dict:
    """A field's extra flag spellings (``--tp``), or for a boolean a ``--no-…`` one that turns it off."""
    return {"cli_flags": list(flags)}


@dataclass(config=ConfigDict(extra="forbid"))
class EngineOptions:
    """The engine's settings; ``EngineConfig`` is this plus how they resolve on a device."""

    model: str = Field("smollm2-135m", description="model alias, .gguf file or Hugging Face directory")
    device: str = Field("auto", description="cpu, cuda, cuda:N or auto (cuda where available, else cpu)")
    dtype: str | None = Field(
        None, description="float32, bfloat16, float16; float32 matches transformers exactly (default with no "
        "quantization: the fastest for the device, logged at start: int8 on a CPU with VNNI, bfloat16 with "
        "native bf16, else float32; bfloat16 on CUDA; see shared/model/precision.py)")
    block_size: Annotated[int, AfterValidator(_power_of_two)] = Field(
        16, ge=1, description="KV block size in tokens (a power of two)")
    kv_cache_memory: Bytes | None = Field(
        None, ge=0, description="KV pool budget, e.g. 2GiB (default: 1GiB on a CPU, on a GPU the share "
        "gpu_memory_utilization leaves after the weights)")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="share of GPU memory for weights + KV when kv_cache_memory is not given")
    max_model_len: int | None = Field(None, ge=16, description="context limit (default: the model's)")
    max_num_seqs: int = Field(64, ge=1, description="max concurrent sequences")
    max_num_batched_tokens: int = Field(512, ge=16, description="token budget per engine step; longer prompts "
                                        "are prefilled in chunks")
    attention_backend: Literal["auto", "torch", "triton"] = Field(
        "auto", description="attention kernels: auto = triton on CUDA, torch elsewhere")
    enable_prefix_caching: bool = Field(True, description="reuse the KV blocks of a prompt prefix computed "
                                        "before", json_schema_extra=cli_flags("--no-prefix-caching"))
    seed: int | None = Field(None, description="seed of the generator for requests without a seed of their own "
                             "(default: one from the OS at start, so unseeded sampling differs between workers and "
                             "restarts; a request's own seed gives the same tokens on any worker)")
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's, one per core; "
                                    "1 per rank in a parallel group)")
    # parallel ranks: shared/model/parallel.py, shared/engine/parallel.py
    tensor_parallel_size: int = Field(
        1, ge=1, json_schema_extra=cli_flags("--tp"),
        description="ranks of a tensor-parallel group: this process is rank 0 and starts the others, each a "
        "process with its shard of the weights and of the KV pool (gloo on a CPU, NCCL on CUDA)")
    pipeline_parallel_size: int = Field(
        1, ge=1, json_schema_extra=cli_flags("--pp"),
        description="pipeline stages of tensor_parallel_size ranks each, every stage a contiguous share of the "
        "layers and their KV; stages run one after another in a step")
    group_local_ranks: int | None = Field(
        None, ge=1, description="ranks of a parallel group this process starts on its host, itself included "
        "(default: all); the others join from other hosts (`tandem rank --join group_host:group_port`), over "
        "gloo/NCCL on the network")
    group_host: str = Field(
        "127.0.0.1", description="the address rank 0 listens on for its group (rendezvous and collectives); "
        "one other hosts reach when group_local_ranks leaves ranks to them")
    group_port: int = Field(
        0, ge=0, le=65535, description="rank 0's rendezvous port (0: a free one, which a group with ranks on "
        "other hosts cannot use: they need to know it)")
    quantization: Annotated[Literal[QUANTIZATION_METHODS] | None, BeforeValidator(_quantization)] = Field(
        None, description="int8: int8 weights and per-token int8 activations in the linear layers (CPU only), "
        "about 2x the decode throughput, slightly different outputs; int8-precise: activations and the LM "
        "head's weights in two int8 levels, closer to float32, up to 2x int8's matmul time; gguf: weight-only "
        "blocks of 32 as a GGUF file's (its own 4-bit layers kept 4-bit, others 8-bit), 8-bit block "
        "activations, for CPUs with AVX2 but no VNNI; default: see dtype")
    kv_cache_dtype: Annotated[Literal[KV_CACHE_DTYPES] | None, BeforeValidator(_kv_cache_dtype)] = Field(
        None, description="the KV pool's dtype (CPU): float16 under a float32 or gguf model halves the pool's "
        "bytes, so a budget holds twice the blocks and a decode step reads half as much, as llama.cpp's "
        "default f16 cache; auto (default) = float16 under gguf, else the model's dtype")
    # tiers below the KV pool (shared/kvcache/tiers.py); sizes are bytes, or text such as 4GiB
    kv_host_memory: Bytes = Field(0, ge=0, description="host-memory KV tier under the pool, e.g. 4GiB: blocks "
                                  "evicted from the pool are kept there and copied back on a prefix hit (0: off)")
    kv_disk_dir: str | None = Field(None, description="disk KV tier directory; it outlives the process, so a "
                                    "restart on the same directory starts warm (default: off)")
    kv_disk_size: Bytes = Field("10GiB", ge=1, validate_default=True, description="disk KV tier budget")
    kv_disk_min_uses: int = Field(2, ge=1, description="a block goes to disk once it was computed or hit "
                                  "this many times")
    # n-gram drafts from the request's own tokens: shared/engine/speculative.py
    speculative_tokens: int = Field(
        0, ge=0, description="speculative decoding: up to this many n-gram draft "
        "tokens per step from the request's own tokens, verified in the same forward (0: off). Greedy text is "
        "unchanged on the CPU; on CUDA it can move as it does with the batch size (another graph bucket)")
    speculative_max_batch: int = Field(4, ge=1, description="speculate only while this many requests or fewer run")
    # shared/engine/compiled/step.py (CPU), shared/engine/compiled/cuda_graph.py (CUDA); True and False mean on and off
    compile: Annotated[Literal[COMPILE_MODES], BeforeValidator(_compile)] = Field(
        "off", description="CPU: decode-only steps as one torch.compile graph (inductor): on = compiled before "
        "the first request, background = compiled on a thread while eager steps serve, off = eager only; "
        "minutes the first time, seconds once inductor's disk cache has it. CUDA: on or background capture "
        "decode steps as CUDA graphs, one per batch bucket, before the first request")
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


ENGINE_FIELDS: tuple[str, ...] = tuple(EngineOptions.__pydantic_fields__)


class TandemEnv(BaseSettings):
    """A settings class read from ``TANDEM_<FIELD>`` variables; unknown fields are errors."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="forbid")


def engine_settings(name: str, base: type[BaseSettings] = TandemEnv, *, defaults: Mapping[str, Any] | None = None,
                    only: Iterable[str] = ENGINE_FIELDS, exclude: Iterable[str] = (),
                    notes: Mapping[str, str] | None = None) -> type[BaseSettings]:
    """A settings class ``name`` with ``base``'s fields and then the fields of ``EngineOptions`` named
    in ``only`` but not in ``exclude``, each with its type, description and validation, and its
    default unless ``defaults`` gives another; ``notes`` put what a field means for this class's
    command (``tandem up``: whose workers get it) before its description."""
    defaults, only, exclude, notes = dict(defaults or {}), set(only), set(exclude), dict(notes or {})
    unknown = (set(defaults) | only | exclude | set(notes)) - set(ENGINE_FIELDS)
    assert not unknown, f"fields EngineOptions does not have: {sorted(unknown)}"
    fields = {}
    for field_name, info in EngineOptions.__pydantic_fields__.items():
        if field_name not in only or field_name in exclude:
            continue
        info = copy(info)
        annotation = info.annotation
        if field_name in defaults:
            info.default = defaults[field_name]
            if info.default is None:
                annotation = info.annotation = annotation | None  # None: left to whoever gets the value
        if field_name in notes:
            info.description = f"{notes[field_name]}: {info.description}"
        fields[field_name] = (annotation, info)
    return create_model(name, __base__=base, **fields)

"""Building an engine from its config: the KV pool and its tiers, the scheduler, the model runner
and the decode-step compile, each handed what it uses when it is made (no object is wired up by
setting another's attributes afterwards). ``load_model`` resolves and loads the config's model."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from shared.engine.compiled.background import BackgroundCompile
from shared.engine.config import EngineConfig, kv_cache_bytes, num_kv_blocks, torch_dtype
from shared.engine.cpu_threads import engine_thread_count
from shared.engine.model_runner import ModelRunner
from shared.engine.parallel import (CompiledStepUnavailable, GroupBlocks, ParallelModel, free_port, join_stage,
                                   open_group_store, start_followers)
from shared.engine.sampler import Sampler
from shared.engine.scheduler import Scheduler, SchedulerConfig
from shared.engine.speculative import SpeculativeConfig, Speculator
from shared.grammar import TokenizerGrammars
from shared.kvcache.events import KvEventEmitter
from shared.kvcache.hashing import make_namespace
from shared.kvcache.layout import KvCacheSpec
from shared.kvcache.manager import KVCacheManager
from shared.kvcache.tiers import KvTiers, TierConfig
from shared.model.attention import AttentionBackend, get_attention_backend
from shared.engine.compiled.artifacts import ArtifactStore, CompileArtifacts, engine_artifact_key
from shared.engine.compiled.step import CompiledDecode, unsupported_reason
from shared.engine.compiled.cuda_graph import GraphedDecode
from shared.model.llama import LlamaModel
from shared.model.parallel import (Collectives, ProcessGroupCollectives, check_pipeline_parallel,
                                   check_tensor_parallel)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineParts:
    max_model_len: int
    kv_namespace: bytes
    kv_spec: KvCacheSpec
    num_blocks: int
    events: KvEventEmitter
    kv_cache: torch.Tensor  # [num_blocks, L, 2, block_size, Hkv, D] (kvcache.layout)
    tiers: KvTiers | None  # host/disk tiers below the pool; only with prefix caching
    kv: KVCacheManager
    scheduler: Scheduler
    backend: AttentionBackend
    runner: ModelRunner
    background_compile: BackgroundCompile | None  # started already


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaModel
    config: EngineConfig  # with the precision chosen for the device
    tokenizer: object
    model_id: str
    eos_token_ids: frozenset[int]


def build_parts(model: LlamaModel, config: EngineConfig, *, tokenizer, model_id: str,
                eos_token_ids: frozenset[int], artifact_store: ArtifactStore | None = None) -> EngineParts:
    if config.quantization is not None and model.quantization != config.quantization:
        raise ValueError(f"the model's linear layers are {model.quantization!r} but the config asks for "
                         f"{config.quantization!r}: call model.quantize() or use LLMEngine.from_config")
    cfg = model.cfg
    max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    namespace = make_namespace(model_id)
    kv_spec = KvCacheSpec(len(model.layers), model.num_kv_heads, cfg.head_dim, config.block_size,
                          config.resolve_kv_dtype(model.dtype, model.device, model.quantization))
    num_blocks = num_kv_blocks(kv_spec, kv_cache_bytes(config, model.device))
    events = KvEventEmitter()
    kv_cache = kv_spec.allocate(num_blocks, model.device)
    if isinstance(model, ParallelModel):
        model.attach_kv(kv_cache, config.block_size)
    tiers = _tiers(config, kv_spec, kv_cache, namespace, events, model, max_model_len)
    kv = KVCacheManager(num_blocks, config.block_size, enable_caching=config.enable_prefix_caching,
                        events=events, tiers=tiers, window=cfg.uniform_window)
    spec_config = SpeculativeConfig(config.speculative_tokens, config.speculative_max_batch)
    scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_model_len),
                          kv, namespace, Speculator(spec_config) if spec_config.enabled else None)
    backend = get_attention_backend(config.attention_backend, model.device)
    runner, background_compile = _runner(model, config, kv_cache, backend, tokenizer, eos_token_ids, artifact_store,
                                         max_model_len)
    return EngineParts(max_model_len, namespace, kv_spec, num_blocks, events, kv_cache, tiers, kv, scheduler,
                       backend, runner, background_compile)


def _start_group(config: EngineConfig, size: int, device: torch.device) -> tuple[ProcessGroupCollectives, list]:
    """Rank 0 of a parallel group: start the ranks this host runs, wait for the others to join from
    their hosts (``tandem rank``: they read the engine config from rank 0's store), make the group."""
    local = config.local_ranks
    if local > size:
        raise ValueError(f"group_local_ranks {local} is more than the group's {size} ranks")
    if local < size and not config.group_port:
        raise ValueError(f"ranks {local}-{size - 1} join from other hosts: give them a group_port to join at")
    host, port = config.group_host, config.group_port or free_port(config.group_host)
    store = open_group_store(config, size, host, port)
    followers = start_followers(config, local, host, port, size)
    if local < size:
        log.info("waiting for ranks %d-%d of the group to join from other hosts at %s:%d (tandem rank --join)",
                 local, size - 1, host, port)
    try:
        # shared-memory collectives only where every rank is on this host
        world = ProcessGroupCollectives(0, size, host, port, device, shared_memory=local == size, store=store)
    except Exception:
        for proc in followers:
            proc.kill()
        raise
    here = f"ranks 1-{local - 1} are processes {[p.pid for p in followers]}" if local > 1 else "no other rank here"
    log.info("parallel worker of %d ranks (TP=%d x PP=%d) on %s; %s%s", size, config.tensor_parallel_size,
             config.pipeline_parallel_size, device, here, f", ranks {local}-{size - 1} on other hosts at {host}:{port}"
             if local < size else "")
    return world, followers


def _tiers(config: EngineConfig, kv_spec: KvCacheSpec, kv_cache: torch.Tensor, namespace: bytes,
           events: KvEventEmitter, model: LlamaModel, max_model_len: int) -> KvTiers | None:
    tier_config = TierConfig(config.kv_host_memory, config.kv_disk_dir, config.kv_disk_size, config.kv_disk_min_uses)
    if not (tier_config.enabled and config.enable_prefix_caching):
        return None
    blocks = None
    if isinstance(model, ParallelModel):  # the tiers keep whole blocks, gathered from every rank's part
        cfg = model.cfg
        kv_spec = KvCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_spec.block_size, kv_spec.dtype)
        blocks = GroupBlocks(model)
    return KvTiers(tier_config, kv_spec, kv_cache, namespace, events, precision=f"{model.dtype}/{model.quantization}",
                   max_blocks_per_request=-(-max_model_len // config.block_size), blocks=blocks)


def _runner(model: LlamaModel, config: EngineConfig, kv_cache: torch.Tensor, backend: AttentionBackend,
            tokenizer, eos_token_ids: frozenset[int],
            artifact_store: ArtifactStore | None,
            max_model_len: int) -> tuple[ModelRunner, BackgroundCompile | None]:
    """The model runner, with its decode step compiled (or loaded: shared/engine/compiled/artifacts.py)
    now (``compile="on"``) or on a background thread that hands it over when ready (``"background"``).
    On CUDA either captures the decode step as CUDA graphs now (seconds; shared/engine/compiled/cuda_graph.py)."""
    compile_mode = config.compile
    sampler = Sampler(model.device, config.seed, _grammars(tokenizer, model.cfg.vocab_size, eos_token_ids))
    if isinstance(model, ParallelModel) and compile_mode != "off":
        return _group_runner(model, config, kv_cache, backend, sampler, artifact_store)
    if model.device.type == "cuda":
        return ModelRunner(model, kv_cache, backend, config.block_size, sampler,
                           _cuda_graphs(model, config, kv_cache, backend, max_model_len, compile_mode)), None
    if compile_mode != "off" and model.device.type != "cpu":
        log.info("no compiled decode step on %s: decode steps run eagerly", model.device.type)
        compile_mode = "off"
    if compile_mode != "off" and (reason := unsupported_reason(model.cfg)):
        log.info("no compiled decode step for this model yet (%s): decode steps run eagerly", reason)
        compile_mode = "off"
    compiled = artifacts = None
    threads = engine_thread_count(config.num_threads)  # the engine thread's count, read before any hand-over
    if compile_mode != "off":
        artifacts = CompileArtifacts(CompileArtifacts.default_root(),
                                     engine_artifact_key(model, config.block_size, threads, kv_cache.dtype))
    if compile_mode == "on":
        compiled = CompiledDecode(model, config.block_size, threads)
        compiled.warm(kv_cache, artifacts, artifact_store)
    runner = ModelRunner(model, kv_cache, backend, config.block_size, sampler, compiled)
    if compile_mode != "background":
        return runner, None
    background = BackgroundCompile(model, config.block_size, kv_cache, threads, runner.use_compiled,
                                   artifacts, artifact_store, getattr(model, "_loaded_with", None))
    background.start()
    return runner, background


def _group_runner(model: ParallelModel, config: EngineConfig, kv_cache: torch.Tensor, backend: AttentionBackend,
                  sampler: Sampler,
                  artifact_store: ArtifactStore | None) -> tuple[ModelRunner, BackgroundCompile | None]:
    """A parallel worker's runner, on a CPU group of one stage: with ``compile="on"`` its decode step
    compiled on every rank before traffic (rank 0 compiles or loads it, the others load what rank 0
    keeps; ``ParallelModel.share_compiled``); with ``"background"`` rank 0 compiles or loads it on its
    compile thread while eager steps serve, and the engine thread's next step after that hands it to every
    rank (``ModelRunner.use_compiled``), or leaves every rank eager where a follower cannot load it
    (before traffic, that fails the build, as a failed compile does on one process). Decode steps
    run eagerly elsewhere."""
    shard = model.model
    why = ("pipeline stages hand hidden states on between their layers" if shard.pipeline.num_stages > 1 else
           f"not on {model.device.type}" if model.device.type != "cpu" else unsupported_reason(model.cfg))
    if why:
        log.info("no compiled decode step on this parallel worker (%s): decode steps run eagerly", why)
        return ModelRunner(model, kv_cache, backend, config.block_size, sampler), None
    threads = engine_thread_count(config.num_threads)
    artifacts = CompileArtifacts(CompileArtifacts.default_root(),
                                 engine_artifact_key(shard, config.block_size, threads, kv_cache.dtype))
    if config.compile == "on":
        compiled = CompiledDecode(shard, config.block_size, threads)
        compiled.warm(kv_cache, artifacts, artifact_store, run_once=False)
        return ModelRunner(model, kv_cache, backend, config.block_size, sampler,
                           model.share_compiled(compiled, artifacts, threads)), None

    def share(compiled: CompiledDecode):
        try:
            return model.share_compiled(compiled, artifacts, threads)
        except CompiledStepUnavailable as exc:  # every rank dropped it together
            log.warning("%s: decode steps stay eager on every rank", exc)
            return None

    runner = ModelRunner(model, kv_cache, backend, config.block_size, sampler, share=share)
    # on rank 0's compile thread, not in a child process (no config: see shared/engine/compiled/background.py)
    background = BackgroundCompile(shard, config.block_size, kv_cache, threads, runner.use_compiled, artifacts,
                                   artifact_store, run_once=False)
    background.start()
    return runner, background


def _cuda_graphs(model: LlamaModel, config: EngineConfig, kv_cache: torch.Tensor, backend: AttentionBackend,
                 max_model_len: int, compile_mode: str) -> GraphedDecode | None:
    if compile_mode == "off":  # asked so, or a parallel worker (its steps talk to its ranks: eager)
        return None
    if backend.name != "triton":  # the torch backend plans attention on the host (a sync per step)
        log.info("CUDA graphs need the triton attention backend, not %s: decode steps run eagerly", backend.name)
        return None
    graphs = GraphedDecode(model, backend, config.block_size, config.max_num_seqs, max_model_len)
    graphs.warm(kv_cache)
    return graphs


def _grammars(tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> TokenizerGrammars | None:
    """Structured outputs need the tokenizer's vocabulary; an engine built without one has none."""
    if tokenizer is None:
        return None
    return TokenizerGrammars(tokenizer.to_json(), vocab_size, sorted(eos_token_ids or {tokenizer.eos_token_id}))


def _layer_formats(model) -> str:
    """What the quantized linear layers hold, for the load log: 'W8A8', or e.g. '4-bit 120, 8-bit 1'."""
    from shared.model.quant import BlockWeight

    if model.quantization != "gguf":
        return "W8A8"
    weights = [getattr(layer, name) for layer in model.layers for name in layer.linear_names
               if getattr(layer, name) is not None] + [model.lm_head]
    counts = {}
    for w in weights:
        kind = f"{w.bits}-bit blocks" if isinstance(w, BlockWeight) else "float"
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items())) + ", 8-bit block activations"


def load_model(config: EngineConfig, world: Collectives | None = None) -> LoadedModel:
    """Resolve the model name (fetching the default model if needed) and load it at the precision
    chosen for the device. With ``config.tensor_parallel_size`` or ``pipeline_parallel_size`` above 1
    and no ``world``, this process becomes rank 0 of a new parallel worker: it starts the other ranks
    (``shared.engine.parallel``), loads its shard and returns it as a ``ParallelModel``; with
    ``world`` (the worker's ranks), a follower's shard."""
    from shared.model.loader import load_model as load_weights, read_config
    from shared.model.quant import calibration_token_ids, check_quantization
    from shared.model.registry import resolve_model
    from shared.tokenizer import Tokenizer

    source = resolve_model(config.model)
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1 and not config.num_threads:
        config = dataclasses.replace(config, num_threads=1)  # a rank a thread: ranks share the cores
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = config.resolve_device()
    shape = read_config(source.path, source.format)
    precision = config.resolve_precision(device)
    dtype = torch_dtype(precision.dtype)
    log.info("precision %s%s on %s: %s", precision.dtype,
             "" if precision.quantization == "none" else f" + {precision.quantization}", device, precision.reason)
    t0 = time.perf_counter()
    tokenizer = Tokenizer.from_model_files(source.path, source.format)
    quantization = check_quantization(precision.quantization, device)
    followers, leads_group = [], False
    size = config.tensor_parallel_size * config.pipeline_parallel_size
    if world is None and size > 1:
        # refused here, before any rank process starts, where the shape does not split
        check_tensor_parallel(shape, config.tensor_parallel_size, quantization)
        check_pipeline_parallel(shape, config.pipeline_parallel_size)
        world, followers = _start_group(config, size, device)
        leads_group = True  # rank 0: the others follow it, started here or joining from other hosts
    group = pipeline = None
    if world is not None:
        device = world.device
        group, pipeline = join_stage(world, config.tensor_parallel_size, config.pipeline_parallel_size,
                                     shape.num_layers)
    model = load_weights(source.path, source.format, device, dtype, group, quantization, pipeline)
    if quantization != "none":  # the calibration text is read where the method smooths (int8)
        model.quantize(quantization, calibration_token_ids(tokenizer, min(512, model.cfg.max_position_embeddings)))
    log.info("loaded %s (%s, %.0fM parameters) on %s as %s%s in %.1fs", source.name, source.format,
             model.cfg.num_params / 1e6, device, str(dtype).removeprefix("torch."),
             "" if quantization == "none" else f" with {quantization} linear layers ({_layer_formats(model)})",
             time.perf_counter() - t0)
    config = dataclasses.replace(config, dtype=precision.dtype, quantization=quantization)
    model._loaded_with = config  # another process can load the same model from it (a compile process)
    if leads_group:
        model = ParallelModel(model, world, followers)
    return LoadedModel(model, config, tokenizer, source.name, frozenset(tokenizer.stop_token_ids))

"""LLMEngine: schedule → run → update, one step at a time (synchronous core)."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shared.engine.compile_thread import BackgroundCompile
from shared.engine.config import EngineConfig, kv_cache_bytes, num_kv_blocks, torch_dtype
from shared.engine.errors import InvalidRequestError, InvalidSamplingParamsError
from shared.engine.cpu_threads import engine_thread_count
from shared.engine.model_runner import ModelRunner
from shared.engine.request import Request, SamplingParams
from shared.engine.sampler import SampledToken, Sampler
from shared.grammar import GrammarError, TokenizerGrammars, compile_grammar
from shared.engine.scheduler import Scheduler, SchedulerConfig
from shared.engine.speculative import SpeculativeConfig, Speculator
from shared.kvcache.events import KvEventEmitter, KvEventSink
from shared.kvcache.hashing import hash_blocks, make_namespace
from shared.kvcache.layout import KvCacheSpec
from shared.kvcache.manager import KVCacheManager
from shared.kvcache.tiers import KvTiers, TierConfig
from shared.model.attention import get_attention_backend
from shared.model.compiled import CompiledDecode
from shared.model.llama import LlamaModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class EngineOutput:
    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    first_scheduled_time: float | None = None  # the request's (time.monotonic()), for its TTFT phases


@dataclass(frozen=True)
class RemotePrefillSlot:
    """Where a prefill worker writes a prompt's KV: the request's blocks, of which the first
    ``num_cached_tokens // block_size`` already hold the locally cached prefix. Only full prompt
    blocks are written (``transfer_block_ids``); the partial tail, which generated tokens will
    share, is recomputed locally, so a repeated write can only rewrite identical prompt KV."""

    block_ids: list[int]
    num_cached_tokens: int
    block_size: int
    num_prompt_tokens: int = 0

    @property
    def uncached_block_ids(self) -> list[int]:
        return self.block_ids[self.num_cached_tokens // self.block_size:]

    @property
    def transfer_block_ids(self) -> list[int]:
        """Full prompt blocks past the cached prefix: what a prefill worker writes."""
        return self.block_ids[self.num_cached_tokens // self.block_size:self.num_prompt_tokens // self.block_size]


@dataclass(frozen=True)
class PrefixFetchSlot:
    """Blocks held for a peer to write a prompt's cached prefix into (``reserve_prefix_fetch``):
    the prompt's first ``len(block_hashes)`` blocks, of which the first ``num_local`` are cached
    here already and ``block_ids`` are fresh, for the rest."""

    block_hashes: list[int]
    num_local: int
    block_ids: list[int]


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_used: int
    num_cached_blocks: int
    max_num_seqs: int
    num_preemptions: int
    num_steps: int
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_generated_tokens: int
    num_remote_pending: int = 0  # reserved for remote prefill, KV not yet in place
    num_held: int = 0  # finished keep_kv requests whose blocks a transfer still reads
    # what admission needs to predict a new request's TTFT (see shared.policy.admission)
    queued_prefill_tokens: dict[int, int] = field(default_factory=dict)  # priority -> tokens not yet prefilled
    num_waiting_by_priority: dict[int, int] = field(default_factory=dict)
    num_running_by_priority: dict[int, int] = field(default_factory=dict)
    prefill_tokens_per_s: float | None = None  # recent prefill throughput; None until measured
    kv_tiers: dict[str, float] = field(default_factory=dict)  # host/disk tier sizes and counters (KvTiers.stats)
    num_draft_tokens: int = 0  # speculative decoding: draft tokens computed
    num_accepted_tokens: int = 0  # of those, accepted
    decode_step: str = "eager"  # eager, compiling (background compile under way) or compiled


StepObserver = Callable[[int, int, float], None]  # sequences, tokens, seconds of one step


class PrefillRate:
    """Prefill throughput of recent steps (exponential average). A step's time includes the decodes
    batched with the chunk, so the rate errs low: predictions built on it err late, not early."""

    def __init__(self, min_tokens: int, weight: float = 0.3) -> None:
        self.min_tokens = min_tokens  # smaller chunks measure per-step overhead, not prefill speed
        self.weight = weight
        self.tokens_per_s: float | None = None

    def observe(self, num_tokens: int, elapsed_s: float) -> None:
        if num_tokens < self.min_tokens or elapsed_s <= 0:
            return
        rate = num_tokens / elapsed_s
        self.tokens_per_s = rate if self.tokens_per_s is None else \
            self.tokens_per_s + self.weight * (rate - self.tokens_per_s)

    def forget(self) -> None:
        """Back to not measured: the next observed step sets the rate afresh."""
        self.tokens_per_s = None


class LLMEngine:
    def __init__(self, model: LlamaModel, config: EngineConfig, *, tokenizer=None,
                 model_id: str = "model", eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.eos_token_ids = eos_token_ids
        self.device = model.device
        if config.quantization is not None and model.quantization != config.quantization:
            raise ValueError(f"the model's linear layers are {model.quantization!r} but the config asks for "
                             f"{config.quantization!r}: call model.quantize() or use LLMEngine.from_config")
        cfg = model.cfg
        self.block_size = config.block_size
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.kv_namespace = make_namespace(model_id)
        self.kv_spec = KvCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.block_size, model.dtype)
        self.num_blocks = num_kv_blocks(self.kv_spec, kv_cache_bytes(config, self.device))
        self.events = KvEventEmitter()
        self.kv = KVCacheManager(self.num_blocks, config.block_size,
                                 enable_caching=config.enable_prefix_caching, events=self.events)
        spec_config = SpeculativeConfig(config.speculative_tokens, config.speculative_max_batch)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len),
            self.kv, self.kv_namespace, Speculator(spec_config) if spec_config.enabled else None)
        self.kv_cache = self.kv_spec.allocate(self.num_blocks, self.device)
        self.tiers: KvTiers | None = None
        tier_config = TierConfig(config.kv_host_memory, config.kv_disk_dir, config.kv_disk_size,
                                 config.kv_disk_min_uses)
        if tier_config.enabled and config.enable_prefix_caching:
            self.tiers = KvTiers(tier_config, self.kv_spec, self.kv_cache, self.kv_namespace, self.events,
                                 precision=f"{model.dtype}/{model.quantization}",
                                 max_blocks_per_request=-(-self.max_model_len // config.block_size))
            self.kv.tiers = self.tiers
            self.kv.pool.on_evict = self.tiers.offload
        self.backend = get_attention_backend(config.attention_backend, self.device)
        compile_mode = config.compile
        if compile_mode != "off" and self.device.type != "cpu":
            log.info("no compiled decode step on %s: decode steps run eagerly", self.device.type)
            compile_mode = "off"
        compiled = None
        threads = engine_thread_count(config.num_threads)  # the engine thread's count, read before any hand-over
        if compile_mode == "on":
            compiled = CompiledDecode(model, config.block_size, threads)
            compiled.warm(self.kv_cache)
        self.runner = ModelRunner(model, self.kv_cache, self.backend, config.block_size,
                                  Sampler(self.device, config.seed, _grammars(tokenizer, cfg.vocab_size, eos_token_ids)),
                                  compiled)
        self.background_compile: BackgroundCompile | None = None
        if compile_mode == "background":
            self.background_compile = BackgroundCompile(model, config.block_size, self.kv_cache, threads,
                                                        self._use_compiled)
            self.background_compile.start()
        self._num_steps = 0
        self._fetches: dict[str, tuple[list[int], list[int], int]] = {}  # fetch id → hashes, tokens, cached here
        self._num_prompt_tokens = 0
        self._num_cached_prompt_tokens = 0
        self._num_generated = 0
        self._prefill_rate = PrefillRate(min_tokens=config.block_size)
        self._step_observers: list[StepObserver] = []
        self._log_capacity()

    def _use_compiled(self, compiled: CompiledDecode) -> None:
        """From the background compile: the engine thread's next decode-only step runs the graph."""
        self.runner.compiled = compiled

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        """Resolve the model name (fetching the default model if needed) and load it."""
        from shared.model.loader import load_model
        from shared.model.quant import calibration_token_ids, check_quantization
        from shared.model.registry import resolve_model
        from shared.tokenizer import Tokenizer

        source = resolve_model(config.model)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = config.resolve_device()
        precision = config.resolve_precision(device)
        dtype = torch_dtype(precision.dtype)
        log.info("precision %s%s on %s: %s", precision.dtype,
                 "" if precision.quantization == "none" else f" + {precision.quantization}", device, precision.reason)
        t0 = time.perf_counter()
        tokenizer = Tokenizer.from_model_files(source.path, source.format)
        quantization = check_quantization(precision.quantization, device)
        model = load_model(source.path, source.format, device, dtype)
        if quantization != "none":
            model.quantize(quantization, calibration_token_ids(tokenizer, min(512, model.cfg.max_position_embeddings)))
        log.info("loaded %s (%s, %.0fM parameters) on %s as %s%s in %.1fs", source.name, source.format,
                 model.cfg.num_params / 1e6, device, str(dtype).removeprefix("torch."),
                 "" if quantization == "none" else f" with {quantization} linear layers (W8A8)",
                 time.perf_counter() - t0)
        config = dataclasses.replace(config, dtype=precision.dtype, quantization=quantization)
        return cls(model, config, tokenizer=tokenizer, model_id=source.name,
                   eos_token_ids=frozenset(tokenizer.stop_token_ids))

    def _log_capacity(self) -> None:
        tokens = self.num_blocks * self.block_size
        gib = self.num_blocks * self.kv_spec.bytes_per_block / 2**30
        per_req = self.kv_spec.bytes_per_token * self.max_model_len / 2**20
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %d KiB/token); a %d-token request "
                 "needs %.1f MiB, so at most %d such sequences run at once (max_num_seqs=%d); %s attention",
                 self.num_blocks, self.block_size, tokens, gib, self.kv_spec.bytes_per_token // 1024,
                 self.max_model_len, per_req, tokens // self.max_model_len, self.config.max_num_seqs,
                 self.backend.name)

    # -- requests -------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise an InvalidRequestError subclass naming the field; safe from any thread."""
        vocab = self.model.cfg.vocab_size
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty", field="prompt")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", field="prompt")
        params.validate(vocab)
        if params.grammar is not None:
            if self.runner.sampler.grammars is None:
                raise InvalidSamplingParamsError("structured output needs the model's tokenizer", field="grammar")
            try:
                compile_grammar(params.grammar)
            except GrammarError as exc:
                raise InvalidSamplingParamsError(str(exc), field="grammar") from None
        self.scheduler.check_fits(len(prompt_token_ids))

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, *, keep_kv: bool = False, deadline: float | None = None) -> None:
        """Queue a request. ``keep_kv``: when it finishes, hold its blocks (``request_block_ids``
        stays valid) until ``release_kv`` — the prefill side of a KV transfer. ``deadline`` (Unix
        seconds): within its priority, earlier deadlines run first (none: after every deadline)."""
        self.validate(prompt_token_ids, params)
        request = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, priority,
                          keep_kv=keep_kv, deadline=math.inf if deadline is None else deadline)
        self.scheduler.add_request(request)

    def release_kv(self, request_id: str) -> bool:
        return self.scheduler.release(request_id)

    def reserve_remote_prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                               priority: int = 0, *, keep_kv: bool = False,
                               decide: Callable[[int], bool] | None = None,
                               deadline: float | None = None) -> RemotePrefillSlot | None:
        """Decode side of remote prefill: reserve blocks for the prompt (reusing the local prefix
        cache) that a prefill worker will write. None when the pool cannot hold it now, or when
        ``decide(num_cached_tokens)`` — asked first, with the locally cached prefix — says no; in
        both cases nothing changed. ``keep_kv``: hold the blocks after the request ends (for any
        reason) until ``release_kv``, so a late write can never land in reused blocks."""
        self.validate(prompt_token_ids, params)
        request = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, priority,
                          keep_kv=keep_kv, deadline=math.inf if deadline is None else deadline)
        reserved = self.scheduler.reserve_remote(request, decide)
        if reserved is None:
            return None
        block_ids, num_cached = reserved
        return RemotePrefillSlot(block_ids, num_cached, self.block_size, len(prompt_token_ids))

    def finish_remote_prefill(self, request_id: str, kv_written: bool) -> EngineOutput | None:
        """The transfer for a reserved request is over: with ``kv_written`` it joins the decode
        batch, otherwise it prefills locally. An aborted request's blocks are freed (and its abort
        output returned)."""
        request = self.scheduler.finish_remote(request_id, kv_written)
        if request is not None and request.status.is_finished:
            return self._output(request, [], None)
        return None

    # -- peer fetch of a cached prefix (services/decode/fetch.py) -----------------------------------
    def reserve_prefix_fetch(self, fetch_id: str, prompt_token_ids: list[int],
                             num_blocks: int) -> PrefixFetchSlot | None:
        """Hold blocks for the prompt's first ``num_blocks`` full blocks (at most all but the one
        holding its last token, which is always computed here) so a peer can write those not
        cached here. None when the pool cannot hold them now or prefix caching is off. End it with
        ``finish_prefix_fetch``."""
        num_blocks = min(num_blocks, (len(prompt_token_ids) - 1) // self.block_size)
        if num_blocks <= 0:
            return None
        tokens = list(prompt_token_ids[:num_blocks * self.block_size])
        hashes = hash_blocks(tokens, self.block_size, self.scheduler.namespace)
        reserved = self.kv.reserve_fetch(_fetch_owner(fetch_id), hashes)
        if reserved is None:
            return None
        num_local, block_ids = reserved
        if block_ids:
            self._fetches[fetch_id] = (hashes, tokens, num_local)
        return PrefixFetchSlot(hashes, num_local, block_ids)

    def finish_prefix_fetch(self, fetch_id: str, num_written: int) -> None:
        """A peer wrote the first ``num_written`` fresh blocks of the fetch (0: none, or given up
        on once no write can still land): they join the prefix cache, and the blocks go back."""
        hashes, tokens, num_local = self._fetches.pop(fetch_id, ([], [], 0))
        self.kv.finish_fetch(_fetch_owner(fetch_id), tokens, hashes, num_local + num_written if num_written else 0)

    def read_prefix_from_disk(self, block_hashes: list[int]) -> bool:
        """Start reading the run of ``block_hashes`` this worker keeps on disk (after those in the
        pool or host memory) so that ``lend_prefix`` finds them; True while reads are under way."""
        self.kv.prefetch(block_hashes)
        return self.kv.is_loading(block_hashes)

    def lend_prefix(self, lend_id: str, block_hashes: list[int]) -> list[int]:
        """Pin the leading run of ``block_hashes`` cached here (pool, or host memory; disk blocks
        once ``read_prefix_from_disk`` brought them in) for a peer to read; their block ids.
        ``return_prefix`` unpins them."""
        return self.kv.lend(_lend_owner(lend_id), block_hashes)

    def return_prefix(self, lend_id: str) -> None:
        self.kv.free(_lend_owner(lend_id))

    def abort_request(self, request_id: str) -> EngineOutput | None:
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        self._forget(request_id)
        return self._output(request, [], None)

    def has_unfinished_requests(self) -> bool:
        """Requests that need steps (waiting or running; not those waiting for remote KV)."""
        return self.scheduler.has_unfinished

    # -- stepping -------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        out = self.scheduler.schedule()
        if not out.scheduled:
            if self.tiers is not None:  # requests may be waiting for their prefix from disk
                self.tiers.wait_loading(0.01)
            return []
        now = time.monotonic()
        for s in out.scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
        started = time.perf_counter()
        sampled = self.runner.execute(out)
        elapsed_s = time.perf_counter() - started
        self._prefill_rate.observe(sum(s.num_new_tokens for s in out.scheduled
                                       if s.start < s.request.num_prompt_tokens), elapsed_s)
        for observe in self._step_observers:
            observe(len(out.scheduled), sum(s.num_new_tokens for s in out.scheduled), elapsed_s)
        self._num_steps += 1
        for s in out.scheduled:
            if s.start == s.request.num_cached_tokens and s.request.num_preemptions == 0:
                self._num_prompt_tokens += s.request.num_prompt_tokens
                self._num_cached_prompt_tokens += s.request.num_cached_tokens
        num_before = {s.request.request_id: len(s.request.output_token_ids) for s in out.scheduled}
        finished = {r.request_id for r in self.scheduler.update_from_output(
            out, {rid: [t.token_id for t in tokens] for rid, tokens in sampled.items()})}
        outputs = []
        for s in out.scheduled:
            rid = s.request.request_id
            tokens = sampled.get(rid)
            if not tokens:
                continue
            new_ids = s.request.output_token_ids[num_before[rid]:]
            self._num_generated += len(new_ids)
            if rid in finished:
                self._forget(rid)
            outputs.append(self._output(s.request, new_ids, tokens[0] if len(tokens) == 1 else None))
        return outputs

    def _forget(self, request_id: str) -> None:
        self.runner.sampler.forget(request_id)
        if self.scheduler.speculator is not None:
            self.scheduler.speculator.forget(request_id)

    def _output(self, request: Request, new_ids: list[int], token: SampledToken | None) -> EngineOutput:
        logprobs = None
        if token is not None and token.logprob is not None:
            logprobs = [TokenLogprobs(token.token_id, token.logprob, token.top_logprobs or ())]
        finish = request.status.value if request.status.is_finished else None
        return EngineOutput(request.request_id, new_ids, logprobs, finish, request.num_prompt_tokens,
                            request.num_cached_tokens, len(request.output_token_ids), request.first_scheduled_time)

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        backlog = self.scheduler.backlog()
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_blocks_total=pool.num_blocks, num_blocks_used=pool.num_used_blocks,
            num_cached_blocks=pool.num_cached_blocks, max_num_seqs=self.config.max_num_seqs,
            num_preemptions=self.scheduler.num_preemptions, num_steps=self._num_steps,
            num_prompt_tokens=self._num_prompt_tokens, num_cached_prompt_tokens=self._num_cached_prompt_tokens,
            num_generated_tokens=self._num_generated, num_remote_pending=len(self.scheduler.remote),
            num_held=len(self.scheduler.held), queued_prefill_tokens=backlog.prefill_tokens,
            num_waiting_by_priority=backlog.num_waiting, num_running_by_priority=backlog.num_running,
            prefill_tokens_per_s=self._prefill_rate.tokens_per_s,
            kv_tiers=self.tiers.stats() if self.tiers is not None else {},
            num_draft_tokens=spec.stats.num_drafted if (spec := self.scheduler.speculator) else 0,
            num_accepted_tokens=spec.stats.num_accepted if spec else 0, decode_step=self.decode_step())

    def decode_step(self) -> str:
        """How decode-only steps run now: eager, compiling (eager while the background compile runs)
        or compiled."""
        if self.runner.compiled is not None:
            return "compiled"
        compiling = self.background_compile is not None and not self.background_compile.done.is_set()
        return "compiling" if compiling else "eager"

    def add_kv_event_sink(self, sink: KvEventSink) -> None:
        """Events go to ``sink`` from now on; the first sink also hears what the disk tier already
        holds (blocks a previous run of this worker left there)."""
        self.events.add_sink(sink)
        if self.tiers is not None and len(self.events.sinks) == 1:
            self.tiers.announce_disk()

    def close(self) -> None:
        """Write the pool's reusable blocks to the disk tier (if any) so a restart on the same
        directory finds them, finish queued writes and stop the tier threads."""
        if self.tiers is not None:
            num = self.tiers.persist(self.kv.pool.cached_blocks())
            if num:
                log.info("KV disk tier: saving %d cached blocks before exit", num)
            self.tiers.close()

    def forget_prefill_rate(self) -> None:
        """Drop the prefill rate measured so far (warm-up's few short prompts on cold kernels, often
        while other processes load, measure a rate the worker's real work does not have)."""
        self._prefill_rate.forget()

    def add_step_observer(self, observe: StepObserver) -> None:
        """``observe(num_seqs, num_tokens, elapsed_s)`` after every step that ran the model, in the
        engine's thread (so it must be quick and thread-safe)."""
        self._step_observers.append(observe)

    def request_block_ids(self, request_id: str) -> list[int]:
        """The request's block table: ids into ``kv_cache``'s first dimension (see kvcache.layout).
        A KV transfer registers ``kv_cache`` once and moves blocks by these ids (shared/transfer)."""
        return self.kv.block_ids(request_id)

    # -- convenience ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 *, priorities: list[int] | None = None) -> list[list[int]]:
        """Run prompts to completion together (continuous batching); returns output token ids."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for i, (rid, prompt) in enumerate(zip(ids, prompts)):
            self.add_request(rid, prompt, params_list[i], priorities[i] if priorities else 0)
        outputs: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished_requests():
            for o in self.step():
                if o.request_id in outputs:
                    outputs[o.request_id].extend(o.new_token_ids)
        return [outputs[rid] for rid in ids]


def _grammars(tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> TokenizerGrammars | None:
    """Structured outputs need the tokenizer's vocabulary; an engine built without one has none."""
    if tokenizer is None:
        return None
    return TokenizerGrammars(tokenizer.to_json(), vocab_size, sorted(eos_token_ids or {tokenizer.eos_token_id}))


def warmup(engine: LLMEngine, num_tokens: int = 64) -> None:
    """Run a throwaway request so the first user request pays no first-run costs."""
    prompt = [i % engine.model.cfg.vocab_size for i in range(1, min(num_tokens, engine.max_model_len - 4))]
    with torch.inference_mode():
        engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))


def _fetch_owner(fetch_id: str) -> str:
    return f"fetch:{fetch_id}"  # fetch and lend ids are ours (uuids): no request has such an id


def _lend_owner(lend_id: str) -> str:
    return f"lend:{lend_id}"

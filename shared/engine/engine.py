"""LLMEngine: schedule → run → update, one step at a time (synchronous core).

Its parts are made by ``shared.engine.build`` from the config; the KV blocks other workers write
or read (remote prefill, peer fetch, lends) are ``reservations``' (shared.engine.reservations);
what each step runs, and a step's prefill stopping between two layers, is ``slicer``'s
(shared.engine.prefill_slicer); what the steps measured is ``step_stats``' (shared.engine.step_stats)."""

from __future__ import annotations

import logging
import math
import time

import torch

from shared.engine.build import build_parts, load_model
from shared.engine.config import EngineConfig
from shared.engine.errors import InvalidRequestError, InvalidSamplingParamsError
from shared.engine.parallel import ParallelModel
from shared.engine.prefill_slicer import PrefillSlicer
from shared.engine.outputs import EngineOutput, TokenLogprobs, make_output  # noqa: F401
from shared.engine.request import Request, SamplingParams
from shared.engine.reservations import KvReservations, PrefixFetchSlot, RemotePrefillSlot  # noqa: F401
from shared.engine.sampler import SampledToken
from shared.engine.scheduler import SchedulerOutput
from shared.engine.step_stats import EngineStats, PrefillRate, StepObserver, StepStats  # noqa: F401
from shared.engine.step_trace import StepTrace
from shared.grammar import GrammarError, compile_grammar
from shared.kvcache.events import KvEventSink
from shared.engine.compiled.artifacts import ArtifactStore
from shared.model.llama import LlamaModel
from shared.model.moe import expert_load

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model: LlamaModel, config: EngineConfig, *, tokenizer=None,
                 model_id: str = "model", eos_token_ids: frozenset[int] = frozenset(),
                 artifact_store: ArtifactStore | None = None) -> None:
        """``artifact_store``: where the cluster keeps compiled decode steps (a worker's NATS bucket),
        asked before compiling and offered what this engine compiles."""
        parts = build_parts(model, config, tokenizer=tokenizer, model_id=model_id, eos_token_ids=eos_token_ids,
                            artifact_store=artifact_store)
        self.model, self.config, self.tokenizer, self.model_id = model, config, tokenizer, model_id
        self.eos_token_ids, self.device, self.block_size = eos_token_ids, model.device, config.block_size
        self.max_model_len, self.kv_namespace = parts.max_model_len, parts.kv_namespace
        self.kv_spec, self.num_blocks, self.kv_cache = parts.kv_spec, parts.num_blocks, parts.kv_cache
        self.events, self.tiers, self.kv, self.scheduler = parts.events, parts.tiers, parts.kv, parts.scheduler
        self.backend, self.runner, self.background_compile = parts.backend, parts.runner, parts.background_compile
        self.reservations = KvReservations(self.scheduler, self._new_request)
        self.step_stats = StepStats(config.block_size)
        self.step_trace = StepTrace(config.step_trace) if config.step_trace else None
        self.slicer = PrefillSlicer(self.runner, self.scheduler, config, self.step_stats, self.step_trace, model)
        self._log_capacity()

    @classmethod
    def from_config(cls, config: EngineConfig, artifact_store: ArtifactStore | None = None) -> "LLMEngine":
        """Resolve the model name (fetching the default model if needed), load it and build on it."""
        loaded = load_model(config)
        return cls(loaded.model, loaded.config, tokenizer=loaded.tokenizer, model_id=loaded.model_id,
                   eos_token_ids=loaded.eos_token_ids, artifact_store=artifact_store)

    def _log_capacity(self) -> None:
        tokens = self.num_blocks * self.block_size
        gib = self.num_blocks * self.kv_spec.bytes_per_block / 2**30
        per_req = self.kv_spec.bytes_per_token * self.max_model_len / 2**20
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB %s, %d KiB/token); a %d-token request "
                 "needs %.1f MiB, so at most %d such sequences run at once (max_num_seqs=%d); %s attention",
                 self.num_blocks, self.block_size, tokens, gib, str(self.kv_spec.dtype).removeprefix("torch."),
                 self.kv_spec.bytes_per_token // 1024,
                 self.max_model_len, per_req, tokens // self.max_model_len, self.config.max_num_seqs,
                 self.backend.name)

    # -- the parallel group ---------------------------------------------------------------------
    @property
    def tensor_parallel_size(self) -> int:
        return self.model.group.size

    @property
    def pipeline_parallel_size(self) -> int:
        return self.model.pipeline.num_stages

    @property
    def rank_pids(self) -> list[int]:
        """The process ids of a tensor-parallel group's ranks 1.. (empty for one process)."""
        return [p.pid for p in getattr(self.model, "followers", ())]

    @property
    def group_address(self) -> str | None:
        """``host:port`` where the ranks of other hosts join rank 0 (None: every rank on this host)."""
        config = self.config
        size = config.tensor_parallel_size * config.pipeline_parallel_size
        if config.local_ranks >= size:
            return None
        return f"{config.group_host}:{config.group_port}"

    def open_group_transfer(self, name: str):
        """A parallel group's NIXL agents, one per rank (``ParallelModel.open_transfer``): rank 0's
        agent and the group's metadata."""
        return self.model.open_transfer(name)

    def send_group_kv(self, target: bytes, local_ids: list[int], remote_ids: list[int], notify: bytes,
                      timeout_s: float) -> tuple[int, int]:
        """Every rank's part of one KV write into the worker whose ``GroupMetadata`` is ``target``
        (``ParallelModel.send_kv``): (bytes, descriptors) of the whole group."""
        return self.model.send_kv(target, local_ids, remote_ids, notify, timeout_s)

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
        """Queue a request. ``keep_kv``: when it finishes, hold its blocks
        (``reservations.request_block_ids`` stays valid) until ``reservations.release_kv`` — the
        prefill side of a KV transfer. ``deadline`` (Unix seconds): within its priority, earlier
        deadlines run first (none: after every deadline)."""
        self.scheduler.add_request(self._new_request(request_id, prompt_token_ids, params, priority, keep_kv,
                                                     deadline))

    def _new_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int,
                     keep_kv: bool, deadline: float | None) -> Request:
        self.validate(prompt_token_ids, params)
        return Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, priority,
                       keep_kv=keep_kv, deadline=math.inf if deadline is None else deadline,
                       decode_path=params.decode_path)

    def abort_request(self, request_id: str) -> EngineOutput | None:
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        self._forget(request_id)
        return make_output(request, [])

    def announce_request(self, priority: int) -> None:
        """A request of ``priority`` is on its way in from another thread: a step's prefill of a
        lower priority stops between two layers for it (``prefill_yield``)."""
        self.slicer.announce(priority)

    def clear_announced(self) -> None:
        """The announced requests are added (before the next step)."""
        self.slicer.clear_announced()

    def has_unfinished_requests(self) -> bool:
        """Requests that need steps (waiting or running; not those waiting for remote KV)."""
        return self.scheduler.has_unfinished

    # -- stepping -------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """One step: schedule → run → update. What runs is the slicer's to say (``PrefillSlicer``):
        the scheduler's next step, whose prefill of a lower priority may stop between two layers
        (``prefill_yield``), or a stopped step's part going on, or decode rows alone."""
        plan = self.slicer.plan()
        if plan is None:
            self._idle()
            return []
        out, sampled = self.slicer.run(plan)
        return self._update(out, sampled)

    def _update(self, out: SchedulerOutput, sampled: dict[str, list[SampledToken]]) -> list[EngineOutput]:
        num_before = {s.request.request_id: len(s.request.output_token_ids) for s in out.scheduled}
        finished = self.scheduler.update_from_output(out, {rid: [t.token_id for t in tokens]
                                                           for rid, tokens in sampled.items()})
        return self._outputs(out, sampled, num_before, {r.request_id for r in finished})

    def _idle(self) -> None:
        if self.tiers is not None:  # requests may be waiting for their prefix from disk
            self.tiers.wait_loading(0.01)

    def _outputs(self, out: SchedulerOutput, sampled: dict[str, list[SampledToken]], num_before: dict[str, int],
                 finished: set[str]) -> list[EngineOutput]:
        outputs = []
        for s in out.scheduled:
            rid = s.request.request_id
            tokens = sampled.get(rid)
            if not tokens:
                continue
            new_ids = s.request.output_token_ids[num_before[rid]:]
            self.step_stats.count_generated(len(new_ids))
            if rid in finished:
                self._forget(rid)
            outputs.append(make_output(s.request, new_ids, tokens[0] if len(tokens) == 1 else None))
        return outputs

    def _forget(self, request_id: str) -> None:
        self.runner.sampler.forget(request_id)
        if self.scheduler.speculator is not None:
            self.scheduler.speculator.forget(request_id)

    def stats(self) -> EngineStats:
        return self.step_stats.snapshot(self.scheduler, self.config.max_num_seqs,
                                        self.tiers.stats() if self.tiers is not None else {}, self.decode_step(),
                                        expert_load(self.model.layers))

    def decode_step(self) -> str:
        """How decode-only steps run now: eager, compiling (eager while the background compile runs)
        or compiled. A group's step is compiled once rank 0 has it: the group's next step hands it to
        every rank before any decode row runs (``ModelRunner.use_compiled``), and an idle worker
        would not come to that step unless its load says it can take requests there."""
        if self.runner.compiled is not None or self.runner.pending is not None:
            return "compiled"
        compiling = self.background_compile is not None and not self.background_compile.done.is_set()
        return "compiling" if compiling else "eager"

    def forget_prefill_rate(self, keep_as_warmup: bool = False) -> None:
        """See ``StepStats.forget_prefill_rate``."""
        self.step_stats.forget_prefill_rate(keep_as_warmup)

    def add_step_observer(self, observe: StepObserver) -> None:
        """See ``StepStats.add_observer``."""
        self.step_stats.add_observer(observe)

    def add_kv_event_sink(self, sink: KvEventSink) -> None:
        """Events go to ``sink`` from now on; the first sink also hears what the disk tier already
        holds (blocks a previous run of this worker left there)."""
        self.events.add_sink(sink)
        if self.tiers is not None and len(self.events.sinks) == 1:
            self.tiers.announce_disk()

    def close(self) -> None:
        """Write the pool's reusable blocks to the disk tier (if any) so a restart on the same
        directory finds them, finish queued writes and stop the tier threads; close the step trace;
        stop the other ranks of a tensor-parallel group."""
        if self.tiers is not None:
            num = self.tiers.persist(self.kv.pool.cached_blocks())
            if num:
                log.info("KV disk tier: saving %d cached blocks before exit", num)
            self.tiers.close()
        if self.step_trace is not None:
            self.step_trace.close()
        if isinstance(self.model, ParallelModel):
            self.model.close()

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


def warmup(engine: LLMEngine, num_tokens: int = 64) -> None:
    """Run a throwaway request so the first user request pays no first-run costs."""
    prompt = [i % engine.model.cfg.vocab_size for i in range(1, min(num_tokens, engine.max_model_len - 4))]
    with torch.inference_mode():
        engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))

"""Workers: registry entries, load reports, control, and the cluster view built from them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from shared.protocol.base import RequestId, WireModel, WorkerId
from shared.protocol.prefill import PrefillQueueStatus

Role = Literal["decode", "prefill"]
WorkerState = Literal["starting", "ready", "draining"]


class WorkerInfo(WireModel):
    """A worker's entry in the ``<ns>-workers`` KV bucket, refreshed by its heartbeat."""

    worker_id: WorkerId
    role: Role
    state: WorkerState = "ready"
    model: str
    block_size: int = Field(ge=1)
    max_model_len: int = Field(ge=1)
    num_blocks_total: int = Field(0, ge=0)
    max_num_seqs: int = Field(1, ge=1)
    generate_subject: str
    cancel_subject: str = ""  # empty for prefill workers (their work comes from the queue)
    control_subject: str | None = None
    kv_namespace_hex: str = ""
    host: str = ""
    # the joined host's random id (tandem join keeps it in its state directory): tells apart two
    # hosts under one name, whose workers would share ids (None: a worker not started by a join)
    host_id: str | None = None
    pid: int = 0
    started_at: float = 0.0
    heartbeat_at: float = 0.0
    num_restarts: int = Field(0, ge=0)  # times its supervisor restarted it after a crash
    # the prefill rate warm-up measured (a long prompt alone on warm kernels), in the entry so that
    # admission has it with the worker's first listing, before any load report: its rate until
    # real prompts measure ``WorkerLoad.prefill_tokens_per_s`` (None: not measured)
    warmup_prefill_tokens_per_s: float | None = Field(None, ge=0)
    # text in (GenerateRequest.messages / prompt_text), text out (TokenChunk.text): the worker
    # brings its own model and tokenizer, and the gateway sends it no token ids or block hashes
    takes_text: bool = False
    # the worker's parallel shape: one entry for a group of tensor_parallel_size x pipeline_parallel_size
    # ranks (processes with their shards of the weights and of the KV pool; ``pid`` is rank 0's,
    # ``rank_pids`` the others')
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    rank_pids: list[int] = Field(default_factory=list)
    # ``host:port`` where ranks on other hosts joined rank 0 (``pid``'s host): a group spanning hosts,
    # whose ``rank_pids`` are this host's ranks only (None: every rank on rank 0's host)
    group_address: str | None = None


class KvTierLoad(WireModel):
    """A worker's KV tiers under its pool (host memory, local disk): blocks held and moved."""

    host_blocks: int = Field(0, ge=0)
    host_capacity_blocks: int = Field(0, ge=0)
    disk_blocks: int = Field(0, ge=0)
    disk_capacity_blocks: int = Field(0, ge=0)
    offloaded_host: int = Field(0, ge=0)  # blocks copied out of the pool into host memory
    offloaded_disk: int = Field(0, ge=0)  # blocks written to disk
    onboarded: int = Field(0, ge=0)  # blocks copied back into the pool on a prefix hit, from any tier
    onboarded_disk: int = Field(0, ge=0)  # of those, blocks read from disk
    disk_read_failures: int = Field(0, ge=0)  # damaged or mismatched files, recomputed instead


class KvFetchLoad(WireModel):
    """A decode worker's prefix fetches from other workers over NIXL, and its loans to them."""

    num_fetches: int = Field(0, ge=0)  # fetches that brought blocks
    num_blocks_fetched: int = Field(0, ge=0)
    num_failed: int = Field(0, ge=0)  # asked, got nothing: computed the prefix instead
    num_skipped: int = Field(0, ge=0)  # a holder named by admission, not asked (cheaper to compute, ...)
    num_lent: int = Field(0, ge=0)  # fetches served for other workers
    num_blocks_lent: int = Field(0, ge=0)


class WorkerLoad(WireModel):
    """Published about once a second on ``<ns>.v1.load.<role>.<worker>``."""

    worker_id: WorkerId
    role: Role
    seq: int = Field(ge=0)
    timestamp: float
    num_running: int = Field(0, ge=0)
    num_waiting: int = Field(0, ge=0)
    num_blocks_used: int = Field(0, ge=0)
    num_blocks_total: int = Field(0, ge=0)
    num_cached_blocks: int = Field(0, ge=0)
    num_held: int = Field(0, ge=0)  # finished keep_kv requests whose blocks a transfer may still use
    max_num_seqs: int = Field(1, ge=1)
    ttft_recent_s: float | None = None
    itl_recent_s: float | None = None
    # the mean number of running requests when itl_recent_s was measured (None: not reported): a
    # batch that just filled up has an ITL measured on fewer sequences than it now runs
    itl_recent_batch: float | None = Field(None, ge=0)
    # mean output tokens of the requests finished in the last 30 s (None: none finished): how long
    # a running request holds its slot (started requests still decoding would bias a total's mean low)
    output_tokens_recent: float | None = Field(None, ge=0)
    # the same by request priority (a priority absent: none of it finished in the window): how long
    # each tier holds the slots it takes (short premium answers free theirs sooner than long batch
    # ones); empty from older workers
    output_tokens_recent_by_priority: dict[int, float] = Field(default_factory=dict)
    # how the worker's decode-only steps run: eager, compiling (eager while a background compile of
    # the decode step runs) or compiled (shared/engine/compiled/step.py)
    decode_step: Literal["eager", "compiling", "compiled"] = "eager"
    num_requests_total: int = Field(0, ge=0)
    num_requests_aborted: int = Field(0, ge=0)
    num_prompt_tokens_total: int = Field(0, ge=0)
    num_generated_tokens_total: int = Field(0, ge=0)
    num_cached_prompt_tokens_total: int = Field(0, ge=0)  # of num_prompt_tokens_total, served from the cache
    # decode: uncached prompt tokens of requests too short for a remote prefill (at most the worker's
    # local-prefill limit, or all with remote prefill off): work the decode side does whatever the split
    num_local_only_prompt_tokens_total: int = Field(0, ge=0)
    # disaggregated prefill (decode: requests whose prompt was prefilled remotely / locally, remote
    # attempts that fell back to a local prefill; prefill: requests written / dropped)
    num_remote_prefills: int = Field(0, ge=0)
    num_local_prefills: int = Field(0, ge=0)
    num_prefill_fallbacks: int = Field(0, ge=0)
    num_prefills_dropped: int = Field(0, ge=0)
    kv_bytes_sent: int = Field(0, ge=0)
    kv_bytes_received: int = Field(0, ge=0)
    # for admission's TTFT prediction: by request priority (lower runs first), the prompt tokens
    # still to prefill and the waiting requests; and the recent prefill rate (None: not measured yet)
    queued_prefill_tokens: dict[int, int] = Field(default_factory=dict)
    num_waiting_by_priority: dict[int, int] = Field(default_factory=dict)
    num_running_by_priority: dict[int, int] = Field(default_factory=dict)  # empty from older workers
    prefill_tokens_per_s: float | None = Field(None, ge=0)
    # a prefill step's seconds per prompt token and per (prompt token x context token): long prompts
    # prefill slower than the rate says (None: not determined yet; see shared.engine.step_stats)
    prefill_cost_s: tuple[float, float] | None = None
    kv_tiers: KvTierLoad | None = None  # None: no tiers below the pool
    kv_fetch: KvFetchLoad | None = None  # None: no prefix fetches between workers

    def prefill_alone_s(self, num_uncached: int, num_cached: int) -> float | None:
        """How long a prompt's ``num_uncached`` tokens after ``num_cached`` cached ones take to
        prefill with nothing else queued, from ``prefill_cost_s``; None without it."""
        if self.prefill_cost_s is None:
            return None
        a, b = self.prefill_cost_s
        return a * num_uncached + b * num_uncached * (2 * num_cached + num_uncached)

    def prefill_tokens_ahead(self, priority: int) -> int:
        """Tokens a new request of ``priority`` waits behind: its own priority and higher ones."""
        return _at_or_above(self.queued_prefill_tokens, priority)

    def num_waiting_ahead(self, priority: int) -> int:
        """Waiting requests a new request of ``priority`` queues behind."""
        return _at_or_above(self.num_waiting_by_priority, priority)

    def num_running_ahead(self, priority: int) -> int:
        """Running requests a new request of ``priority`` cannot take the slot of (the engine
        preempts a lower priority for it); all of them from a worker that does not report them."""
        if not self.num_running_by_priority:
            return self.num_running
        return _at_or_above(self.num_running_by_priority, priority)


def _at_or_above(by_priority: dict[int, int], priority: int) -> int:
    return sum(n for p, n in by_priority.items() if p <= priority)


class ControlRequest(WireModel):
    """``drain``/``stop``: finish in-flight work and leave. ``configure``: change the decode
    worker's conditional-disaggregation thresholds (fields left None keep their value).
    ``status``: change nothing, report (with ``request_id``: also whether that request is running
    here, so that a gateway waiting for its first token can tell a long queue from a request, or
    its replies, lost on the way: core NATS delivers at most once). ``flip``: take no new work, finish what is in flight, then
    serve as ``role`` in the same process (same engine, same weights) and register again; the
    reply comes at once (state ``draining``), the registry shows when the flip is done."""

    action: Literal["drain", "stop", "configure", "status", "flip"]
    max_local_prefill_tokens: int | None = Field(None, ge=0)
    max_prefill_queue: int | None = Field(None, ge=0)
    role: Role | None = None  # flip: the role to take
    drain_timeout_s: float | None = Field(None, ge=0)  # drain/stop: instead of the worker's own
    request_id: RequestId | None = None  # status: ask whether this request is running here

    @model_validator(mode="after")
    def _flip_names_a_role(self) -> "ControlRequest":
        if (self.action == "flip") != (self.role is not None):
            raise ValueError(f"role ({self.role}) is required with action flip and only there (action {self.action})")
        return self


class ControlResult(WireModel):
    worker_id: WorkerId
    state: WorkerState
    role: Role | None = None          # the role it serves now (None: an older worker)
    flipping_to: Role | None = None   # a flip is under way
    num_in_flight: int = Field(0, ge=0)
    max_local_prefill_tokens: int | None = None
    max_prefill_queue: int | None = None
    # the asked ``request_id`` is running here: received and its stream not ended (None: not asked,
    # or a worker that does not say)
    holds_request: bool | None = None


class ServiceInfo(WireModel):
    """A process's entry in the ``<ns>-services`` KV bucket (``shared.bus.services``), refreshed by
    its heartbeat: gateway, admission, kv-index, autoscaler, and each worker keyed by its worker
    id. ``tandem status`` lists them with their restarts and where their Prometheus metrics are."""

    instance_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_=.-]+$")  # the bucket key
    service: str  # gateway, admission, decode, prefill, kv-index, autoscaler
    metrics_url: str = ""  # empty from a producer that serves no metrics
    host: str = ""
    pid: int = 0
    started_at: float = 0.0
    heartbeat_at: float = 0.0
    num_restarts: int = Field(0, ge=0)  # times its supervisor restarted it after a crash
    # the Tandem release it runs (``shared.__version__``): processes of releases with the same major
    # and minor number work together, patch releases mix (empty from a producer that does not say)
    version: str = ""


class ClusterStatusRequest(WireModel):
    pass


class WorkerStatus(WireModel):
    info: WorkerInfo
    load: WorkerLoad | None = None
    load_age_s: float | None = None


class ScaleRequest(WireModel):
    """The autoscaler to ``tandem up`` (which owns the worker processes): ``start`` a worker of
    ``role``, or ``stop`` ``worker_id`` (it drains, finishes what it holds, exits 0 and is not
    restarted). ``reason`` is the policy's, for the log."""

    action: Literal["start", "stop"]
    role: Role
    worker_id: WorkerId | None = None
    reason: str = ""

    @model_validator(mode="after")
    def _stop_names_a_worker(self) -> "ScaleRequest":
        if (self.action == "stop") != (self.worker_id is not None):
            raise ValueError(f"worker_id ({self.worker_id}) is required with action stop and only there "
                             f"(action {self.action})")
        return self


class ScaleResult(WireModel):
    worker_id: WorkerId        # the worker started, or the one stopping
    pid: int | None = None     # start: the new process


class ScalingAction(WireModel):
    """One thing the autoscaler did to carry out a decision: ``flip`` a worker to ``role``, or ask
    ``tandem up`` to ``start`` a worker of ``role`` or ``stop`` one (``worker_id`` names it)."""

    kind: Literal["flip", "start", "stop"]
    worker_id: WorkerId | None = None  # start: None when tandem up refused
    role: Role                 # flip: the role the worker was asked to take; start/stop: the worker's
    ok: bool
    message: str = ""


class ScalingDecisionRecord(WireModel):
    """One autoscaler tick that changed something (or tried to), with the policy's reason."""

    timestamp: float
    reason: str
    num_prefill: int = Field(ge=0)
    num_decode: int = Field(ge=0)
    target_prefill: int = Field(ge=0)
    target_decode: int = Field(ge=0)
    prefill_tokens_per_s: float = 0.0           # demand measured over the tick
    local_prefill_tokens_per_s: float = 0.0     # of it, prompts too short for a remote prefill
    decode_tokens_per_s: float = 0.0
    prefill_capacity_tokens_per_s: float = 0.0  # one worker's, as the policy was told
    decode_capacity_tokens_per_s: float = 0.0
    actions: list[ScalingAction] = Field(default_factory=list)


class ScalingStatus(WireModel):
    enabled: bool
    last_reason: str = ""  # the latest tick's, acting or not
    last_tick_at: float | None = None
    last_decision: ScalingDecisionRecord | None = None  # the latest the policy made, acting or not
    recent: list[ScalingDecisionRecord] = Field(default_factory=list)  # those that acted, newest last


class ClusterStatusResult(WireModel):
    timestamp: float
    workers: list[WorkerStatus] = Field(default_factory=list)
    prefill_queue: PrefillQueueStatus | None = None  # None: no prefill queue exists (yet)
    scaling: ScalingStatus | None = None  # None: an autoscaler without the field

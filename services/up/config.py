from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.framework.command import ENV_ONLY
from services.framework.errors import CliError
from services.framework.settings import QosSettings
from shared.engine_settings import engine_settings


def default_state_dir() -> Path:
    from kernels.cache_dir import cache_dir

    return cache_dir() / "up"


# the engine settings a host passes on to its workers, each with its type, validation and help from
# their one definition (shared/engine_settings.py); unset (None), a worker keeps its own default
_HostEngineFields = engine_settings(
    "_HostEngineFields", only=("model", "device", "dtype", "quantization", "kv_cache_dtype", "num_threads",
                               "kv_cache_memory", "kv_host_memory", "kv_disk_dir", "speculative_tokens", "compile",
                               "group_local_ranks", "group_host", "group_port"),
    defaults={name: None for name in ("dtype", "quantization", "kv_cache_dtype", "num_threads", "kv_cache_memory",
                                      "kv_host_memory", "kv_disk_dir", "speculative_tokens", "compile",
                                      "group_host", "group_port")},
    notes={"model": "every worker's", "device": "every worker's", "dtype": "every worker's",
           "quantization": "every worker's", "kv_cache_dtype": "every worker's (unset: the workers' own)",
           "num_threads": "every worker's, per rank of a tensor-parallel one (unset: the host's cores shared out)",
           "kv_cache_memory": "every worker's", "kv_host_memory": "each decode worker's",
           "kv_disk_dir": "each decode worker keeps its blocks in DIR/<worker name>, found again when it restarts",
           "speculative_tokens": "decode workers' (unset: the workers' own, 6)",
           "compile": "every worker's (unset: the workers' own, background)",
           "group_local_ranks": "each parallel worker's, the others run by `tandem join --group-join` on their "
                                "hosts; needs --group-host and --group-port",
           "group_host": "this host's, for every parallel worker's group (gloo over TCP, not encrypted: keep it "
                         "on a private network)",
           "group_port": "the first port: parallel workers decode-1.. then prefill-1.. take one each, in order, "
                         "so decode-1's is this one"})


class WorkerHostSettings(_HostEngineFields):
    """The settings of a host's workers and their supervision: ``tandem up`` and ``tandem join``."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="forbid")

    decode: int = Field(1, ge=0, le=64, description="number of decode workers (0 with --prefill 0: the control "
                        "plane alone, for workers of your own; see docs/services.md)")
    prefill: int = Field(0, ge=0, le=64, description="number of prefill workers (0: every prompt prefills "
                         "on its decode worker)")
    max_local_prefill_tokens: int | None = Field(None, ge=0, description="decode workers prefill locally up to "
                                                 "this many uncached prompt tokens (default: decode's)")
    max_prefill_queue: int | None = Field(None, ge=0, description="decode workers prefill locally while the "
                                          "prefill queue is this long (default: decode's)")
    metrics_host: str | None = Field(None, description="where every process this command starts serves /metrics "
                                     "(each on a free port, listed in /status): 0.0.0.0 or this host's address "
                                     "lets a Prometheus on another host scrape them (default: 127.0.0.1)")
    metrics_key_file: str | None = Field(None, description="file holding the key every process this command "
                                         "starts then requires on its /metrics (`Authorization: Bearer KEY`; "
                                         "tandem up: default its --operator-key-file, so one key opens them all)")
    decode_tp: int = Field(1, ge=1, le=64, description="ranks of each decode worker's tensor-parallel group: one "
                           "worker, that many processes, each with its shard of the weights and KV (the model's "
                           "heads, KV heads and MLP width must split into it)")
    decode_pp: int = Field(1, ge=1, le=64, description="pipeline stages of each decode worker, each of --decode-tp "
                           "ranks with a contiguous share of the layers")
    prefill_tp: int = Field(1, ge=1, le=64, description="ranks of each prefill worker's tensor-parallel group; "
                            "its KV is re-laid out in transit to the decode workers' shape")
    prefill_pp: int = Field(1, ge=1, le=64, description="pipeline stages of each prefill worker, each of "
                            "--prefill-tp ranks")
    plan: Path | None = Field(None, description="start the workers of a plan from `tandem plan --json`: its decode and "
                              "prefill workers with their TP/PP and devices, in place of --decode/--prefill and "
                              "--decode-tp/--decode-pp (a plan this host cannot run is refused, naming the worker)")
    plan_node: str | None = Field(None, description="the plan's node this host is (a plan over several nodes: tandem "
                                  "up on one, tandem join on each other, all with the same --group-port): it starts "
                                  "the workers whose first GPU is on it and its ranks of workers led from others")
    plan_leaders: str | None = Field(None, pattern=r"^[^=,\s]+=[^=,\s]+(,[^=,\s]+=[^=,\s]+)*$",
                                     description="NODE=ADDRESS,... of the plan's nodes that lead workers with ranks "
                                     "on this one (their --group-host)")
    drain_timeout_s: float = Field(5.0, ge=0, description="on Ctrl-C, how long decode may finish work")
    state_dir: Path = Field(default_factory=default_state_dir, description="JetStream/Redis state")
    ready_timeout_s: float = Field(300.0, gt=0, description="give up if not ready within this")
    log_level: str = Field("INFO", description="services' logging level")
    restart: bool = Field(True, description="restart a service or worker that crashes (exponential backoff, "
                          "capped at restart_max_backoff_s); --no-restart stops the stack instead")
    restart_max_backoff_s: float = Field(30.0, gt=0, description="longest wait before restarting a child "
                                         "that keeps crashing")

    def group_worker_flags(self) -> dict[str, dict[str, object]]:
        """Each parallel worker's own group flags, by name ("decode-1"): its rendezvous address,
        one port each, and how many of its ranks start here (none without --group-local-ranks)."""
        if self.group_local_ranks is None:
            return {}
        parallel = [*(f"decode-{i + 1}" for i in range(self.decode) if self.decode_tp * self.decode_pp > 1),
                    *(f"prefill-{i + 1}" for i in range(self.prefill) if self.prefill_tp * self.prefill_pp > 1)]
        return {name: {"group_local_ranks": self.group_local_ranks,
                       **self.group_address(i, "--group-local-ranks leaves ranks to other hosts")}
                for i, name in enumerate(parallel)}

    def group_address(self, index: int, why: str) -> dict[str, object]:
        """The rendezvous flags of this host's ``index``-th parallel worker (0 first: decode workers,
        then prefill; or a plan's group index) whose other ranks run elsewhere: --group-host and its
        own port, --group-port + index. ``why`` starts the error when either flag is missing."""
        if self.group_host is None or not self.group_port:
            raise CliError(f"{why}: give --group-host (this host's address the other hosts reach) and --group-port "
                           "(the first of one port per parallel worker)")
        return {"group_host": self.group_host, "group_port": self.group_port + index}

    def worker_flags(self) -> tuple[dict[str, object], dict[str, object]]:
        """The decode workers' and the prefill workers' flags these settings give (unset ones left
        to the workers' own defaults)."""
        engine = {"kv_cache_memory": self.kv_cache_memory, "device": self.device,
                  "drain_timeout_s": self.drain_timeout_s,
                  **_given(dtype=self.dtype, quantization=self.quantization, num_threads=self.num_threads,
                           kv_cache_dtype=self.kv_cache_dtype,
                           compile=self.compile)}
        decode_only = _given(max_local_prefill_tokens=self.max_local_prefill_tokens,
                             max_prefill_queue=self.max_prefill_queue, kv_host_memory=self.kv_host_memory,
                             kv_disk_dir=self.kv_disk_dir, speculative_tokens=self.speculative_tokens)
        if self.decode_tp > 1:
            decode_only["tensor_parallel_size"] = self.decode_tp
        if self.decode_pp > 1:
            decode_only["pipeline_parallel_size"] = self.decode_pp
        prefill_only = {}
        if self.prefill_tp > 1:
            prefill_only["tensor_parallel_size"] = self.prefill_tp
        if self.prefill_pp > 1:
            prefill_only["pipeline_parallel_size"] = self.prefill_pp
        return {**engine, **decode_only}, {**engine, **prefill_only}


def _given(**flags: object) -> dict[str, object]:
    return {k: v for k, v in flags.items() if v is not None}


class UpSettings(WorkerHostSettings, QosSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="forbid")

    gateways: int = Field(1, ge=1, le=16, description="number of gateways (gateway i listens on port + i), so "
                          "one can die without taking the service down")
    admissions: int = Field(1, ge=1, le=16, description="number of admission services (one queue group: each "
                            "request goes to one of them)")
    host: str = Field("127.0.0.1", description="gateway listen address")
    port: int = Field(8000, ge=0, le=65535, description="gateway port (0: any free port)")
    nats_url: str | None = Field(None, description="use this NATS server instead of an embedded one (its "
                                 "credentials in the URL: nats://user:password@host:port); unset: an embedded "
                                 "one whose password and port are kept in the state directory across runs")
    redis_url: str | None = Field(None, description="use this Redis instead of an embedded one "
                                  "(redis://:password@host:port/db); unset: an embedded one with a fresh "
                                  "password each run")
    nats_ca: str | None = Field(None, description="with --nats-url: the CA file its TLS certificate is signed by")
    nats_cluster: int = Field(1, ge=1, le=7, description="embedded NATS: run this many nats-servers routed into one "
                              "JetStream cluster (3: streams and buckets kept in 3 copies, one server may die)")
    nats_host: str = Field("127.0.0.1", description="embedded NATS: client listen address (0.0.0.0 or this host's "
                           "address so that workers on other hosts can join: tandem join)")
    nats_port: int = Field(0, ge=0, le=65535, description="embedded NATS: client port (0: a free one; a cluster's "
                           "members listen on port, port + 1, ...)")
    advertise_host: str | None = Field(None, description="the address other hosts dial for this host's NATS, "
                                       "written into connect.env (default: --nats-host, or for 0.0.0.0 this "
                                       "host's address on its default route)")
    nats_tls: bool = Field(False, description="embedded NATS: clients connect over TLS; a CA made in the state "
                           "directory (tls/ca.pem) signs the server's certificate and every client verifies it")
    nats_replicas: int | None = Field(None, ge=1, le=5, description="copies JetStream keeps of each stream and "
                                      "bucket (default: 1, or up to 3 on a cluster)")
    namespace: str = Field("tandem", pattern=r"^[A-Za-z0-9_-]{1,64}$", description="subject/key namespace")
    registry_ttl_s: float = Field(6.0, gt=0, description="worker registry entry TTL")
    api_keys: str | None = Field(None, json_schema_extra=ENV_ONLY, description="gateway API keys as key:tier "
                                 "pairs (tiers from --qos); unset (and no --api-keys-file): no auth")
    api_keys_file: str | None = Field(None, description="file of gateway API keys, one KEY or KEY:TIER a line "
                                      "(# comments); the gateways read it themselves")
    operator_key_file: str | None = Field(None, description="file holding the operator key that /status, /metrics "
                                          "and /dashboard then require (and tandem up itself sends); unset: open")
    rate_limit_per_s: float | None = Field(None, gt=0, description="requests per second per API key (per client "
                                           "address without keys), one limit across every gateway (kept in "
                                           "Redis); unset: no limit")
    autoscale: bool = Field(False, description="let the autoscaler act: flip workers between decode and prefill, "
                            "and start and stop worker processes between --min-workers and --max-workers")
    min_workers: int | None = Field(None, ge=1, description="with --autoscale: never fewer workers than this "
                                    "(default: --decode + --prefill)")
    max_workers: int | None = Field(None, ge=1, description="with --autoscale: never more workers than this "
                                    "(default: --decode + --prefill, a fleet of fixed size)")
    scale_down_drain_timeout_s: float = Field(300.0, gt=0, description="a worker stopped by the autoscaler "
                                              "finishes what it holds for up to this long")
    rate_limit_burst: int | None = Field(None, ge=1, description="gateway requests a key may send at once "
                                         "(default: the gateway's)")


    @model_validator(mode="after")
    def _fleet_bounds(self) -> "UpSettings":
        if not self.autoscale and (self.min_workers is not None or self.max_workers is not None):
            raise ValueError("min_workers and max_workers need autoscale (--autoscale)")
        if self.nats_url and (self.nats_cluster > 1 or self.nats_tls):
            raise ValueError("nats_cluster and nats_tls set up the embedded NATS: not with nats_url (give "
                             "every member's URL, comma-separated, and nats_ca for TLS)")
        num_workers = self.decode + self.prefill
        low, high = self.fleet_bounds()
        if not low <= num_workers <= high:
            raise ValueError(f"--decode + --prefill ({num_workers}) must lie between min_workers ({low}) and "
                             f"max_workers ({high})")
        return self

    def fleet_bounds(self) -> tuple[int, int]:
        num_workers = self.decode + self.prefill
        return self.min_workers or num_workers, self.max_workers or num_workers

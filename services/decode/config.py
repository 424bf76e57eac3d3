from pydantic import Field, model_validator

from services.worker.settings import EngineWorkerSettings, default_worker_id


class DecodeSettings(EngineWorkerSettings):
    worker_id: str = Field(default_factory=lambda: default_worker_id("decode"), pattern=r"^[A-Za-z0-9_-]{1,64}$",
                           description="unique worker id (a subject token)")
    remote_prefill: bool = Field(True, description="send long uncached prompts to prefill workers when any "
                                 "are registered (needs NIXL)")
    kv_peer_fetch: bool = Field(True, description="fetch a prompt's cached prefix over NIXL from the worker that "
                                "holds it (named by admission) when that beats recomputing it, and lend cached "
                                "blocks to other workers (needs NIXL)")
    kv_fetch_window_s: float = Field(1.0, gt=0, description="a holder must start writing a fetched prefix within "
                                     "this, or the prefix is computed here")
    max_local_prefill_tokens: int = Field(512, ge=0, description="prefill locally when the uncached part of "
                                          "the prompt is at most this long (0: every uncached prompt goes remote)")
    max_prefill_queue: int = Field(128, ge=0, description="prefill locally while the prefill queue holds this "
                                   "many requests or more")
    remote_prefill_timeout_s: float = Field(30.0, gt=1, description="prefill locally if a prefill worker has not "
                                            "delivered the KV within this")
    kv_write_timeout_s: float = Field(2.0, gt=0, description="longest a prefill worker's KV write into this "
                                      "worker may take (sets its write deadline)")
    prefill_lease_s: float = Field(4.0, gt=0, description="a prefill worker's lease on the blocks reserved for "
                                   "it, renewed while it works: blocks of one that died are freed (and its "
                                   "request prefilled here) this long after its last renewal")

    @model_validator(mode="after")
    def _window_covers_a_write(self) -> "DecodeSettings":
        if self.remote_prefill_timeout_s <= self.kv_write_timeout_s + 1:
            raise ValueError(f"remote_prefill_timeout_s ({self.remote_prefill_timeout_s}) must exceed "
                             f"kv_write_timeout_s ({self.kv_write_timeout_s}) by more than 1s")
        if self.prefill_lease_s <= self.kv_write_timeout_s + 0.5:
            raise ValueError(f"prefill_lease_s ({self.prefill_lease_s}) must exceed kv_write_timeout_s "
                             f"({self.kv_write_timeout_s}) by more than 0.5s")
        return self

    def disagg_config(self):
        from shared.policy.disagg import DisaggConfig

        return DisaggConfig(self.max_local_prefill_tokens, self.max_prefill_queue)

from pydantic import Field

from services.worker.settings import EngineWorkerSettings, default_worker_id


class PrefillSettings(EngineWorkerSettings):
    worker_id: str = Field(default_factory=lambda: default_worker_id("prefill"), pattern=r"^[A-Za-z0-9_-]{1,64}$",
                           description="unique worker id (a subject token)")
    max_concurrent_prefills: int = Field(8, ge=1, description="queue messages prefilled at once (batched together)")
    ack_wait_s: float = Field(10.0, gt=0, description="redeliver a message to another worker if its worker has "
                              "not acknowledged it or reported progress within this")
    max_deliver: int = Field(3, ge=1, description="deliveries of one message before the queue gives up on it")
    queue_max_age_s: float = Field(300.0, gt=0, description="prefill queue: drop messages older than this")
    queue_max_msgs: int = Field(10_000, gt=0, description="prefill queue: refuse new messages beyond this many")
    max_priority_skips: int = Field(3, ge=1, description="a lower-priority prefill-queue level passed over this "
                                    "many times in a row while it waits is served next (no starvation)")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, how long to finish in-flight prefills")

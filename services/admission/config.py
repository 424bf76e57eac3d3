from typing import Literal

from pydantic import Field

from services.framework.settings import QosSettings, ServiceSettings


class AdmissionSettings(ServiceSettings, QosSettings):
    max_waiting_per_worker: int = Field(32, ge=1, description="reject when every worker queues this many")
    routing: Literal["kv", "round-robin"] = Field(
        "kv", description="kv: the cheapest worker by prefix overlap and load (overlap weight 0: load alone); "
        "round-robin: the ready workers in turn, the baseline kv routing is judged against")
    overlap_weight: float = Field(1.0, ge=0, description="routing cost per block to prefill")
    queue_weight: float = Field(4.0, ge=0, description="routing cost per queued request, in blocks")
    kv_match_timeout_s: float = Field(0.5, gt=0, description="wait for kv-index, then least-loaded")
    retry_after_s: float = Field(1.0, ge=0, description="Retry-After suggested on rejection")
    refresh_interval_s: float = Field(0.5, gt=0, description="how often to re-read the registry")
    min_fetch_blocks: int = Field(2, ge=1, description="name a worker holding at least this many more of the "
                                  "prompt's leading blocks than the chosen one, for it to fetch them from")
    fallback_workers: int = Field(3, ge=0, description="when the routing's choice would miss the request's "
                                  "SLO, try this many next-cheapest workers before rejecting it (0: reject)")
    shed_hold_s: float = Field(2.0, ge=0, description="lower tiers stay shed this long after a higher tier's SLO miss")
    arrival_margin_sd: float = Field(
        1.645, ge=0, description="count higher tiers' arrivals during a predicted wait this many standard "
        "deviations over their mean (1.645: a prediction met 19 times in 20; 0: the mean)")

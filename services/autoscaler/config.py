from pydantic import Field, model_validator

from shared.runtime.settings import ServiceSettings


class AutoscalerSettings(ServiceSettings):
    refresh_interval_s: float = Field(1.0, gt=0, description="how often to re-read the registry")
    autoscale: bool = Field(False, description="act on the load: flip workers between decode and prefill "
                            "(off: only serve the cluster view)")
    autoscale_interval_s: float = Field(10.0, gt=0, description="how often to measure demand and decide")
    autoscale_window_s: float = Field(30.0, gt=0, description="measure demand over this long (longer: "
                                      "steadier, slower to react)")
    autoscale_cooldown_s: float = Field(60.0, ge=0, description="no new flip until this long after "
                                        "the last one is done")
    autoscale_hysteresis: float = Field(0.15, ge=0, description="relative change of the prefill share needed "
                                        "to act")
    min_prefill_workers: int = Field(0, ge=0, description="never fewer prefill workers than this")
    max_prefill_workers: int | None = Field(None, ge=0, description="never more prefill workers (unset: no cap)")
    min_decode_workers: int = Field(1, ge=1, description="never fewer decode workers than this")
    max_decode_workers: int | None = Field(None, ge=1, description="never more decode workers (unset: no cap)")
    max_flips_per_tick: int = Field(1, ge=1, description="workers flipped at most per decision")
    prefill_capacity_tokens_per_s: float = Field(2000.0, gt=0, description="one worker's prefill rate, used "
                                                 "until workers report a measured one")
    decode_capacity_tokens_per_s: float = Field(200.0, gt=0, description="one decode worker's output tokens "
                                                "per second at its SLO")
    control_timeout_s: float = Field(10.0, gt=0, description="wait this long for a worker to accept a flip")

    @model_validator(mode="after")
    def _bounds_are_ordered(self) -> "AutoscalerSettings":
        for role in ("prefill", "decode"):
            low, high = getattr(self, f"min_{role}_workers"), getattr(self, f"max_{role}_workers")
            if high is not None and high < low:
                raise ValueError(f"max_{role}_workers ({high}) is below min_{role}_workers ({low})")
        return self

    def autoscale_config(self):
        from shared.policy.autoscale import AutoscaleConfig

        return AutoscaleConfig(cooldown_s=self.autoscale_cooldown_s, hysteresis=self.autoscale_hysteresis,
                               min_prefill=self.min_prefill_workers, min_decode=self.min_decode_workers,
                               max_flips_per_tick=self.max_flips_per_tick, max_prefill=self.max_prefill_workers,
                               max_decode=self.max_decode_workers)

    def capacities(self):
        from shared.policy.autoscale_inputs import Capacities

        return Capacities(self.prefill_capacity_tokens_per_s, self.decode_capacity_tokens_per_s)

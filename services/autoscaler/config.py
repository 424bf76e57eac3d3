from pydantic import Field, model_validator

from services.framework.settings import ServiceSettings


class AutoscalerSettings(ServiceSettings):
    refresh_interval_s: float = Field(1.0, gt=0, description="how often to re-read the registry")
    autoscale: bool = Field(False, description="act on the load: flip workers between decode and prefill "
                            "(off: only serve the cluster view)")
    autoscale_interval_s: float = Field(10.0, gt=0, description="how often to measure demand and decide")
    autoscale_window_s: float = Field(30.0, gt=0, description="measure demand over this long (longer: "
                                      "steadier, slower to react)")
    autoscale_cooldown_s: float = Field(60.0, ge=0, description="no new flip until this long after "
                                        "the last one is done")
    autoscale_stabilization_s: float = Field(30.0, ge=0, description="flip only once every tick of this long "
                                             "asked for it (a shorter burst is not worth a drain)")
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
    min_workers: int = Field(1, ge=1, description="with max_workers: never stop a worker below this fleet size")
    max_workers: int | None = Field(None, ge=1, description="start and stop worker processes (through tandem up) "
                                    "between min_workers and this; unset: the fleet's size is fixed")
    scale_up_at: float = Field(0.8, gt=0, description="start a worker when demand reaches this share of the "
                               "fleet's capacity (or requests queue on the workers)")
    scale_down_at: float = Field(0.4, ge=0, description="stop a worker when the rest would be at most this busy")
    max_waiting_per_worker: float = Field(1.0, gt=0, description="start a worker when this many requests per "
                                          "worker wait for a slot")
    control_timeout_s: float = Field(10.0, gt=0, description="wait this long for a worker to accept a flip")

    @model_validator(mode="after")
    def _bounds_are_ordered(self) -> "AutoscalerSettings":
        for role in ("prefill", "decode"):
            low, high = getattr(self, f"min_{role}_workers"), getattr(self, f"max_{role}_workers")
            if high is not None and high < low:
                raise ValueError(f"max_{role}_workers ({high}) is below min_{role}_workers ({low})")
        if self.max_workers is not None and self.max_workers < self.min_workers:
            raise ValueError(f"max_workers ({self.max_workers}) is below min_workers ({self.min_workers})")
        if self.scale_down_at >= self.scale_up_at:
            raise ValueError(f"scale_down_at ({self.scale_down_at}) must be below scale_up_at ({self.scale_up_at})")
        return self

    def fleet_config(self):
        """The fleet-size policy's settings; None when the fleet's size is fixed."""
        from shared.policy.fleet import FleetConfig

        if self.max_workers is None:
            return None
        return FleetConfig(min_workers=self.min_workers, max_workers=self.max_workers, scale_up_at=self.scale_up_at,
                           scale_down_at=self.scale_down_at, max_waiting_per_worker=self.max_waiting_per_worker,
                           cooldown_s=self.autoscale_cooldown_s, min_prefill=self.min_prefill_workers,
                           min_decode=self.min_decode_workers)

    def autoscale_config(self):
        from shared.policy.autoscale import AutoscaleConfig

        return AutoscaleConfig(cooldown_s=self.autoscale_cooldown_s, hysteresis=self.autoscale_hysteresis,
                               stabilization_s=self.autoscale_stabilization_s,
                               min_prefill=self.min_prefill_workers, min_decode=self.min_decode_workers,
                               max_flips_per_tick=self.max_flips_per_tick, max_prefill=self.max_prefill_workers,
                               max_decode=self.max_decode_workers)

    def capacities(self):
        from shared.policy.autoscale_inputs import Capacities

        return Capacities(self.prefill_capacity_tokens_per_s, self.decode_capacity_tokens_per_s)

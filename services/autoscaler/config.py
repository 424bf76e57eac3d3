from pydantic import Field

from shared.runtime.settings import ServiceSettings


class AutoscalerSettings(ServiceSettings):
    refresh_interval_s: float = Field(1.0, gt=0, description="how often to re-read the registry")

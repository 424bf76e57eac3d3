from pydantic import Field

from services.framework.settings import ServiceSettings


class KvIndexSettings(ServiceSettings):
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL")
    events_max_age_s: float = Field(3600.0, gt=0, description="KV event stream retention (seconds)")
    events_max_msgs: int = Field(1_000_000, gt=0, description="KV event stream retention (messages)")
    sweep_interval_s: float = Field(1.0, gt=0, description="how often to drop workers that left")

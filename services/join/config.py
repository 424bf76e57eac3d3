import socket
from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.up.config import WorkerHostSettings, default_state_dir


def default_host_name() -> str:
    return socket.gethostname().split(".")[0][:24] or "host"


class JoinSettings(WorkerHostSettings):
    """``tandem up``'s worker settings, with the descriptions that hold for a host without the
    control plane; plus where that control plane is."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="forbid")

    connect: Path = Field(..., description="the control plane's connect.env (tandem up writes it in its state "
                          "directory and names it when ready); its CA file (TLS) is read from the path it "
                          "names or, copied beside it, as ca.pem")
    host_name: str = Field(default_factory=default_host_name, pattern=r"^[A-Za-z0-9_-]{1,24}$",
                           description="this host's name in its workers' ids (<namespace>-<host>-decode-1), "
                                       "unique among the hosts joined to one control plane (a join whose worker "
                                       "ids another host's live workers hold exits 7)")
    decode: int = Field(1, ge=0, le=64, description="number of decode workers on this host (0: prefill "
                        "workers only; --decode and --prefill may not both be 0 but on a host of --group-join "
                        "ranks, where 0 is the default)")
    prefill: int = Field(0, ge=0, le=64, description="number of prefill workers on this host")
    state_dir: Path = Field(default_factory=default_state_dir, description="this host's own "
                            "directory (join-<namespace>/ in it, with the host id that tells this host's workers "
                            "from another's under the same host name); the control plane's JetStream and Redis "
                            "state stay on its host")
    ready_timeout_s: float = Field(300.0, gt=0, description="give up (exit 3) if the control plane's NATS "
                                   "cannot be reached within this, and (exit 6) if the workers are not ready "
                                   "in its registry within this")
    group_join: str | None = Field(None, pattern=r"^\S+:[0-9]{1,5}$", description="HOST:PORT of a parallel "
                                   "worker's rank 0 on another host (its --group-host and group port): run "
                                   "--group-ranks of its ranks here, from --group-rank on, restarted whenever "
                                   "the group ends (they rejoin it when its rank 0 comes back); no workers of "
                                   "this host's own unless --decode/--prefill are given")
    group_rank: int = Field(1, ge=1, description="the first rank of --group-join's group this host runs (rank "
                            "0's host runs ranks 0 to its --group-local-ranks - 1)")
    group_ranks: int = Field(1, ge=1, le=64, description="how many of that group's ranks this host runs")

    @model_validator(mode="after")
    def _ranks_only(self) -> "JoinSettings":
        if self.group_join and not {"decode", "prefill"} & self.model_fields_set:
            self.decode = 0  # a host of another host's group's ranks: no worker of its own unless asked
        return self

    def rank_flags(self) -> dict[str, dict[str, object]]:
        """The ``tandem rank`` processes of --group-join, by name ("rank-1"): their flags."""
        if not self.group_join:
            return {}
        return {f"rank-{r}": {"join": self.group_join, "rank": r, "log_level": self.log_level}
                for r in range(self.group_rank, self.group_rank + self.group_ranks)}

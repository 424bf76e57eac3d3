import socket
from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.up.config import WorkerHostSettings


def default_host_name() -> str:
    return socket.gethostname().split(".")[0][:24] or "host"


class JoinSettings(WorkerHostSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="forbid")

    connect: Path = Field(..., description="the control plane's connect.env (tandem up writes it in its state "
                          "directory and names it when ready); its CA file (TLS) is read from the path it "
                          "names or, copied beside it, as ca.pem")
    host_name: str = Field(default_factory=default_host_name, pattern=r"^[A-Za-z0-9_-]{1,24}$",
                           description="this host's name in its workers' ids (<namespace>-<host>-decode-1), "
                                       "unique among the hosts joined to one control plane")

"""The embedded NATS's logins as kept in its data directory (``login.json``, its owner's alone) across
restarts: read by the stack at start, changed by a rotation (``services/stack/rotate.py``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

from services.stack.servers import Login, port_is_free, private_file

USER_NAMES = ("tandem", "tandem-2")  # a rotation moves to the other one


@dataclass(frozen=True)
class KeptLogin:
    """The embedded NATS's logins (the current one first; during an overlap the old one after it),
    its client ports, and when the overlap ends (wall clock, seconds since the epoch). Taken back
    only for the same number of members, and the ports only while they are free."""

    logins: tuple[Login, ...]
    ports: tuple[int, ...]
    old_until_s: float | None = None

    FILE: ClassVar[str] = "login.json"

    @classmethod
    def new(cls, password: str, ports: list[int]) -> "KeptLogin":
        return cls((Login(USER_NAMES[0], password),), tuple(ports))

    @property
    def current(self) -> Login:
        return self.logins[0]

    @property
    def is_overlapping(self) -> bool:
        return len(self.logins) > 1

    def with_ports(self, ports: list[int]) -> "KeptLogin":
        return replace(self, ports=tuple(ports))

    def rotated(self, password: str, now_s: float, overlap_s: float) -> "KeptLogin":
        """A new current login (the other user name), the current one accepted ``overlap_s`` more."""
        assert not self.is_overlapping, f"a rotation overlaps until {self.old_until_s}: finish it first"
        assert overlap_s > 0, f"overlap_s must be positive, got {overlap_s}"
        user = USER_NAMES[1] if self.current.user == USER_NAMES[0] else USER_NAMES[0]
        return replace(self, logins=(Login(user, password), self.current), old_until_s=now_s + overlap_s)

    def finished(self) -> "KeptLogin":
        """The current login alone: the overlap is over."""
        return replace(self, logins=self.logins[:1], old_until_s=None)

    def is_due(self, now_s: float) -> bool:
        """Whether the overlap is over and the old login should go."""
        return self.is_overlapping and self.old_until_s is not None and now_s >= self.old_until_s

    @classmethod
    def load(cls, directory: Path, num_members: int) -> "KeptLogin | None":
        try:
            data = json.loads((directory / cls.FILE).read_text())
            if "logins" in data:
                logins = tuple(Login(str(d["user"]), str(d["password"])) for d in data["logins"])
            else:  # written before rotation existed: one password for the first user name
                logins = (Login(USER_NAMES[0], str(data["password"])),)
            until = data.get("old_until_s")
            kept = cls(logins, tuple(int(p) for p in data["ports"]), None if until is None else float(until))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        valid = all(login.password for login in logins) and len(logins) in (1, 2)
        return kept if valid and len(kept.ports) == num_members else None

    def free_ports(self, host: str) -> list[int] | None:
        return list(self.ports) if all(port_is_free(host, p) for p in self.ports) else None

    def save(self, directory: Path) -> None:
        private_file(directory / self.FILE, json.dumps({
            "logins": [{"user": login.user, "password": login.password} for login in self.logins],
            "ports": list(self.ports), "old_until_s": self.old_until_s}))

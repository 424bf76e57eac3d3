"""The base of every wire model: frozen, JSON on the wire, tolerant of fields it does not know.

``extra="ignore"`` is what lets an older consumer accept a message from a newer producer that
added an optional field (the only kind of change allowed within ``v1``).
"""

from __future__ import annotations

from typing import Annotated, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

M = TypeVar("M", bound="WireModel")

# Worker ids become one token of a NATS subject and part of Redis keys: no dots, spaces or wildcards.
WorkerId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
# Block hashes are non-negative 63-bit ints (shared.kvcache.hashing).
BlockHash = Annotated[int, Field(ge=0, lt=2**63)]
RequestId = Annotated[str, StringConstraints(min_length=1, max_length=128)]


class WireModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls: type[M], data: bytes) -> M:
        """Parse a message; raises ``pydantic.ValidationError`` on malformed input."""
        return cls.model_validate_json(data)


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """A failed parse in one line, and the field it names (dotted path; None for the whole message)."""
    first = exc.errors()[0]
    field = ".".join(str(p) for p in first.get("loc", ())) or None
    return f"{first['msg']}" + (f" (field {field})" if field else ""), field

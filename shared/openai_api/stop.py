"""Stop strings applied to streamed text: text is held back while it could still be the start of
a stop string, and everything from a matched stop string on is dropped (OpenAI semantics)."""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self.is_stopped = False

    def push(self, text: str) -> str:
        """Add newly decoded text; return what can be emitted now (stop: the text before it)."""
        if self.is_stopped:
            return ""
        if not self._stops:
            return text
        self._pending += text
        cut = min((i for i in (self._pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.is_stopped = True
            out, self._pending = self._pending[:cut], ""
            return out
        if len(self._pending) <= self._hold:
            return ""
        out, self._pending = self._pending[:-self._hold or None], self._pending[-self._hold:] if self._hold else ""
        return out

    def flush(self) -> str:
        """The held-back text, when the request ended without a stop string."""
        out, self._pending = ("" if self.is_stopped else self._pending), ""
        return out

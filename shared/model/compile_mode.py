"""The ``compile`` setting's values, without importing torch (``--help`` stays fast)."""

from __future__ import annotations

COMPILE_MODES = ("off", "on", "background")
_BOOLEAN_SPELLINGS = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}


def compile_mode(value: str | bool) -> str:
    """The canonical ``compile`` setting: off, on or background (True and False, and the strings an
    environment variable would hold for them, mean on and off)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    mode = _BOOLEAN_SPELLINGS.get(value.lower(), value.lower())
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {value!r} (choose {', '.join(COMPILE_MODES)})")
    return mode

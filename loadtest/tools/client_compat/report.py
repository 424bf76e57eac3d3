"""Running the checks, the JSON result, and the README table made from it (the table is never
written by hand: ``--readme`` replaces the text between the markers)."""

from __future__ import annotations

import re
import time
from pathlib import Path

from loadtest.tools.client_compat.base import FEATURES, Check, Client, Target

PASS, FAIL, NOT_INSTALLED = "pass", "fail", "not installed"
README = Path(__file__).resolve().parents[3] / "README.md"
BEGIN, END = "<!-- client-compat:begin -->", "<!-- client-compat:end -->"


def run_check(check: Check, target: Target) -> dict:
    """One check's outcome: ``status`` pass or fail, ``error`` (the exception, shortened), ``seconds``."""
    start = time.perf_counter()
    try:
        check(target)
        status, error = PASS, None
    except Exception as exc:  # every failure is a result to record, whatever the client raised
        status, error = FAIL, f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:500]
    return {"status": status, "error": error, "seconds": round(time.perf_counter() - start, 2)}


def run_client(client: Client, target: Target) -> dict:
    """Every check of ``client`` in ``FEATURES`` order; none run when its library is not installed."""
    version = client.version()
    if version is None:
        return {"client": client.name, "version": None, "installed": False,
                "features": {f: {"status": NOT_INSTALLED} for f in FEATURES if f in client.checks}}
    features = {}
    for feature in (f for f in FEATURES if f in client.checks):
        outcome = features[feature] = run_check(client.checks[feature], target)
        print(f"{client.name:18s} {feature:14s} {outcome['status']}  {outcome['error'] or ''}".rstrip(), flush=True)
    return {"client": client.name, "version": version, "installed": True, "features": features}


def run(target: Target, clients: list[Client]) -> dict:
    """The result: the model, when, the feature names, and each client's outcomes."""
    return {"model": target.model, "run_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "features": FEATURES, "clients": [run_client(c, target) for c in clients]}


def failures(result: dict) -> list[tuple[str, str, str]]:
    """(client, feature, error) of every installed client's check that did not pass."""
    return [(c["client"], f, o.get("error") or o["status"]) for c in result["clients"] if c["installed"]
            for f, o in c["features"].items() if o["status"] != PASS]


def table(result: dict) -> str:
    """The README's table: a row per client, a column per feature ("—": the client has no API for
    it), then each failure's error. Versions stay in the JSON result: a new release alone that
    passes as the last did makes no new table."""
    def cell(client: dict, feature: str) -> str:
        outcome = client["features"].get(feature)
        return "—" if outcome is None else {PASS: "passes", FAIL: "fails", NOT_INSTALLED: "not installed"}[
            outcome["status"]]

    head = ["Client", *FEATURES.values()]
    rows = [[c["client"], *(cell(c, f) for f in FEATURES)] for c in result["clients"]]
    lines = ["| " + " | ".join(r) + " |" for r in [head, ["---"] * len(head), *rows]]
    lines += [f"- {client}, {FEATURES[feature]}: {error}" for client, feature, error in failures(result)]
    return "\n".join(lines)


_MARKED = re.compile(re.escape(BEGIN) + r"\n?(.*?)\n?" + re.escape(END), re.S)


def table_in(readme: str) -> str:
    """The text between the markers of ``readme``; ValueError without them."""
    match = _MARKED.search(readme)
    if match is None:
        raise ValueError(f"no {BEGIN} ... {END} in the README")
    return match.group(1).strip()


def with_table(readme: str, new_table: str) -> str:
    """``readme`` with ``new_table`` between its markers, the rest unchanged."""
    table_in(readme)  # raises without the markers
    return _MARKED.sub(lambda _: f"{BEGIN}\n{new_table}\n{END}", readme, count=1)

"""A live replay: the requests sent open loop to a running stack (or one started here for the run)."""

from __future__ import annotations

import os
from pathlib import Path

from loadtest.tools.replay.summary import Outcome, outcome_of
from loadtest.tools.replay.trace import ReplayRequest, TierSpec, prompt_text


def run_live(url: str, model: str, requests: list[ReplayRequest], *, seed: int = 0, max_retries: int = 0,
             progress: bool = True, timeout_s: float = 600.0) -> list[Outcome]:
    import asyncio

    from loadtest.tools.runner import run_openai
    from loadtest.tools.workload import RequestSpec

    keys = {r.index: r.api_key for r in requests}
    if any(k is None for k in keys.values()) and any(k is not None for k in keys.values()):
        raise ValueError("either every tier has an API key or none does")
    key_of = None if all(k is None for k in keys.values()) else (lambda s: keys[s.index])
    specs = [RequestSpec(r.index, r.at_s, prompt_text(r, seed), r.output_tokens) for r in requests]
    results = asyncio.run(run_openai(url, model, specs, key_of=key_of, progress=progress, timeout_s=timeout_s,
                                     max_retries=max_retries))
    by_index = {r.index: r for r in requests}
    return [outcome_of(by_index[res.index], res) for res in results]


def qos_yaml(tiers: list[TierSpec], with_slos: bool) -> str:
    lines = [f"default_tier: {tiers[-1].name}", "tiers:"]
    for priority, t in enumerate(tiers):
        slo = f", ttft_slo_ms: {t.ttft_slo_s * 1000:g}" if with_slos else ""
        lines.append(f"  {t.name}: {{priority: {priority}{slo}}}")
    return "\n".join(lines) + "\n"


def decode_flags(args) -> dict[str, object]:
    """The decode workers' flags for ``--start-stack`` (their KV pool, host tier, peer fetch)."""
    flags: dict[str, object] = {"device": "cpu"}
    if args.kv_cache_memory:
        flags["kv_cache_memory"] = args.kv_cache_memory
    if args.kv_host_memory:
        flags["kv_host_memory"] = args.kv_host_memory
    if not args.kv_peer_fetch:
        flags["kv_peer_fetch"] = False
    return flags


def autoscaler_flags(args) -> dict[str, object]:
    """The autoscaler's flags for ``--start-stack --autoscale`` (none: it only serves the cluster view).
    Every worker may flip, as long as one decodes."""
    if not args.autoscale:
        return {}
    flags: dict[str, object] = {"autoscale": True, "min_prefill_workers": 0, "min_decode_workers": 1,
                                "autoscale_interval_s": args.autoscale_interval_s,
                                "autoscale_window_s": args.autoscale_window_s,
                                "autoscale_cooldown_s": args.autoscale_cooldown_s,
                                "autoscale_stabilization_s": args.autoscale_stabilization_s}
    if args.autoscale_decode_capacity is not None:
        flags["decode_capacity_tokens_per_s"] = args.autoscale_decode_capacity
    return flags


def start_stack(args, tiers: list[TierSpec], state_dir: Path, log):
    from services.stack.stack import Stack, StackSpec

    gateway_flags: dict[str, object] = {}
    admission_flags: dict[str, object] = {"overlap_weight": 0.0 if args.routing == "load" else 1.0,
                                          "routing": "round-robin" if args.routing == "round-robin" else "kv",
                                          "fallback_workers": args.fallback_workers}
    if any(t.api_key for t in tiers):
        qos = state_dir / "qos.yaml"
        qos.write_text(qos_yaml(tiers, args.admission))
        gateway_flags |= {"qos": str(qos), "api_keys": ",".join(f"{t.api_key}:{t.name}" for t in tiers)}
        admission_flags["qos"] = str(qos)
    stack = Stack(StackSpec(state_dir=state_dir / "stack", num_decode=args.decode, model=args.model_live, port=0,
                            namespace=f"replay{os.getpid()}", log_level="WARNING", decode_flags=decode_flags(args),
                            num_prefill=args.prefill_workers or 0, prefill_flags=decode_flags(args),
                            gateway_flags=gateway_flags, admission_flags=admission_flags,
                            autoscaler_flags=autoscaler_flags(args)),
                  on_line=lambda name, line: log.write(f"{name:<12}| {line}\n"))
    stack.start()
    return stack

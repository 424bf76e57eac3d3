"""What re-laying KV out between parallel shapes costs, against a transfer between two workers of
the same shape, over real NIXL between real rank processes.

    python -m loadtest.bench.relayout --out loadtest/results/parallel/relayout-zen4

Engines of ``--model`` (SmolLM2-135M, float32 by default) are started at each shape the pairs
name, each rank a process with one thread; ``--blocks`` whole blocks of random KV are put in the
writer's pool (every rank its layers and heads), and the time from ``write_blocks`` to the
target's notification (every rank's writes landed) is timed ``--repeats`` times, the pairs in
turn within each round, so that a shared host's changing load falls on every pair alike.
The baseline is one process writing into another (TP=1 -> TP=1), the bytes the same in every pair:
the whole model's KV of those blocks. Prints each pair's median time, its ratio to the baseline
(the median over rounds of the pair's time over the baseline's in the same round), the descriptors
it used and GB/s; writes ``relayout.json`` and ``relayout.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path

import torch

PAIRS = "1x1:1x1,3x1:3x1,3x1:1x1,1x1:3x1,1x2:1x1,1x2:3x1"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.relayout", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or Hugging Face directory")
    p.add_argument("--pairs", default=PAIRS, help="writer:target shapes as TPxPP, comma-separated; the first is "
                   "the baseline (default: %(default)s)")
    p.add_argument("--blocks", type=int, default=64, help="blocks per transfer (64 x 16 tokens: a 1,024-token prompt)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=None, help="write relayout.json and relayout.png here")
    return p.parse_args(argv)


class Endpoint:
    """One worker's KV transfer outside a service: a parallel worker's (every rank's agent,
    ``GroupTransfer``, its group operations run at once in the calling thread) or a single
    process's agent; the rank 0 agent polled by a thread of its own, as a service's loop polls it,
    keeping the notifications that arrive."""

    def __init__(self, engine, name: str, poll_s: float = 0.0005) -> None:
        from shared.engine.parallel import ParallelModel
        from shared.transfer.group import GroupTransfer
        from shared.transfer.nixl import NixlTransfer

        self.engine, self.poll_s = engine, poll_s
        self.is_group = isinstance(engine.model, ParallelModel)
        if self.is_group:
            rank0, metadata = engine.model.open_transfer(name)
            self.transfer = GroupTransfer(rank0, metadata, self._send_now, write_timeout_s=60)
        else:
            self.transfer = NixlTransfer(name, thread_safe=True)
            self.transfer.register_kv_pool(engine.kv_cache, engine.kv_spec)
        self.notes: list = []
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, daemon=True)
        self._poller.start()

    def _send_now(self, *write) -> Future:
        """``AsyncEngine.send_group_kv`` without an engine thread: the group's write, at once."""
        future: Future = Future()
        try:
            future.set_result(self.engine.send_group_kv(*write))
        except Exception as exc:  # noqa: BLE001 - the future carries it
            future.set_exception(exc)
        return future

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.notes += self.transfer.get_notifications()

    def write_whole(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Whole blocks [n, L, 2, bs, Hkv, D] into the pool, every rank its part."""
        if self.is_group:
            self.engine.model.write_blocks(block_ids, data)
        else:
            self.engine.kv_cache[block_ids] = data

    def read_whole(self, block_ids: list[int]) -> torch.Tensor:
        if self.is_group:
            return self.engine.model.read_blocks(block_ids)
        return self.engine.kv_cache[block_ids].clone()

    def send(self, target: "Endpoint", local_ids: list[int], remote_ids: list[int], notify: bytes,
             timeout_s: float = 60.0):
        """Write and wait until ``target`` has the notification; returns the writer's handle."""
        from shared.transfer.relayout import load_target

        peer = self.transfer.add_peer(load_target(target.transfer.local_metadata().to_bytes()))
        seen = len(target.notes)
        handle = self.transfer.write_blocks(peer, local_ids, remote_ids, notify)
        self.transfer.wait(handle, timeout_s)
        deadline = time.monotonic() + timeout_s
        while not any(n.message == notify for n in target.notes[seen:]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no notification {notify!r} after {timeout_s:g}s")
            time.sleep(self.poll_s / 4)
        return handle

    def close(self) -> None:
        self._stop.set()
        self._poller.join(5)
        self.transfer.close()
        self.engine.close()


def shape_of(text: str) -> tuple[int, int]:
    tp, pp = text.lower().split("x")
    return int(tp), int(pp)


def start_engine(model: str, dtype: str, tp: int, pp: int):
    from shared.engine import EngineConfig, LLMEngine

    return LLMEngine.from_config(EngineConfig(model=model, dtype=dtype, tensor_parallel_size=tp,
                                              pipeline_parallel_size=pp, num_threads=1, kv_cache_memory=128 << 20,
                                              max_model_len=2048))


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    pairs = [(shape_of(a), shape_of(b)) for a, b in (p.split(":") for p in args.pairs.split(","))]
    endpoints: dict[tuple[str, tuple[int, int]], Endpoint] = {}  # a writer and a target of each shape
    try:
        runs = [_prepare(endpoints, args, src_shape, dst_shape) for src_shape, dst_shape in pairs]
        times: list[list[float]] = [[] for _ in pairs]
        for i in range(args.repeats):  # round-robin: the host's load drifts over every pair alike
            for run, pair_times in zip(runs, times):
                started = time.perf_counter()
                run["handle"] = run["src"].send(run["dst"], run["src_ids"], run["dst_ids"], f"bench-{i}".encode())
                pair_times.append(time.perf_counter() - started)
        rows = [_row(run, pair_times, times[0]) for run, pair_times in zip(runs, times)]
    finally:
        for endpoint in endpoints.values():
            endpoint.close()
    for row in rows:
        (wt, wp), (tt, tp) = row["writer"], row["target"]
        print(f"TP={wt} x PP={wp} -> TP={tt} x PP={tp}: {row['median_s'] * 1e3:7.2f} ms ({row['ratio']:.2f}x the "
              f"same-shape baseline, median of the rounds' ratios), {row['bytes'] / 2**20:.1f} MiB in "
              f"{row['descriptors']} descriptors, {row['bytes'] / row['median_s'] / 1e9:.2f} GB/s", flush=True)
    result = {"model": args.model, "dtype": args.dtype, "host": platform.node(), "processor": platform.processor(),
              "cores": os.cpu_count(), "config": vars(args) | {"out": str(args.out)}, "rows": rows}
    if args.out:
        _write(args.out, result)
    return 0


def _prepare(endpoints: dict, args, src_shape: tuple[int, int], dst_shape: tuple[int, int]) -> dict:
    """A pair's writer and target (started once per shape and side), its blocks in the writer's
    pool, and one write that connects the agents (not timed) and checks the target's blocks."""
    for side, shape in (("writer", src_shape), ("target", dst_shape)):
        if (side, shape) not in endpoints:
            print(f"starting a {side} at TP={shape[0]} x PP={shape[1]}", flush=True)
            engine = start_engine(args.model, args.dtype, *shape)
            endpoints[side, shape] = Endpoint(engine, f"{side}-{shape[0]}x{shape[1]}-{uuid.uuid4().hex[:6]}")
    src, dst = endpoints["writer", src_shape], endpoints["target", dst_shape]
    cfg, n = src.engine.model.cfg, args.blocks
    data = torch.randn(n, cfg.num_layers, 2, src.engine.block_size, cfg.num_kv_heads, cfg.head_dim,
                       generator=torch.Generator().manual_seed(0)).to(src.engine.kv_cache.dtype)
    src_ids, dst_ids = list(range(1, n + 1)), list(range(2, n + 2))
    src.write_whole(src_ids, data)
    handle = src.send(dst, src_ids, dst_ids, b"connect")
    assert torch.equal(dst.read_whole(dst_ids), data), "the target's blocks differ from the writer's"
    return {"src": src, "dst": dst, "shapes": (src_shape, dst_shape), "src_ids": src_ids, "dst_ids": dst_ids,
            "handle": handle}


def _row(run: dict, times: list[float], base_times: list[float]) -> dict:
    """A pair's result; ``ratio``: the median over rounds of its time over the baseline's that round."""
    (src_shape, dst_shape), handle = run["shapes"], run["handle"]
    ratios = [t / b for t, b in zip(times, base_times)]
    return {"writer": list(src_shape), "target": list(dst_shape), "blocks": len(run["src_ids"]),
            "bytes": handle.num_bytes, "descriptors": handle.num_descriptors, "median_s": statistics.median(times),
            "ratio": statistics.median(ratios), "times_s": times}


def _write(out: Path, result: dict) -> None:
    from loadtest.tools.report import bar_chart

    out.mkdir(parents=True, exist_ok=True)
    (out / "relayout.json").write_text(json.dumps(result, indent=2))
    names = [f"{r['writer'][0]}x{r['writer'][1]}->{r['target'][0]}x{r['target'][1]}" for r in result["rows"]]
    bar_chart(out / "relayout.png", names, {"median ms": [r["median_s"] * 1e3 for r in result["rows"]]},
              ylabel="ms per transfer", title=f"KV re-layout, {result['rows'][0]['blocks']} blocks, {result['model']}")
    print(f"wrote {out / 'relayout.json'} and {out / 'relayout.png'}")


if __name__ == "__main__":
    raise SystemExit(main())

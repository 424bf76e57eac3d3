"""KV transfer between two processes over NIXL (UCX), page by page vs collated, against memcpy.

    python -m loadtest.bench.kv_transfer [--tokens 1024,7500,16384] [--shapes smollm2,llama3-8b]
                                         [--error-modes peer,none] [--reps 5]

Process A (this one) holds a prompt's KV in its pool and writes it into process B's pool (a
spawned child with its own NIXL agent). Per prompt length and model shape, in one run:

- ``pages``: one descriptor per block per layer per K/V, the layout of a per-layer paged cache
  (each block row split into ``num_layers * 2`` pages, listed layer by layer so NIXL cannot merge
  neighbours): raw NIXL API, prepared descriptor lists.
- ``collated_runs8``: ``NixlTransfer.write_blocks`` into destination blocks scattered in runs of 8
  blocks (128 tokens, a fragmented decode pool): one descriptor per run.
- ``collated``: ``NixlTransfer.write_blocks`` with consecutive blocks on both sides (a fresh pool):
  one descriptor.
- ``memcpy``: ``torch`` copy of the same bytes inside process A (no second process involved).

Times are medians over ``--reps`` rounds after a warm-up round (the modes take turns within a
round, so background load on a shared host hits them alike), from creating the transfer request to its
completion as seen by the initiator (polled without pause). B polls its notifications in a loop
meanwhile, as a decode worker does (UCX needs the target to make progress; see NixlTransfer), and
checks the bytes and the number of notifications afterwards. Results: JSON and a PNG in
loadtest/results/kv_transfer/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import platform
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from shared.kvcache.layout import KvCacheSpec
from shared.telemetry.plot import figure

OUT_DIR = Path(__file__).parents[1] / "results" / "kv_transfer"
SHAPES = {
    "smollm2": KvCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32),
    "llama3-8b": KvCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16),
}
MODES = ("pages", "collated_runs8", "collated", "memcpy")
RUN_BLOCKS = 8


# --- process B -----------------------------------------------------------------------------------
def _target_main(conn) -> None:
    from shared.transfer.nixl import NixlTransfer

    transfer = pool = None
    received: list = []
    while True:
        # like a decode worker's loop: poll notifications between commands, which also drives UCX
        # progress (needed by the writes: without a progress thread the target must make progress)
        while transfer is not None and not conn.poll(0):
            received.extend(transfer.get_notifications())
        method, args = conn.recv()
        if method == "exit":
            return
        if method == "init":
            spec, num_blocks, name, params = args
            if transfer is not None:
                transfer.close()
            pool = spec.allocate(num_blocks, "cpu")
            transfer = NixlTransfer(name, backend_params=params)
            transfer.register_kv_pool(pool, spec)
            received = []
            conn.send(transfer.local_metadata().to_bytes())
        elif method == "collect":  # poll notifications (and connection progress) until n or deadline
            count, timeout_s = args
            deadline = time.monotonic() + timeout_s
            while len(received) < count and time.monotonic() < deadline:
                received.extend(transfer.get_notifications())
            conn.send((len(received), transfer.stats.num_bytes_received))
        elif method == "checksum":
            conn.send(checksum(pool, args[0]))


def checksum(pool: torch.Tensor, block_ids: list[int]) -> float:
    """Position-weighted sum of the blocks: a block moved to the wrong place changes it."""
    sums = pool[block_ids].double().flatten(1).sum(1)
    return float((sums * torch.arange(1, len(block_ids) + 1, dtype=torch.float64)).sum())


class Target:
    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_target_main, args=(child,), daemon=True)
        self.process.start()

    def call(self, method: str, *args, timeout_s: float = 120.0):
        self.conn.send((method, args))
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"process B gave no answer to {method} in {timeout_s}s")
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(("exit", ()))
        self.process.join(10)


# --- process A -----------------------------------------------------------------------------------
def _page_descs(base: int, num_blocks: int, spec: KvCacheSpec) -> np.ndarray:
    """[num_blocks * L * 2, 3]: page (block b, layer l, k/v) at index (b * L + l) * 2 + kv."""
    page_bytes = spec.bytes_per_block // (spec.num_layers * 2)
    n = num_blocks * spec.num_layers * 2
    descs = np.empty((n, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(page_bytes)
    descs[:, 1], descs[:, 2] = page_bytes, 0
    return descs


def _page_indices(block_ids: list[int], spec: KvCacheSpec) -> np.ndarray:
    """Layer by layer, K then V, block by block: how a per-layer paged cache lists its pages."""
    ids = np.asarray(block_ids, dtype=np.int64)
    per_layer = [(ids * spec.num_layers + layer) * 2 + kv for layer in range(spec.num_layers) for kv in (0, 1)]
    return np.concatenate(per_layer).astype(np.int32)


class PageWriter:
    """The page-by-page baseline on the raw NIXL API (its own agent on the same pool memory)."""
    def __init__(self, api, name: str, pool: torch.Tensor, spec: KvCacheSpec, remote, params: dict) -> None:
        config = api.nixl_agent_config(enable_prog_thread=False, capture_telemetry=True, backends=[])
        self.agent = api.nixl_agent(name, config)
        self.agent.create_backend("UCX", params)
        self.registration = self.agent.register_memory(pool)
        self.spec = spec
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", _page_descs(pool.data_ptr(), pool.shape[0], spec),
                                                "DRAM")
        peer = self.agent.add_remote_agent(remote.backend_metadata)
        self.peer = peer.decode() if isinstance(peer, bytes) else peer
        self.remote = self.agent.prep_xfer_dlist(self.peer, _page_descs(remote.pool_address, remote.num_blocks, spec),
                                                 "DRAM")

    def write(self, local_ids: list[int], remote_ids: list[int]) -> int:
        """Blocking write; returns NIXL's descriptor count."""
        handle = self.agent.make_prepped_xfer("WRITE", self.local, _page_indices(local_ids, self.spec),
                                              self.remote, _page_indices(remote_ids, self.spec), b"pages")
        state = self.agent.transfer(handle)
        while state == "PROC":
            state = self.agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"page write failed: {state}")
        count = self.agent.get_xfer_telemetry(handle).descCount
        handle.release()
        return count


def _scattered_runs(num_blocks: int, pool_blocks: int, seed: int) -> list[int]:
    """Destination ids: runs of RUN_BLOCKS consecutive blocks, the runs in shuffled order."""
    starts = list(range(0, pool_blocks - RUN_BLOCKS + 1, RUN_BLOCKS))
    random.Random(seed).shuffle(starts)
    ids: list[int] = []
    for start in starts:
        ids.extend(range(start, start + RUN_BLOCKS))
        if len(ids) >= num_blocks:
            return ids[:num_blocks]
    raise ValueError(f"pool of {pool_blocks} blocks too small for {num_blocks}")


def _interleaved_ms(runs: dict, reps: int) -> dict[str, list[float]]:
    """ms per call of each mode, the modes taking turns within every repetition so that all of them
    see the same background load (this host is shared); one warm-up round first (connections,
    registration caches, first touch of the destination pages)."""
    times: dict[str, list[float]] = {mode: [] for mode in runs}
    for rep in range(reps + 1):
        for mode, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            if rep:
                times[mode].append((time.perf_counter() - t0) * 1e3)
    return times


@dataclasses.dataclass
class Link:
    """Process A's side of one shape's connection to B: its KV pool, the collated path and the page path."""

    spec: KvCacheSpec
    pool: torch.Tensor  # [pool_blocks, ...] as the spec lays a block out
    pool_blocks: int
    transfer: object  # NixlTransfer
    peer: object
    pages: PageWriter


def _connect(shape: str, error_mode: str, pool_blocks: int, target: Target) -> Link:
    """A pool of ``pool_blocks`` in A and in B, both transfer paths connected and warmed up."""
    from nixl_cu12 import _api as api

    from shared.transfer import AgentMetadata
    from shared.transfer.nixl import NixlTransfer

    spec = SHAPES[shape]
    pool = spec.allocate(pool_blocks, "cpu")
    pool.normal_()
    suffix = f"{shape}-{error_mode}-{os.getpid()}"
    params = {"ucx_error_handling_mode": error_mode}
    remote = AgentMetadata.from_bytes(target.call("init", spec, pool_blocks, f"bench-b-{suffix}", params))
    transfer = NixlTransfer(f"bench-a-{suffix}", capture_telemetry=True, backend_params=params)
    transfer.register_kv_pool(pool, spec)
    peer = transfer.add_peer(remote)
    pages = PageWriter(api, f"bench-pages-{suffix}", pool, spec, remote, params)
    # first contact from each agent: B must progress for the connection to come up
    warm = transfer.write_blocks(peer, [0], [0], b"hello")
    pages_warm = pages.agent.make_prepped_xfer("WRITE", pages.local, [0], pages.remote, [0], b"hello")
    pages.agent.transfer(pages_warm)
    target.conn.send(("collect", (2, 60.0)))  # both sides progress at once while the connections come up
    transfer.wait(warm, 60.0)
    while pages.agent.check_xfer_state(pages_warm) == "PROC":
        pass
    pages_warm.release()
    assert target.conn.poll(60.0) and target.conn.recv()[0] == 2, "B did not get the warm-up notifications"
    return Link(spec, pool, pool_blocks, transfer, peer, pages)


def _bench_tokens(link: Link, num_tokens: int, reps: int, target: Target) -> dict:
    """One prompt length in every mode: times, descriptor counts, and B's bytes and notifications checked."""
    num_blocks = -(-num_tokens // link.spec.block_size)
    local_ids = list(range(num_blocks))
    nbytes = num_blocks * link.spec.bytes_per_block
    dest = {"collated": list(range(RUN_BLOCKS, RUN_BLOCKS + num_blocks)),
            "collated_runs8": _scattered_runs(num_blocks, link.pool_blocks, seed=num_tokens),
            "pages": _scattered_runs(num_blocks, link.pool_blocks, seed=num_tokens + 1)}
    descriptors: dict[str, int] = {}

    def collated(mode: str):
        def run():
            handle = link.transfer.write_blocks(link.peer, local_ids, dest[mode], mode.encode())
            while not link.transfer.poll(handle):
                pass
            descriptors[mode] = handle.backend_descriptors
        return run

    def paged():
        descriptors["pages"] = link.pages.write(local_ids, dest["pages"])

    src, dst = link.pool[:num_blocks], torch.empty_like(link.pool[:num_blocks])
    runs = {"pages": paged, "collated_runs8": collated("collated_runs8"), "collated": collated("collated"),
            "memcpy": lambda: dst.copy_(src)}
    received_before = target.call("collect", 0, 0.0)[0]
    result = {"tokens": num_tokens, "blocks": num_blocks, "bytes": nbytes}
    for mode, times in _interleaved_ms(runs, reps).items():
        ms = statistics.median(times)
        result[mode] = {"ms": ms, "gb_per_s": nbytes / ms / 1e6, "times_ms": times,
                        "descriptors": descriptors.get(mode, 0)}
    for mode in ("pages", "collated_runs8", "collated"):  # the modes' destinations overlap: write, then check
        runs[mode]()
        got, expected = target.call("checksum", dest[mode]), checksum(link.pool, local_ids)
        assert abs(got - expected) <= 1e-9 * max(1.0, abs(expected)), f"{mode}: B holds other bytes"
    num_writes = 3 * (reps + 2)
    received, bytes_received = target.call("collect", received_before + num_writes, 60.0)
    result["notifications_received"] = received - received_before
    return result


def _add_ratios(result: dict) -> None:
    result["speedup_collated_vs_pages"] = result["pages"]["ms"] / result["collated"]["ms"]
    result["speedup_runs8_vs_pages"] = result["pages"]["ms"] / result["collated_runs8"]["ms"]
    result["collated_fraction_of_memcpy"] = result["collated"]["gb_per_s"] / result["memcpy"]["gb_per_s"]
    result["runs8_fraction_of_memcpy"] = result["collated_runs8"]["gb_per_s"] / result["memcpy"]["gb_per_s"]


def bench_shape(shape: str, error_mode: str, tokens_list: list[int], reps: int, target: Target) -> list[dict]:
    pool_blocks = -(-max(tokens_list) // SHAPES[shape].block_size) + RUN_BLOCKS
    link = _connect(shape, error_mode, pool_blocks, target)
    rows = []
    for num_tokens in tokens_list:
        result = {"shape": shape, "ucx_error_handling_mode": error_mode,
                  **_bench_tokens(link, num_tokens, reps, target)}
        _add_ratios(result)
        print(_line(result), flush=True)
        rows.append(result)
    link.transfer.close()
    return rows


def _line(r: dict) -> str:
    cells = "  ".join(f"{m} {r[m]['ms']:8.2f} ms {r[m]['gb_per_s']:6.2f} GB/s ({r[m]['descriptors']} d)"
                      for m in MODES)
    return (f"{r['shape']:9s} {r['ucx_error_handling_mode']:4s} {r['tokens']:6d} tok "
            f"{r['bytes'] / 2**20:7.1f} MiB  {cells}  "
            f"collated/pages x{r['speedup_collated_vs_pages']:.1f}  "
            f"collated/memcpy {100 * r['collated_fraction_of_memcpy']:.0f}%")


def plot(rows: list[dict], path: Path) -> None:
    shapes = sorted({r["shape"] for r in rows}, key=list(SHAPES).index)
    with figure(path, 1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False, dpi=110) as (fig, axes):
        for ax, shape in zip(axes[0], shapes):
            sub = [r for r in rows if r["shape"] == shape]
            x = np.arange(len(sub))
            width = 0.8 / len(MODES)
            for i, mode in enumerate(MODES):
                ax.bar(x + i * width, [r[mode]["gb_per_s"] for r in sub], width, label=mode)
            labels = [f"{r['tokens']} tok\n{r['bytes'] / 2**20:.0f} MiB" for r in sub]
            ax.set_xticks(x + width * (len(MODES) - 1) / 2, labels)
            ax.set_ylabel("GB/s")
            ax.set_title(f"{shape} KV, process A -> B over NIXL/UCX")
            ax.legend(fontsize=8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1024,7500,16384")
    parser.add_argument("--shapes", default="smollm2,llama3-8b")
    parser.add_argument("--error-modes", default="peer",
                        help="UCX ucx_error_handling_mode values to run, comma-separated (peer: NIXL's default, "
                             "detects dead peers, active messages over TCP; none: shared memory throughout)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    load_before = os.getloadavg()
    target = Target()
    rows: list[dict] = []
    try:
        for shape in args.shapes.split(","):
            for error_mode in args.error_modes.split(","):
                rows.extend(bench_shape(shape, error_mode, tokens, args.reps, target))
    finally:
        target.close()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__, "reps": args.reps,
            "load_average_before": load_before, "load_average_after": os.getloadavg(), "modes": list(MODES),
            "run_blocks": RUN_BLOCKS}
    (args.out / "kv_transfer.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    plot(rows, args.out / "kv_transfer.png")
    print(f"wrote {args.out / 'kv_transfer.json'} and kv_transfer.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

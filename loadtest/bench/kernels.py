"""Benchmark Tandem's Triton kernels on a CUDA GPU.

    python -m loadtest.bench.kernels [--batches 1,32,128] [--contexts 1024,8192,32768]

Decode attention with Llama-3-8B shapes (32 query heads, 8 KV heads, head_dim 128, bf16,
16-token blocks, shuffled block tables): time per call, achieved bandwidth (K/V bytes of the
context plus q and output, over time) as a fraction of the GPU's HBM bandwidth, and the speed
ratio against torch SDPA and FlexAttention (compiled) on the same shapes over dense, contiguous
K/V (their best case: neither reads a block table). Then causal prefill attention over the paged
cache (whole prompts, the same heads) in TFLOP/s against SDPA on dense K/V, and the bandwidth of the
KV-movement kernels. Results are printed and saved as JSON plus a plot under loadtest/results/kernels/
(or --out), named after the device; the JSON is rewritten after every shape, so a run cut short
keeps what it measured.
Without CUDA it says so and exits with status 2: there is nothing to measure on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from shared.telemetry.plot import figure

RESULTS_DIR = Path(__file__).parents[1] / "results" / "kernels"
# Peak HBM bandwidth in bytes/s by device-name fragment, most specific first.
HBM_BYTES_PER_S = [
    ("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100-SXM4-80GB", 2.039e12),
    ("A100", 1.555e12), ("L40S", 0.864e12),
]
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B


def hbm_bandwidth(device_name: str, override_gbps: float | None) -> float | None:
    if override_gbps:
        return override_gbps * 1e9
    for fragment, bandwidth in HBM_BYTES_PER_S:
        if fragment in device_name:
            return bandwidth
    return None


def time_ms(fn) -> float:
    """Median ms per call (CUDA events, warmed up, L2 flushed between calls)."""
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def graph_time_ms(fn) -> float:
    """Median ms per call of ``fn`` replayed from a CUDA graph: the GPU time alone, without the
    host's launch overhead that ``time_ms`` includes (at small shapes, the launches take longer
    than the kernels; a serving step hides them by replaying a captured graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm on the side stream, as capture wants
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay)


def paged_decode_inputs(batch: int, context: int, block_size: int, dtype: torch.dtype):
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    # one layer of the pool layout [N, L, 2, bs, Hkv, D]; the kernel sees the strided layer views
    pool = torch.empty((num_blocks, 1, 2, block_size, NUM_KV_HEADS, HEAD_DIM), dtype=dtype, device="cuda")
    pool.normal_()
    table = torch.randperm(num_blocks, device="cuda", dtype=torch.int64).to(torch.int32)
    table = table.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    return q, pool, table, seq_lens


def dense_kv(pool: torch.Tensor, table: torch.Tensor, layer_part: int) -> torch.Tensor:
    """[B, Hkv, L, D] contiguous copy of one of K (0) / V (1) in the order of the block table."""
    pages = pool[:, 0, layer_part][table.long()]  # [B, M, bs, Hkv, D]
    return pages.flatten(1, 2).transpose(1, 2).contiguous()


def bench_decode_shape(batch: int, context: int, block_size: int, dtype: torch.dtype, flex) -> dict:
    import torch.nn.functional as F

    from kernels.decode_attention_triton import paged_decode_attention_triton, plan_num_splits

    q, pool, table, seq_lens = paged_decode_inputs(batch, context, block_size, dtype)
    k_cache, v_cache = pool[:, 0, 0], pool[:, 0, 1]
    scale = HEAD_DIM ** -0.5
    out = torch.empty_like(q)

    def run_triton():
        paged_decode_attention_triton(q, k_cache, v_cache, table, seq_lens, scale,
                                      max_seq_len=context, out=out)

    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    row = {"batch": batch, "context": context, "block_size": block_size, "dtype": str(dtype),
           "num_splits": plan_num_splits(batch, NUM_KV_HEADS, context, num_sms)}
    row["triton_ms"] = time_ms(run_triton)
    row["triton_graph_ms"] = graph_time_ms(run_triton)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * pool.element_size()
    row["bytes"] = kv_bytes + 2 * q.numel() * q.element_size()
    row["triton_gbps"] = row["bytes"] / row["triton_ms"] / 1e6
    row["triton_graph_gbps"] = row["bytes"] / row["triton_graph_ms"] / 1e6

    k_dense, v_dense = dense_kv(pool, table, 0), dense_kv(pool, table, 1)
    del pool, k_cache, v_cache
    q4 = q.unsqueeze(2)  # [B, Hq, 1, D]

    def run_sdpa():
        return F.scaled_dot_product_attention(q4, k_dense, v_dense, scale=scale, enable_gqa=True)

    expected = _timed(row, "sdpa", run_sdpa)
    if expected is not None:
        row["max_abs_err_vs_sdpa"] = float((out.float() - expected[:, :, 0].float()).abs().max())
        row["sdpa_graph_ms"] = graph_time_ms(run_sdpa)
    if flex is not None:
        _timed(row, "flex", lambda: flex(q4, k_dense, v_dense, scale=scale, enable_gqa=True))
    del k_dense, v_dense, expected
    torch.cuda.empty_cache()
    return row


def _timed(row: dict, name: str, fn):
    """Run ``fn`` once (compiles, checks it fits), then time it into ``row[name + "_ms"]``; a failure
    (out of memory, no kernel for the shape) is recorded in ``row[name + "_error"]``."""
    try:
        result = fn()
        row[f"{name}_ms"] = time_ms(fn)
        return result
    except Exception as exc:  # report it and go on with the other shapes
        row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
        torch.cuda.empty_cache()
        return None


def bench_prefill_shape(batch: int, prompt_len: int, block_size: int, dtype: torch.dtype) -> dict:
    """Causal attention of ``batch`` whole prompts of ``prompt_len`` tokens over the paged cache."""
    import torch.nn.functional as F

    from kernels.prefill_attention_triton import paged_prefill_attention_triton

    q_dense, pool, table, seq_lens = paged_decode_inputs(batch, prompt_len, block_size, dtype)
    del q_dense
    k_cache, v_cache = pool[:, 0, 0], pool[:, 0, 1]
    q = torch.randn(batch * prompt_len, NUM_Q_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    starts = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * prompt_len
    scale = HEAD_DIM ** -0.5
    out = torch.empty_like(q)

    def run_triton():
        paged_prefill_attention_triton(q, k_cache, v_cache, table, starts, seq_lens, scale,
                                       max_query_len=prompt_len, out=out)

    # causal: half the QK^T and PV products of a full square, 2 FLOPs per multiply-add
    flops = 2 * 2 * batch * NUM_Q_HEADS * HEAD_DIM * prompt_len * prompt_len / 2
    row = {"batch": batch, "prompt_len": prompt_len, "block_size": block_size, "dtype": str(dtype), "flops": flops}
    row["triton_ms"] = time_ms(run_triton)
    row["triton_tflops"] = flops / row["triton_ms"] / 1e9
    k_dense, v_dense = dense_kv(pool, table, 0), dense_kv(pool, table, 1)
    del pool, k_cache, v_cache
    q4 = q.view(batch, prompt_len, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2)  # [B, Hq, L, D]

    def run_sdpa():
        return F.scaled_dot_product_attention(q4, k_dense, v_dense, scale=scale, is_causal=True, enable_gqa=True)

    expected = _timed(row, "sdpa", run_sdpa)
    if expected is not None:
        row["max_abs_err_vs_sdpa"] = float((out.view_as(q4.transpose(1, 2)).float()
                                            - expected.transpose(1, 2).float()).abs().max())
        row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["triton_ms"]
    del k_dense, v_dense, expected
    torch.cuda.empty_cache()
    return row


def bench_kv_movement(block_size: int, dtype: torch.dtype) -> list[dict]:
    """Gather/scatter of 512 Llama-3-8B blocks (32 layers)."""
    from kernels.kv_gather_triton import gather_kv_blocks_triton, scatter_kv_blocks_triton

    num_blocks, num_moved = 1024, 512
    pool = torch.randn((num_blocks, 32, 2, block_size, NUM_KV_HEADS, HEAD_DIM), dtype=dtype, device="cuda")
    ids = torch.randperm(num_blocks, device="cuda")[:num_moved]
    slab = gather_kv_blocks_triton(pool, ids)
    slab_bytes = slab.numel() * slab.element_size()
    rows = []

    def add(name, fn, nbytes):
        ms = time_ms(fn)
        rows.append({"kernel": name, "ms": ms, "bytes": nbytes, "gbps": nbytes / ms / 1e6})

    add("gather_kv_blocks", lambda: gather_kv_blocks_triton(pool, ids, out=slab), 2 * slab_bytes)
    add("scatter_kv_blocks", lambda: scatter_kv_blocks_triton(slab, pool, ids), 2 * slab_bytes)
    return rows


def _decode_line(row: dict, peak: float | None) -> str:
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    frac = 100 * row["hbm_fraction"] if peak else None
    graph_frac = 100 * row["graph_hbm_fraction"] if peak else None
    return (f"{row['batch']:>6} {row['context']:>8} {row['num_splits']:>6} {row['triton_ms']:>10.4f} "
            f"{row['triton_gbps']:>8.0f} {fmt(frac, '.0f'):>6} {fmt(row['speedup_vs_sdpa'], '.2f'):>7} "
            f"{fmt(row['speedup_vs_flex'], '.2f'):>7} {row['triton_graph_ms']:>9.4f} {fmt(graph_frac, '.0f'):>6} "
            f"{fmt(row['graph_speedup_vs_sdpa'], '.2f'):>7} {fmt(row.get('max_abs_err_vs_sdpa'), '.1e'):>8}")


def plot(result: dict, path: Path) -> None:
    """Decode attention's share of HBM bandwidth and its speed against SDPA / Flex, per shape."""
    rows = result["decode_attention"]
    if not rows:
        return
    labels = [f"B{r['batch']}\n{r['context'] // 1024}k" for r in rows]
    x = range(len(rows))
    with figure(path, 1, 2, figsize=(12, 4)) as (fig, (ax1, ax2)):
        width = 0.4
        ax1.bar([i - width / 2 for i in x], [100 * (r["hbm_fraction"] or 0) for r in rows], width, label="launched")
        ax1.bar([i + width / 2 for i in x], [100 * (r.get("graph_hbm_fraction") or 0) for r in rows], width,
                label="CUDA graph")
        ax1.legend()
        ax1.set_xticks(list(x), labels)
        ax1.set_ylabel("% of peak HBM bandwidth")
        ax1.set_title(f"paged decode attention (Triton), {result['device']}")
        for offset, other in ((-width / 2, "sdpa"), (width / 2, "flex")):
            ax2.bar([i + offset for i in x], [r.get(f"speedup_vs_{other}") or 0 for r in rows], width,
                    label=f"vs {other}")
        ax2.axhline(1.0, color="black", linewidth=0.8)
        ax2.set_xticks(list(x), labels)
        ax2.set_ylabel("speed ratio (>1: Triton faster)")
        ax2.set_title("against dense K/V (no block table)")
        ax2.legend()


def make_flex():
    try:
        from torch.nn.attention.flex_attention import flex_attention
        return torch.compile(flex_attention, dynamic=False)
    except Exception as exc:
        print(f"FlexAttention unavailable: {exc}", file=sys.stderr)
        return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hbm-gbps", type=float, help="peak HBM bandwidth, if the device is not known")
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--out", type=Path,
                        help="JSON path (default: loadtest/results/bench_kernels_<device>.json)")
    return parser.parse_args(argv)


def _add_decode_ratios(row: dict, peak: float | None) -> None:
    """Shares of peak HBM bandwidth and speed ratios against SDPA / Flex, where they were measured."""
    row["hbm_fraction"] = row["triton_gbps"] * 1e9 / peak if peak else None
    row["graph_hbm_fraction"] = row["triton_graph_gbps"] * 1e9 / peak if peak else None
    sdpa_graph_ms = row.get("sdpa_graph_ms")
    row["graph_speedup_vs_sdpa"] = sdpa_graph_ms / row["triton_graph_ms"] if sdpa_graph_ms else None
    for other in ("sdpa", "flex"):
        other_ms = row.get(f"{other}_ms")
        row[f"speedup_vs_{other}"] = other_ms / row["triton_ms"] if other_ms else None


def run_decode(args, dtype: torch.dtype, flex, peak: float | None, result: dict, save) -> None:
    print("decode attention: per call as launched from Python, then replayed from a CUDA graph (GPU time alone)")
    print(f"{'batch':>6} {'context':>8} {'splits':>6} {'triton ms':>10} {'GB/s':>8} {'%HBM':>6} "
          f"{'x SDPA':>7} {'x Flex':>7} {'graph ms':>9} {'%HBM':>6} {'x SDPA':>7} {'max err':>8}", flush=True)
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            row = bench_decode_shape(batch, context, args.block_size, dtype, flex)
            _add_decode_ratios(row, peak)
            result["decode_attention"].append(row)
            print(_decode_line(row, peak), flush=True)
            save()


def run_prefill(args, dtype: torch.dtype, result: dict, save) -> None:
    print(f"{'batch':>6} {'prompt':>8} {'triton ms':>10} {'TFLOP/s':>8} {'x SDPA':>7} {'max err':>8}")
    for batch, prompt_len in ((1, 4096), (4, 2048), (16, 512)):
        row = bench_prefill_shape(batch, prompt_len, args.block_size, dtype)
        result["prefill_attention"].append(row)
        speedup, err = row.get("speedup_vs_sdpa"), row.get("max_abs_err_vs_sdpa")
        print(f"{batch:>6} {prompt_len:>8} {row['triton_ms']:>10.4f} {row['triton_tflops']:>8.1f} "
              f"{'-' if speedup is None else format(speedup, '.2f'):>7} {'-' if err is None else format(err, '.1e'):>8}",
              flush=True)
        save()


def run_kv_movement(args, dtype: torch.dtype, peak: float | None, result: dict) -> None:
    result["kv_movement"] = bench_kv_movement(args.block_size, dtype)
    for row in result["kv_movement"]:
        frac = f" = {row['gbps'] * 1e9 / peak:.0%} of HBM" if peak else ""
        print(f"{row['kernel']:>20} {row['ms']:>9.4f} ms {row['gbps']:>8.0f} GB/s{frac}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device here, so nothing was measured. The kernels' correctness "
              "is tested on the CPU (pytest tests/kernels, under TRITON_INTERPRET=1); run this "
              "benchmark on a machine with an NVIDIA GPU.", file=sys.stderr)
        return 2

    device_name = torch.cuda.get_device_name()
    peak = hbm_bandwidth(device_name, args.hbm_gbps)
    flex = None if args.no_flex else make_flex()
    dtype = torch.bfloat16
    out = args.out or RESULTS_DIR / f"bench_kernels_{device_name.replace(' ', '_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "device": device_name, "peak_hbm_bytes_per_s": peak, "torch": torch.__version__,
        "triton": __import__("triton").__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "decode_attention": [], "prefill_attention": [], "kv_movement": [],
    }

    def save():  # after every shape: a run cut short keeps what it measured
        out.write_text(json.dumps(result, indent=2))

    print(f"device: {device_name}  peak HBM: {peak / 1e9 if peak else 'unknown'} GB/s")
    run_decode(args, dtype, flex, peak, result, save)
    run_prefill(args, dtype, result, save)
    run_kv_movement(args, dtype, peak, result)
    save()
    plot(result, out.with_suffix(".png"))
    print(f"saved {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

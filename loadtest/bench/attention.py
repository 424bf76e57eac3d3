"""What batch-invariant attention costs on the CPU: the torch references against the calls they replaced.

    python -m loadtest.bench.attention [--prompt-lengths 128,700,2000] [--batch-sizes 1,8,32]

For SmolLM2-135M's heads (9 query heads, 3 KV heads of 64) in float32, times one layer's attention:

- prefill of a whole prompt: ``kernels.prefill_attention`` (queries in tiles of ``QUERY_TILE``
  positions, each over the keys up to its end, so that a chunked prompt gets the same bits; other
  tile sizes with ``--query-tiles``) and, where it builds, the C++ kernel
  (``kernels/cpu/prefill_attention.cpp``) reading a float16 pool in place, against one causal SDPA
  call over the prompt, the baseline;
- decode of a batch whose sequences all have the same context (the prompt length): the planned
  decode attention (whole blocks, always masked) against the same gather cut at the length with no
  mask, which the engine did before when every length in a step was equal; and, where it builds,
  the compiled step's C++ kernel (``kernels/cpu/decode_attention.cpp``) and the eager step's
  (``kernels/cpu/prefill_attention.cpp``, each row a sequence of one query) reading a float16 pool
  in place.

Prints each case's time and its ratio to the baseline and writes ``attention.json`` and
``attention.png`` under --out.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

from loadtest.bench.linear import time_call

HQ, HKV, D, BS = 9, 3, 64, 16


def prefill_cases(length: int, tiles: list[int] | None = None) -> dict:
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    from kernels.prefill_attention import QUERY_TILE, paged_prefill_attention_ref  # noqa: PLC0415

    num_blocks = -(-length // BS)
    # values a float16 pool holds exactly, so that every case reads the same numbers
    k_cache, v_cache = torch.randn(2, num_blocks + 1, BS, HKV, D).half().float().unbind(0)
    table = torch.arange(num_blocks, dtype=torch.int32)[None]
    q = torch.randn(length, HQ, D)
    loc = torch.tensor([0, length], dtype=torch.int32)
    lens = torch.tensor([length], dtype=torch.int32)

    def one_causal_call():
        k = k_cache[table[0].long()].reshape(-1, HKV, D)[:length].transpose(0, 1)[None]
        v = v_cache[table[0].long()].reshape(-1, HKV, D)[:length].transpose(0, 1)[None]
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True, scale=D ** -0.5,
                                              enable_gqa=True)

    cases = {"baseline": one_causal_call,
             **{f"invariant, {t}-query tiles": functools.partial(paged_prefill_attention_ref, q, k_cache, v_cache,
                                                                 table, loc, lens, D ** -0.5, tile=t)
                for t in tiles or [QUERY_TILE]}}
    from kernels import prefill_attention  # noqa: PLC0415

    if prefill_attention.usable(q, k_cache):  # the C++ kernel, on the float16 pool gguf serves with
        k16, v16 = k_cache.half(), v_cache.half()
        cases["C++ kernel (float16 pool)"] = functools.partial(prefill_attention.paged_prefill_attention, q, k16, v16,
                                                                table, loc, lens, D ** -0.5)
    return cases


def decode_cases(batch: int, context: int) -> dict:
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    from kernels.decode_attention import decode_plan, paged_decode_attention_planned  # noqa: PLC0415

    per_seq = -(-context // BS)
    # values a float16 pool holds exactly, so that every case reads the same numbers
    k_cache, v_cache = torch.randn(2, batch * per_seq + 1, BS, HKV, D).half().float().unbind(0)
    tables = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, HQ, D)
    plan = decode_plan(tables, lens, BS)  # made once per step, reused by every layer

    def cut_without_mask():
        k = k_cache.index_select(0, plan.block_ids).view(batch, -1, HKV, D)[:, :context]
        v = v_cache.index_select(0, plan.block_ids).view(batch, -1, HKV, D)[:, :context]
        return F.scaled_dot_product_attention(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), scale=D ** -0.5,
                                              enable_gqa=True)

    cases = {"baseline": cut_without_mask,
             "invariant": lambda: paged_decode_attention_planned(q, k_cache, v_cache, plan, D ** -0.5)}
    from kernels import attention_cpu  # noqa: PLC0415

    if attention_cpu.load():  # the compiled step's kernel, on the float16 pool layout gguf serves with
        pool = torch.stack([k_cache, v_cache], 1)[:, None].to(torch.float16)  # [blocks, 1 layer, 2, BS, HKV, D]
        valid = torch.arange(per_seq * BS)[None, :] < (lens[:, None] - 1)  # the past; the last position is
        src = torch.full(valid.shape, -1, dtype=torch.long)                   # the step's own k, v:
        last = tables[:, (context - 1) // BS].long()
        k_new, v_new = k_cache[last, (context - 1) % BS], v_cache[last, (context - 1) % BS]
        blocks = tables.long().reshape(-1)
        cases["compiled step's kernel"] = functools.partial(attention_cpu.decode_attention, q, k_new, v_new, pool, 0,
                                                            blocks, valid, src)
    from kernels import prefill_attention  # noqa: PLC0415

    if prefill_attention.usable(q, k_cache):  # the eager step's kernel: each row a sequence of one query
        loc = torch.arange(batch + 1, dtype=torch.int32)
        cases["eager step's kernel"] = functools.partial(prefill_attention.paged_prefill_attention, q,
                                                         k_cache.half(), v_cache.half(), tables, loc, lens, D ** -0.5)
    return cases


def main(argv: list[str] | None = None) -> int:
    import torch  # noqa: PLC0415

    from loadtest.tools.report import bar_chart  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-lengths", default="128,700,2000")
    p.add_argument("--query-tiles", default=None,
                   help="prefill query tile sizes to compare, e.g. 128,64,32 (default: the engine's, QUERY_TILE)")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--decode-context", type=int, default=256, help="every decoding sequence's context length")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/attention"))
    args = p.parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(0)
    report: dict = {"num_threads": torch.get_num_threads(), "decode_context": args.decode_context, "cases": {}}
    from kernels.prefill_attention import QUERY_TILE  # noqa: PLC0415

    tiles = [int(t) for t in args.query_tiles.split(",")] if args.query_tiles else [QUERY_TILE]
    report["query_tiles"] = tiles
    cases = [(f"prefill {n}", prefill_cases(n, tiles)) for n in map(int, args.prompt_lengths.split(","))]
    cases += [(f"decode x{b}", decode_cases(b, args.decode_context)) for b in map(int, args.batch_sizes.split(","))]
    for name, calls in cases:
        us = {kind: time_call(fn) * 1e6 for kind, fn in calls.items()}
        ratios = {kind: t / us["baseline"] for kind, t in us.items() if kind != "baseline"}
        report["cases"][name] = {"us_per_layer": us, "over_baseline": ratios}
        print(f"{name}: baseline {us['baseline']:.0f} us per layer; "
              + ", ".join(f"{kind} {us[kind]:.0f} us ({r:.2f}x)" for kind, r in ratios.items()), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention.json").write_text(json.dumps(report, indent=1))
    names = list(report["cases"])
    kinds = list(dict.fromkeys(k for n in names for k in report["cases"][n]["us_per_layer"]))
    bar_chart(args.out / "attention.png", names,
              {kind: [report["cases"][n]["us_per_layer"].get(kind, 0.0) / 1e3 for n in names] for kind in kinds},
              ylabel="ms per layer", title=f"CPU attention, SmolLM2-135M heads ({report['num_threads']} threads)")
    print("wrote", args.out / "attention.json", args.out / "attention.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

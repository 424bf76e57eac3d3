"""Replay a Mooncake-format request trace: live against a running stack, or in the simulator.

    # live, open loop by timestamp, against a stack already up
    python -m loadtest.tools.replay --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
        --max-requests 150 --length-scale 1/16 --time-scale 4 --url http://127.0.0.1:8000 \\
        --api-keys key-premium:premium:0.3,key-batch:batch:0.7 --slo-ttft-ms premium=2000,batch=8000 \\
        --out loadtest/results/replay/live.json

    # the whole hour at the paper's lengths and rates, simulated on a GPU cluster (planner models)
    python -m loadtest.tools.replay --trace ... --simulate gpu --out loadtest/results/replay/sim-gpu.json

    # the same scaled slice as the live run, simulated on this machine's calibrated CPU model
    python -m loadtest.tools.replay --trace ... --max-requests 150 --length-scale 1/16 --time-scale 4 \\
        --simulate cpu --decode 2 --kv-cache-memory 64MiB --out loadtest/results/replay/sim-cpu.json

**The trace.** One JSON object a line: ``timestamp`` (ms), ``input_length``, ``output_length``
(tokens) and ``hash_ids``, one id per 512-token prompt block; requests that share leading ids
share that prompt prefix. The replayed slice is ``--skip`` requests in, ``--max-requests`` long
(in timestamp order), its times counted from its first request. A short slice of the Mooncake
trace shares little beyond the first block (150 requests: 4.5% ideal hits; turns of a conversation
come minutes apart): ``--sample-conversations 1/40`` keeps whole conversations (requests sharing
their first two blocks) over the hour instead, ~250 requests with ~25% ideal hits, to be
compressed with ``--time-scale``.

**Scaling.** A request due at ``t`` in the trace is sent at ``t * time_scale / rate_scale`` after
the start (``--time-scale 4``: the slice takes four times as long; ``--rate-scale 2``: twice the
offered rate — the two multiply; one stretches the timeline to fit a slow machine, the other sets
the load relative to it). Every full block becomes ``B = round(512 * length_scale)`` tokens
(1/16: 32 tokens); a prompt's last block is partial in the trace (``input_length`` is not a
multiple of 512) and becomes ``round(rest * length_scale)`` tokens, at least 1 and at most ``B``.
Outputs become ``round(output_length * output_scale)`` tokens (default: the length scale), at
least 1, sent with ``ignore_eos``. ``--max-input-tokens`` drops a long prompt's trailing blocks
(its prefix, and so its sharing, is kept).

**Prompt text, and why block boundaries do not drift.** Block ``h`` of ``n`` tokens is ``n``
words, each preceded by one space, drawn from ``WORDS`` by ``random.Random("replay/<seed>/<h>")``
(seeded by the id: the same id always gives the same words, and a partial block is a prefix of
the full one). A prompt is its blocks' text concatenated. Two properties make the token sequence
exactly the blocks' token sequences one after another, at any scale: every word of ``WORDS`` is
a single SmolLM2 token when preceded by a space (checked with the real tokenizer in
``tests/unit/test_replay.py``), and the tokenizer's pre-tokenizer splits text before every space,
so no BPE merge crosses a word, let alone a block. A block of ``n`` words is therefore exactly
``n`` tokens, and prompts that share leading ids share exactly that many leading tokens (with
``B`` a multiple of the engine's 16-token KV block, the shared prefix is whole KV blocks; 1/16 and
1/32 are).

**Ideal hit ratio.** Infinite cache, starting empty at the slice: a prompt block is a hit when its
id chain (its id and every id before it in the prompt) was in an earlier request of the slice.
``ideal_hit_ratio`` is the fraction of blocks (the trace README's 36.6% for the whole hour);
``ideal_token_hit_ratio`` weighs each hit block by the scaled tokens an earlier request had of it
(a partial last block holds only its part) and never counts a prompt's last token, the unit of the achieved
``hit_ratio`` (the completed requests' ``usage.prompt_tokens_details.cached_tokens`` over their
``prompt_tokens``); ``hit_ratio_vs_ideal`` is the one over the other.

**Tiers.** ``--api-keys KEY:TIER:SHARE,...`` draws each request's tier (seeded) by share and sends
it with that key; ``--slo-ttft-ms`` (one value, or ``TIER=MS,...``) and optionally
``--slo-tpot-ms`` give each tier's SLO. A request attains its SLO when it completes within its
tier's TTFT (and TPOT, if given) budget; ``attainment`` counts over everything the tier sent (a
429 is a miss), ``attainment_admitted`` over what was admitted. Goodput: such requests per second
of the run.

**429s.** By default a 429 is the request's result: counted in ``rejected`` (its Retry-After
recorded, mean and max reported), not sent again — the schedule stays the trace's. With
``--retry-429 N`` a 429 is sent again after its Retry-After, up to N times, its latency still
counted from the first send.

**Simulation** (``--simulate``) runs ``shared.sim.Simulator`` — the live routing
(``shared.policy.kv_routing``), admission and disaggregation code — on the same scaled requests
with their hash ids as the prefix-cache keys (block size ``B``), and writes the same summary:

* ``gpu``: a GPU cluster (``--cluster``, default ``examples/clusters/mooncake-h100x32.yaml``) and a
  model preset (``--model``, default llama-2-70b), planned by ``shared.planner`` for the slice's
  rate and mean lengths (or ``--plan``), prefill pool and decode pool disaggregated;
* ``cpu``: this machine as ``tandem up --decode N`` runs here: N decode workers that prefill
  locally, timed by the cost model fitted to this machine's measured step times
  (``loadtest/results/calibration``, from ``loadtest.calibrate.sim``), each with a KV pool of
  ``--kv-cache-memory`` and the engine's sequence and chunked-prefill limits; the N workers share
  the CPU, so each is modelled at 1/N of its speed (``--cpu-share``).

The simulator has no per-token times: its ITL is each request's TPOT (``itl_is_tpot``).
``--routing load`` sets the overlap weight to 0 (load only), ``round-robin`` cycles through the
decode workers (live: the admission service's ``--routing round-robin``). ``--prefix-cache-blocks``
lets each simulated decode worker keep more prefix blocks than its KV pool holds (a host tier; the
copy back is not timed). Simulated decode workers fetch a prompt's cached prefix from the worker
holding more of it, as the engine's peer fetch does (off with ``--no-kv-peer-fetch``).
``--admission`` gives the simulated tiers their TTFT SLOs (predicted misses are rejected, lowest
priority first, as the admission service does with a QoS file; a request the routing's choice would
serve late is tried on ``--fallback-workers`` others first); without it every request is admitted.

``--start-stack`` starts ``tandem up`` here for the live run (``--decode``, ``--kv-cache-memory``,
``--kv-host-memory``, ``--no-kv-peer-fetch``, ``--routing``; the tiers and, with ``--admission``,
their SLOs in a QoS file) and stops it after; ``--compare-sim`` also simulates the slice (``cpu``)
and reports the simulator's error. ``--simulate cpu --compare-with LIVE_JSON`` compares a simulation
with a live run of the same slice recorded earlier (with another ``--calibration-dir``, say).
``--prefill-workers N`` adds prefill workers beside the decode workers (live and ``cpu``; decode
workers still prefill prompts of up to 512 uncached tokens), and
``--autoscale`` lets the autoscaler flip any worker between the roles as long as one decodes
(``--autoscale-*`` set its interval, window, cooldown, stabilization window and decode capacity);
a live run then records the split over time and the autoscaler's decisions.

Writes ``--out`` (JSON: the summary's fields at the top level, then ``config`` and every request
unless ``--no-per-request``, live ones with the decode worker that served them) and a PNG next to
it (TTFT and ITL CDFs per tier, TTFT over the run, hit ratio against ideal).

The modules, by concern: ``trace`` (slice, scaling, prompt text, ideal hit ratio), ``live`` (send
to a stack, or start one), ``simulate`` (the simulator's setups and run), ``summary`` (outcomes,
summary, plot, sim-vs-live comparison), ``cli`` (the command line); this package re-exports them.
"""

from loadtest.tools.replay.cli import main, parse_args
from loadtest.tools.replay.live import autoscaler_flags, decode_flags, qos_yaml, run_live, start_stack
from loadtest.tools.replay.simulate import cpu_prefix_cache_blocks, parse_bytes, run_sim, with_prefill_workers
from loadtest.tools.replay.summary import (Outcome, compare, format_sim_vs_live, format_summary, outcome_of,
                                           relative_error, summarize, write_out)
from loadtest.tools.replay.trace import (DEFAULT_TIER, ENGINE_BLOCK_TOKENS, TRACE_BLOCK_TOKENS, ReplayRequest,
                                         TierSpec, TraceRecord, block_text, block_words, build_requests,
                                         conversation_key, ideal_hits, ideal_ratios, parse_scale, parse_tiers,
                                         prompt_text, read_trace, scale_blocks, scaled_block_tokens)

__all__ = ["DEFAULT_TIER", "ENGINE_BLOCK_TOKENS", "TRACE_BLOCK_TOKENS", "Outcome", "ReplayRequest", "TierSpec",
           "TraceRecord", "autoscaler_flags", "block_text", "block_words", "build_requests", "compare",
           "conversation_key", "cpu_prefix_cache_blocks", "decode_flags", "format_sim_vs_live", "format_summary",
           "ideal_hits", "ideal_ratios", "main", "outcome_of", "parse_args", "parse_bytes", "parse_scale",
           "parse_tiers", "prompt_text", "qos_yaml", "read_trace", "relative_error", "run_live", "run_sim",
           "scale_blocks", "scaled_block_tokens", "start_stack", "summarize", "with_prefill_workers", "write_out"]

"""loadtest.tools.replay: trace slicing and scaling, prompt text (with the real tokenizer), the ideal hit
ratio by hand, the summary's fields, the simulator on a small trace; one live run (slow)."""

from __future__ import annotations

import json
import math
import types

import pytest

from loadtest.tools import replay
from loadtest.tools.stats import RequestResult

# 20 requests, 512-token blocks. Ids 0-1 are a shared 2-block "system prompt"; conversations
# A (ids 10..), B (20..), C (30..) grow turn by turn; D requests share nothing but block 0.
ROWS = [
    # (timestamp ms, input_length, output_length, hash_ids)
    (0, 1500, 40, [0, 1, 10]),             # A1: 3 blocks, new
    (100, 1200, 30, [0, 1, 20]),           # B1: 0, 1 seen -> 2 hits
    (200, 2000, 20, [0, 1, 10, 11]),       # A2: 0, 1, 10 seen -> 3 hits
    (300, 700, 10, [0, 40]),               # D1: 0 seen -> 1
    (400, 2500, 50, [0, 1, 10, 11, 12]),   # A3: 4 hits
    (500, 1800, 30, [0, 1, 20, 21]),       # B2: 3 hits
    (600, 1100, 5, [0, 1, 30]),            # C1: 2 hits
    (700, 600, 8, [0, 41]),                # D2: 1 hit
    (800, 2100, 40, [0, 1, 30, 31, 32]),   # C2: 3 hits
    (900, 3000, 60, [0, 1, 10, 11, 12, 13]),  # A4: 5 hits
    (1000, 500, 1, [0]),                   # E: 1 block, seen -> 1 hit
    (1100, 2300, 20, [0, 1, 20, 21, 22]),  # B3: 4 hits
    (1200, 900, 12, [0, 42]),              # D3: 1 hit
    (1300, 1536, 16, [0, 1, 30]),          # C1 again, exactly 3 full blocks: 3 hits
    (1400, 2600, 30, [0, 1, 30, 31, 32, 33]),  # C3: 5 hits
    (1500, 800, 9, [5, 43]),               # F: another root: 0 hits
    (1600, 900, 9, [5, 43]),               # F again: 2 hits
    (1700, 1200, 9, [1, 10, 11]),          # ids seen, but not as this chain: 0 hits
    (1800, 3500, 70, [0, 1, 10, 11, 12, 13, 14]),  # A5: 6 hits
    (1900, 1000, 20, [0, 1]),              # 2 hits
]
HITS = [0, 2, 3, 1, 4, 3, 2, 1, 3, 5, 1, 4, 1, 3, 5, 0, 2, 0, 6, 2]


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = ROWS[:]
    rows[3], rows[4] = rows[4], rows[3]   # out of order in the file: read_trace sorts by timestamp
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h})
                            + "\n" for t, i, o, h in rows) + "\n")
    return path


def test_ideal_hit_ratio_by_hand(trace_file):
    recs = replay.read_trace(trace_file)
    assert [r.hash_ids for r in recs] == [tuple(h) for _, _, _, h in ROWS]
    assert replay.ideal_hits([r.hash_ids for r in recs]) == HITS
    reqs = replay.build_requests(recs)
    ideal = replay.ideal_ratios(reqs)
    blocks = sum(len(h) for *_, h in ROWS)
    assert ideal["num_blocks"] == blocks == 70 and ideal["num_ideal_hit_blocks"] == sum(HITS) == 48
    assert ideal["ideal_hit_ratio"] == pytest.approx(48 / 70)
    # by tokens at full scale: a hit block counts the tokens an earlier prompt had of it (A1's
    # partial block 10 held 476 when A2 hits it), and a prompt's last token never counts (E: 499)
    hit_tokens = sum([0, 1024, 1024 + 476, 512, 1536 + 464, 1024 + 176, 1024, 512, 1024 + 76, 2048 + 452,
                      499, 1536 + 264, 512, 1535, 2048 + 52, 0, 512 + 288, 0, 2560 + 440, 999])
    assert ideal["ideal_token_hit_ratio"] == pytest.approx(hit_tokens / sum(i for _, i, _, _ in ROWS))


def test_slice_and_scaling(trace_file):
    recs = replay.read_trace(trace_file, max_requests=5, skip=2)
    assert [r.at_s for r in recs] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    # the slice's own ideal: its first request's blocks count as new
    assert replay.ideal_hits([r.hash_ids for r in recs]) == [0, 1, 4, 2, 2]
    reqs = replay.build_requests(recs, time_scale=4, rate_scale=2, length_scale=1 / 16)
    assert [r.at_s for r in reqs] == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8])
    a2 = reqs[0]   # 2000 tokens, 4 ids: 3 full blocks of 32 and 464 -> 29
    assert a2.block_tokens == (32, 32, 32, 29) and a2.input_tokens == 125 and a2.output_tokens == 1
    assert replay.scale_blocks(1536, 3, 1 / 16) == [32, 32, 32]       # a full last block stays full
    assert replay.scale_blocks(513, 2, 1 / 16) == [32, 1]             # at least one token
    assert replay.build_requests(recs, output_scale=0.5)[0].output_tokens == 10
    capped = replay.build_requests(recs, length_scale=1 / 16, max_input_tokens=70)
    assert capped[2].block_tokens == (32, 32) and capped[2].hash_ids == (0, 1) and capped[2].truncated
    assert replay.parse_scale("1/16") == 1 / 16 and replay.parse_scale("4") == 4.0


def test_sampling_conversations_keeps_them_whole(trace_file):
    recs = replay.read_trace(trace_file, sample_conversations=0.5, seed=3)
    keys = {replay.conversation_key(r.hash_ids) for r in recs}
    all_recs = replay.read_trace(trace_file)
    assert 0 < len(recs) < len(all_recs)
    assert len(recs) == sum(1 for r in all_recs if replay.conversation_key(r.hash_ids) in keys)


def test_tiers_by_key_and_share(trace_file):
    tiers = replay.parse_tiers("kp:premium:1,kb:batch:3", "premium=2000,batch=8000", "100")
    assert [(t.name, t.api_key, t.share, t.ttft_slo_s, t.tpot_slo_s) for t in tiers] == [
        ("premium", "kp", 0.25, 2.0, 0.1), ("batch", "kb", 0.75, 8.0, 0.1)]
    recs = replay.read_trace(trace_file)
    a = replay.build_requests(recs, tiers=tiers, seed=1)
    assert a == replay.build_requests(recs, tiers=tiers, seed=1)
    assert {r.tier for r in a} == {"premium", "batch"} and all(r.api_key == "kp" for r in a if r.tier == "premium")
    with pytest.raises(ValueError):
        replay.parse_tiers("kp:premium:1", "batch=3", None)


def test_block_text_is_deterministic_and_a_partial_block_is_a_prefix():
    assert replay.block_text(7, 32) == replay.block_text(7, 32)
    assert replay.block_text(7, 32) != replay.block_text(8, 32)
    assert replay.block_text(7, 32).startswith(replay.block_text(7, 10))
    assert replay.block_text(7, 32, seed=1) != replay.block_text(7, 32)
    assert len(replay.block_text(7, 32).split()) == 32


@pytest.fixture(scope="module")
def tokenizer():
    from shared.tokenizer import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.mark.parametrize("length_scale", [1 / 16, 1 / 10, 1 / 32])
def test_prompts_tokenize_to_their_blocks_exactly(trace_file, tokenizer, length_scale):
    """Every block is exactly its scaled token count, and the prompt's tokens are the blocks'
    tokens one after another: prompts sharing leading ids share exactly that token prefix."""
    reqs = replay.build_requests(replay.read_trace(trace_file), length_scale=length_scale)
    for r in reqs:
        ids = tokenizer.encode(replay.prompt_text(r))
        assert len(ids) == r.input_tokens
        pos = 0
        for h, n in zip(r.hash_ids, r.block_tokens):
            assert ids[pos:pos + n] == tokenizer.encode(replay.block_text(h, n))
            pos += n
    # A1 [0, 1, 10] ends in a partial block 10; A2 [0, 1, 10, 11] has it whole: A1 is a prefix of A2
    a1, a2 = tokenizer.encode(replay.prompt_text(reqs[0])), tokenizer.encode(replay.prompt_text(reqs[2]))
    assert reqs[0].block_tokens[-1] < reqs[2].block_tokens[2] and a2[:len(a1)] == a1
    # B1 [0, 1, 20] shares two blocks with A1, and its third block starts differently
    b1 = tokenizer.encode(replay.prompt_text(reqs[1]))
    two = 2 * replay.scaled_block_tokens(length_scale)
    assert b1[:two] == a1[:two] and b1[two:two + 4] != a1[two:two + 4]


def test_every_word_is_one_token(tokenizer):
    from loadtest.tools.workload import WORDS

    assert all(len(tokenizer.encode(" " + w)) == 1 for w in WORDS)


def test_summary_fields(trace_file):
    tiers = replay.parse_tiers("kp:premium:1,kb:batch:1", "premium=500,batch=2000", None)
    reqs = replay.build_requests(replay.read_trace(trace_file, max_requests=4), length_scale=1 / 16, tiers=tiers)
    results = []
    for k, r in enumerate(reqs):
        if k == 3:
            results.append(RequestResult(r.index, r.at_s, r.at_s, error="HTTP 429", retry_after_s=2.0))
            continue
        t0 = r.at_s
        results.append(RequestResult(r.index, r.at_s, t0, first_token_s=t0 + 0.3 * (k + 1),
                                     finished_s=t0 + 0.3 * (k + 1) + 0.2, token_times_s=[t0 + 0.3 * (k + 1),
                                                                                          t0 + 0.3 * (k + 1) + 0.2],
                                     num_output_tokens=2, prompt_tokens=r.input_tokens,
                                     cached_tokens=32 * replay.ideal_hits([q.hash_ids for q in reqs])[k]))
    outcomes = [replay.outcome_of(r, res) for r, res in zip(reqs, results)]
    s = replay.summarize(outcomes, reqs, tiers)
    for key in ("requests", "completed", "rejected", "failed", "hit_ratio", "ideal_hit_ratio",
                "ideal_token_hit_ratio", "goodput_rps", "ttft_s", "itl_s", "tiers", "retry_after_s"):
        assert key in s
    assert (s["requests"], s["completed"], s["rejected"], s["failed"]) == (4, 3, 1, 0)
    assert s["prompt_tokens_mismatched"] == 0 and s["retry_after_s"]["max"] == 2.0
    assert s["hit_ratio"] == pytest.approx((64 + 96) / sum(r.input_tokens for r in reqs[:3]))
    ttft_by_tier = {r.tier: [] for r in reqs}
    for k, r in enumerate(reqs[:3]):
        ttft_by_tier[r.tier].append(0.3 * (k + 1))
    for name, t in s["tiers"].items():
        mine = [r for r in reqs if r.tier == name]
        assert t["requests"] == len(mine)
        assert set(t["ttft_s"]) >= {"p50", "p90", "p99"}
        good = sum(1 for x in ttft_by_tier[name] if x <= t["slo_ttft_s"])
        assert t["attainment"] == pytest.approx(good / len(mine))
    assert s["itl_s"]["p50"] == pytest.approx(0.2)
    assert "premium" in replay.format_summary("x", s)


def test_simulator_on_a_small_trace_writes_the_summary(trace_file, tmp_path):
    out = tmp_path / "sim.json"
    rc = replay.main(["--trace", str(trace_file), "--length-scale", "1/16", "--time-scale", "10",
                      "--simulate", "cpu", "--decode", "2", "--kv-cache-memory", "64MiB",
                      "--api-keys", "kp:premium:0.3,kb:batch:0.7", "--slo-ttft-ms", "premium=3000,batch=9000",
                      "--out", str(out), "--no-progress"])
    assert rc == 0
    d = json.loads(out.read_text())
    assert (d["requests"], d["completed"] + d["rejected"] + d["failed"]) == (20, 20)
    assert d["ideal_hit_ratio"] == pytest.approx(48 / 70)
    assert 0 < d["hit_ratio"] <= d["ideal_token_hit_ratio"] + 1e-9
    assert set(d["tiers"]) == {"premium", "batch"} and d["sim"]["setup"] == "cpu" and d["itl_is_tpot"]
    assert len(d["per_request"]) == 20 and out.with_suffix(".png").exists()
    assert math.isfinite(d["tiers"]["batch"]["ttft_s"]["p50"])


def test_a_host_tier_and_peer_fetch_reach_the_stack_and_the_simulator(trace_file, tmp_path):
    base = ["--trace", str(trace_file), "--length-scale", "1/16", "--time-scale", "10", "--simulate", "cpu",
            "--decode", "2", "--kv-cache-memory", "12MiB", "--no-progress", "--no-per-request"]
    args = replay.parse_args([*base, "--kv-host-memory", "64MiB", "--no-kv-peer-fetch"])
    assert replay.decode_flags(args) == {"device": "cpu", "kv_cache_memory": "12MiB", "kv_host_memory": "64MiB",
                                         "kv_peer_fetch": False}
    assert replay.decode_flags(replay.parse_args(base)) == {"device": "cpu", "kv_cache_memory": "12MiB"}
    model = types.SimpleNamespace(kv_bytes_per_token=lambda: 1024.0)
    assert replay.cpu_prefix_cache_blocks(args, model, 12 << 20) == (76 << 20) // (1024 * 32)  # 32-token blocks at 1/16
    assert replay.cpu_prefix_cache_blocks(replay.parse_args([*base, "--kv-host-memory", "64MiB",
                                                             "--prefix-cache-blocks", "7"]), model, 12 << 20) == 7
    assert replay.cpu_prefix_cache_blocks(replay.parse_args(base), model, 12 << 20) is None
    # a pool too small to keep any prefix between requests, then the same pool over a host tier
    hits = {}
    for name, extra in (("pool", []), ("host", ["--kv-host-memory", "64MiB"])):
        assert replay.main([*base, *extra, "--out", str(tmp_path / f"{name}.json")]) == 0
        hits[name] = json.loads((tmp_path / f"{name}.json").read_text())["hit_ratio"]
    assert hits["host"] > hits["pool"]


@pytest.mark.parametrize("routing", ["load", "round-robin"])
def test_simulator_routings_and_the_gpu_cluster(trace_file, tmp_path, routing):
    out = tmp_path / f"{routing}.json"
    assert replay.main(["--trace", str(trace_file), "--simulate", "gpu", "--routing", routing,
                        "--cluster", "examples/clusters/homo-h100x8.yaml", "--model", "llama-2-7b",
                        "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["completed"] == 20 and d["sim"]["setup"] == "gpu" and d["config"]["routing"] == routing


def test_a_fixed_split_and_the_autoscaler_in_the_gpu_simulation(trace_file, tmp_path):
    base = ["--trace", str(trace_file), "--simulate", "gpu", "--cluster", "examples/clusters/homo-h100x8.yaml",
            "--model", "llama-2-7b", "--no-progress"]
    planned, fixed, auto = (tmp_path / f"{n}.json" for n in ("planned", "fixed", "auto"))
    assert replay.main([*base, "--out", str(planned)]) == 0
    groups = [w["role"] for w in json.loads(planned.read_text())["sim"]["workers"]]
    assert len(groups) >= 2
    want = 1 if groups.count("prefill") != 1 else 2 if len(groups) > 2 else 1
    assert replay.main([*base, "--prefill-workers", str(want), "--out", str(fixed)]) == 0
    d = json.loads(fixed.read_text())
    assert [w["role"] for w in d["sim"]["workers"]].count("prefill") == want
    assert {n for _, n in d["sim"]["num_prefill_over_time"]} == {want} and d["sim"]["flips"] == 0
    assert d["completed"] + d["rejected"] + d["failed"] == 20
    assert replay.main([*base, "--autoscale", "--autoscale-cooldown-s", "1", "--out", str(auto)]) == 0
    assert json.loads(auto.read_text())["completed"] == 20
    with pytest.raises(SystemExit):   # every group prefilling leaves no decode worker
        replay.main([*base, "--prefill-workers", str(len(groups)), "--out", str(fixed)])


def test_prefill_workers_and_the_autoscaler_in_the_cpu_simulation_and_the_stack(trace_file, tmp_path):
    base = ["--trace", str(trace_file), "--length-scale", "1/16", "--time-scale", "10", "--simulate", "cpu",
            "--kv-cache-memory", "64MiB", "--no-progress", "--no-per-request",
            "--api-keys", "kp:premium:0.3,kb:batch:0.7", "--slo-ttft-ms", "premium=3000,batch=9000"]
    fixed, auto, other = (tmp_path / f"{n}.json" for n in ("fixed", "auto", "other"))
    assert replay.main([*base, "--decode", "1", "--prefill-workers", "1", "--out", str(fixed)]) == 0
    d = json.loads(fixed.read_text())
    assert [w["role"] for w in d["sim"]["workers"]] == ["decode", "prefill"]
    assert {n for _, n in d["sim"]["num_prefill_over_time"]} == {1} and d["completed"] == 20
    assert replay.main([*base, "--decode", "2", "--autoscale", "--out", str(auto)]) == 0
    assert json.loads(auto.read_text())["completed"] == 20
    # what the started stack would be given
    args = replay.parse_args([*base, "--decode", "2", "--autoscale", "--autoscale-stabilization-s", "5",
                              "--autoscale-decode-capacity", "150"])
    assert replay.autoscaler_flags(args) == {
        "autoscale": True, "min_prefill_workers": 0, "min_decode_workers": 1, "autoscale_interval_s": 10.0,
        "autoscale_window_s": 30.0, "autoscale_cooldown_s": 60.0, "autoscale_stabilization_s": 5.0,
        "decode_capacity_tokens_per_s": 150.0}
    assert replay.autoscaler_flags(replay.parse_args(base)) == {}
    # a simulation compared with a run recorded earlier (here: the fixed split's, as if it were live)
    assert replay.main([*base, "--decode", "1", "--prefill-workers", "1", "--compare-with", str(fixed),
                        "--out", str(other)]) == 0
    rows = json.loads(other.read_text())["sim_vs_live"]
    assert rows["goodput_rps"]["rel_error"] == 0 and rows["hit_ratio"]["rel_error"] == 0
    # not the same slice: refused
    assert replay.main([*base, "--max-requests", "5", "--decode", "2", "--compare-with", str(fixed),
                        "--out", str(other)]) == 2


@pytest.mark.slow
@pytest.mark.long
def test_live_replay_against_a_small_stack(trace_file, tmp_path):
    """tandem up with one decode worker; 8 requests spaced so that each earlier prefix is cached:
    every prompt tokenizes to its scaled length and the prefix cache is hit."""
    out = tmp_path / "live.json"
    rc = replay.main(["--trace", str(trace_file), "--max-requests", "8", "--length-scale", "1/16",
                      "--time-scale", "5", "--start-stack", "--decode", "1", "--out", str(out), "--no-progress"])
    d = json.loads(out.read_text())
    assert rc == 0 and d["completed"] == 8, d["errors"]
    assert d["prompt_tokens_mismatched"] == 0
    assert len({r["worker"] for r in d["per_request"]}) == 1 and d["per_request"][0]["worker"]  # who served each
    assert d["hit_ratio"] > 0.5 * d["ideal_token_hit_ratio"] > 0


@pytest.mark.slow
@pytest.mark.long
def test_live_replay_with_a_prefill_worker_records_the_split(trace_file, tmp_path):
    """tandem up with one prefill and one decode worker (``--prefill-workers``): every request
    completes, and the run records the split it ran on and the autoscaler's view (not acting)."""
    out = tmp_path / "live.json"
    rc = replay.main(["--trace", str(trace_file), "--max-requests", "8", "--length-scale", "1/16",
                      "--time-scale", "5", "--start-stack", "--decode", "1", "--prefill-workers", "1",
                      "--out", str(out), "--no-progress"])
    d = json.loads(out.read_text())
    assert rc == 0 and d["completed"] == 8, d["errors"]
    assert d["split_over_time"] and {(p, n) for _, p, n in d["split_over_time"]} == {(1, 1)}, d["split_over_time"]
    assert d["scaling"] is not None and not d["scaling"]["enabled"]

"""The serving benchmark's arithmetic: aggregate tokens/s over waves and ratios to the peer."""

from loadtest.bench.serving import ratios, summarize_waves


def wave(wall_s, tokens, itls=(), tpots=(), errors=()):
    return {"wall_s": wall_s, "tokens": tokens, "itls_s": list(itls), "ttfts_s": [0.1], "tpots_s": list(tpots),
            "errors": list(errors)}


def test_aggregate_rate_is_all_tokens_over_all_wave_time():
    s = summarize_waves([wave(2.0, 256, [0.01, 0.03], [0.02]), wave(6.0, 256, [0.05], [0.04], ["HTTP 503"])])
    assert s["output_tok_s"] == 64.0  # 512 tokens / 8 s, not the mean of 128 and 42.7
    assert s["itl_p50_ms"] == 30.0 and s["tpot_p50_ms"] == 30.0
    assert s["errors"] == ["HTTP 503"]
    assert s["round_tok_s"] == [128.0, 42.7]  # each round's own rate, in order
    assert s["round_cpu_steal_share"] == [None, None]  # a wave recorded without /proc/stat


def test_each_round_keeps_the_cpu_steal_it_was_measured_under():
    s = summarize_waves([wave(2.0, 256) | {"cpu_steal_share": 0.0}, wave(2.0, 128) | {"cpu_steal_share": 0.31234}])
    assert s["round_cpu_steal_share"] == [0.0, 0.312]


def test_ratios_are_against_the_last_target_and_skip_a_level_it_has_no_rate_for():
    results = {"tandem": {1: {"output_tok_s": 70.0}, 8: {"output_tok_s": 300.0}},
               "llama-server": {1: {"output_tok_s": 140.0}, 8: {"output_tok_s": None}}}
    assert ratios(results) == {"tandem": {1: 0.5}}

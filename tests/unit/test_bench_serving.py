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


def test_prompt_rate_is_the_prompt_tokens_over_the_same_wave_time():
    """With one output token a wave is its prompts' prefills: the prompt rate is what it measures."""
    s = summarize_waves([wave(2.0, 4) | {"prompt_tokens": 4000, "cached_tokens": 0},
                         wave(3.0, 4) | {"prompt_tokens": 4000, "cached_tokens": 16}])
    assert s["prompt_tok_s"] == 1600.0 and s["prompt_tokens"] == 8000 and s["cached_tokens"] == 16
    results = {"tandem": {8: {"prompt_tok_s": 1500.0}}, "vllm": {8: {"prompt_tok_s": 1000.0}}}
    assert ratios(results, "prompt_tok_s") == {"tandem": {8: 1.5}}


def test_a_wave_waits_for_the_machine_to_be_idle_but_not_longer_than_it_is_told(monkeypatch):
    """A server still busy after its turn (vLLM's engine keeps a core working a second or more) must
    not slow the next target's wave: settle waits while the CPUs are busy, up to its limit."""
    import asyncio

    from loadtest.bench import serving

    readings = iter([{"user": 0, "idle": 0}, {"user": 90, "idle": 10},   # 90% busy: wait
                     {"user": 90, "idle": 10}, {"user": 95, "idle": 105}])  # 5% busy: go
    monkeypatch.setattr(serving, "cpu_times", lambda: next(readings))
    monkeypatch.setattr(serving, "SETTLE_WINDOW_S", 0.0)
    asyncio.run(serving.settle(60.0))
    assert next(readings, "done") == "done"  # stopped at the first idle window
    monkeypatch.setattr(serving, "cpu_times", lambda: {"user": 0, "idle": 0})  # never idle (no time passes)
    assert asyncio.run(serving.settle(0.0)) < 0.05  # 0: no wait at all


def test_ratios_are_against_the_last_target_and_skip_a_level_it_has_no_rate_for():
    results = {"tandem": {1: {"output_tok_s": 70.0}, 8: {"output_tok_s": 300.0}},
               "llama-server": {1: {"output_tok_s": 140.0}, 8: {"output_tok_s": None}}}
    assert ratios(results) == {"tandem": {1: 0.5}}


def test_the_vllm_peer_serves_the_gguf_weights_as_a_bf16_directory_under_the_alias(smollm2_gguf, tmp_path, monkeypatch):
    """What the vLLM peer is given: the default model's GGUF dequantized into a bf16 Hugging Face
    directory that our own loader reads as the same model, served under the alias the requests name."""
    import safetensors.torch
    import torch

    from loadtest.tools import vllm_server
    from shared.model.loader import read_config

    monkeypatch.setattr(vllm_server, "CACHE", tmp_path)
    made = vllm_server.convert(str(smollm2_gguf))
    assert made == tmp_path / "hf" / f"{smollm2_gguf.stem}-bf16" and vllm_server.convert(str(smollm2_gguf)) == made
    gguf_shape, hf_shape = read_config(smollm2_gguf, "gguf"), read_config(made, "hf")
    assert (hf_shape.num_layers, hf_shape.num_heads, hf_shape.num_kv_heads, hf_shape.hidden_size) == \
        (gguf_shape.num_layers, gguf_shape.num_heads, gguf_shape.num_kv_heads, gguf_shape.hidden_size)
    weights = safetensors.torch.load_file(made / "model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    command = vllm_server.server_command(tmp_path / "python", made, 8091, "smollm2-135m")
    assert command[command.index("--served-model-name") + 1] == "smollm2-135m"
    assert command[command.index("--model") + 1] == str(made)

"""The compiled decode step is built once per cluster (shared/engine/compiled/artifacts.py):
``tandem model fetch --compile --nats`` on one "machine" (a compile cache directory of its own)
compiles the step and publishes it to a real nats-server; on a second machine with an empty cache
the same command takes it from the cluster and loads it; a third run there finds it locally. The
loaded step gives the compiled one's greedy tokens. A 2-layer model with SmolLM2's vocabulary
keeps the cold compile to about a minute. The real model's worker path is in
test_compiled_worker.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.long]


@pytest.fixture(scope="module")
def tiny_gguf(smollm2_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    subprocess.run([sys.executable, "-m", "loadtest.tools.synth_model", "--shape", "tiny", "--format", "gguf-q8_0",
                    "--tokenizer-from", str(smollm2_gguf), "--out", str(out)], check=True, capture_output=True)
    return out


def fetch_compile(model, cache_dir, nats_url: str, namespace: str) -> dict:
    env = {**os.environ, "TANDEM_COMPILE_CACHE_DIR": str(cache_dir)}
    done = subprocess.run([sys.executable, "-m", "services.cli", "model", "fetch", str(model), "--compile",
                           "--nats", nats_url, "--namespace", namespace], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0] == str(model)
    return json.loads(lines[-1])


def test_the_first_machine_compiles_and_publishes_later_ones_load(tiny_gguf, nats_url, namespace, tmp_path):
    """Near or over a minute because the first machine compiles the step cold (the point of the
    test: the later ones do not)."""
    first = fetch_compile(tiny_gguf, tmp_path / "host1", nats_url, namespace)
    assert (first["step"], first["fetched"], first["published"]) == ("compiled", False, True)

    second = fetch_compile(tiny_gguf, tmp_path / "host2", nats_url, namespace)
    assert second["key"] == first["key"]
    assert (second["step"], second["fetched"], second["published"]) == ("loaded", True, False)
    # what the second machine loaded is the first one's step, libraries included
    one, two = (tmp_path / host / first["key"] for host in ("host1", "host2"))
    assert (two / "decode.bin").read_bytes() == (one / "decode.bin").read_bytes()
    assert sorted(p.name for p in (two / "inductor").rglob("*.so")) == sorted(p.name for p in (one / "inductor").rglob("*.so"))

    again = fetch_compile(tiny_gguf, tmp_path / "host2", nats_url, namespace)
    assert (again["step"], again["fetched"], again["published"]) == ("loaded", False, False)


def test_a_loaded_step_gives_the_compiled_steps_tokens(tiny_gguf, tmp_path, monkeypatch):
    from shared.engine import EngineConfig, LLMEngine, SamplingParams

    monkeypatch.setenv("TANDEM_COMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "before"))  # restored afterwards
    config = EngineConfig(model=str(tiny_gguf), device="cpu", kv_cache_memory=16 << 20, compile="on")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + 13 * j) % 900 + 3 for j in range(5 + 9 * i)] for i in range(3)]
    compiled = LLMEngine.from_config(config)
    assert compiled.runner.compiled.source == "compiled"
    expected = compiled.generate(prompts, greedy)
    loaded = LLMEngine.from_config(config)
    assert loaded.runner.compiled.source == "loaded"
    assert loaded.generate(prompts, greedy) == expected
    assert loaded.runner.compiled.num_steps >= 11


def test_a_background_compile_runs_in_a_process_of_its_own(tiny_gguf, tmp_path, monkeypatch, caplog):
    """A worker's background compile (``compile="background"``) builds the step in a child process,
    which shares no GIL with serving, into the compile cache; the engine thread then loads it from
    there, and the loaded step gives eager's greedy tokens. Near or over a minute: the child compiles cold."""
    from shared.engine import EngineConfig, LLMEngine, SamplingParams

    monkeypatch.setenv("TANDEM_COMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "before"))
    monkeypatch.delenv("TANDEM_COMPILE_PROCESS", raising=False)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + 13 * j) % 900 + 3 for j in range(5 + 9 * i)] for i in range(3)]
    config = EngineConfig(model=str(tiny_gguf), device="cpu", kv_cache_memory=16 << 20)
    expected = LLMEngine.from_config(config).generate(prompts, greedy)
    with caplog.at_level("INFO", logger="shared.engine.compiled.background"):
        engine = LLMEngine.from_config(dataclasses.replace(config, compile="background"))
        assert engine.background_compile.wait(timeout=900) and engine.background_compile.error is None
    assert "compiled in a child process" in caplog.text
    assert engine.runner.compiled.source == "loaded"  # this process compiled nothing
    marker = json.loads((tmp_path / engine.runner.compiled.artifacts.key / "complete.json").read_text())
    assert marker["source"] == "compiled"
    assert engine.generate(prompts, greedy) == expected
    assert engine.runner.compiled.num_steps >= 11

"""The compiled decode step is built once per cluster (shared/engine/compile_artifacts.py):
``tandem model fetch --compile --nats`` on one "machine" (a compile cache directory of its own)
compiles the graphs and publishes them to a real nats-server; on a second machine with an empty
cache the same command takes them from the cluster and compiles nothing; a third run there finds
them locally. A 2-layer model with SmolLM2's vocabulary keeps the cold compile to about a minute.
The real model's worker path is in test_compiled_worker.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


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


def test_the_first_machine_compiles_and_publishes_later_ones_compile_nothing(tiny_gguf, nats_url, namespace,
                                                                          tmp_path):
    first = fetch_compile(tiny_gguf, tmp_path / "host1", nats_url, namespace)
    assert (first["source"], first["published"]) == ("compiled", True)
    assert first["graphs_compiled"] == 2  # batch 1, and every larger batch

    second = fetch_compile(tiny_gguf, tmp_path / "host2", nats_url, namespace)
    assert second["key"] == first["key"]
    assert (second["source"], second["published"]) == ("cluster", False)
    assert (second["graphs_from_cache"], second["graphs_compiled"]) == (2, 0)

    again = fetch_compile(tiny_gguf, tmp_path / "host2", nats_url, namespace)
    assert (again["source"], again["graphs_from_cache"], again["graphs_compiled"]) == ("local", 2, 0)

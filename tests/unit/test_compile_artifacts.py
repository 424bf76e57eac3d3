"""The compiled decode step's artifacts (shared/engine/compile_artifacts.py): what the key depends
on, packing and unpacking a cache directory, and the fetch/publish rules against a bucket."""

from __future__ import annotations

import io
import tarfile

import pytest

from shared.engine.compile_artifacts import CompileArtifacts, artifact_key, fetch_from, isa_flags, publish_to

AVX512 = frozenset({"fpu", "sse2", "avx2", "avx512f", "avx512_vnni", "hypervisor", "constant_tsc"})
BASE = dict(model_name="m.gguf", model_bytes=1000, dtype="float32", quantization="int8", block_size=16, threads=2,
            torch_version="2.13.0+cpu", flags=AVX512)


def test_the_key_names_everything_the_compiled_code_depends_on():
    key = artifact_key(**BASE)
    assert key == artifact_key(**BASE) and key.startswith("decode-")
    for change in (dict(model_bytes=1001), dict(quantization="none"), dict(dtype="bfloat16"), dict(block_size=32),
                   dict(threads=4), dict(torch_version="2.14.0+cpu"), dict(flags=AVX512 | {"amx_tile"})):
        assert artifact_key(**{**BASE, **change}) != key, change
    # flags that do not change the instructions a compiler may emit do not split the cluster
    assert artifact_key(**{**BASE, "flags": AVX512 - {"hypervisor", "constant_tsc"}}) == key
    assert isa_flags(AVX512) == ["avx2", "avx512_vnni", "avx512f", "sse2"]


def fill(directory, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def test_pack_and_unpack_carry_the_cache_but_not_its_locks(tmp_path):
    source = CompileArtifacts(tmp_path / "a", "decode-x")
    fill(source.inductor_dir, {"fxgraph/ab/entry": b"graph", "cd/lib.so": b"\x7fELF" + bytes(300),
                               "locks/abc.lock": b"", "aotautograd/k/v": b"aot"})
    data = source.pack()
    target = CompileArtifacts(tmp_path / "b", "decode-x")
    fill(target.inductor_dir, {"stale": b"from before"})  # what was there is replaced whole
    assert target.unpack(data) == 3
    got = {str(p.relative_to(target.inductor_dir)): p.read_bytes()
           for p in target.inductor_dir.rglob("*") if p.is_file()}
    assert got == {"fxgraph/ab/entry": b"graph", "cd/lib.so": b"\x7fELF" + bytes(300), "aotautograd/k/v": b"aot"}
    assert target.complete() is None  # unpacking is not completing: the caller marks it
    target.mark_complete("cluster")
    assert target.complete()["source"] == "cluster"
    assert not [p for p in target.dir.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_unpack_refuses_a_path_outside_the_cache(tmp_path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("../../escaped")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    target = CompileArtifacts(tmp_path / "root", "decode-x")
    with pytest.raises(tarfile.TarError):
        target.unpack(buffer.getvalue())
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "root" / "escaped").exists()


class Bucket:
    """The ObjectBucket calls the module makes, over a dict."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.puts = 0

    async def get(self, name):
        return self.objects.get(name)

    async def info(self, name):
        return name if name in self.objects else None

    async def put(self, name, data, description=""):
        self.puts += 1
        self.objects[name] = data


async def test_the_first_compile_publishes_and_later_ones_fetch(tmp_path):
    bucket = Bucket()
    first = CompileArtifacts(tmp_path / "host1", "decode-k")
    assert not await fetch_from(bucket, first)  # nothing in the cluster yet
    fill(first.inductor_dir, {"fxgraph/e": b"entry", "x.so": b"lib"})
    assert await publish_to(bucket, first)
    assert not await publish_to(bucket, first)  # the cluster has them: not stored again
    assert bucket.puts == 1
    second = CompileArtifacts(tmp_path / "host2", "decode-k")
    assert await fetch_from(bucket, second)
    assert (second.inductor_dir / "x.so").read_bytes() == b"lib" and second.complete()["source"] == "cluster"


async def test_unusable_artifacts_leave_a_cold_compile(tmp_path):
    bucket = Bucket()
    bucket.objects["decode-k"] = b"not a tar"
    artifacts = CompileArtifacts(tmp_path, "decode-k")
    assert not await fetch_from(bucket, artifacts)
    assert artifacts.complete() is None

"""The compiled decode step's artifacts (shared/engine/compiled/artifacts.py): what the key depends
on, packing and unpacking a key's directory, and the fetch/offer rules against a store."""

from __future__ import annotations

import io
import tarfile

import pytest
import torch

from shared.engine.compiled.artifacts import CompileArtifacts, artifact_key, isa_flags, model_structure

AVX512 = frozenset({"fpu", "sse2", "avx2", "avx512f", "avx512_vnni", "hypervisor", "constant_tsc"})
BASE = dict(structure={"layers": 2}, block_size=16, threads=2, code="abc", torch_version="2.13.0+cpu", flags=AVX512)


def test_the_key_names_everything_the_compiled_code_depends_on():
    key = artifact_key(**BASE)
    assert key == artifact_key(**BASE) and key.startswith("decode-")
    for change in (dict(structure={"layers": 3}), dict(block_size=32), dict(threads=4), dict(code="abd"),
                   dict(torch_version="2.14.0+cpu"), dict(flags=AVX512 | {"amx_tile"}), dict(int8_kernel=True)):
        assert artifact_key(**{**BASE, **change}) != key, change
    # flags that do not change the instructions a compiler may emit do not split the cluster
    assert artifact_key(**{**BASE, "flags": AVX512 - {"hypervisor", "constant_tsc"}}) == key
    assert isa_flags(AVX512) == ["avx2", "avx512_vnni", "avx512f", "sse2"]


def test_the_structure_is_shapes_and_dtypes_not_values(tiny_engine_model):
    from shared.model.quant import Int8Weight

    structure = model_structure(tiny_engine_model)
    assert structure["cfg"]["num_layers"] == len(structure["layers"]) == tiny_engine_model.cfg.num_layers
    assert structure["layers"][0]["qkv"] == [list(tiny_engine_model.layers[0].qkv.shape), "torch.float32"]
    with torch.no_grad():
        tiny_engine_model.layers[0].qkv.add_(1.0)  # other weights of the same shapes: the same compiled step
    try:
        assert model_structure(tiny_engine_model) == structure
    finally:
        with torch.no_grad():
            tiny_engine_model.layers[0].qkv.sub_(1.0)
    weight = Int8Weight(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4))
    two_levels = Int8Weight(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4), act_levels=2)
    assert model_structure(weight) != model_structure(two_levels)  # another graph


def fill(directory, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def test_pack_and_unpack_carry_the_step_and_its_libraries_but_not_locks(tmp_path):
    source = CompileArtifacts(tmp_path / "a", "decode-x")
    fill(source.inductor_dir, {"fxgraph/ab/entry": b"graph", "cd/lib.so": b"\x7fELF" + bytes(300),
                               "locks/abc.lock": b""})
    source.save_function(b"the step", "compiled")
    data = source.pack()
    target = CompileArtifacts(tmp_path / "b", "decode-x")
    fill(target.inductor_dir, {"stale": b"from before"})  # what was there is replaced whole
    assert target.complete() is None
    assert target.unpack(data) == 3
    got = {str(p.relative_to(target.inductor_dir)): p.read_bytes()
           for p in target.inductor_dir.rglob("*") if p.is_file()}
    assert got == {"fxgraph/ab/entry": b"graph", "cd/lib.so": b"\x7fELF" + bytes(300)}
    assert target.function_path.read_bytes() == b"the step" and target.complete()["source"] == "cluster"
    assert not [p for p in target.dir.iterdir() if p.name.startswith(".")]  # no staging left behind


def tar_of(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_unpack_refuses_a_path_outside_the_directory_or_no_step(tmp_path):
    target = CompileArtifacts(tmp_path / "root", "decode-x")
    with pytest.raises(tarfile.TarError):
        target.unpack(tar_of({"decode.bin": b"x", "../../escaped": b"bad"}))
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "root" / "escaped").exists()
    with pytest.raises(tarfile.TarError, match="no decode.bin"):
        target.unpack(tar_of({"inductor/x.so": b"lib"}))
    assert target.complete() is None


class Store:
    """An ArtifactStore over a dict."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.puts = 0

    def get(self, key):
        return self.objects.get(key)

    def has(self, key):
        return key in self.objects

    def put(self, key, data):
        self.puts += 1
        self.objects[key] = data


def test_the_first_machine_offers_and_later_ones_fetch(tmp_path):
    store = Store()
    first = CompileArtifacts(tmp_path / "host1", "decode-k")
    assert not first.fetch(store)  # nothing in the cluster yet
    fill(first.inductor_dir, {"x.so": b"lib"})
    first.save_function(b"step", "compiled")
    assert first.offer(store)
    assert not first.offer(store)  # the cluster has it: not stored again
    assert store.puts == 1
    second = CompileArtifacts(tmp_path / "host2", "decode-k")
    assert second.fetch(store)
    assert (second.inductor_dir / "x.so").read_bytes() == b"lib" and second.complete()["source"] == "cluster"


def test_unusable_artifacts_leave_a_compile_here(tmp_path):
    store = Store()
    store.objects["decode-k"] = b"not a tar"
    artifacts = CompileArtifacts(tmp_path, "decode-k")
    assert not artifacts.fetch(store)
    assert artifacts.complete() is None

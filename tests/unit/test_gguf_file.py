"""shared.model.gguf_file reads what the ``gguf`` package writes exactly as the package's own reader
does: every metadata value, every tensor's type, shape and bytes; and a damaged file is a clear
error, not a crash or a silent short read."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from shared.model.gguf_file import read_gguf


def _package_view(path):
    reader = gguf.GGUFReader(str(path))
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return metadata, reader.tensors


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Every metadata type, and float, integer and block-quantized tensors (rows of 64)."""
    path = tmp_path_factory.mktemp("gguf") / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -3000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.15625)
    w.add_float64("t.f64", 1e-300)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁wörld")
    w.add_array("t.strs", ["", "a", "Ġthe", "<|im_end|>", "ünï"])
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64), dtype=np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 64)).astype(np.float16))
    w.add_tensor("i32", np.arange(10, dtype=np.int32))
    for kind in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.BF16):
        raw = gguf.quants.quantize(rng.standard_normal((4, 64), dtype=np.float32), kind)
        w.add_tensor(kind.name.lower(), raw, raw_shape=raw.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_metadata_equals_the_gguf_packages_reading(written):
    metadata, _ = _package_view(written)
    ours = read_gguf(written)
    assert ours.version == 3
    assert ours.metadata == metadata
    assert ours.get("t.strs") == ["", "a", "Ġthe", "<|im_end|>", "ünï"]
    assert ours.get("t.u64") == 2**63 + 5 and ours.get("t.bool") is True
    assert ours.get("missing", 42) == 42


def test_tensors_equal_the_gguf_packages_reading(written):
    _, tensors = _package_view(written)
    ours = read_gguf(written)
    assert [t.name for t in ours.tensors] == [t.name for t in tensors]
    for theirs, mine in zip(tensors, ours.tensors):
        assert mine.tensor_type == theirs.tensor_type.value, mine.name
        assert mine.dims == tuple(int(d) for d in theirs.shape), mine.name
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        assert np.array_equal(mine.data, theirs.data), mine.name
    q8 = next(t for t in ours.tensors if t.name == "q8_0")
    assert q8.shape == (4, 64)
    assert gguf.quants.dequantize(q8.data, gguf.GGMLQuantizationType.Q8_0).shape == (4, 64)


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(path)


def test_a_truncated_file_is_an_error_naming_what_ran_past_the_end(written, tmp_path):
    data = written.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])  # the last tensor loses its tail
    with pytest.raises(ValueError, match="truncated GGUF .*tensor bf16"):
        read_gguf(cut)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:200])  # inside the metadata
    with pytest.raises(ValueError, match="truncated GGUF .*header"):
        read_gguf(header_only)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        read_gguf(empty)


def test_the_real_model_file_reads_as_the_package_reads_it(smollm2_gguf):
    metadata, tensors = _package_view(smollm2_gguf)
    ours = read_gguf(smollm2_gguf)
    assert ours.metadata == metadata
    assert len(ours.get("tokenizer.ggml.tokens")) == 49152
    assert [(t.name, t.data.shape) for t in ours.tensors] == [(t.name, t.data.shape) for t in tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, tensors))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_block_formats_dequantize_to_the_gguf_packages_floats_bit_for_bit(kind):
    from shared.model.loader import _dequantize_blocks

    kind = gguf.GGMLQuantizationType[kind]
    x = np.random.default_rng(1).standard_normal((3, 5, 128), dtype=np.float32) * 4 + 0.5
    raw = gguf.quants.quantize(x, kind)
    ours = _dequantize_blocks(raw, kind.value).numpy()
    assert ours.shape == x.shape
    assert np.array_equal(ours, gguf.quants.dequantize(raw, kind))

"""A GGUF file's metadata and tensor views, read straight from a memory map.

The ``gguf`` package's reader builds a numpy view for every part of every metadata value, which
costs about 3 s of CPU for SmolLM2's 49k-token vocabulary and 48k merges, paid once by the model
loader and again by the tokenizer in each process that opens the file. Here each value is decoded
once with ``struct`` (strings) or ``np.frombuffer`` (numeric arrays): tens of milliseconds.

Format (little-endian, versions 2 and 3): magic ``GGUF``, uint32 version, uint64 tensor count,
uint64 metadata count; the metadata as (string key, uint32 type, value); one info per tensor
(string name, uint32 dims, uint64 dims in ggml order — innermost first —, uint32 ggml type,
uint64 offset); then the tensor data, starting at the next multiple of ``general.alignment``
(default 32). A string is a uint64 byte count and UTF-8 bytes; an array is a uint32 element type,
a uint64 count and the elements.

Tensor ``data`` is laid out as the ``gguf`` package lays it out, so ``gguf.quants.dequantize``
takes it as it is: float and integer types as typed arrays of the tensor's shape (outermost
first), quantized types as uint8 rows of the row's bytes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# metadata value types
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
_SCALARS = {_UINT8: "B", _INT8: "b", _UINT16: "H", _INT16: "h", _UINT32: "I", _INT32: "i",
            _FLOAT32: "f", _BOOL: "?", _UINT64: "Q", _INT64: "q", _FLOAT64: "d"}
_NUMPY = {_UINT8: np.uint8, _INT8: np.int8, _UINT16: np.uint16, _INT16: np.int16, _UINT32: np.uint32,
          _INT32: np.int32, _FLOAT32: np.float32, _BOOL: np.bool_, _UINT64: np.uint64, _INT64: np.int64,
          _FLOAT64: np.float64}

# ggml tensor types stored as plain typed elements (the rest are blocks of bytes)
_PLAIN_TENSOR_TYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32,
                       27: np.int64, 28: np.float64}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: int          # a ggml type (``gguf.GGMLQuantizationType`` value)
    dims: tuple[int, ...]     # ggml order: innermost first
    data: np.ndarray          # read-only view into the file (see the module docstring)

    @property
    def shape(self) -> tuple[int, ...]:
        """Outermost first, as torch and numpy order it."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GgufFile:
    version: int
    metadata: dict[str, object]   # str, int, float, bool, or a list of them
    tensors: list[GgufTensor]

    def get(self, key: str, default: object = None) -> object:
        return self.metadata.get(key, default)


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF (a string runs past the end of the file)")
        text = bytes(self.buf[self.pos:end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, kind: int) -> object:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise ValueError(f"{self.path}: unknown GGUF metadata type {kind} at byte {self.pos}")
        return self.scalar(fmt)

    def array(self) -> list:
        kind, count = self.scalar("I"), self.scalar("Q")
        if kind == _STRING:
            buf, pos, out = self.buf, self.pos, []
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                out.append(bytes(buf[pos:pos + n]).decode("utf-8", errors="replace"))
                pos += n
            self.pos = pos
            return out
        if kind in _NUMPY:
            dtype = np.dtype(_NUMPY[kind]).newbyteorder("<")
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += values.nbytes
            return values.tolist()
        return [self.value(kind) for _ in range(count)]  # arrays of arrays


def read_gguf(path: Path | str) -> GgufFile:
    """Parse ``path``'s header; tensor data stays in the (read-only) memory map."""
    path = Path(path)
    with open(path, "rb") as f:
        if not path.stat().st_size:
            raise ValueError(f"{path} is empty, not a GGUF file")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(buf, path)
    except struct.error:
        raise ValueError(f"{path}: truncated GGUF (its header runs past the end of the file)") from None


def _parse(buf, path: Path) -> GgufFile:
    if buf[:4] != MAGIC:
        raise ValueError(f"{path} is not a GGUF file (magic {bytes(buf[:4])!r})")
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.scalar("I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are; "
                         "a big-endian file also reads as an unknown version)")
    num_tensors, num_kv = cur.scalar("Q"), cur.scalar("Q")
    metadata: dict[str, object] = {}
    for _ in range(num_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("I"))
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = tuple(cur.scalar("Q") for _ in range(cur.scalar("I")))
        infos.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cur.pos // alignment) * alignment
    whole = np.frombuffer(buf, dtype=np.uint8)
    tensors = [GgufTensor(name, kind, dims, _tensor_view(whole, start + offset, kind, dims, path, name))
               for name, dims, kind, offset in infos]
    return GgufFile(version, metadata, tensors)


def _tensor_view(whole: np.ndarray, offset: int, kind: int, dims: tuple[int, ...], path: Path,
                 name: str) -> np.ndarray:
    shape = tuple(reversed(dims))
    n = int(np.prod(dims)) if dims else 1
    if kind in _PLAIN_TENSOR_TYPES:
        dtype = np.dtype(_PLAIN_TENSOR_TYPES[kind])
        nbytes, byte_shape = n * dtype.itemsize, None
    else:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except ValueError:
            raise ValueError(f"{path}: tensor {name} has unknown ggml type {kind}") from None
        if shape[-1] % block:
            raise ValueError(f"{path}: tensor {name}'s rows ({shape[-1]}) are not whole blocks of {block}")
        byte_shape = (*shape[:-1], shape[-1] // block * block_bytes)
        nbytes, dtype = n // block * block_bytes, np.dtype(np.uint8)
    if offset + nbytes > len(whole):
        raise ValueError(f"{path}: truncated GGUF (tensor {name} runs past the end of the file)")
    raw = whole[offset:offset + nbytes]
    return raw.reshape(byte_shape) if byte_shape is not None else raw.view(dtype).reshape(shape)

"""A bounds-checked GGUF reader: header, metadata and the tensor table.

Every count, length and offset is checked against the file's size before it
is used, so a damaged file is a ``ValueError`` naming the problem, never a
crash (MLX's own GGUF reader trusts the header and segfaults on damaged
counts). Tensor data is not read here: ``GGUFFile.tensor_bytes`` gives a
zero-copy numpy view of one tensor's bytes in the memory-mapped file.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_MAX_COUNT = 1 << 24  # far above any real model's tensor or key count
_MAX_DIMS = 4

# ggml tensor type -> (name, elements per block, bytes per block)
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str
    shape: tuple[int, ...]  # row-major (numpy) order: GGUF lists dims innermost first
    offset: int  # absolute byte offset in the file
    nbytes: int


class _Reader:
    def __init__(self, buf, path):
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, what: str):
        raise ValueError(f"{self.path} is not a valid GGUF file: {what} (byte {self.pos})")

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > len(self.buf):
            self.fail(f"{what} extends past the end of the file (truncated or corrupt)")
        start = self.pos
        self.pos += n
        return start

    def unpack(self, fmt: str, what: str):
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what + " length")
        start = self.take(n, what)
        return bytes(self.buf[start:start + n]).decode("utf-8", errors="replace")

    def strings(self, count: int, what: str) -> list[str]:
        """A string array: the hot part of a vocabulary, so a tight loop."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        if count > (end - pos) // 8:
            self.fail(f"{what} claims {count} strings")
        out = []
        append = out.append
        for _ in range(count):
            n = int.from_bytes(buf[pos:pos + 8], "little")
            pos += 8
            if pos + n > end:
                self.pos = pos
                self.fail(f"{what} string extends past the end of the file (truncated or corrupt)")
            append(buf[pos:pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, what: str):
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype = self.unpack("<I", what + " element type")
            count = self.unpack("<Q", what + " element count")
            if etype == _STRING:
                return self.strings(count, what)
            if etype not in _NUMPY_DTYPES:
                self.fail(f"{what} has unknown array element type {etype}")
            dtype = np.dtype(_NUMPY_DTYPES[etype])
            start = self.take(count * dtype.itemsize, what + " array")
            return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).copy()
        if vtype not in _SCALAR_FORMATS:
            self.fail(f"{what} has unknown value type {vtype}")
        return self.unpack(_SCALAR_FORMATS[vtype], what)


class GGUFFile:
    """An open GGUF file: ``metadata`` (dict), ``tensors`` (name -> TensorInfo)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        if size < 24:
            raise ValueError(f"{self.path} is not a valid GGUF file: only {size} bytes")
        with open(self.path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse(size)
        except BaseException:
            self._mmap.close()
            raise

    def _parse(self, size: int) -> None:
        r = _Reader(self._mmap, self.path)
        if bytes(self._mmap[:4]) != b"GGUF":
            r.fail("bad magic")
        r.pos = 4
        version = r.unpack("<I", "version")
        if version not in (2, 3):
            r.fail(f"unsupported version {version}")
        n_tensors = r.unpack("<Q", "tensor count")
        n_kv = r.unpack("<Q", "metadata count")
        if n_tensors > _MAX_COUNT or n_kv > _MAX_COUNT:
            r.fail(f"implausible counts ({n_tensors} tensors, {n_kv} metadata keys)")
        self.metadata: dict = {}
        for _ in range(n_kv):
            key = r.string("metadata key")
            vtype = r.unpack("<I", "metadata type")
            self.metadata[key] = r.value(vtype, f"metadata value {key[:64]!r}")
        alignment = self.metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            r.fail("general.alignment is not a power of two")
        infos = []
        for _ in range(n_tensors):
            name = r.string("tensor name")
            n_dims = r.unpack("<I", "tensor dimension count")
            if not 1 <= n_dims <= _MAX_DIMS:
                r.fail(f"tensor {name[:64]!r} has {n_dims} dimensions")
            dims = [r.unpack("<Q", "tensor dimension") for _ in range(n_dims)]
            if any(d == 0 or d > _MAX_COUNT * 64 for d in dims):
                r.fail(f"tensor {name[:64]!r} has dimensions {dims}")
            ttype = r.unpack("<I", "tensor type")
            offset = r.unpack("<Q", "tensor offset")
            if ttype not in GGML_TYPES:
                r.fail(f"tensor {name[:64]!r} has unknown type {ttype}")
            type_name, block, block_bytes = GGML_TYPES[ttype]
            if dims[0] % block:
                r.fail(f"tensor {name[:64]!r} rows of {dims[0]} are not whole {type_name} blocks")
            if offset % alignment:
                r.fail(f"tensor {name[:64]!r} offset {offset} is not aligned")
            count = int(np.prod(dims, dtype=np.int64))
            infos.append((name, type_name, tuple(reversed(dims)), offset, count // block * block_bytes))
        data_start = (r.pos + alignment - 1) // alignment * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, type_name, shape, offset, nbytes in infos:
            if data_start + offset + nbytes > size:
                raise ValueError(
                    f"{self.path} is not a valid GGUF file: tensor {name!r} needs bytes up to "
                    f"{data_start + offset + nbytes} but the file has {size} (truncated?)"
                )
            if name in self.tensors:
                raise ValueError(f"{self.path} is not a valid GGUF file: tensor {name!r} appears twice")
            self.tensors[name] = TensorInfo(name, type_name, shape, data_start + offset, nbytes)

    def tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        """The tensor's raw bytes as a read-only uint8 view of the mapped file."""
        return np.frombuffer(self._mmap, dtype=np.uint8, count=info.nbytes, offset=info.offset)

"""Bounds-checked walk over a GGUF file's header before anything parses it.

MLX's GGUF reader trusts the header's counts and lengths: a damaged header
crashes the process. This walk reads every count, length and offset against
the file's size first and raises ``ValueError`` naming the problem.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_COUNT = 1 << 24  # far above any real model's tensor or key count
_MAX_DIMS = 4

# ggml tensor type -> (elements per block, bytes per block)
GGML_TYPES = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24),
    8: (32, 34), 9: (32, 36), 10: (256, 84), 11: (256, 110), 12: (256, 144),
    13: (256, 176), 14: (256, 210), 15: (256, 292), 16: (256, 66), 17: (256, 74),
    18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
    23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8),
    29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66), 39: (32, 17),
}


class _Reader:
    def __init__(self, buf, path):
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, what: str):
        raise ValueError(f"{self.path} is not a valid GGUF file: {what} (byte {self.pos})")

    def take(self, n: int, what: str):
        if n < 0 or self.pos + n > len(self.buf):
            self.fail(f"{what} extends past the end of the file (truncated or corrupt)")
        start = self.pos
        self.pos += n
        return start

    def u32(self, what):
        return struct.unpack_from("<I", self.buf, self.take(4, what))[0]

    def u64(self, what):
        return struct.unpack_from("<Q", self.buf, self.take(8, what))[0]

    def string(self, what) -> bytes:
        n = self.u64(what + " length")
        start = self.take(n, what)
        return bytes(self.buf[start:start + n])

    def value(self, vtype: int, what: str) -> object:
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype = self.u32(what + " element type")
            count = self.u64(what + " element count")
            if etype == _STRING:
                for _ in range(count):
                    n = self.u64(what + " string length")
                    self.take(n, what + " string")
            elif etype in _SCALAR_SIZES:
                self.take(count * _SCALAR_SIZES[etype], what + " array")
            else:
                self.fail(f"{what} has unknown array element type {etype}")
            return None
        if vtype not in _SCALAR_SIZES:
            self.fail(f"{what} has unknown value type {vtype}")
        start = self.take(_SCALAR_SIZES[vtype], what)
        if vtype == 4:
            return struct.unpack_from("<I", self.buf, start)[0]
        return None


def check_gguf(path: str | Path) -> None:
    """Raise ValueError unless the header, metadata and tensor table are sound."""
    path = Path(path)
    size = path.stat().st_size
    if size < 24:
        raise ValueError(f"{path} is not a valid GGUF file: only {size} bytes")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        r = _Reader(buf, path)
        if bytes(buf[:4]) != b"GGUF":
            r.fail("bad magic")
        r.pos = 4
        version = r.u32("version")
        if version not in (2, 3):
            r.fail(f"unsupported version {version}")
        n_tensors = r.u64("tensor count")
        n_kv = r.u64("metadata count")
        if n_tensors > _MAX_COUNT or n_kv > _MAX_COUNT:
            r.fail(f"implausible counts ({n_tensors} tensors, {n_kv} metadata keys)")
        alignment = 32
        for _ in range(n_kv):
            key = r.string("metadata key")
            vtype = r.u32("metadata type")
            val = r.value(vtype, f"metadata value {key[:64]!r}")
            if key == b"general.alignment":
                if not isinstance(val, int) or val == 0 or val & (val - 1):
                    r.fail("general.alignment is not a power of two")
                alignment = val
        data_needed = 0
        for _ in range(n_tensors):
            name = r.string("tensor name")
            n_dims = r.u32("tensor dimension count")
            if not 1 <= n_dims <= _MAX_DIMS:
                r.fail(f"tensor {name[:64]!r} has {n_dims} dimensions")
            count = 1
            for _ in range(n_dims):
                d = r.u64("tensor dimension")
                if d == 0 or d > _MAX_COUNT * 64:
                    r.fail(f"tensor {name[:64]!r} has dimension {d}")
                count *= d
            ttype = r.u32("tensor type")
            offset = r.u64("tensor offset")
            if ttype not in GGML_TYPES:
                r.fail(f"tensor {name[:64]!r} has unknown type {ttype}")
            block, nbytes = GGML_TYPES[ttype]
            if count % block:
                r.fail(f"tensor {name[:64]!r} has {count} elements, not a multiple of {block}")
            if offset % alignment:
                r.fail(f"tensor {name[:64]!r} offset {offset} is not aligned")
            data_needed = max(data_needed, offset + count // block * nbytes)
        data_start = (r.pos + alignment - 1) // alignment * alignment
        if data_start + data_needed > size:
            raise ValueError(
                f"{path} is not a valid GGUF file: tensor data needs "
                f"{data_start + data_needed} bytes but the file has {size} (truncated?)"
            )

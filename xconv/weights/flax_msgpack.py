"""Flax ``msgpack`` variables files written and read one array at a time.

``flax.serialization.msgpack_serialize`` builds the whole file in memory and
``msgpack_restore`` needs it whole too (and copies each array out of it once more): three
copies of the weights for a moment. These write the same bytes and read the same tree while
holding one array at a time beyond the result; read arrays are 64-byte aligned, so JAX on
CPU takes them without another copy (``jax.device_put`` is zero-copy for aligned arrays).
"""

from __future__ import annotations

import math
import os
from typing import Any, BinaryIO

import numpy as np

_ALIGN = 64


def write_msgpack(tree: Any, f: BinaryIO) -> None:
    """Write ``tree`` exactly as ``flax.serialization.msgpack_serialize(tree)`` would."""
    import msgpack
    from flax import serialization

    if isinstance(tree, dict):
        f.write(msgpack.Packer().pack_map_header(len(tree)))
        for key in sorted(tree):  # jax's tree_map, inside msgpack_serialize, sorts keys
            f.write(msgpack.packb(key))
            write_msgpack(tree[key], f)
        return
    if (
        isinstance(tree, np.ndarray)
        and not tree.dtype.hasobject
        and tree.dtype.fields is None
        and tree.nbytes <= serialization.MAX_CHUNK_SIZE
    ):
        _write_array(tree, f)
        return
    f.write(serialization.msgpack_serialize(tree))


def _write_array(arr: np.ndarray, f: BinaryIO) -> None:
    """One ndarray as flax's ext type 1 ``(shape, dtype name, bin data)``, its data written
    straight from the array (one copy only when it is a non-contiguous view)."""
    import msgpack

    n = arr.nbytes
    head = b"\x93" + msgpack.packb(arr.shape) + msgpack.packb(arr.dtype.name)
    if n < 2**8:
        head += b"\xc4" + n.to_bytes(1, "big")
    elif n < 2**16:
        head += b"\xc5" + n.to_bytes(2, "big")
    else:
        head += b"\xc6" + n.to_bytes(4, "big")
    size = len(head) + n
    if size in (1, 2, 4, 8, 16):
        ext = bytes([0xD4 + size.bit_length() - 1])
    elif size < 2**8:
        ext = b"\xc7" + size.to_bytes(1, "big")
    elif size < 2**16:
        ext = b"\xc8" + size.to_bytes(2, "big")
    else:
        ext = b"\xc9" + size.to_bytes(4, "big")
    f.write(ext + b"\x01" + head)
    data = np.ascontiguousarray(arr)
    if data.size:
        f.write(memoryview(data.reshape(-1).view(np.uint8)))


class _Fallback(Exception):
    """Something this reader does not parse; the caller uses flax's reader."""


def read_msgpack(path: str | os.PathLike) -> Any:
    """Read a Flax msgpack variables file into nested dicts of aligned numpy arrays.

    Same result as ``flax.serialization.msgpack_restore(open(path, "rb").read())``; files
    with anything besides string-keyed maps of arrays go through flax's reader.
    """
    from flax import serialization

    with open(path, "rb") as f:
        try:
            tree = _read_value(f)
        except _Fallback:
            f.seek(0)
            return serialization.msgpack_restore(f.read())
    return serialization._unchunk_array_leaves_in_place(tree)


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise _Fallback("truncated")
    return data


def _uint(f: BinaryIO, n: int) -> int:
    return int.from_bytes(_read(f, n), "big")


def _read_value(f: BinaryIO) -> Any:
    b = _read(f, 1)[0]
    if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):
        n = b & 0x0F if b <= 0x8F else _uint(f, 2 if b == 0xDE else 4)
        out = {}
        for _ in range(n):
            key = _read_value(f)
            if not isinstance(key, str):
                raise _Fallback("non-string key")
            out[key] = _read_value(f)
        return out
    if 0xA0 <= b <= 0xBF or b in (0xD9, 0xDA, 0xDB):
        n = b & 0x1F if b <= 0xBF else _uint(f, {0xD9: 1, 0xDA: 2, 0xDB: 4}[b])
        return _read(f, n).decode("utf-8")
    if b in (0xC7, 0xC8, 0xC9) or 0xD4 <= b <= 0xD8:
        n = 1 << (b - 0xD4) if b >= 0xD4 else _uint(f, {0xC7: 1, 0xC8: 2, 0xC9: 4}[b])
        code = _read(f, 1)[0]
        if code != 1:  # scalars and complex numbers: small, flax decodes them
            from flax import serialization

            return serialization._msgpack_ext_unpack(code, _read(f, n))
        return _read_array(f, n)
    raise _Fallback(f"type byte {b:#x}")


def _read_array(f: BinaryIO, length: int) -> np.ndarray:
    """An ndarray ext payload: ``(shape, dtype name, bin data)``; the data read in place."""
    import msgpack
    from flax import serialization

    start = f.tell()
    head = f.read(min(length, 512))
    unpacker = msgpack.Unpacker(raw=True)
    unpacker.feed(head)
    if unpacker.read_array_header() != 3:
        raise _Fallback("ndarray payload")
    shape = tuple(unpacker.unpack())
    dtype = np.dtype(serialization._dtype_from_name(unpacker.unpack()))
    nbytes = math.prod(shape) * dtype.itemsize
    f.seek(start + length - nbytes)
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    offset = (-raw.ctypes.data) % _ALIGN
    buf = raw[offset : offset + nbytes]
    if f.readinto(memoryview(buf)) != nbytes:
        raise _Fallback("truncated array")
    return buf.view(dtype).reshape(shape)

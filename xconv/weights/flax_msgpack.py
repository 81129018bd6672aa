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
import sys
from typing import Any, BinaryIO

import numpy as np

_ALIGN = 64


#: Threads writing arrays of a variables file at their offsets (copies and writes release
#: the GIL); at most this many array copies exist at a time.
WRITERS = 4


def write_msgpack(tree: Any, f: BinaryIO) -> None:
    """Write ``tree`` exactly as ``flax.serialization.msgpack_serialize(tree)`` would.

    Every array's place in the file is known from the headers, so a real file gets its
    arrays written by :data:`WRITERS` threads at their offsets (``os.pwrite``); an array that
    is a view in another layout (a Flax kernel is a transposed view of the source's weight)
    is made contiguous by its thread (by torch when torch is loaded: about 3x numpy's speed
    for a transpose), so copies and writes overlap. Other streams are written in order.
    """
    pieces = list(_pieces(tree))
    try:
        fd = f.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        fd = None
    if fd is None:
        for piece in pieces:
            _write_piece(f, piece)
        return
    from concurrent.futures import ThreadPoolExecutor

    f.flush()
    offset = f.tell()
    jobs = []
    for piece in pieces:
        if isinstance(piece, np.ndarray):
            jobs.append((piece, offset))
            offset += piece.nbytes
        else:
            os.pwrite(fd, piece, offset)
            offset += len(piece)
    with ThreadPoolExecutor(WRITERS, thread_name_prefix="xconv-msgpack") as pool:
        for done in [pool.submit(_pwrite_array, fd, arr, at) for arr, at in jobs]:
            done.result()
    f.seek(offset)


def _write_piece(f: BinaryIO, piece: bytes | np.ndarray) -> None:
    if isinstance(piece, np.ndarray):
        data = _contiguous(piece)
        if data.size:
            f.write(memoryview(data.reshape(-1).view(np.uint8)))
    else:
        f.write(piece)


def _pwrite_array(fd: int, arr: np.ndarray, offset: int) -> None:
    data = _contiguous(arr)
    if not data.size:
        return
    view = memoryview(data.reshape(-1).view(np.uint8))
    while view:  # pwrite may write less than asked (Linux caps one call near 2 GiB)
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _pieces(tree: Any):
    """The file as a sequence of byte strings and arrays (each array's data comes after its
    own header piece)."""
    import msgpack
    from flax import serialization

    if isinstance(tree, dict):
        yield msgpack.Packer().pack_map_header(len(tree))
        for key in sorted(tree):  # jax's tree_map, inside msgpack_serialize, sorts keys
            yield msgpack.packb(key)
            yield from _pieces(tree[key])
        return
    if (
        isinstance(tree, np.ndarray)
        and not tree.dtype.hasobject
        and tree.dtype.fields is None
        and tree.nbytes <= serialization.MAX_CHUNK_SIZE
    ):
        yield _array_header(tree)
        yield tree
        return
    yield serialization.msgpack_serialize(tree)


def _contiguous(arr: np.ndarray) -> np.ndarray:
    """``arr`` in C order; a strided view is copied by torch when it is loaded (parallel,
    cache-blocked) and by numpy otherwise."""
    if arr.flags.c_contiguous:
        return arr
    torch = sys.modules.get("torch")
    if torch is not None and arr.dtype.kind in "fiub" and arr.dtype.itemsize in (1, 2, 4, 8):
        try:
            out = torch.from_numpy(arr).contiguous().numpy()
        except (TypeError, ValueError, RuntimeError):  # a dtype or stride torch does not take
            pass
        else:
            if out.dtype == arr.dtype:
                return out
    return np.ascontiguousarray(arr)


def _array_header(arr: np.ndarray) -> bytes:
    """The ext type 1 header ``(shape, dtype name, bin header)`` of one ndarray, as flax
    writes it; the array's data follows it."""
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
    return ext + b"\x01" + head


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

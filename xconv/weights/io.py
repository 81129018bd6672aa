"""Checkpoint files in and out, as flat ``{name: np.ndarray}`` maps, shard by shard.

Formats (:func:`detect_format`):

* ``torch``: ``.pt`` / ``.pth`` / ``.bin`` / ``.ckpt`` read with ``torch.load(weights_only=True)``;
  a full pickle is only unpickled with ``trust_pickle=True`` (it runs code from the file).
* ``safetensors``: ``.safetensors`` memory-mapped through ``safetensors.safe_open``; a sharded
  checkpoint is its ``*.index.json`` (``{"weight_map": {name: shard file}}``), read one shard
  at a time.
* ``msgpack``: Flax ``flax.serialization`` msgpack (a nested tree; names are ``/``-joined paths).
* ``orbax``: an Orbax checkpoint directory (``StandardCheckpointer``).
* ``npz``: ``numpy.savez`` archives (``allow_pickle=False``).

Names are flat: torch keys as they are (``layer1.0.conv1.weight``), Flax trees as
``/``-joined paths (``params/conv1/kernel``). Writers take a flat map or a nested tree and are
atomic: they write a temporary file (or folder) beside the target, then rename it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from xconv.errors import ConversionError, InvalidModelError, UsageError, WeightsError, require

FORMATS = ("torch", "safetensors", "msgpack", "orbax", "npz")
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
SEP = "/"
#: npz entry recording the dtypes numpy cannot store (bfloat16, float8), as JSON.
_NPZ_DTYPES = "__xconv_dtypes__"

Flat = dict[str, np.ndarray]


def detect_format(path: str | os.PathLike) -> str:
    """The checkpoint format of ``path`` from its suffix (a folder is an Orbax checkpoint)."""
    p = Path(path)
    name = p.name.lower()
    if p.is_dir() or (not p.exists() and not p.suffix):
        return "orbax"
    if name.endswith(".index.json") or name.endswith(".safetensors"):
        return "safetensors"
    if name.endswith(".msgpack"):
        return "msgpack"
    if name.endswith(".npz"):
        return "npz"
    if name.endswith(TORCH_SUFFIXES):
        return "torch"
    raise ConversionError(
        f"cannot tell the checkpoint format of {p.name!r} from its name; known suffixes: "
        ".pt .pth .bin .ckpt (torch), .safetensors / .index.json (safetensors), .msgpack, "
        ".npz, or an Orbax checkpoint folder"
    )


# ------------------------------------------------------------------ trees


def flatten(tree: Mapping[str, Any], prefix: str = "") -> Flat:
    """``{"params": {"fc": {"kernel": a}}}`` -> ``{"params/fc/kernel": a}`` (arrays as numpy)."""
    out: Flat = {}
    for key, value in tree.items():
        name = f"{prefix}{SEP}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten(value, name))
        else:
            out[name] = to_numpy(value)
    return out


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`flatten`: split each name on ``/``."""
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split(SEP)
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConversionError(f"checkpoint name {name!r} nests under a tensor")
        node[leaf] = value
    return tree


def _kind(dtype: Any) -> str:
    kind = np.dtype(dtype).kind if not str(dtype).startswith(("bfloat16", "float8")) else "f"
    return {"f": "float", "V": "float", "c": "complex", "b": "bool"}.get(kind, "int")


def check_fits(expected: Mapping[str, Any], got: Mapping[str, Any], where: str) -> None:
    """Raise a WeightsError naming every missing, unexpected, mis-shaped and mis-typed entry.

    Args:
        expected: A nested tree (or flat map) of what the model needs: arrays or anything
            with ``.shape`` and ``.dtype`` (``jax.ShapeDtypeStruct``).
        got: The checkpoint, nested or flat.
        where: The checkpoint's path, for the message.
    """

    def leaves(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            name = f"{prefix}{SEP}{key}" if prefix else str(key)
            out.update(leaves(value, name) if isinstance(value, Mapping) else {name: value})
        return out

    want, have = leaves(expected), leaves(got)
    common = set(want) & set(have)

    def shape(v):
        return tuple(getattr(v, "shape", np.shape(v)))

    problems = {
        "missing": sorted(set(want) - set(have)),
        "unexpected": sorted(set(have) - set(want)),
        "mis-shaped": sorted(k for k in common if shape(want[k]) != shape(have[k])),
        "mis-typed": sorted(
            k
            for k in common
            if _kind(getattr(want[k], "dtype", "float32"))
            != _kind(getattr(have[k], "dtype", np.asarray(have[k]).dtype))
        ),
    }
    parts = []
    for label, keys in problems.items():
        if keys:
            more = f" (+{len(keys) - 5} more)" if len(keys) > 5 else ""
            parts.append(f"{label}: {keys[:5]}{more}")
    if parts:
        raise WeightsError(f"{where} does not fit the module: {'; '.join(parts)}")


def to_numpy(value: Any) -> np.ndarray:
    """A numpy array from a numpy / jax / torch array, keeping the dtype (bfloat16 included)."""
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.startswith("torch"):
        t = value.detach().cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        if str(t.dtype) == "torch.bfloat16":
            import ml_dtypes
            import torch

            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(value)


def _contiguous(a: np.ndarray) -> np.ndarray:
    # Not np.ascontiguousarray: it turns 0-d arrays (num_batches_tracked) into shape (1,).
    return a if a.flags.c_contiguous else a.copy(order="C")


def to_torch(array: np.ndarray):
    """A torch tensor sharing nothing with ``array`` (bfloat16 kept)."""
    import torch

    arr = _contiguous(np.asarray(array))
    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(arr.copy())


# ------------------------------------------------------------------ readers


def iter_shards(path: str | os.PathLike, *, trust_pickle: bool = False) -> Iterator[Flat]:
    """Yield the checkpoint one shard at a time (one dict for unsharded files).

    Safetensors shards are memory-mapped: each array is read when the shard is yielded and
    released when the caller drops it, so peak memory is about one shard.
    """
    p = Path(path)
    if not p.exists():
        raise InvalidModelError(f"no such checkpoint: {p}")
    fmt = detect_format(p)
    if fmt == "safetensors":
        for shard in safetensors_shards(p):
            yield _read_safetensors(shard)
    else:
        yield _READERS[fmt](p, trust_pickle)


def iter_checkpoint(path: str | os.PathLike, *, trust_pickle: bool = False):
    """Yield ``(name, array)`` pairs, shard by shard."""
    for shard in iter_shards(path, trust_pickle=trust_pickle):
        while shard:
            name = next(iter(shard))
            yield name, shard.pop(name)


def read_checkpoint(path: str | os.PathLike, *, trust_pickle: bool = False) -> Flat:
    """The whole checkpoint as a flat ``{name: np.ndarray}``."""
    out: Flat = {}
    for shard in iter_shards(path, trust_pickle=trust_pickle):
        out.update(shard)
    return out


def checkpoint_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]] | None:
    """``{name: shape}`` from the headers alone (safetensors); None for formats without one."""
    p = Path(path)
    if not p.exists():
        raise InvalidModelError(f"no such checkpoint: {p}")
    if detect_format(p) != "safetensors":
        return None
    safetensors = require("safetensors", "safetensors")
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in safetensors_shards(p):
        try:
            with safetensors.safe_open(str(shard), framework="numpy") as f:
                for name in f.keys():  # noqa: SIM118
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except Exception as e:
            raise InvalidModelError(f"{shard} is not a readable safetensors file: {e}") from e
    return shapes


def safetensors_shards(path: Path) -> list[Path]:
    """The shard files of a safetensors checkpoint (the file itself when unsharded)."""
    if not path.name.lower().endswith(".json"):
        return [path]
    try:
        index = json.loads(path.read_text())
        weight_map = index["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidModelError(f"{path} is not a safetensors index (no weight_map): {e}") from e
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v for k, v in weight_map.items()
    ):
        raise InvalidModelError(
            f"{path} is not a safetensors index: its weight_map must map tensor names to shard "
            "file names"
        )
    shards = sorted(set(weight_map.values()))
    files = [path.parent / s for s in shards]
    outside = [s for s, f in zip(shards, files, strict=True)
               if f.resolve().parent != path.parent.resolve()]  # fmt: skip
    if outside:
        raise InvalidModelError(
            f"{path} names shard files outside its folder: {outside[:3]}; shards must sit "
            "beside the index"
        )
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise InvalidModelError(f"{path} names shard files that do not exist: {missing}")
    return files


def _read_safetensors(path: Path) -> Flat:
    safetensors = require("safetensors", "safetensors")
    out: Flat = {}
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                out[name] = f.get_tensor(name)
    except (TypeError, ValueError) as e:
        if "bfloat16" not in str(e) and "BF16" not in str(e):
            raise InvalidModelError(f"{path} is not a readable safetensors file: {e}") from e
        # numpy has no bfloat16: read through torch, then view as ml_dtypes.bfloat16.
        with safetensors.safe_open(str(path), framework="pt") as f:
            out = {name: to_numpy(f.get_tensor(name)) for name in f.keys()}  # noqa: SIM118
    except Exception as e:
        raise InvalidModelError(f"{path} is not a readable safetensors file: {e}") from e
    return out


def _read_torch(path: Path, trust_pickle: bool) -> Flat:
    torch = require("torch", "torch")
    import pickle

    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # The weights-only unpickler refuses any class but tensors and plain containers
        # ("Unsupported global"); any other refusal is a corrupt file.
        if "Unsupported global" not in str(e):
            raise InvalidModelError(
                f"{path} is corrupt or not a PyTorch file (refused by the weights-only "
                f"unpickler: {str(e).strip().splitlines()[0][:200] if str(e).strip() else e!r})"
            ) from e
        if not trust_pickle:
            raise UsageError(
                f"{path} holds pickled Python objects beyond tensors; loading it runs code "
                "from the file",
                missing=[("--trust-pickle", "only if you trust it (trust_pickle=True)")],
            ) from e
        obj = torch.load(str(path), map_location="cpu", weights_only=False)
    except Exception as e:
        raise InvalidModelError(f"{path} is not a readable PyTorch file: {e}") from e
    if isinstance(obj, torch.nn.Module):
        obj = obj.state_dict()
    state = _find_state_dict(obj, torch)
    if state is None:
        raise InvalidModelError(f"{path} holds a {type(obj).__name__}, not a state_dict")
    return {k: to_numpy(v) for k, v in state.items()}


def _find_state_dict(obj: Any, torch) -> Mapping[str, Any] | None:
    if isinstance(obj, Mapping):
        if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            return obj
        for key in ("state_dict", "model_state_dict", "model", "module"):
            if isinstance(obj.get(key), Mapping):
                found = _find_state_dict(obj[key], torch)
                if found is not None:
                    return found
    return None


def _read_msgpack(path: Path, trust_pickle: bool) -> Flat:
    serialization = require("flax.serialization", "flax")
    try:
        tree = serialization.msgpack_restore(path.read_bytes())
    except Exception as e:
        raise InvalidModelError(f"{path} is not a readable Flax msgpack file: {e}") from e
    if not isinstance(tree, Mapping):
        raise InvalidModelError(f"{path} holds a {type(tree).__name__}, not a variable tree")
    return flatten(tree)


def _read_orbax(path: Path, trust_pickle: bool) -> Flat:
    """One Orbax checkpoint, or one written in parts (``path/part-00001``, ...: the sharded
    streams of ``xconv.sharding.stream``), read part by part."""
    ocp = require("orbax.checkpoint", "orbax")
    flat: Flat = {}
    try:
        with ocp.StandardCheckpointer() as ckptr:
            for part in sorted(path.glob("part-*")) or [path]:
                flat.update(flatten(ckptr.restore(part.absolute())))
    except Exception as e:
        raise InvalidModelError(f"{path} is not a readable Orbax checkpoint: {e}") from e
    return flat


def read_npz_inputs(path: str | os.PathLike) -> tuple[np.ndarray, ...]:
    """The arrays of an ``.npz`` inputs file, in file order (positional inputs); pickled
    object arrays are refused.

    Raises:
        InvalidModelError: The file is missing, corrupt, truncated or holds object arrays.
    """
    p = Path(path)
    if not p.is_file():
        raise InvalidModelError(f"no such inputs file: {p}")
    return tuple(_read_npz(p, False).values())


def _read_npz(path: Path, trust_pickle: bool) -> Flat:
    try:
        with np.load(path, allow_pickle=False) as data:
            if not hasattr(data, "files"):  # a bare .npy, not an archive
                raise ValueError("not an .npz archive")
            out = {k: np.array(data[k]) for k in data.files}
        dtypes = out.pop(_NPZ_DTYPES, None)
        if dtypes is not None:
            import ml_dtypes

            for name, dtype in json.loads(str(dtypes)).items():
                out[name] = out[name].view(getattr(ml_dtypes, dtype))
    except MemoryError as e:
        raise InvalidModelError(f"{path} declares arrays larger than memory: {e}") from e
    except Exception as e:
        raise InvalidModelError(f"{path} is not a readable .npz file: {_line(e)}") from e
    return out


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


_READERS: dict[str, Callable[[Path, bool], Flat]] = {
    "torch": _read_torch,
    "msgpack": _read_msgpack,
    "orbax": _read_orbax,
    "npz": _read_npz,
}


# ------------------------------------------------------------------ writers


def write_checkpoint(
    flat_or_tree: Mapping[str, Any],
    path: str | os.PathLike,
    format: str | None = None,  # noqa: A002 (the user-facing word)
    *,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write a flat map or nested tree to ``path`` atomically.

    Args:
        flat_or_tree: ``{name: array}`` or a nested dict of arrays (numpy, jax or torch).
        path: Target file (folder for Orbax; the ``*.index.json`` for sharded safetensors).
        format: One of ``FORMATS``; default: from ``path``'s suffix.
        max_shard_bytes: safetensors only: split into shards of at most this size, written
            as ``<stem>-00001-of-0000N.safetensors`` plus ``path`` as the index json.

    Returns:
        The path written: ``path``, or ``<path>.index.json`` for a sharded safetensors output.
    """
    p = Path(path)
    fmt = format or detect_format(p)
    if fmt not in FORMATS:
        raise ConversionError(f"unknown checkpoint format {fmt!r}; choose one of {list(FORMATS)}")
    flat = flatten(flat_or_tree)
    p.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors" and (max_shard_bytes or p.name.lower().endswith(".json")):
        if not p.name.lower().endswith(".json"):
            p = p.with_name(p.name + ".index.json")  # model.safetensors.index.json
        return write_sharded_safetensors(iter(_split(flat, max_shard_bytes)), p)
    if fmt == "orbax":
        _write_orbax(flat, p)
        return p
    _atomic(p, lambda tmp: _WRITERS[fmt](flat, tmp))
    return p


def write_sharded_safetensors(shards: Iterator[Flat], index_path: str | os.PathLike) -> Path:
    """Write shards as they come (one in memory at a time) plus the ``weight_map`` index.

    The shard count is unknown while streaming, so shards are named ``<stem>-0000K.safetensors``.
    """
    index = Path(index_path)
    stem = index.name.removesuffix(".json").removesuffix(".index").removesuffix(".safetensors")
    weight_map: dict[str, str] = {}
    total = 0
    for k, shard in enumerate(shards, start=1):
        name = f"{stem}-{k:05d}.safetensors"
        _atomic(index.parent / name, lambda tmp, s=shard: _write_safetensors(s, tmp))
        for key, arr in shard.items():
            weight_map[key] = name
            total += arr.nbytes
    body = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _atomic(index, lambda tmp: tmp.write_text(json.dumps(body, indent=2, sort_keys=True)))
    return index


def _split(flat: Flat, max_bytes: int | None) -> Iterator[Flat]:
    shard: Flat = {}
    size = 0
    for name, arr in flat.items():
        if shard and max_bytes and size + arr.nbytes > max_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = arr
        size += arr.nbytes
    if shard or not flat:
        yield shard


def _atomic(path: Path, write: Callable[[Path], Any]) -> None:
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_safetensors(flat: Flat, tmp: Path) -> None:
    numpy_st = require("safetensors.numpy", "safetensors")
    if any(a.dtype.name == "bfloat16" for a in flat.values()):
        torch_st = require("safetensors.torch", "safetensors")
        torch_st.save_file({k: to_torch(v) for k, v in flat.items()}, str(tmp))
        return
    numpy_st.save_file({k: _contiguous(v) for k, v in flat.items()}, str(tmp))


def _write_torch(flat: Flat, tmp: Path) -> None:
    torch = require("torch", "torch")
    torch.save({k: to_torch(v) for k, v in flat.items()}, str(tmp))


def _write_msgpack(flat: Flat, tmp: Path) -> None:
    serialization = require("flax.serialization", "flax")
    tmp.write_bytes(serialization.msgpack_serialize(unflatten(flat)))


def _write_npz(flat: Flat, tmp: Path) -> None:
    # npz has no bfloat16 / float8: store their bits, and their dtype names in a json entry.
    extra = {k: a.dtype.name for k, a in flat.items() if a.dtype.kind == "V"}
    arrays = {k: (a.view(f"u{a.itemsize}") if k in extra else a) for k, a in flat.items()}
    if extra:
        arrays[_NPZ_DTYPES] = np.asarray(json.dumps(extra, sort_keys=True))
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)


def _write_orbax(flat: Flat, path: Path) -> None:
    ocp = require("orbax.checkpoint", "orbax")
    parent = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        staged = parent / "ckpt"
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(staged.absolute(), unflatten(flat))
            ckptr.wait_until_finished()
        if path.exists():
            old = parent / "old"
            os.replace(path, old)
        os.replace(staged, path)
    finally:
        shutil.rmtree(parent, ignore_errors=True)


_WRITERS: dict[str, Callable[[Flat, Path], None]] = {
    "safetensors": _write_safetensors,
    "torch": _write_torch,
    "msgpack": _write_msgpack,
    "npz": _write_npz,
}

__all__ = [
    "FORMATS",
    "check_fits",
    "checkpoint_shapes",
    "detect_format",
    "flatten",
    "iter_checkpoint",
    "iter_shards",
    "read_checkpoint",
    "read_npz_inputs",
    "safetensors_shards",
    "to_numpy",
    "to_torch",
    "unflatten",
    "write_checkpoint",
    "write_sharded_safetensors",
]

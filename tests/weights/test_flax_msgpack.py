"""Streamed Flax msgpack: the same bytes as flax writes, the same tree as flax reads."""

from __future__ import annotations

import io

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import serialization

from xconv.weights.flax_msgpack import read_msgpack, write_msgpack


def _tree():
    rng = np.random.default_rng(0)
    return {
        "params": {
            "dense": {
                "kernel": rng.standard_normal((4, 3)).astype(np.float32).T,  # a view
                "bias": np.ones(3, np.float32),
            },
            "empty": {},
            "big": rng.standard_normal((300, 300)).astype(np.float32),
            "bf16": np.ones((5,), ml_dtypes.bfloat16),
        },
        "constants": {
            "ids": np.arange(5),
            "none": np.zeros((0, 3), np.float32),
            "scalar": np.float32(2),
            "zero_d": np.array(3.0),
            "one": np.ones(1, np.int8),
            "two": np.ones(2, np.int8),
            "mask": np.ones(3, bool),
        },
    }


def test_same_bytes_as_flax():
    f = io.BytesIO()
    write_msgpack(_tree(), f)
    assert f.getvalue() == serialization.msgpack_serialize(_tree())


def _views():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 5, 3, 2))
    return {
        "conv": w.astype(np.float16).transpose(2, 3, 1, 0),  # (O, I, kh, kw) -> (kh, kw, I, O)
        "f32": w.astype(np.float32).reshape(30, 6).T,
        "bf16": w.astype(ml_dtypes.bfloat16).reshape(30, 6).T,
        "ids": np.arange(12).reshape(3, 4).T,
        "mask": (w > 0).reshape(30, 6).T,
        "strided": w.astype(np.float32)[::2, :, ::-1],
    }


@pytest.mark.parametrize("torch_loaded", [True, False])
def test_views_written_like_flax(monkeypatch, tmp_path, torch_loaded):
    """Non-contiguous views are copied (by torch when loaded) one ahead of the write."""
    if torch_loaded:
        pytest.importorskip("torch")
    else:
        monkeypatch.setitem(__import__("sys").modules, "torch", None)
    f = io.BytesIO()
    write_msgpack(_views(), f)
    assert f.getvalue() == serialization.msgpack_serialize(_views())
    path = tmp_path / "v.msgpack"  # a real file: arrays written by threads at their offsets
    with open(path, "wb") as out:
        out.write(b"prefix")
        write_msgpack(_views(), out)
        out.write(b"suffix")
    assert path.read_bytes() == b"prefix" + f.getvalue() + b"suffix"


@pytest.mark.parametrize("writer", ["xconv", "flax"])
def test_reads_like_flax_and_aligned(tmp_path, writer):
    path = tmp_path / "v.msgpack"
    if writer == "flax":
        path.write_bytes(serialization.msgpack_serialize(_tree()))
    else:
        with open(path, "wb") as f:
            write_msgpack(_tree(), f)
    ours = read_msgpack(path)
    theirs = serialization.msgpack_restore(path.read_bytes())
    assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(theirs)
    for a, b in zip(
        jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs), strict=True
    ):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    kernel = ours["params"]["dense"]["kernel"]
    assert kernel.ctypes.data % 64 == 0
    # Aligned arrays go to JAX on CPU without a copy.
    assert (
        jax.device_put(ours["params"]["big"]).unsafe_buffer_pointer()
        == ours["params"]["big"].ctypes.data
    )

"""Checkpoint IO: every format round-trips bit-exactly; sharded safetensors; safe torch loads."""

from __future__ import annotations

import fractions
import json

import ml_dtypes
import numpy as np
import pytest
import torch

from xconv.errors import ConversionError, InvalidModelError
from xconv.weights import io


def _flat() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "params/fc/kernel": rng.standard_normal((4, 3)).astype(np.float32),
        "params/fc/bias": rng.standard_normal(3).astype(np.float32),
        "batch_stats/bn/mean": rng.standard_normal(5).astype(np.float16),
        "steps": np.array(7, dtype=np.int64),  # 0-d, like num_batches_tracked
        "half": rng.standard_normal(6).astype(ml_dtypes.bfloat16),
    }


@pytest.mark.parametrize(
    "name", ["w.msgpack", "w.npz", "w.safetensors", "w.pt", "w_orbax"], ids=str
)
def test_round_trip_bit_exact(tmp_path, name):
    flat = _flat()
    path = io.write_checkpoint(flat, tmp_path / name)
    back = io.read_checkpoint(path)
    assert set(back) == set(flat)
    for k, a in flat.items():
        assert back[k].dtype == a.dtype, k
        assert back[k].shape == a.shape, k
        assert back[k].tobytes() == a.tobytes(), k
    # atomic writers leave no temporary files behind
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_tree_in_tree_out(tmp_path):
    tree = {"params": {"fc": {"kernel": np.ones((2, 2), np.float32)}}}
    io.write_checkpoint(tree, tmp_path / "v.msgpack")
    assert list(io.read_checkpoint(tmp_path / "v.msgpack")) == ["params/fc/kernel"]
    assert io.unflatten(io.flatten(tree))["params"]["fc"]["kernel"].shape == (2, 2)


def test_sharded_safetensors_index(tmp_path):
    flat = {f"layer{i}.weight": np.full((64, 64), i, np.float32) for i in range(6)}
    index = io.write_checkpoint(flat, tmp_path / "model.safetensors", max_shard_bytes=40_000)
    assert index.name == "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    assert set(weight_map) == set(flat)
    shards = sorted(set(weight_map.values()))
    assert len(shards) == 3  # 16 KiB each, at most 40 kB per shard -> 2 per shard
    seen = []
    for shard in io.iter_shards(index):  # one shard at a time
        assert len(shard) == 2
        seen += list(shard)
    assert sorted(seen) == sorted(flat)
    assert io.checkpoint_shapes(index) == {k: (64, 64) for k in flat}
    back = io.read_checkpoint(index)
    assert all(np.array_equal(back[k], flat[k]) for k in flat)
    assert [n for n, _ in io.iter_checkpoint(index)] == seen


def test_sharded_index_with_missing_shard(tmp_path):
    (tmp_path / "m.index.json").write_text(json.dumps({"weight_map": {"a": "nope.safetensors"}}))
    with pytest.raises(InvalidModelError, match="do not exist"):
        io.read_checkpoint(tmp_path / "m.index.json")


def test_torch_pickle_needs_opt_in(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "meta": fractions.Fraction(1, 3)}, path)
    with pytest.raises(ConversionError, match="trust_pickle"):
        io.read_checkpoint(path)
    assert np.array_equal(io.read_checkpoint(path, trust_pickle=True)["w"], np.ones(2))


def test_torch_nested_state_dict_weights_only(tmp_path):
    path = tmp_path / "ckpt.pth"
    torch.save({"model": {"w": torch.arange(3.0).to(torch.bfloat16)}, "epoch": 3}, path)
    got = io.read_checkpoint(path)
    assert got["w"].dtype == ml_dtypes.bfloat16
    assert np.array_equal(got["w"].astype(np.float32), [0, 1, 2])


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(Exception):  # noqa: B017 (safetensors has no object dtype)
        io.write_checkpoint({"x": np.array([object()])}, tmp_path / "x.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_unknown_suffix():
    with pytest.raises(ConversionError, match="known suffixes"):
        io.detect_format("weights.h6")

"""Repeated blocks traced once (xconv.converters.torch.importer.repeat): used when the list's entries
are interchangeable and the forward runs them one after the other, the full trace otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from xconv.checkpoint import convert_checkpoint, from_checkpoint
from xconv.weights.shards import ShardWriter

torch = pytest.importorskip("torch")

_NET = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width, index, scale):
        super().__init__()
        self.index = index  # the entry's own index differs by design (like layer_idx)
        self.scale = scale
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x, shared):
        return x + self.fc(self.norm(x)) * shared * self.scale


class Net(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        width, n, self.kind = cfg["width"], cfg["layers"], cfg["kind"]
        scales = [2.0 if self.kind == "scaled" and i == n - 1 else 0.5 for i in range(n)]
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Block(width, i, s) for i, s in enumerate(scales))
        self.head = nn.Linear(width, 3)
        self.register_buffer("shared", torch.linspace(0.5, 1.5, width), persistent=False)
        self.n = n

    def forward(self, x):
        h = self.embed(x)
        if self.kind == "indexed":  # names every entry: the shortened list cannot run
            for i in range(self.n):
                h = self.blocks[i](h, self.shared)
        else:
            for i, block in enumerate(self.blocks):
                h = block(h, self.shared)
                if self.kind == "branch" and i == 0:
                    h = torch.tanh(h)  # glue between the first two entries only
        return self.head(h)


def make(cfg):
    return Net(cfg)
"""


def _checkpoint(tmp_path: Path, kind: str, layers: int = 5):
    """The factory file, its config and a two-shard checkpoint of a seeded build."""
    (tmp_path / "net.py").write_text(_NET)
    cfg = {"width": 16, "layers": layers, "kind": kind}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from xconv.factories import resolve_factory

    torch.manual_seed(0)
    net = resolve_factory(f"{tmp_path / 'net.py'}:make")(cfg).eval()
    state = {k: v.detach().numpy() for k, v in net.state_dict().items()}
    names = list(state)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        w = ShardWriter(
            ckpt / f"part-{i}.safetensors", [(n, state[n].shape, np.float32) for n in part]
        )
        for n in part:
            w.write(n, state[n])
        w.close()
    return (
        f"{tmp_path / 'net.py'}:make",
        str(ckpt / "part-*.safetensors"),
        tmp_path / "config.json",
        net,
    )


def test_uniform_list_is_traced_with_two_entries_and_converts_exactly(tmp_path):
    module, weights, config, net = _checkpoint(tmp_path, "uniform")
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    result = convert_checkpoint(
        module, weights, config=config, target="flax", out_dir=tmp_path / "out",
        example_inputs=(x,),
    )  # fmt: skip
    assert result.route == "traced blocks with 2 of 5 entries; entries 2..4 copied from entry 1"
    assert result.parity.passed, str(result.parity)
    names = [b["name"] for b in result.parity.blocks]
    assert [f"blocks.{i}" for i in range(5)] == [n for n in names if n.startswith("blocks.")]
    from xconv.pipeline import _load_generated

    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy()
    model, variables = _load_generated(tmp_path / "out" / "model.py").load(tmp_path / "out")
    got = model.apply(variables, x)
    got = np.asarray(got[0] if isinstance(got, tuple) else got)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("scaled", "blocks: scale differs between entries: [0.5, 0.5, 2.0]"),
        ("indexed", "the shortened blocks does not trace"),
        ("branch", "does not run blocks.0 then blocks.1 as consecutive blocks"),
    ],
)
def test_list_that_is_not_a_plain_repeat_falls_back_to_the_full_trace(tmp_path, kind, reason):
    """Entries that differ in a hyper-parameter, a forward indexing every entry, glue between
    entries: the full trace, with the reason in the route."""
    module, weights, config, _ = _checkpoint(tmp_path, kind, layers=3)
    x = (np.ones((1, 4), np.float32),)
    traced = from_checkpoint(module, weights, config=config, example_inputs=x)
    assert traced.route.startswith("full trace ("), traced.route
    assert reason in traced.route, traced.route
    scopes = {n.metadata_props.get("xconv.scope") or "" for n in traced.model.graph}
    assert any(s.startswith("blocks.2") for s in scopes)  # traced, not copied


def test_find_repeated_needs_one_class_and_equal_shapes():
    from torch import nn

    from xconv.converters.torch.importer.repeat import find_repeated

    mixed = nn.Module()
    mixed.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 8)])
    found, why = find_repeated(mixed)
    assert found is None and "entry 2 has other parameters/buffers than entry 0" in why
    mixed.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.ReLU()])
    found, why = find_repeated(mixed)
    assert found is None and "entry 2 is ReLU" in why
    same = nn.Module()
    same.short = nn.ModuleList([nn.Linear(4, 4)] * 2)  # nothing to gain under 3 entries
    same.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
    found, why = find_repeated(same)
    assert (found.path, found.length, why) == ("layers", 3, "")


def test_a_copy_that_fails_falls_back_to_the_full_trace(tmp_path, monkeypatch):
    import xconv.converters.torch.importer.repeat as repeat

    def broken(*args, **kwargs):
        raise RuntimeError("simulated")

    monkeypatch.setattr(repeat, "_replicate_ir", broken)
    module, weights, config, _ = _checkpoint(tmp_path, "uniform", layers=3)
    traced = from_checkpoint(
        module, weights, config=config, example_inputs=(np.ones((1, 4), np.float32),)
    )
    assert traced.route == "full trace (copying blocks failed: ['simulated'])"
    scopes = {n.metadata_props.get("xconv.scope") or "" for n in traced.model.graph}
    assert any(s.startswith("blocks.2") for s in scopes)

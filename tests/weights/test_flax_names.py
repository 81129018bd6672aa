"""The (scope, role) <-> Flax variable path rule and kernel layouts."""

from __future__ import annotations

import numpy as np
import pytest

from xconv.weights.flax_names import (
    flax_kernel_layout,
    flax_path,
    from_flax_kernel,
    identifier,
    module_name,
    raw_param_name,
    to_flax_kernel,
)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("layer1.0.conv1", "layer1_0_conv1"),
        ("Block_0/Conv_0", "Block_0_Conv_0"),
        ("0.weight", "m_0_weight"),
        ("class", "class_"),
        ("a..b", "a_b"),
    ],
)
def test_identifier(name, expected):
    assert identifier(name) == expected
    assert identifier(name).isidentifier()


@pytest.mark.parametrize(
    ("kind", "role", "expected"),
    [
        ("conv", "kernel", ("params", "layer1_0_conv1", "kernel")),
        ("batch_norm", "mean", ("batch_stats", "layer1_0_conv1", "mean")),
        ("batch_norm", "var", ("batch_stats", "layer1_0_conv1", "var")),
        ("batch_norm", "scale", ("params", "layer1_0_conv1", "scale")),
        ("batch_norm", "num_batches", None),
        ("embedding", "embedding", ("params", "layer1_0_conv1", "embedding")),
    ],
)
def test_flax_path(kind, role, expected):
    assert flax_path("layer1.0.conv1", role, kind) == expected


def test_unknown_role_is_an_error():
    with pytest.raises(KeyError):
        flax_path("fc", "mean", "dense")


@pytest.mark.parametrize(
    ("layout", "flax"), [("OIHW", "HWIO"), ("OI", "IO"), ("OIDHW", "DHWIO"), ("OIW", "WIO")]
)
def test_kernel_layouts_round_trip(layout, flax):
    assert flax_kernel_layout(layout) == flax
    a = np.random.default_rng(0).standard_normal(tuple(range(2, 2 + len(layout))))
    k = to_flax_kernel(a, layout)
    assert k.shape == tuple(a.shape[layout.index(c)] for c in flax)
    np.testing.assert_array_equal(from_flax_kernel(k, layout), a)


def test_conv_kernel_values():
    w = np.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5)  # O I H W
    k = to_flax_kernel(w, "OIHW")
    assert k[1, 2, 0, 1] == w[1, 0, 1, 2]


def test_module_and_raw_names():
    assert module_name("encoder.layers.0.self_attn") == "encoder_layers_0_self_attn"
    assert raw_param_name("encoder.pos_embed") == "encoder_pos_embed"

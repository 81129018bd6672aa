"""Torch backend nn and rnn handlers against ONNX's reference evaluator, plus autograd."""

from __future__ import annotations

import numpy as np
import pytest

from tests.converters.torch_backend.test_math import OpCase, check_case, f32, grad_check

IMG = f32(1, 2, 5, 6)
W = f32(3, 2, 3, 3)

CASES = [
    OpCase(
        "conv_same_strided",
        "Conv",
        [IMG, W, f32(3)],
        attrs={"auto_pad": "SAME_UPPER", "strides": [2, 2]},
        rtol=1e-4,
        atol=1e-5,
    ),  # fmt: skip
    OpCase(
        "conv_group_dilated",
        "Conv",
        [f32(1, 4, 7, 7), f32(4, 2, 2, 2)],
        attrs={"group": 2, "dilations": [2, 2], "pads": [1, 0, 0, 1]},
        rtol=1e-4,
        atol=1e-5,
    ),  # fmt: skip
    OpCase(
        "conv_transpose",
        "ConvTranspose",
        [IMG, f32(2, 3, 3, 3)],
        attrs={"strides": [2, 2], "pads": [1, 0, 0, 1], "output_padding": [1, 1]},
        rtol=1e-4,
        atol=1e-5,
    ),  # fmt: skip
    OpCase(
        "maxpool_indices_ceil",
        "MaxPool",
        [IMG],
        attrs={"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
        n_out=2,
    ),
    OpCase(
        "maxpool_dilated", "MaxPool", [IMG], attrs={"kernel_shape": [2, 2], "dilations": [2, 2]}
    ),  # fmt: skip
    OpCase(
        "avgpool_pads", "AveragePool", [IMG], attrs={"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    ),  # fmt: skip
    OpCase("lppool", "LpPool", [IMG], attrs={"kernel_shape": [2, 2], "p": 3}, rtol=1e-4),
    OpCase(
        "batchnorm", "BatchNormalization", [IMG, f32(2), f32(2), f32(2), f32(2, lo=0.5, hi=2)]
    ),  # fmt: skip
    OpCase("instancenorm", "InstanceNormalization", [IMG, f32(2), f32(2)], rtol=1e-4, atol=1e-5),
    OpCase(
        "layernorm",
        "LayerNormalization",
        [IMG, f32(5, 6), f32(5, 6)],
        attrs={"axis": 2},
        rtol=1e-4,
        atol=1e-5,
    ),  # fmt: skip
    OpCase(
        "gridsample_cubic_reflect",
        "GridSample",
        [IMG, f32(1, 3, 4, 2, lo=-1.2, hi=1.2)],
        attrs={"mode": "cubic", "padding_mode": "reflection"},
        rtol=1e-4,
        atol=1e-5,
    ),
    OpCase(
        "lstm_bidirectional",
        "LSTM",
        [f32(3, 2, 4), f32(2, 12, 4), f32(2, 12, 3), f32(2, 24)],
        attrs={"hidden_size": 3, "direction": "bidirectional"},
        n_out=3,
        rtol=1e-4,
        atol=1e-5,
    ),  # fmt: skip
    OpCase(
        "gru_reverse",
        "GRU",
        [f32(3, 2, 4), f32(1, 9, 4), f32(1, 9, 3)],
        attrs={"hidden_size": 3, "direction": "reverse", "linear_before_reset": 1},
        n_out=2,
        rtol=1e-4,
        atol=1e-5,
    ),  # fmt: skip
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_reference(case: OpCase) -> None:
    check_case(case)


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c.name in ("conv_transpose", "avgpool_pads", "layernorm", "gru_reverse")],
    ids=lambda c: c.name,
)
def test_gradients(case: OpCase) -> None:
    grad_check(case)


def test_dropout_in_eval_is_identity() -> None:
    x = f32(4, 5)
    case = OpCase("dropout", "Dropout", [x], consts={1: np.array(0.5, np.float32)})
    check_case(case)

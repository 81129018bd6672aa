"""Torch backend linalg, reduce and attention handlers against ONNX's reference evaluator,
with autograd checks for the differentiable ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import xconv
from tests.converters.torch_backend.test_math import (
    RNG,
    OpCase,
    build_model,
    check_case,
    f32,
    grad_check,
    ints,
    run_case,
)
from xconv.errors import ConversionError


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


I64 = np.int64
X3 = rand(2, 3, 4)

CASES = [
    OpCase("matmul_batched", "MatMul", [rand(2, 3, 4), rand(4, 5)]),
    OpCase("matmul_vector", "MatMul", [rand(4), rand(2, 4, 3)]),
    OpCase("matmul_int", "MatMul", [ints(3, 4), ints(4, 2)]),
    OpCase(
        "gemm_trans",
        "Gemm",
        [rand(4, 3), rand(5, 4), rand(5)],
        attrs={"transA": 1, "transB": 1, "alpha": 0.5, "beta": 2.0},
    ),  # fmt: skip
    OpCase("gemm_no_c", "Gemm", [rand(3, 4), rand(4, 2)]),
    OpCase(
        "gemm_int_fractional",
        "Gemm",
        [ints(2, 3), ints(3, 2), ints(2, 2)],
        attrs={"alpha": 0.5, "beta": 1.5},
    ),  # fmt: skip
    OpCase(
        "einsum_batch",
        "Einsum",
        [rand(2, 3, 4), rand(2, 4, 5)],
        attrs={"equation": "bij, bjk -> bik"},
    ),  # fmt: skip
    OpCase(
        "einsum_fp16",
        "Einsum",
        [rand(3, 4, dtype=np.float16), rand(4, 3, dtype=np.float16)],
        attrs={"equation": "ij,jk->ik"},
        rtol=1e-3,
        atol=1e-3,
    ),  # fmt: skip
    OpCase("einsum_scalar", "Einsum", [np.array(3.0, np.float32)], attrs={"equation": "->"}),
    OpCase("det", "Det", [rand(2, 3, 3)], rtol=1e-4),
    OpCase("cumsum", "CumSum", [X3], consts={1: np.array(1, I64)}),
    OpCase(
        "cumsum_exclusive_reverse",
        "CumSum",
        [X3],
        consts={1: np.array(-1, I64)},
        attrs={"exclusive": 1, "reverse": 1},
    ),  # fmt: skip
    OpCase("cumsum_int", "CumSum", [ints(3, 4)], consts={1: np.array(0, I64)}),
    OpCase(
        "cumsum_uint32_exclusive",
        "CumSum",
        [ints(3, 4, lo=0, hi=9, dtype=np.uint32)],
        consts={1: np.array(1, I64)},
        attrs={"exclusive": 1},
    ),  # fmt: skip
    OpCase(
        "topk_largest",
        "TopK",
        [np.array([[3, 1, 3, 2, 1]], np.float32)],
        consts={1: np.array([3], I64)},
        n_out=2,
    ),  # fmt: skip
    OpCase(
        "topk_smallest_axis0",
        "TopK",
        [rand(5, 3)],
        consts={1: np.array([2], I64)},
        attrs={"axis": 0, "largest": 0},
        n_out=2,
    ),  # fmt: skip
    OpCase(
        "topk_uint64",
        "TopK",
        [ints(2, 6, lo=0, hi=5, dtype=np.uint64)],
        consts={1: np.array([3], I64)},
        n_out=2,
    ),  # fmt: skip
    OpCase("softmax_13", "Softmax", [X3], attrs={"axis": 1}),
    OpCase("hardmax_ties", "Hardmax", [np.array([[1, 3, 3], [2, 2, 1]], np.float32)]),
    OpCase(
        "nll_weighted_ignore",
        "NegativeLogLikelihoodLoss",
        [rand(3, 5, 2), np.array([[0, 4], [1, 2], [3, 1]], I64), f32(5, lo=0.1, hi=1)],
        attrs={"ignore_index": 1},
    ),  # fmt: skip
    OpCase(
        "nll_none",
        "NegativeLogLikelihoodLoss",
        [rand(3, 5), np.array([0, 4, 2], I64)],
        attrs={"reduction": "none"},
    ),  # fmt: skip
    OpCase(
        "sce_log_prob",
        "SoftmaxCrossEntropyLoss",
        [rand(3, 5), np.array([0, 4, 2], I64)],
        attrs={"reduction": "sum"},
        n_out=2,
    ),  # fmt: skip
    # Reduce family: axes as attribute (opset 11) and as input (opset 18).
    OpCase("reduce_sum_input", "ReduceSum", [X3], consts={1: np.array([0, 2], I64)}),
    OpCase(
        "reduce_sum_noop",
        "ReduceSum",
        [X3],
        consts={1: np.zeros(0, I64)},
        attrs={"noop_with_empty_axes": 1},
    ),  # fmt: skip
    OpCase("reduce_mean_attr", "ReduceMean", [X3], attrs={"axes": [1], "keepdims": 0}, opset=11),
    OpCase("reduce_max_all", "ReduceMax", [X3], attrs={"keepdims": 0}),
    OpCase(
        "reduce_max_empty_set",
        "ReduceMax",
        [np.zeros((2, 0, 4), np.float32)],
        consts={1: np.array([1], I64)},
    ),  # fmt: skip
    OpCase("reduce_min_int", "ReduceMin", [ints(3, 4)], consts={1: np.array([1], I64)}),
    OpCase("reduce_prod", "ReduceProd", [X3], consts={1: np.array([0, 1], I64)}),
    OpCase("reduce_l1", "ReduceL1", [X3], consts={1: np.array([-1], I64)}),
    OpCase("reduce_l2", "ReduceL2", [X3], consts={1: np.array([2], I64)}),
    OpCase("reduce_log_sum", "ReduceLogSum", [f32(2, 3, lo=0.1)], consts={1: np.array([1], I64)}),
    OpCase(
        "reduce_log_sum_exp",
        "ReduceLogSumExp",
        [X3 * 50],
        consts={1: np.array([1], I64)},
        rtol=1e-5,
        atol=1e-4,
    ),  # fmt: skip
    OpCase(
        "reduce_sum_square_noop",
        "ReduceSumSquare",
        [X3],
        consts={1: np.zeros(0, I64)},
        attrs={"noop_with_empty_axes": 1},
    ),  # fmt: skip
    OpCase(
        "reduce_sum_empty_set",
        "ReduceSum",
        [np.zeros((2, 0, 4), np.float32)],
        consts={1: np.array([1], I64)},
        attrs={"keepdims": 0},
    ),  # fmt: skip
    OpCase(
        "reduce_max_uint64",
        "ReduceMax",
        [np.array([[2**64 - 1, 3], [5, 7]], np.uint64)],
        consts={1: np.array([1], I64)},
    ),
    OpCase(
        "reduce_sum_uint32",
        "ReduceSum",
        [ints(3, 4, lo=0, hi=99, dtype=np.uint32)],
        consts={1: np.array([0], I64)},
    ),
    OpCase(
        "argmin_uint64_last",
        "ArgMin",
        [np.array([[9, 1, 1]], np.uint64)],
        attrs={"axis": 1, "select_last_index": 1},
    ),
    OpCase(
        "topk_uint32_smallest",
        "TopK",
        [ints(2, 6, lo=0, hi=5, dtype=np.uint32)],
        consts={1: np.array([3], I64)},
        attrs={"largest": 0},
        n_out=2,
    ),
    OpCase(
        "argmax_last",
        "ArgMax",
        [np.array([[1, 3, 3], [2, 2, 1]], np.float32)],
        attrs={"axis": 1, "select_last_index": 1},
    ),  # fmt: skip
    OpCase("argmin_keepdims0", "ArgMin", [X3], attrs={"axis": -1, "keepdims": 0}),
    # Attention (opset 23): 4-D MHA, 3-D GQA with a KV cache, masks, softcap, qk output.
    OpCase("attention_4d", "Attention", [rand(2, 3, 4, 8), rand(2, 3, 6, 8), rand(2, 3, 6, 8)]),
    OpCase(
        "attention_causal_cache",
        "Attention",
        [
            rand(2, 4, 3, 8),
            rand(2, 2, 3, 8),
            rand(2, 2, 3, 8),
            None,
            rand(2, 2, 5, 8),
            rand(2, 2, 5, 8),
        ],
        attrs={"is_causal": 1},
        n_out=3,
    ),  # fmt: skip
    OpCase(
        "attention_3d_gqa_bool_mask",
        "Attention",
        [rand(2, 4, 16), rand(2, 6, 8), rand(2, 6, 8), RNG.integers(0, 2, (4, 6)).astype(bool)],
        attrs={"q_num_heads": 4, "kv_num_heads": 2},
    ),  # fmt: skip
    OpCase(
        "attention_softcap_qk_out",
        "Attention",
        [rand(1, 2, 3, 4), rand(1, 2, 5, 4), rand(1, 2, 5, 4), rand(3, 5)],
        attrs={"softcap": 2.0, "qk_matmul_output_mode": 1},
        n_out=4,
    ),  # fmt: skip
    OpCase(
        "rotary_interleaved",
        "RotaryEmbedding",
        [rand(1, 2, 3, 8), rand(4, 4), rand(4, 4), np.array([[0, 2, 3]], I64)],
        attrs={"interleaved": 1},
    ),  # fmt: skip
    OpCase(
        "rotary_3d_partial",
        "RotaryEmbedding",
        [rand(1, 3, 16), rand(1, 3, 2), rand(1, 3, 2)],
        attrs={"num_heads": 2, "rotary_embedding_dim": 4},
    ),  # fmt: skip
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_reference(case: OpCase) -> None:
    check_case(case)


@pytest.mark.parametrize(
    "case",
    [
        OpCase("matmul", "MatMul", [rand(2, 3), rand(3, 2)]),
        OpCase("gemm", "Gemm", [rand(2, 3), rand(3, 2), rand(2)], attrs={"alpha": 0.3}),
        OpCase("softmax", "Softmax", [rand(2, 4)]),
        OpCase("log_softmax", "LogSoftmax", [rand(2, 4)]),
        OpCase("reduce_lse", "ReduceLogSumExp", [rand(2, 4)], consts={1: np.array([1], I64)}),
        OpCase("reduce_l2", "ReduceL2", [rand(2, 4)], consts={1: np.array([0], I64)}),
        OpCase(
            "cumsum", "CumSum", [rand(2, 4)], consts={1: np.array(1, I64)}, attrs={"exclusive": 1}
        ),  # fmt: skip
        OpCase(
            "attention",
            "Attention",
            [rand(1, 2, 3, 4), rand(1, 2, 3, 4), rand(1, 2, 3, 4)],
            attrs={"is_causal": 1},
        ),  # fmt: skip
        OpCase(
            "attention_mask",
            "Attention",
            [rand(1, 2, 3, 4), rand(1, 2, 3, 4), rand(1, 2, 3, 4), rand(3, 3)],
        ),  # fmt: skip
    ],
    ids=lambda c: c.name,
)
def test_gradients(case: OpCase) -> None:
    grad_check(case)


def test_topk_k_out_of_range_is_an_error() -> None:
    case = OpCase("topk_big_k", "TopK", [rand(2, 3)], consts={1: np.array([4], I64)}, n_out=2)
    module, _ = xconv.to_torch(xconv.load(build_model(case)))
    with pytest.raises(ConversionError, match="k=4 is out of range"):
        module(torch.from_numpy(case.data[0]))


def test_attention_plain_path_matches_explicit_math() -> None:
    """The SDPA fast path gives what the reference's explicit formula gives."""
    q, k, v = rand(1, 2, 4, 8), rand(1, 2, 4, 8), rand(1, 2, 4, 8)
    expected, got = run_case(OpCase("sdpa", "Attention", [q, k, v], attrs={"is_causal": 1}))
    np.testing.assert_allclose(got[0].numpy(), expected[0], rtol=1e-5, atol=1e-6)
    scores = torch.from_numpy(q) @ torch.from_numpy(k).transpose(-1, -2) / np.sqrt(8)
    scores = scores.masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf"))
    manual = torch.softmax(scores, -1) @ torch.from_numpy(v)
    np.testing.assert_allclose(got[0].numpy(), manual.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
def test_softmax_before_13_coerces_to_2d(op: str) -> None:
    """Opset < 13 normalises over all dimensions from ``axis`` on (the reference evaluator
    applies the opset-13 rule here, so the oracle is numpy)."""
    import onnxruntime as ort

    case = OpCase(f"{op}_11", op, [X3], attrs={"axis": 1}, opset=11)
    session = ort.InferenceSession(
        build_model(case).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    (expected,) = session.run(None, {"x0": X3})
    flat = X3.reshape(2, 12)
    e = np.exp(flat - flat.max(1, keepdims=True))
    if op == "Softmax":
        np.testing.assert_allclose(expected, (e / e.sum(1, keepdims=True)).reshape(X3.shape),
                                   rtol=1e-5)  # fmt: skip
    module, _ = xconv.to_torch(xconv.load(build_model(case)))
    with torch.no_grad():
        got = module(torch.from_numpy(X3)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)

"""JAX handlers for the attention family (Attention 23-25, RotaryEmbedding, SwiGLU,
TensorScatter, LinearAttention, CausalConvWithState, FlexAttention): parity with the ONNX
reference evaluator, plus jit and grad checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import xconv
from tests.converters.jax.linalg_cases import (
    OpCase,
    assert_close,
    build_model,
    feeds,
    rand,
    run_both,
)

B, HQ, HKV, SQ, SKV, D = 2, 4, 2, 3, 5, 8
Q4, K4, V4 = rand(B, HQ, SQ, D), rand(B, HQ, SKV, D), rand(B, HQ, SKV, 6)
KG, VG = rand(B, HKV, SKV, D), rand(B, HKV, SKV, D)
Q3, K3, V3 = rand(B, SQ, HQ * D), rand(B, SKV, HKV * D), rand(B, SKV, HKV * D)
PAST_K, PAST_V = rand(B, HKV, 4, D), rand(B, HKV, 4, D)
BOOL_MASK = np.random.default_rng(1).random((SQ, SKV)) > 0.3
FLOAT_MASK = rand(B, 1, SQ, SKV - 2)  # shorter than kv: padded with -inf

ATTENTION = [
    OpCase("attn_4d", "Attention", [Q4, K4, V4]),
    OpCase(
        "attn_4d_scaled_softcap_modes",
        "Attention",
        [Q4, K4, V4],
        {"scale": 0.2, "softcap": 2.0, "qk_matmul_output_mode": 1},
        n_out=4,
    ),
    OpCase("attn_4d_gqa_bool_mask", "Attention", [Q4, KG, VG, BOOL_MASK]),
    OpCase(
        "attn_4d_float_mask_short_mode2",
        "Attention",
        [Q4, K4, V4, FLOAT_MASK],
        {"qk_matmul_output_mode": 2},
        n_out=4,
    ),
    OpCase(
        "attn_4d_causal_mode3",
        "Attention",
        [Q4, K4, V4],
        {"is_causal": 1, "qk_matmul_output_mode": 3},
        n_out=4,
    ),
    OpCase(
        "attn_3d_gqa_past_causal",
        "Attention",
        [Q3, K3, V3, None, PAST_K, PAST_V],
        {"q_num_heads": HQ, "kv_num_heads": HKV, "is_causal": 1},
        n_out=3,
    ),
    OpCase(
        "attn_3d_softmax_precision",
        "Attention",
        [Q3, K3, V3],
        {"q_num_heads": HQ, "kv_num_heads": HKV, "softmax_precision": TensorProto.FLOAT},
    ),
    OpCase(
        "attn_24_nonpad_causal",
        "Attention",
        [Q4, K4, V4, None, None, None, np.array([4, 2], np.int64)],
        {"is_causal": 1},
        opset=24,
    ),
    OpCase(
        "attn_25_window_past",
        "Attention",
        [Q4, KG, VG, BOOL_MASK[:, :4], PAST_K, PAST_V],
        {"left_window_size": 2, "right_window_size": 0},
        n_out=3,
        opset=25,
    ),
    OpCase(
        "attn_fully_masked_row",
        "Attention",
        [Q4, K4, V4, np.array([[False] * SKV, [True] * SKV, [True] * SKV])],
    ),
]

COS, SIN = np.cos(rand(16, 4)), np.sin(rand(16, 4))
POS_IDS = np.array([[0, 3, 7], [1, 2, 15]], np.int64)
OTHER = [
    OpCase("rope_4d", "RotaryEmbedding", [rand(2, 2, 3, 8), COS, SIN, POS_IDS]),
    OpCase(
        "rope_3d_interleaved",
        "RotaryEmbedding",
        [rand(2, 3, 16), COS, SIN, POS_IDS],
        {"num_heads": 2, "interleaved": 1},
    ),
    OpCase(
        "rope_partial_dim",
        "RotaryEmbedding",
        [rand(2, 2, 3, 12), COS, SIN, POS_IDS],
        {"rotary_embedding_dim": 8},
    ),
    OpCase(
        "rope_no_position_ids",
        "RotaryEmbedding",
        [rand(2, 2, 3, 8), COS[:6].reshape(2, 3, 4), SIN[:6].reshape(2, 3, 4)],
    ),
    OpCase("swiglu_alpha", "SwiGLU", [rand(3, 8), rand(3, 8)], {"alpha": 1.7}, opset=28),
    OpCase(
        "tensorscatter_linear",
        "TensorScatter",
        [rand(2, 3, 6, 4), rand(2, 3, 2, 4), np.array([1, 4], np.int64)],
        opset=24,
    ),
    OpCase(
        "tensorscatter_circular_axis1",
        "TensorScatter",
        [rand(2, 5, 4), rand(2, 3, 4), np.array([3, 0], np.int64)],
        {"mode": "circular", "axis": 1},
        opset=24,
    ),
    OpCase(
        "linear_attention_gated_delta_gqa",
        "LinearAttention",
        [
            rand(2, 5, 4 * 3),
            rand(2, 5, 2 * 3),
            rand(2, 5, 2 * 4),
            rand(2, 2, 3, 4),
            -np.abs(rand(2, 5, 2)),
            1 / (1 + np.exp(-rand(2, 5, 2))),
        ],
        {"q_num_heads": 4, "kv_num_heads": 2},
        n_out=2,
        opset=27,
        rtol=1e-4,
        atol=1e-5,
    ),
    OpCase(
        "linear_attention_linear",
        "LinearAttention",
        [rand(1, 4, 6), rand(1, 4, 6), rand(1, 4, 6)],
        {"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "linear", "scale": 0.5},
        n_out=2,
        opset=27,
        rtol=1e-4,
        atol=1e-5,
    ),
    OpCase(
        "causal_conv_silu_past",
        "CausalConvWithState",
        [rand(2, 3, 7), rand(3, 1, 4), rand(3), rand(2, 3, 3)],
        {"activation": "silu"},
        n_out=2,
        opset=27,
    ),
]


@pytest.mark.parametrize("case", ATTENTION + OTHER, ids=str)
def test_matches_reference(case: OpCase):
    _, _, actual, expected = run_both(case)
    assert_close(actual, expected, case.rtol, case.atol)


def test_flex_attention_score_mod():
    score_mod = helper.make_graph(
        [helper.make_node("Mul", ["s", "half"], ["out"])],
        "score_mod",
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        initializer=[onnx.numpy_helper.from_array(np.array(0.5, np.float32), "half")],
    )
    case = OpCase(
        "flex",
        "FlexAttention",
        [Q4, KG, VG],
        {"score_mod": score_mod, "scale": 0.3},
        domain="ai.onnx.preview",
        opset=26,
        rtol=1e-5,
        atol=1e-6,
    )
    _, _, actual, expected = run_both(case)
    assert_close(actual, expected, case.rtol, case.atol)


@pytest.mark.parametrize(
    "name",
    [
        "attn_3d_gqa_past_causal",
        "attn_24_nonpad_causal",
        "attn_25_window_past",
        "rope_3d_interleaved",
        "linear_attention_gated_delta_gqa",
        "tensorscatter_linear",
    ],
)
def test_under_jit(name):
    case = next(c for c in ATTENTION + OTHER if c.name == name)
    fn, params, eager, expected = run_both(case)
    jitted = jax.jit(fn)(params, *(jnp.asarray(x) for x in feeds(case)))
    assert_close(jitted, expected, case.rtol, case.atol)
    assert_close(jitted, eager, 1e-5, 1e-6)


def _sdpa(q, k, v, mask):
    """Plain-jnp scaled dot-product attention (the gradient oracle)."""
    s = q @ jnp.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    s = jnp.where(mask, s, -jnp.inf)
    return jax.nn.softmax(s, axis=-1) @ v


def test_grad_attention_with_mask_and_fully_masked_row():
    mask = np.array([[False] * SKV, [True, True, False, True, False], [True] * SKV])
    case = OpCase("attn", "Attention", [Q4, K4, V4, mask])
    fn, params = xconv.to_jax(xconv.load(build_model(case)))
    k, v = jnp.asarray(K4), jnp.asarray(V4)

    def loss(q):
        return jnp.sum(fn(params, q, k, v, jnp.asarray(mask))[0] ** 2)

    g = jax.jit(jax.grad(loss))(jnp.asarray(Q4))
    assert np.all(np.isfinite(g)), "no NaN gradients through a fully-masked row"
    # Rows 1-2 against plain attention; row 0 is fully masked: zero output, zero gradient.
    ref = jax.grad(lambda q: jnp.sum(_sdpa(q, k, v, mask[1:]) ** 2))(jnp.asarray(Q4[:, :, 1:]))
    np.testing.assert_allclose(g[:, :, 1:], ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(g[:, :, 0]), 0.0)


_NEG_ROW_MASK = np.where(np.arange(SKV)[None, :] < 2, 0.0, -np.inf).astype(np.float32)
_NEG_ROW_MASK = np.broadcast_to(_NEG_ROW_MASK, (SQ, SKV)).copy()
_NEG_ROW_MASK[0] = -np.inf  # a row nothing may attend: zeros, as in the reference
_EMPTY_ROW_BOOL = BOOL_MASK.copy()
_EMPTY_ROW_BOOL[1] = False

FAST = [
    OpCase("fast_4d", "Attention", [Q4, K4, V4]),
    OpCase("fast_4d_scale_causal", "Attention", [Q4, K4, V4], {"scale": 0.2, "is_causal": 1}),
    OpCase("fast_4d_gqa_bool_mask", "Attention", [Q4, KG, VG, _EMPTY_ROW_BOOL]),
    OpCase("fast_4d_float_mask_short", "Attention", [Q4, K4, V4, FLOAT_MASK]),
    OpCase("fast_4d_float_mask_empty_row", "Attention", [Q4, K4, V4, _NEG_ROW_MASK]),
    OpCase(
        "fast_4d_bool_mask_causal", "Attention", [Q4, K4, V4, _EMPTY_ROW_BOOL], {"is_causal": 1}
    ),
    OpCase(
        "fast_3d_gqa_causal",
        "Attention",
        [Q3, K3, V3],
        {"q_num_heads": HQ, "kv_num_heads": HKV, "is_causal": 1},
    ),
    OpCase(
        "fast_3d_float_mask",
        "Attention",
        [Q3, K3, V3, FLOAT_MASK],
        {"q_num_heads": HQ, "kv_num_heads": HKV},
    ),
]


@pytest.mark.parametrize("case", FAST, ids=str)
def test_fast_formulation_matches_reference(case: OpCase, monkeypatch):
    """The fused formulation (head- or sequence-major, one select per mask) is the one taken
    for these nodes, and it gives the reference's numbers, fully-masked rows included; the
    step-by-step formulation ("reference") agrees with it."""
    from xconv.converters.jax import attention
    from xconv.converters.ops import formulation

    taken = []
    real = attention._fast_attention
    monkeypatch.setattr(
        attention, "_fast_attention", lambda *a, **k: taken.append(1) or real(*a, **k)
    )
    fn, params, actual, expected = run_both(case)
    assert taken, "the fused formulation was not taken"
    assert_close(actual, expected, case.rtol, case.atol)
    jitted = jax.jit(fn)(params, *(jnp.asarray(x) for x in feeds(case)))
    assert_close(jitted, expected, case.rtol, case.atol)
    with formulation.use(attention="reference"):
        taken.clear()
        slow = fn(params, *(jnp.asarray(x) for x in feeds(case)))
        assert not taken
    assert_close(slow, actual[:1], 1e-5, 1e-6)


def test_fast_formulation_grad_with_fully_masked_row():
    """Gradients through the fused form stay finite and match the step-by-step form's."""
    from xconv.converters.ops import formulation

    case = OpCase("attn", "Attention", [Q4, K4, V4, _NEG_ROW_MASK])
    fn, params = xconv.to_jax(xconv.load(build_model(case)))
    k, v, m = jnp.asarray(K4), jnp.asarray(V4), jnp.asarray(_NEG_ROW_MASK)

    def loss(q):
        return jnp.sum(fn(params, q, k, v, m)[0] ** 2)

    g = jax.grad(loss)(jnp.asarray(Q4))
    with formulation.use(attention="reference"):
        g_ref = jax.grad(loss)(jnp.asarray(Q4))
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-6)


def test_a_constant_mask_that_masks_nothing_adds_no_select():
    """An all-True boolean (or all-zero float) constant mask over every key is no mask: the
    traced function selects nothing; one False entry keeps the select."""
    for mask, selects in ((np.ones((SQ, SKV), bool), False), (_EMPTY_ROW_BOOL, True)):
        case = OpCase("attn_const_mask", "Attention", [Q4, K4, V4, mask], consts={3: mask})
        fn, params, actual, expected = run_both(case)
        assert_close(actual, expected, 1e-5, 1e-6)
        xs = [jnp.asarray(x) for x in feeds(case)]
        jaxpr = str(jax.make_jaxpr(lambda *a, fn=fn, p=params: fn(p, *a))(*xs))
        assert ("select_n" in jaxpr) == selects, jaxpr

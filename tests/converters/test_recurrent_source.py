"""LinearAttention and CausalConvWithState in both source emitters: the generated Flax (linen,
nnx) and torch source, each checked against its runtime by ``example_inputs`` and here against
the ONNX reference evaluator, over several steps, with and without an initial state, for each
update rule, decay and beta shape, activation and head grouping the spec has."""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

torch = pytest.importorskip("torch")
pytest.importorskip("flax")

import xconv  # noqa: E402
from xconv.pipeline import _load_generated  # noqa: E402

OPSET = 27
R = np.random.default_rng(7)


def _rand(*shape, dtype=np.float32):
    return R.standard_normal(shape).astype(dtype)


def _model(op: str, inputs: dict[str, np.ndarray | None], attrs: dict, n_out: int = 2):
    """One ``op`` node over graph inputs (``None``: an omitted optional input)."""
    names = [name if x is not None else "" for name, x in inputs.items()]
    while names and not names[-1]:
        names.pop()
    outs = ["output", "present_state"][:n_out]
    node = helper.make_node(op, names, outs, **attrs)
    given = {k: x for k, x in inputs.items() if x is not None}
    graph = helper.make_graph(
        [node],
        op.lower(),
        [
            helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
            for k, x in given.items()
        ],
        [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outs],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    return proto, list(given.values())


B, T = 2, 5


def _la(name, hq, hk, dk, dv, *, past=False, decay=None, beta=None, n_out=2, **attrs):
    """A LinearAttention case; ``decay`` / ``beta`` give their last dimension."""
    inputs = {
        "query": _rand(B, T, hq * dk),
        "key": _rand(B, T, hk * dk) / np.sqrt(dk),
        "value": _rand(B, T, hk * dv),
        "past_state": _rand(B, hk, dk, dv) if past else None,
        "decay": -np.abs(_rand(B, T, decay)) if decay else None,
        "beta": 1 / (1 + np.exp(-_rand(B, T, beta))) if beta else None,
    }
    rule = {(False, False): "linear", (True, False): "gated", (False, True): "delta"}
    attrs = {"q_num_heads": hq, "kv_num_heads": hk, **attrs}
    attrs.setdefault("update_rule", rule.get((bool(decay), bool(beta)), "gated_delta"))
    return pytest.param("LinearAttention", inputs, attrs, n_out, id=name)


def _cc(name, c, k, length, *, bias=False, past=False, dtype=np.float32, **attrs):
    inputs = {
        "input": _rand(B, c, length, dtype=dtype),
        "weight": _rand(c, 1, k, dtype=dtype),
        "bias": _rand(c, dtype=dtype) if bias else None,
        "past_state": _rand(B, c, k - 1, dtype=dtype) if past else None,
    }
    return pytest.param("CausalConvWithState", inputs, attrs, 2, id=name)


CASES = [
    _la("la_linear", 2, 2, 4, 3),
    _la("la_linear_past_scale", 2, 2, 4, 3, past=True, scale=0.3),
    _la("la_gated_per_key_decay", 2, 2, 4, 3, decay=2 * 4),
    _la("la_gated_per_head_decay_past", 2, 2, 4, 3, decay=2, past=True),
    _la("la_delta", 2, 2, 4, 3, beta=2),
    _la("la_gated_delta_gqa_past", 4, 2, 4, 3, decay=2 * 4, beta=2, past=True),
    _la("la_gated_delta_mqa_scalar_beta", 4, 1, 4, 4, decay=1, beta=1),
    _la("la_output_only", 2, 2, 4, 3, decay=2, beta=2, n_out=1),
    _cc("cc_plain", 3, 4, 7),
    _cc("cc_bias_past", 3, 4, 7, bias=True, past=True),
    _cc("cc_silu_past", 3, 3, 6, past=True, activation="silu"),
    _cc("cc_swish_bias", 3, 3, 6, bias=True, activation="swish"),
    _cc("cc_kernel_one", 3, 1, 5),
    _cc("cc_short_input", 2, 5, 2, past=True),
    _cc("cc_fp16_silu", 3, 4, 6, dtype=np.float16, activation="silu"),
]


def _close(got, want, dtype):
    tol = 2e-3 if dtype == np.float16 else 1e-4
    for g, w in zip(got, want, strict=True):
        g = np.asarray(g)
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g.astype(np.float64), w, rtol=tol, atol=tol)


def _torch_module(source: str, state: dict, folder: Path):
    path = folder / f"gen_{uuid.uuid4().hex[:8]}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    module = mod.Model()
    module.load_state_dict(state)
    return module


@pytest.mark.parametrize(("op", "inputs", "attrs", "n_out"), CASES)
def test_generated_sources_match_the_reference(op, inputs, attrs, n_out, tmp_path):
    proto, xs = _model(op, inputs, attrs, n_out)
    want = ReferenceEvaluator(proto).run(None, dict(zip([i.name for i in proto.graph.input],
                                                        xs, strict=True)))  # fmt: skip
    assert len(want) == n_out
    model = xconv.load(proto)
    helper_name = "_linear_attention(" if op == "LinearAttention" else "_causal_conv_with_state("

    for api in ("linen", "nnx"):
        out = xconv.to_flax(model, tmp_path / api, api=api, example_inputs=tuple(xs))
        text = (out / "model.py").read_text()
        assert helper_name in text and "import xconv" not in text and "from xconv" not in text
        assert ("lax.scan(" in text) == (op == "LinearAttention")
        generated = _load_generated(out / "model.py")
        if api == "linen":
            mod, variables = generated.load(out)
            got = mod.apply(variables, *xs)
        else:
            got = generated.load(out)(*xs)
        _close(got if n_out > 1 else (got,), want, xs[0].dtype)

    source, state = xconv.to_torch_source(model, example_inputs=tuple(xs))
    assert helper_name in source and "import xconv" not in source and "from xconv" not in source
    module = _torch_module(source, state, tmp_path)
    with torch.no_grad():
        got = module(*(torch.from_numpy(x) for x in xs))
    got = got if n_out > 1 else (got,)
    _close([g.numpy() for g in got], want, xs[0].dtype)

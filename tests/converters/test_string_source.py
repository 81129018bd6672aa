"""The string ops (StringConcat, StringNormalizer, StringSplit, RegexFullMatch) in both source
emitters: hand-built models written as Flax (linen) and torch source, run on numpy string
arrays, against the runtimes and ONNX's reference evaluator; attributes the written helpers
cannot take are refused when writing; the generated code ruff-clean and standalone."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import xconv  # noqa: E402
from tests.generated_lint import ruff_findings  # noqa: E402
from xconv.errors import ConversionError  # noqa: E402
from xconv.pipeline import _load_generated  # noqa: E402

WORDS = np.array(["Monday", "tuesday", "wednesday", "MONDAY", "a b  c"], dtype=object)


def _model(node: onnx.NodeProto, inputs, outputs) -> onnx.ModelProto:
    graph = helper.make_graph([node], "strings", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def _strings(name: str, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.STRING, shape)


def _same(got, want) -> None:
    """Equal values and shape; the dtype the reference's, or JAX's canonical one for a jax
    array (int64 as int32 with 64-bit types off)."""
    dtype = jax.dtypes.canonicalize_dtype(want.dtype) if isinstance(got, jax.Array) else None
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    if want.dtype.kind in "OUS":
        assert got.tolist() == want.astype(object).tolist()
    else:
        assert got.dtype == (dtype or want.dtype), (got.dtype, want.dtype)
        np.testing.assert_array_equal(got, want)


def _check(proto: onnx.ModelProto, inputs, tmp_path) -> None:
    """Flax (linen) and torch source of ``proto`` run on ``inputs`` give the reference's
    outputs, as both runtimes do."""
    names = [i.name for i in proto.graph.input]
    want = ReferenceEvaluator(proto).run(None, dict(zip(names, inputs, strict=True)))
    model = xconv.load(proto)
    fn, params = xconv.to_jax(model)
    torch_module, _ = xconv.to_torch(model)
    runtimes = [fn(params, *inputs), torch_module(*inputs)]

    out = xconv.to_flax(model, tmp_path / "flax")
    assert not ruff_findings(out / "model.py", 100)
    module, variables = _load_generated(out / "model.py").load(out)
    source, state = xconv.to_torch_source(model)
    (tmp_path / "torch_model.py").write_text(source)
    assert not ruff_findings(tmp_path / "torch_model.py", 100)
    assert "import xconv" not in source and "from xconv" not in source
    ns: dict = {"__name__": "generated_torch_source"}
    exec(compile(source, "<generated>", "exec"), ns)  # noqa: S102
    generated = ns["Model"]().eval()
    generated.load_state_dict(state)
    sources = [module.apply(variables, *inputs), generated(*inputs)]

    for got in runtimes + sources:
        got = got if isinstance(got, tuple | list) else (got,)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _same(g.numpy() if isinstance(g, torch.Tensor) else g, w)


def test_string_concat_broadcasts(tmp_path):
    suffix = np.array(["_x"], dtype=object)
    node = helper.make_node("StringConcat", ["x", "y"], ["z"])
    proto = _model(node, [_strings("x", [5]), _strings("y", [1])], [_strings("z", None)])
    _check(proto, [WORDS, suffix], tmp_path)


@pytest.mark.parametrize(
    "attrs",
    [
        {},
        {"case_change_action": "LOWER", "stopwords": ["monday"]},
        {"case_change_action": "UPPER", "is_case_sensitive": 1, "stopwords": ["monday"]},
        {"case_change_action": "LOWER", "stopwords": ["monday", "tuesday", "wednesday", "friday"]},
    ],
)
def test_string_normalizer(tmp_path, attrs):
    """Stop words removed (case-insensitively by default), case changed; [""] where no word
    is left (the last case)."""
    days = np.array([["Monday", "tuesday", "wednesday", "MONDAY", "Friday"]], dtype=object)
    node = helper.make_node("StringNormalizer", ["x"], ["y"], **attrs)
    proto = _model(node, [_strings("x", [1, 5])], [_strings("y", None)])
    _check(proto, [days], tmp_path)


@pytest.mark.parametrize("attrs", [{}, {"delimiter": " "}, {"delimiter": " ", "maxsplit": 1}])
def test_string_split_pads_and_counts(tmp_path, attrs):
    node = helper.make_node("StringSplit", ["x"], ["y", "n"], **attrs)
    outputs = [_strings("y", None), helper.make_tensor_value_info("n", TensorProto.INT64, None)]
    proto = _model(node, [_strings("x", [5])], outputs)
    _check(proto, [WORDS], tmp_path)


def test_regex_full_match(tmp_path):
    node = helper.make_node("RegexFullMatch", ["x"], ["y"], pattern=r"[A-Za-z]+day")
    y = helper.make_tensor_value_info("y", TensorProto.BOOL, None)
    proto = _model(node, [_strings("x", [5])], [y])
    _check(proto, [WORDS], tmp_path)


@pytest.mark.parametrize(
    ("node", "message"),
    [
        (helper.make_node("RegexFullMatch", ["x"], ["y"], pattern="(unclosed"), "not a valid"),
        (helper.make_node("StringNormalizer", ["x"], ["y"], case_change_action="TITLE"), "TITLE"),
    ],
)
def test_invalid_attributes_are_refused_when_writing(tmp_path, node, message):
    proto = _model(node, [_strings("x", [5])], [_strings("y", None)])
    model = xconv.load(proto)
    with pytest.raises(ConversionError, match=message):
        xconv.to_flax(model, tmp_path / "flax")
    assert not (tmp_path / "flax").exists()
    with pytest.raises(ConversionError, match=message):
        xconv.to_torch_source(model)

"""DFT, STFT and MelWeightMatrix in both source emitters: torch's FFTs exported to ONNX, written
as Flax and torch source, against torch's own numbers; hand-built DFT forms against the ONNX
reference and each emitter's runtime; the generated code ruff-clean."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from xconv.converters import expressions as ex

torch = pytest.importorskip("torch")
pytest.importorskip("flax")

import xconv  # noqa: E402
from tests.generated_lint import ruff_findings  # noqa: E402
from xconv.pipeline import _load_generated  # noqa: E402


def _both_sources(model, inputs, tmp_path):
    """The generated Flax (linen) and torch source of ``model``, each checked against its
    runtime on ``inputs`` (``example_inputs``), run on them: (flax outputs, torch outputs)."""
    out = xconv.to_flax(model, tmp_path / "flax", example_inputs=inputs)
    assert not ruff_findings(out / "model.py"), ruff_findings(out / "model.py")
    module, variables = _load_generated(out / "model.py").load(out)
    flax_out = np.asarray(module.apply(variables, *inputs))
    source, state = xconv.to_torch_source(model, example_inputs=inputs)
    (tmp_path / "torch_model.py").write_text(source)
    assert not ruff_findings(tmp_path / "torch_model.py"), ruff_findings(
        tmp_path / "torch_model.py"
    )
    ns: dict = {"__name__": "generated_torch_source"}
    exec(compile(source, "<generated>", "exec"), ns)  # noqa: S102
    generated = ns["Model"]().eval()
    generated.load_state_dict(state)
    with torch.no_grad():
        torch_out = generated(*(torch.as_tensor(x) for x in inputs)).numpy()
    return flax_out, torch_out, source + (out / "model.py").read_text()


class _Spectrum(torch.nn.Module):
    def forward(self, x):
        return torch.fft.rfft(x, dim=-1).abs()


class _Stft(torch.nn.Module):
    def forward(self, x):
        window = torch.hann_window(16)
        z = torch.stft(x, 16, hop_length=4, window=window, return_complex=True)
        return torch.view_as_real(z)


@pytest.mark.parametrize(("module", "op"), [(_Spectrum(), "_dft("), (_Stft(), "_stft(")])
def test_torch_ffts_through_both_sources_match_torch(module, op, tmp_path):
    """torch.fft.rfft and torch.stft traced by xconv.from_torch (ONNX DFT / STFT), written
    as Flax and torch source: both give torch's numbers."""
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    with torch.no_grad():
        want = module(torch.as_tensor(x)).numpy()
    model = xconv.from_torch(module, (torch.as_tensor(x),))
    assert {n.op_type for n in model.graph} & {"DFT", "STFT"}
    flax_out, torch_out, text = _both_sources(model, (x,), tmp_path)
    assert op in text and "import xconv" not in text and "from xconv" not in text
    np.testing.assert_allclose(flax_out, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(torch_out, want, rtol=1e-4, atol=1e-4)


def _dft_model(shape, *, length=None, axis=None, **attrs) -> onnx.ModelProto:
    inputs = ["x", "n" if length is not None else "", "axis" if axis is not None else ""]
    while inputs[-1] == "":
        inputs.pop()
    inits = [helper.make_tensor("n", TensorProto.INT64, [], [length])] if length else []
    inits += [helper.make_tensor("axis", TensorProto.INT64, [], [axis])] if axis is not None else []
    graph = helper.make_graph(
        [helper.make_node("DFT", inputs, ["y"], **attrs)],
        "dft",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


#: (input shape, dft_length, axis, attributes): real and complex signals, forward and
#: inverse, both onesided forms, dft_length padding and truncating, another axis.
DFT_FORMS = [
    ((2, 8, 1), None, None, {}),
    ((2, 8, 2), None, None, {}),
    ((2, 8, 2), None, None, {"onesided": 1}),
    ((2, 8, 2), None, None, {"inverse": 1}),
    ((2, 5, 2), None, None, {"inverse": 1, "onesided": 1}),
    ((2, 7, 1), 10, None, {}),
    ((2, 9, 1), 6, None, {"onesided": 1}),
    ((2, 8, 2), 5, None, {"inverse": 1}),
    ((3, 4, 6, 1), None, 2, {"onesided": 1}),
    ((3, 4, 6, 2), 9, 1, {}),
]


@pytest.mark.parametrize(("shape", "length", "axis", "attrs"), DFT_FORMS)
def test_dft_forms_match_the_reference(shape, length, axis, attrs, tmp_path):
    from onnx.reference import ReferenceEvaluator

    proto = _dft_model(shape, length=length, axis=axis, **attrs)
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    (want,) = ReferenceEvaluator(proto).run(None, {"x": x})
    flax_out, torch_out, _ = _both_sources(xconv.load(proto), (x,), tmp_path)
    np.testing.assert_allclose(flax_out, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(torch_out, want, rtol=1e-4, atol=1e-4)


def test_stft_and_mel_weight_matrix_at_run_time(tmp_path):
    """STFT's frame_step and frame_length and MelWeightMatrix's inputs computed at run time:
    read eagerly in Flax, ``int(x)`` / numpy in torch."""
    from onnx.reference import ReferenceEvaluator

    graph = helper.make_graph(
        [
            helper.make_node("STFT", ["signal", "step", "", "length"], ["spec"], onesided=0),
            helper.make_node("MelWeightMatrix", ["bins", "n_fft", "rate", "lo", "hi"], ["mel"]),
        ],
        "signal",
        [
            helper.make_tensor_value_info("signal", TensorProto.FLOAT, [1, 40, 2]),
            helper.make_tensor_value_info("step", TensorProto.INT64, []),
            helper.make_tensor_value_info("length", TensorProto.INT64, []),
            *(helper.make_tensor_value_info(n, TensorProto.INT32, []) for n in ("bins", "n_fft")),
            helper.make_tensor_value_info("rate", TensorProto.INT32, []),
            helper.make_tensor_value_info("lo", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("hi", TensorProto.FLOAT, []),
        ],
        [
            helper.make_tensor_value_info("spec", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("mel", TensorProto.FLOAT, None),
        ],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    values = [
        np.random.default_rng(2).standard_normal((1, 40, 2)).astype(np.float32),
        np.array(6, np.int64), np.array(12, np.int64), np.array(8, np.int32),
        np.array(32, np.int32), np.array(8000, np.int32), np.array(100.0, np.float32),
        np.array(3000.0, np.float32),
    ]  # fmt: skip
    names = ["signal", "step", "length", "bins", "n_fft", "rate", "lo", "hi"]
    want = ReferenceEvaluator(proto).run(None, dict(zip(names, values, strict=True)))
    model = xconv.load(proto)
    out = xconv.to_flax(model, tmp_path / "flax", api="nnx", example_inputs=tuple(values))
    assert not ruff_findings(out / "model.py"), ruff_findings(out / "model.py")
    got = _load_generated(out / "model.py").load(out)(*values)
    source, state = xconv.to_torch_source(model, example_inputs=tuple(values))
    ns: dict = {"__name__": "generated_torch_source"}
    exec(compile(source, "<generated>", "exec"), ns)  # noqa: S102
    generated = ns["Model"]().eval()
    generated.load_state_dict(state)
    with torch.no_grad():
        got_torch = generated(*(torch.as_tensor(v) for v in values))
    for g, t, w in zip(got, got_torch, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(t.numpy(), w, rtol=1e-4, atol=1e-4)


def test_mel_weight_matrix_text_is_the_runtimes():
    """The generated _mel_weight_matrix computes ops/signal.mel_weight_matrix, bit for bit."""
    from xconv.converters.ops.signal import mel_weight_matrix

    ns: dict = {"np": np}
    exec(ex.MEL_WEIGHT_MATRIX, ns)  # noqa: S102
    for args in [(8, 32, 8000, 100.0, 3000.0), (20, 512, 16000, 0.0, 8000.0), (4, 16, 100, 0, 50)]:
        typed = [np.int32(args[0]), np.int32(args[1]), np.int32(args[2])]
        typed += [np.float32(args[3]), np.float32(args[4])]
        want = mel_weight_matrix(*(np.asarray(a) for a in typed))
        np.testing.assert_array_equal(ns["_mel_weight_matrix"](*typed), want)


@pytest.mark.parametrize("module", ["flax", "torch"])
def test_signal_helpers_are_short_lines(module):
    if module == "flax":
        from xconv.converters.flax.source import templates as t
    else:
        from xconv.converters.torch.source import templates as t
    for name in ("dft", "stft", "mel_weight_matrix"):
        assert max(len(line) for line in t.registry.helpers[name].splitlines()) <= 100, name


@pytest.mark.parametrize("module", ["flax", "torch"])
def test_dft_axis_is_an_attribute_before_opset_20(module):
    """Opsets 17-19 read DFT's axis attribute (default 1); 20 on its input (default -2)."""
    import onnx_ir as ir

    if module == "flax":
        from xconv.converters.flax.source import templates as t
    else:
        from xconv.converters.torch.source import templates as t

    def emit(version, attrs, args=("x",)):
        x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 8, 1]))
        node = ir.Node("", "DFT", inputs=[x], num_outputs=1, version=version)
        tpl, _ = t.registry.lookup("", "DFT", version)
        call = t.OpCall(
            node=node, args=list(args), consts=[None] * len(args), shapes=[(1, 8, 1)],
            attrs={**tpl.attrs, **attrs},
        )  # fmt: skip
        return tpl.fn(call), call.helpers

    assert emit(17, {}) == ("_dft(x, 1)", {"dft"})
    assert emit(19, {"axis": 0, "onesided": 1})[0] == "_dft(x, 0, onesided=True)"
    assert emit(20, {"inverse": 1})[0] == "_dft(x, -2, inverse=True)"
    assert "axis" not in t.registry.lookup("", "DFT", 20)[0].attrs

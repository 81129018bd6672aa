"""Adapters for ONNX models (``onnx_ir.Model``, ``.onnx``, ModelProto) run by onnxruntime
or the ONNX reference evaluator, and the float64 cast of an IR graph used as their oracle."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from xconv.errors import require
from xconv.parity.adapters import Adapter, Trace, to_float64
from xconv.parity.localize import scope_groups


class OnnxAdapter(Adapter):
    """An ONNX model (``onnx_ir.Model``, ``.onnx`` path or ModelProto) run by onnxruntime.

    Its oracle casts the graph to float64 and runs it on onnxruntime, or, where
    onnxruntime lacks a float64 kernel, on the ONNX reference evaluator.
    """

    framework = "onnxruntime"

    def __init__(self, model: Any, *, double: bool = False, engine: str = "onnxruntime") -> None:
        import onnx_ir as ir

        self.model = model if isinstance(model, ir.Model) else ir.from_proto(model)
        self.double = double
        self.is_oracle = double
        self.engine = engine
        self._sessions: dict[str, Any] = {}
        self._proto = None

    def describe(self):
        extra = " (float64)" if self.double else ""
        return f"onnx via {self.engine}{extra}"

    @property
    def framework_name(self) -> str:
        return self.engine

    def proto(self):
        import onnx_ir as ir

        if self._proto is None:
            self._proto = ir.to_proto(self.model)
        return self._proto

    def devices(self):
        if self.engine != "onnxruntime":
            return ["cpu"]
        ort = require("onnxruntime", "onnxruntime")
        providers = ort.get_available_providers()
        return ["cpu"] + (["cuda"] if "CUDAExecutionProvider" in providers else [])

    def input_specs(self):
        return _ir_input_specs(self.model)

    def output_names(self, n):
        names = [v.name for v in self.model.graph.outputs]
        return names if len(names) == n else super().output_names(n)

    def _session(self, device: str, proto=None, key: str | None = None):
        key = key or device
        if key not in self._sessions:
            proto = proto if proto is not None else self.proto()
            if self.engine == "reference":
                from onnx.reference import ReferenceEvaluator

                self._sessions[key] = ReferenceEvaluator(proto)
            else:
                ort = require("onnxruntime", "onnxruntime")
                providers = ["CUDAExecutionProvider"] if device == "cuda" else []
                opts = ort.SessionOptions()
                opts.log_severity_level = 3
                if self.double:
                    # Fusions may drop to float32 kernels; keep the graph as written.
                    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
                self._sessions[key] = ort.InferenceSession(
                    proto.SerializeToString(), opts, providers=[*providers, "CPUExecutionProvider"]
                )
        return self._sessions[key]

    def prepare(self, device):
        self._session(device)

    def _feeds(self, inputs):
        names = [v.name for v in self.model.graph.inputs if not v.is_initializer()]
        xs = to_float64(inputs) if self.double else inputs
        if len(xs) != len(names):
            raise ValueError(f"the ONNX model takes {len(names)} input(s) {names}, got {len(xs)}")
        return dict(zip(names, xs, strict=True))

    def run(self, inputs, device):
        sess = self._session(device)
        return [np.asarray(o) for o in sess.run(None, self._feeds(inputs))]

    def oracle(self):
        if self.double:
            return self, "already float64"
        try:
            model64 = cast_model_to_double(self.model)
        except Exception as e:
            return None, f"onnx: cannot cast the graph to float64 ({type(e).__name__}: {e})"
        twin = OnnxAdapter(model64, double=True)
        try:
            twin._session("cpu")
            return twin, "onnx: graph cast to float64, run by onnxruntime"
        except Exception as e:
            ref = OnnxAdapter(model64, double=True, engine="reference")
            try:
                ref._session("cpu")
            except Exception as e2:
                return (
                    None,
                    f"onnx: float64 graph runs on neither onnxruntime ({e}) nor the reference evaluator ({e2})",
                )
            return (
                ref,
                "onnx: graph cast to float64, run by the ONNX reference evaluator (onnxruntime lacks float64 kernels for it)",
            )

    def trace(self, inputs, device):
        groups = scope_groups(self.model.graph)
        if not groups:
            return None
        wanted = sorted({n for g in groups for n in (*g.outputs, *g.inputs)})
        feeds = self._feeds(inputs)
        if self.engine == "reference":
            values = self._session(device).run(None, feeds, intermediate=True)
        else:
            proto = _with_outputs(self.proto(), wanted)
            sess = self._session(device, proto, key=f"{device}:trace")
            names = [o.name for o in sess.get_outputs()]
            values = dict(zip(names, sess.run(None, feeds), strict=True))
        values = {**feeds, **{k: np.asarray(v) for k, v in values.items()}}
        return trace_from_values(self.model.graph, values)


class OrtSessionAdapter(Adapter):
    """A ready onnxruntime session (its model file is reloaded for the oracle when known)."""

    framework = "onnxruntime"

    def __init__(self, session: Any) -> None:
        self.session = session

    def describe(self):
        return "onnxruntime session"

    def _path(self) -> str | None:
        path = getattr(self.session, "_model_path", None)
        return path if path and os.path.isfile(path) else None

    def input_specs(self):
        specs = []
        from xconv.parity.checker import InputSpec

        for i in self.session.get_inputs():
            shape = tuple(d if isinstance(d, int) else 2 for d in i.shape)
            dtype = i.type.replace("tensor(", "").replace(")", "")
            specs.append(
                InputSpec(shape, {"float": "float32", "double": "float64"}.get(dtype, dtype))
            )
        return specs

    def output_names(self, n):
        names = [o.name for o in self.session.get_outputs()]
        return names if len(names) == n else super().output_names(n)

    def run(self, inputs, device):
        names = [i.name for i in self.session.get_inputs()]
        return [
            np.asarray(o) for o in self.session.run(None, dict(zip(names, inputs, strict=True)))
        ]

    def oracle(self):
        path = self._path()
        if path is None:
            return None, "onnxruntime session: its model file is unknown, so no float64 oracle"
        from xconv.converters.onnx.io import load

        return OnnxAdapter(load(path)).oracle()

    def trace(self, inputs, device):
        path = self._path()
        if path is None:
            return None
        from xconv.converters.onnx.io import load

        return OnnxAdapter(load(path)).trace(inputs, "cpu")


def _with_outputs(proto, names: list[str]):
    """A copy of ``proto`` whose graph also outputs ``names`` (types from shape inference)."""
    import onnx

    model = onnx.ModelProto()
    model.CopyFrom(proto)
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:
        inferred = model
    infos = {vi.name: vi for vi in inferred.graph.value_info}
    infos.update({vi.name: vi for vi in inferred.graph.input})
    existing = {o.name for o in model.graph.output}
    graph_inputs = {i.name for i in model.graph.input}
    for name in names:
        if name in existing or name in graph_inputs:
            continue
        vi = infos.get(name)
        if vi is None:
            vi = onnx.helper.make_empty_tensor_value_info(name)
        model.graph.output.append(vi)
    return model


def _ir_input_specs(model) -> list[Any]:
    from xconv.parity.checker import InputSpec

    specs = []
    for v in model.graph.inputs:
        if v.is_initializer():
            continue
        if v.shape is None or v.dtype is None:
            return None
        shape = tuple(d if isinstance(d, int) else 2 for d in v.shape)
        specs.append(InputSpec(shape, v.dtype.numpy().name))
    return specs


def trace_from_values(graph, values: Mapping[str, Any]) -> Trace:
    """Scope outputs of an IR graph from its values by name (see ``scope_groups``)."""
    trace = Trace()
    for g in scope_groups(graph):
        outs = [np.asarray(values[n]) for n in g.outputs if n in values]
        if not outs:
            continue
        ins = [np.asarray(values[n]) for n in g.inputs if n in values]
        trace.record(g.name, outs, ins)
    return trace


# --------------------------------------------------------------------------- float64 IR


def cast_model_to_double(model):
    """A float64 copy of an IR model: float weights, value types, Cast targets and tensor
    attributes (Constant, ConstantOfShape) become double. Integer parts are untouched."""
    import onnx
    import onnx_ir as ir

    proto = ir.to_proto(model)
    low = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
    _cast_graph(proto.graph, low)
    return ir.from_proto(proto)


def _cast_tensor(t, low) -> None:
    import onnx
    from onnx import numpy_helper

    if t.data_type in low:
        arr = numpy_helper.to_array(t).astype(np.float64)
        new = numpy_helper.from_array(arr, t.name)
        t.CopyFrom(new)
    del onnx


def _cast_graph(graph, low) -> None:
    import onnx

    double = onnx.TensorProto.DOUBLE
    for t in graph.initializer:
        _cast_tensor(t, low)
    for vi in [*graph.input, *graph.output, *graph.value_info]:
        tt = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and tt.elem_type in low:
            tt.elem_type = double
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.INT and attr.name in (
                "to",
                "dtype",
                "output_dtype",
            ):
                if attr.i in low:
                    attr.i = double
            elif attr.type == onnx.AttributeProto.TENSOR:
                _cast_tensor(attr.t, low)
            elif attr.type == onnx.AttributeProto.GRAPH:
                _cast_graph(attr.g, low)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    _cast_graph(g, low)

"""The backends the conformance harness can run, by name."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from tests.conformance.harness import Prepare, Runner

_WIDE = {onnx.TensorProto.INT64, onnx.TensorProto.UINT64, onnx.TensorProto.DOUBLE}


def _ort_runner(model_bytes_or_path: bytes | str) -> Runner:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model_bytes_or_path, opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]

    def run(inputs: list[Any]) -> list[Any]:
        return sess.run(None, dict(zip(names, inputs, strict=False)))

    return run


def onnxruntime_backend(model: onnx.ModelProto) -> Runner:
    """onnxruntime alone: the baseline every other backend is measured against."""
    return _ort_runner(model.SerializeToString())


def roundtrip_backend(model: onnx.ModelProto) -> Runner:
    """xconv.load -> xconv.save -> onnxruntime: proves the IR loses nothing."""
    import xconv

    ir_model = xconv.load(model)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        xconv.save(ir_model, path, check=False)
        return _ort_runner(path.read_bytes())


def _uses_wide_types(model: onnx.ModelProto) -> bool:
    def elem_types(vis):
        for vi in vis:
            t = vi.type
            while True:
                if t.HasField("tensor_type"):
                    yield t.tensor_type.elem_type
                    break
                if t.HasField("sequence_type"):
                    t = t.sequence_type.elem_type
                elif t.HasField("optional_type"):
                    t = t.optional_type.elem_type
                else:
                    break

    g = model.graph
    types = set(elem_types(list(g.input) + list(g.output)))
    types |= {t.data_type for t in g.initializer}
    return bool(types & _WIDE)


def jax_backend(model: onnx.ModelProto) -> Runner:
    """xconv.load -> xconv.to_jax; 64-bit cases run with x64 enabled (inside the harness only)."""
    import jax

    import xconv

    x64 = _uses_wide_types(model)
    ctx = jax.enable_x64(True) if x64 else contextlib.nullcontext()
    with ctx:
        fn, params = xconv.to_jax(xconv.load(model))

    def run(inputs: list[Any]) -> list[Any]:
        with jax.enable_x64(True) if x64 else contextlib.nullcontext():
            # Inputs go in as JAX arrays (run-time data), as users pass them.
            outs = fn(params, *(_to_device(x) for x in inputs))
            return [_to_numpy(o) for o in outs]

    return run


def _to_device(x: Any) -> Any:
    import jax.numpy as jnp

    if isinstance(x, np.ndarray) and x.dtype.kind not in "OSU":
        return jnp.asarray(x)
    if isinstance(x, list):
        return [_to_device(v) for v in x]
    return x


def _to_numpy(x: Any) -> Any:
    if x is None:
        return None
    if isinstance(x, list):
        return [_to_numpy(v) for v in x]
    return np.asarray(x)


BACKENDS: dict[str, Callable[[], Prepare]] = {
    "onnxruntime": lambda: onnxruntime_backend,
    "roundtrip": lambda: roundtrip_backend,
    "jax": lambda: jax_backend,
}


def torch_backend(model: onnx.ModelProto) -> Runner:
    """xconv.load -> xconv.to_torch: the IR run with torch ops."""
    import torch

    import xconv

    module, _ = xconv.to_torch(xconv.load(model))

    def to_torch(x: Any) -> Any:
        if isinstance(x, np.ndarray) and x.dtype.kind not in "OSU":
            from xconv.converters.torch.runtime.dtypes import to_tensor

            return to_tensor(x)
        if isinstance(x, list):
            return [to_torch(v) for v in x]
        return x

    def to_numpy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            from xconv.converters.torch.runtime.dtypes import to_numpy as tensor_to_numpy

            return tensor_to_numpy(x)
        if isinstance(x, list):
            return [to_numpy(v) for v in x]
        return x

    def run(inputs: list[Any]) -> list[Any]:
        with torch.no_grad():
            out = module(*(to_torch(x) for x in inputs))
        outs = out if isinstance(out, tuple) else (out,)
        return [to_numpy(o) for o in outs]

    return run


BACKENDS["torch"] = lambda: torch_backend

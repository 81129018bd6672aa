"""Adapters: one small class per kind of model, all with the same surface (JAX and Flax in
``jax_adapters``, ONNX in ``onnx_adapters``; torch and TF here, with ``wrap``).

Every adapter runs the model on numpy inputs on one device and returns numpy outputs
(arrays cross frameworks by DLPack where possible, numpy otherwise); it lists the devices
its framework sees, builds its float64 oracle twin, traces module-scope outputs for
localisation, and computes gradients of a weighted-sum loss. Frameworks are imported only
when an object of theirs is wrapped.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xconv.errors import InvalidModelError, require
from xconv.parity.localize import canonical_scope


@dataclass
class Trace:
    """Scope outputs (and inputs) captured from one run, in completion order."""

    order: list[str] = field(default_factory=list)
    outputs: dict[str, list[np.ndarray]] = field(default_factory=dict)
    inputs: dict[str, list[np.ndarray]] = field(default_factory=dict)

    def record(self, scope: str, outputs: list[np.ndarray], inputs: list[np.ndarray]) -> None:
        if scope in self.outputs:
            self.order.remove(scope)
        self.order.append(scope)
        self.outputs[scope] = outputs
        self.inputs[scope] = inputs


@dataclass
class Grads:
    """Gradients of the weighted-sum loss: per input (None for non-float) and per weight."""

    inputs: list[np.ndarray | None]
    params: dict[str, np.ndarray]
    #: Names of state the model does not differentiate (torch buffers, frozen parameters).
    frozen: tuple[str, ...] = ()


class Adapter:
    """Base class. Subclasses set ``framework`` and implement ``run``."""

    framework = "?"
    #: Whether outputs of this adapter are float64 ground truth.
    is_oracle = False

    def describe(self) -> str:
        return self.framework

    def devices(self) -> list[str]:
        return ["cpu"]

    def input_specs(self) -> list[Any] | None:
        return None

    def output_names(self, n: int) -> list[str]:
        return [f"output_{i}" for i in range(n)]

    def run(self, inputs: Sequence[np.ndarray], device: str) -> list[np.ndarray]:
        raise NotImplementedError

    def oracle(self) -> tuple[Adapter | None, str]:
        """A float64 twin of this model, or ``(None, why not)``."""
        return None, f"{self.framework}: no float64 oracle for this kind of model"

    def trace(self, inputs: Sequence[np.ndarray], device: str) -> Trace | None:
        return None

    def grads(
        self, inputs: Sequence[np.ndarray], cotangents: Sequence[np.ndarray | None], device: str
    ) -> Grads | None:
        return None

    def prepare(self, device: str) -> None:
        """Do one-off work for a device (moving weights) outside timed runs."""

    def dot_precision(self, device: str, inputs: Sequence[np.ndarray]) -> tuple[str, int]:
        """The precision this model's float32 dots and convolutions run at on ``device`` under
        the current settings (:mod:`xconv.parity.precision`), and the dot / conv stages on
        its longest path (counted only where the precision is reduced; 1 otherwise)."""
        return "float32", 1

    def precision_context(self, request: str) -> Any:
        """A context running this model at ``request`` (``"highest"``: full float32 dots)."""
        return contextlib.nullcontext()

    def source_names(self, names: Sequence[str]) -> tuple[dict[str, str], str] | None:
        """For a model xconv converted: each of ``names`` (this side's weight-gradient
        names) -> the source model's weight name, as the conversion recorded it, and where
        the record came from. None when the model carries no such record."""
        return None


# --------------------------------------------------------------------------- helpers


def to_numpy(x: Any) -> np.ndarray:
    """Any framework's array as numpy: zero-copy by DLPack for CPU arrays, else a copy."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, np.generic | int | float | bool):
        return np.asarray(x)
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        if str(x.dtype) == "torch.bfloat16":
            import ml_dtypes

            return x.view(_torch().int16).numpy().view(ml_dtypes.bfloat16)
        try:
            return np.from_dlpack(x)
        except Exception:
            return x.numpy()
    if mod in ("jax", "jaxlib"):
        return np.asarray(x)
    if mod in ("tensorflow", "keras"):
        return np.asarray(x.numpy() if hasattr(x, "numpy") else x)
    return np.asarray(x)


def flatten_outputs(out: Any) -> list[Any]:
    """Leaves of a nested output (tuple, list, dict, dataclass-like ModelOutput)."""
    if out is None:
        return []
    if isinstance(out, tuple | list):
        return [leaf for o in out for leaf in flatten_outputs(o)]
    if isinstance(out, Mapping):
        return [leaf for k in out for leaf in flatten_outputs(out[k])]
    if hasattr(out, "to_tuple") and callable(out.to_tuple):  # transformers ModelOutput
        return flatten_outputs(out.to_tuple())
    return [out]


def is_float(x: np.ndarray) -> bool:
    return x.dtype.kind == "f" or x.dtype.name == "bfloat16"


def to_float64(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [a.astype(np.float64) if is_float(a) else a for a in arrays]


def _torch():
    return require("torch", "torch")


def _jax():
    return require("jax", "jax")


# --------------------------------------------------------------------------- torch


class TorchAdapter(Adapter):
    """A torch ``nn.Module`` or a function of torch tensors."""

    framework = "torch"

    def __init__(self, fn: Callable[..., Any], *, double: bool = False) -> None:
        self.fn = fn
        self.double = double
        self.is_oracle = double
        self._moved: dict[str, Any] = {}
        self._depths: dict[str, tuple[int, bool]] = {}

    @property
    def module(self):
        torch = _torch()
        return self.fn if isinstance(self.fn, torch.nn.Module) else None

    def describe(self) -> str:
        name = (
            type(self.fn).__name__
            if self.module is not None
            else getattr(self.fn, "__name__", "fn")
        )
        return f"torch {name}" + (" (float64)" if self.double else "")

    def devices(self) -> list[str]:
        torch = _torch()
        devs = ["cpu"]
        if torch.cuda.is_available():
            devs += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        return devs

    def _home(self) -> str:
        """The device the module's weights live on: ``"cpu"`` for a function or a module
        without weights."""
        module = self.module
        if module is None:
            return "cpu"
        first = next(itertools.chain(module.parameters(), module.buffers()), None)
        if first is None or first.device.type == "cpu":
            return "cpu"
        return f"{first.device.type}:{first.device.index or 0}"

    def _on(self, device: str):
        """The module on ``device``: as given where its weights live, else a moved copy (a
        module on ``cuda:0`` runs its ``cpu`` row from a CPU copy)."""
        if self.module is None or device == self._home():
            return self.fn
        if device not in self._moved:
            self._moved[device] = copy.deepcopy(self.module).to(device)
        return self._moved[device]

    def prepare(self, device: str) -> None:
        self._on(device)

    def _tensors(self, inputs, device, requires_grad=False):
        torch = _torch()
        out = []
        for a in inputs:
            a = np.ascontiguousarray(a)
            if self.double and is_float(a):
                a = a.astype(np.float64)
            try:
                t = torch.from_dlpack(a)
            except Exception:
                t = torch.as_tensor(a)
            if device != "cpu":
                t = t.to(device)
            if requires_grad and t.is_floating_point():
                t = t.detach().clone().requires_grad_(True)
            out.append(t)
        return out

    def run(self, inputs, device):
        torch = _torch()
        with torch.no_grad():
            out = self._on(device)(*self._tensors(inputs, device))
        return [to_numpy(o) for o in flatten_outputs(out) if isinstance(o, torch.Tensor)]

    def dot_precision(self, device, inputs):
        from xconv.parity.precision import torch_dot_depth, torch_precision

        if torch_precision(device, has_conv=True) == "float32":
            return "float32", 1
        if device not in self._depths:
            self._depths[device] = torch_dot_depth(lambda: self.run(inputs, device), ())
        depth, has_conv = self._depths[device]
        return torch_precision(device, has_conv), depth

    def precision_context(self, request):
        from xconv.parity.precision import torch_context

        return torch_context(request)

    def oracle(self):
        torch = _torch()
        if self.module is not None:
            twin = copy.deepcopy(self.module).to("cpu").double()
            return TorchAdapter(twin, double=True), "torch: float64 copy of the module (.double())"
        del torch
        return (
            TorchAdapter(self.fn, double=True),
            "torch function: inputs cast to float64 (weights it closes over are not)",
        )

    def trace(self, inputs, device):
        torch = _torch()
        module = self._on(device)
        if not isinstance(module, torch.nn.Module):
            return None
        trace = Trace()
        handles = []

        def hook(name):
            def fn(mod, args, output):
                outs = [to_numpy(o) for o in flatten_outputs(output) if isinstance(o, torch.Tensor)]
                ins = [to_numpy(a) for a in flatten_outputs(args) if isinstance(a, torch.Tensor)]
                trace.record(canonical_scope(name), outs, ins)

            return fn

        for name, sub in module.named_modules():
            if name:
                handles.append(sub.register_forward_hook(hook(name)))
        try:
            with torch.no_grad():
                module(*self._tensors(inputs, device))
        finally:
            for h in handles:
                h.remove()
        return trace

    def grads(self, inputs, cotangents, device):
        torch = _torch()
        fn = self._on(device)
        xs = self._tensors(inputs, device, requires_grad=True)
        named = list(fn.named_parameters()) if isinstance(fn, torch.nn.Module) else []
        named = [(n, p) for n, p in named if p.requires_grad]
        with torch.enable_grad():
            outs = [o for o in flatten_outputs(fn(*xs)) if isinstance(o, torch.Tensor)]
            loss = 0
            for o, c in zip(outs, cotangents, strict=False):
                if c is not None and o.is_floating_point():
                    loss = loss + (o * torch.as_tensor(c, dtype=o.dtype, device=o.device)).sum()
            wrt = [x for x in xs if x.requires_grad] + [p for _, p in named]
            gs = torch.autograd.grad(loss, wrt, allow_unused=True)
        it = iter(gs)
        gin = []
        for x in xs:
            gin.append(_grad_np(next(it), x) if x.requires_grad else None)
        params = {n: _grad_np(g, p) for (n, p), g in zip(named, it, strict=False)}
        frozen = ()
        if isinstance(fn, torch.nn.Module):
            frozen = tuple(n for n, _ in fn.named_buffers()) + tuple(
                n for n, p in fn.named_parameters() if not p.requires_grad
            )
        return Grads(gin, params, frozen)

    def source_names(self, names):
        # ``xconv.to_torch`` modules keep IR weight name (the source's) -> state_dict key.
        recorded = getattr(self.module, "_weight_names", None)
        if not isinstance(recorded, Mapping) or not hasattr(self.module, "_model"):
            return None
        by_key = {key: source for source, key in recorded.items()}
        return {n: by_key.get(n, n) for n in names}, "the xconv.to_torch module's weight names"


class ExportedProgramAdapter(TorchAdapter):
    """A ``torch.export.ExportedProgram`` (a loaded ``.pt2``): runs ``program.module()``;
    its float64 oracle runs the program's graph with float64 weights and every float dtype
    argument cast to float64 (``module().double()`` trips the program's dtype guards)."""

    def __init__(self, program: Any) -> None:
        super().__init__(program.module())
        self.program = program

    def describe(self) -> str:
        return "torch ExportedProgram"

    def oracle(self):
        from xconv.parity.layerwise import float64_program

        return (
            TorchAdapter(float64_program(self.program), double=True),
            "torch: the exported graph with float64 weights and dtypes",
        )


def _grad_np(g, like) -> np.ndarray:
    if g is None:
        return np.zeros(tuple(like.shape), dtype=to_numpy(like).dtype)
    return to_numpy(g)


# --------------------------------------------------------------------------- TF


class TfAdapter(Adapter):
    """A TF function or Keras model (no scope traces; oracle only if it accepts float64)."""

    framework = "tf"

    def __init__(self, fn: Any, *, double: bool = False) -> None:
        self.fn = fn
        self.double = double
        self.is_oracle = double

    def describe(self):
        return f"tf {type(self.fn).__name__}" + (" (float64)" if self.double else "")

    def devices(self):
        tf = require("tensorflow", "tf")
        return [d.name.split("device:")[-1].lower() for d in tf.config.list_logical_devices()]

    def _call(self, inputs, device):
        tf = require("tensorflow", "tf")
        xs = to_float64(inputs) if self.double else inputs
        with tf.device(device):
            return self.fn(*[tf.convert_to_tensor(x) for x in xs])

    def run(self, inputs, device):
        return [to_numpy(o) for o in flatten_outputs(self._call(inputs, device))]

    def oracle(self):
        return TfAdapter(self.fn, double=True), "tf: called with float64 inputs"

    def grads(self, inputs, cotangents, device):
        tf = require("tensorflow", "tf")
        xs = [tf.Variable(x) if is_float(x) else tf.convert_to_tensor(x) for x in inputs]
        variables = list(getattr(self.fn, "trainable_variables", []) or [])
        with tf.device(device), tf.GradientTape() as tape:
            outs = flatten_outputs(self.fn(*xs))
            loss = 0.0
            for o, c in zip(outs, cotangents, strict=False):
                if c is not None and o.dtype.is_floating:
                    loss = loss + tf.reduce_sum(o * tf.cast(c, o.dtype))
        float_xs = [x for x in xs if isinstance(x, tf.Variable)]
        gs = tape.gradient(loss, float_xs + variables)
        it = iter(gs)
        gin = [to_numpy(next(it)) if isinstance(x, tf.Variable) else None for x in xs]
        params = {}
        for v, g in zip(variables, it, strict=False):
            name = getattr(v, "path", None) or v.name
            params[name.replace("/", ".").split(":")[0]] = (
                to_numpy(g) if g is not None else np.zeros(v.shape)
            )
        return Grads(gin, params)


# --------------------------------------------------------------------------- wrap


def wrap(obj: Any, *, framework: str | None = None) -> Adapter:
    """Wrap a reference or candidate model in its adapter.

    Args:
        obj: A torch module or function; ``(fn, params)`` for JAX (``xconv.to_jax``
            results included); ``(module, variables)`` for Flax linen; an nnx module; a TF
            function or Keras model; an onnxruntime session, ``.onnx`` path, ModelProto or
            ``onnx_ir.Model``; or an Adapter.
        framework: Force the framework of a plain function: ``"torch"``, ``"jax"``, ``"tf"``.
    """
    from xconv.parity.jax_adapters import FlaxLinenAdapter, JaxAdapter, NnxAdapter
    from xconv.parity.onnx_adapters import OnnxAdapter, OrtSessionAdapter

    if isinstance(obj, Adapter):
        return obj
    if isinstance(obj, str | os.PathLike):
        path = os.fspath(obj)
        if path.endswith(".onnx"):
            from xconv.converters.onnx.io import load

            return OnnxAdapter(load(path))
        raise InvalidModelError(f"cannot check {path!r}: only .onnx files are read by path")
    if _is_instance(obj, "onnx_ir", "Model"):
        return OnnxAdapter(obj)
    if _is_instance(obj, "onnx", "ModelProto"):
        from xconv.converters.onnx.io import load

        return OnnxAdapter(load(obj))
    if _is_instance(obj, "onnxruntime", "InferenceSession"):
        return OrtSessionAdapter(obj)
    if isinstance(obj, tuple) and len(obj) == 2 and not _is_array(obj[0]):
        first, second = obj
        if _is_instance(first, "flax.linen", "Module"):
            return FlaxLinenAdapter(first, second)
        if callable(first):
            return JaxAdapter(first, second)
    if _is_instance(obj, "torch.export", "ExportedProgram"):
        return ExportedProgramAdapter(obj)
    if _is_instance(obj, "torch.nn", "Module"):
        return TorchAdapter(obj)
    if _is_instance(obj, "flax.nnx", "Module"):
        return NnxAdapter(obj)
    root = type(obj).__module__.split(".")[0]
    if root in ("tensorflow", "keras", "tf_keras"):
        return TfAdapter(obj)
    if callable(obj):
        fw = framework or _guess_framework(obj)
        if fw == "torch":
            return TorchAdapter(obj)
        if fw == "tf":
            return TfAdapter(obj)
        if fw == "jax":
            return JaxAdapter(lambda _p, *xs: obj(*xs), {})
    raise TypeError(
        f"cannot check a {type(obj).__name__}: pass a torch module or function, (fn, params) "
        "for JAX, (module, variables) for Flax linen, an nnx module, a TF function or Keras "
        "model, an onnxruntime session, a .onnx path or an onnx_ir.Model"
    )


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _is_instance(obj: Any, module: str, name: str) -> bool:
    """isinstance without importing ``module`` (if it is not loaded, obj cannot be one)."""
    mod = sys.modules.get(module)
    if mod is None:
        return False
    cls = getattr(mod, name, None)
    return cls is not None and isinstance(obj, cls)


def _guess_framework(fn: Callable[..., Any]) -> str | None:
    """The framework a plain function uses, from the modules its code refers to."""
    code = getattr(fn, "__code__", None)
    glb = getattr(fn, "__globals__", {})
    if code is None:
        return None
    found = set()
    refs = [glb.get(name) for name in code.co_names]
    refs += [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _has_contents(c)]
    for obj in refs:
        modname = getattr(obj, "__name__", None) if isinstance(obj, type(sys)) else None
        modname = modname or getattr(type(obj), "__module__", "") or ""
        if isinstance(modname, str):
            found.add(modname.split(".")[0])
    for root, fw in (("torch", "torch"), ("jax", "jax"), ("tensorflow", "tf")):
        if root in found:
            return fw
    return None


def _has_contents(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def cpu_device(adapter: Adapter) -> str:
    """The adapter's CPU device (its first device when it has none)."""
    devs = adapter.devices()
    return next((d for d in devs if d.startswith("cpu")), devs[0])

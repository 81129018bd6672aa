"""Adapters: one small class per kind of model, all with the same surface.

Every adapter runs the model on numpy inputs on one device and returns numpy outputs
(arrays cross frameworks by DLPack where possible, numpy otherwise); it lists the devices
its framework sees, builds its float64 oracle twin, traces module-scope outputs for
localisation, and computes gradients of a weighted-sum loss. Frameworks are imported only
when an object of theirs is wrapped.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xconv.errors import InvalidModelError, require
from xconv.parity.localize import canonical_scope, scope_groups


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

    def _on(self, device: str):
        if self.module is None or device == "cpu":
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
        return Grads(gin, params)


def _grad_np(g, like) -> np.ndarray:
    if g is None:
        return np.zeros(tuple(like.shape), dtype=to_numpy(like).dtype)
    return to_numpy(g)


# --------------------------------------------------------------------------- JAX


def _jax_device_name(d) -> str:
    return f"{d.platform}:{d.id}"


def jax_devices() -> list[Any]:
    jax = _jax()
    devs = list(jax.devices())
    try:
        cpus = jax.devices("cpu")
    except RuntimeError:
        cpus = []
    for d in cpus:
        if d not in devs:
            devs.append(d)
    # CPU first: the reference device for oracle runs and the default row of the matrix.
    return sorted(devs, key=lambda d: (d.platform != "cpu", d.platform, d.id))


class JaxAdapter(Adapter):
    """A JAX function with its params: ``(fn, params)``, ``fn(params, *inputs)``.

    ``xconv.to_jax`` results are recognised: their IR gives scope traces and a float64 twin.
    """

    framework = "jax"

    def __init__(self, fn: Callable[..., Any], params: Any, *, x64: bool = False) -> None:
        self.fn = fn
        self.params = params
        self.x64 = x64
        self.is_oracle = x64
        self._placed: dict[str, Any] = {}

    @property
    def ir_model(self):
        model = getattr(self.fn, "model", None)
        return model if hasattr(self.fn, "intermediates") and model is not None else None

    def describe(self) -> str:
        kind = (
            "xconv.to_jax function"
            if self.ir_model is not None
            else getattr(self.fn, "__name__", "fn")
        )
        return f"jax {kind}" + (" (float64)" if self.x64 else "")

    def devices(self):
        return [_jax_device_name(d) for d in jax_devices()]

    def input_specs(self):
        return _ir_input_specs(self.ir_model) if self.ir_model is not None else None

    def output_names(self, n):
        names = getattr(self.fn, "output_names", None)
        return list(names) if names and len(names) == n else super().output_names(n)

    def _device(self, name: str):
        for d in jax_devices():
            if _jax_device_name(d) == name:
                return d
        raise ValueError(f"no JAX device {name!r}; JAX sees {self.devices()}")

    def _ctx(self):
        import contextlib

        jax = _jax()
        return jax.enable_x64(True) if self.x64 else contextlib.nullcontext()

    def _params_on(self, device: str):
        jax = _jax()
        if device not in self._placed:
            with self._ctx():
                params = self.params
                if self.x64:
                    params = jax.tree_util.tree_map(
                        lambda p: (
                            np.asarray(p).astype(np.float64) if is_float(np.asarray(p)) else p
                        ),
                        params,
                    )
                self._placed[device] = jax.device_put(params, self._device(device))
        return self._placed[device]

    def prepare(self, device):
        self._params_on(device)

    def _args(self, inputs, device):
        jax = _jax()
        xs = to_float64(inputs) if self.x64 else list(inputs)
        return [jax.device_put(x, self._device(device)) for x in xs]

    def _call(self, params, xs):
        return self.fn(params, *xs)

    def run(self, inputs, device):
        jax = _jax()
        with self._ctx(), jax.default_device(self._device(device)):
            out = self._call(self._params_on(device), self._args(inputs, device))
            leaves = jax.tree_util.tree_leaves(out)
            return [np.asarray(o) for o in leaves]

    def oracle(self):
        if self.ir_model is not None:
            from xconv.converters.jax.interpreter import to_jax

            try:
                model64 = cast_model_to_double(self.ir_model)
                fn64, _ = to_jax(model64, registry=self.fn.registry)
            except Exception as e:
                return None, f"jax: cannot cast the IR to float64 ({type(e).__name__}: {e})"
            return JaxAdapter(fn64, self.params, x64=True), "jax: IR cast to float64, run with x64"
        return JaxAdapter(
            self.fn, self.params, x64=True
        ), "jax: float64 params and inputs under jax.enable_x64"

    def trace(self, inputs, device):
        model = self.ir_model
        if model is None:
            return None
        jax = _jax()
        with self._ctx(), jax.default_device(self._device(device)):
            xs = self._args(inputs, device)
            values = dict(self.fn.intermediates(self._params_on(device), *xs))
        real_inputs = [v for v in model.graph.inputs if not v.is_initializer()]
        for v, x in zip(real_inputs, xs, strict=False):
            values.setdefault(v.name, x)
        return trace_from_values(model.graph, {k: v for k, v in values.items()})

    def grads(self, inputs, cotangents, device):
        jax = _jax()
        with self._ctx(), jax.default_device(self._device(device)):
            params = self._params_on(device)
            xs = self._args(inputs, device)
            float_idx = [i for i, x in enumerate(xs) if np.issubdtype(x.dtype, np.floating)]
            cts = [None if c is None else jax.numpy.asarray(c) for c in cotangents]

            # Differentiate float weights only (integer buffers such as step counters ride along).
            leaves, treedef = jax.tree_util.tree_flatten(params)
            fidx = [
                i for i, v in enumerate(leaves) if jax.numpy.issubdtype(v.dtype, jax.numpy.floating)
            ]

            def loss(fp, fx):
                full_p = list(leaves)
                for i, v in zip(fidx, fp, strict=True):
                    full_p[i] = v
                full = list(xs)
                for i, v in zip(float_idx, fx, strict=True):
                    full[i] = v
                outs = jax.tree_util.tree_leaves(
                    self._call(jax.tree_util.tree_unflatten(treedef, full_p), full)
                )
                total = 0.0
                for o, c in zip(outs, cts, strict=False):
                    if c is not None and jax.numpy.issubdtype(o.dtype, jax.numpy.floating):
                        total = total + jax.numpy.sum(o * c.astype(o.dtype))
                return total

            gfp, gx = jax.grad(loss, argnums=(0, 1))(
                [leaves[i] for i in fidx], [xs[i] for i in float_idx]
            )
            gleaves = [None] * len(leaves)
            for i, g in zip(fidx, gfp, strict=True):
                gleaves[i] = g
            named = list(
                flatten_tree(
                    jax.tree_util.tree_unflatten(treedef, list(range(len(leaves))))
                ).items()
            )
            gin: list[np.ndarray | None] = [None] * len(xs)
            for i, g in zip(float_idx, gx, strict=True):
                gin[i] = np.asarray(g)
            return Grads(
                gin, {k: np.asarray(gleaves[j]) for k, j in named if gleaves[j] is not None}
            )


def flatten_tree(tree: Any) -> dict[str, Any]:
    """``{"a": {"b": x}}`` -> ``{"a.b": x}`` (JAX key paths joined with ".")."""
    jax = _jax()
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = []
        for k in path:
            for attr in ("key", "name", "idx"):
                if hasattr(k, attr):
                    parts.append(str(getattr(k, attr)))
                    break
            else:
                parts.append(str(k))
        out[".".join(parts)] = leaf
    return out


class FlaxLinenAdapter(JaxAdapter):
    """A Flax linen module with its variables: ``(module, variables)``."""

    framework = "flax"

    def __init__(self, module: Any, variables: Any, *, x64: bool = False) -> None:
        super().__init__(module.apply, variables, x64=x64)
        self.module = module

    def describe(self):
        return f"flax {type(self.module).__name__}" + (" (float64)" if self.x64 else "")

    def input_specs(self):
        return None

    def output_names(self, n):
        return Adapter.output_names(self, n)

    def oracle(self):
        return FlaxLinenAdapter(
            self.module, self.params, x64=True
        ), "flax: float64 variables under jax.enable_x64"

    def trace(self, inputs, device):
        import flax.linen as nn

        jax = _jax()
        trace = Trace()

        def interceptor(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            if context.method_name == "__call__" and context.module.path:
                name = canonical_scope("/".join(str(p) for p in context.module.path))
                outs = [
                    np.asarray(o) for o in jax.tree_util.tree_leaves(out) if hasattr(o, "dtype")
                ]
                ins = [
                    np.asarray(a) for a in jax.tree_util.tree_leaves(args) if hasattr(a, "dtype")
                ]
                trace.record(name, outs, ins)
            return out

        with (
            self._ctx(),
            jax.default_device(self._device(device)),
            nn.intercept_methods(interceptor),
        ):
            self.module.apply(self._params_on(device), *self._args(inputs, device))
        return trace

    def _call(self, params, xs):
        return self.module.apply(params, *xs)

    def grads(self, inputs, cotangents, device):
        # Differentiate with respect to the "params" collection only.
        variables = self.params
        if not isinstance(variables, Mapping) or "params" not in variables:
            return super().grads(inputs, cotangents, device)
        rest = {k: v for k, v in variables.items() if k != "params"}
        module = self.module
        sub = JaxAdapter(
            lambda p, *x: module.apply({"params": p, **rest}, *x), variables["params"], x64=self.x64
        )
        return sub.grads(inputs, cotangents, device)


class NnxAdapter(JaxAdapter):
    """A Flax nnx module (split into graphdef and state; no scope traces)."""

    framework = "flax"

    def __init__(self, module: Any, *, x64: bool = False) -> None:
        from flax import nnx

        graphdef, state = nnx.split(module)
        self.module = module
        self.graphdef = graphdef

        def fn(st, *xs):
            return nnx.merge(graphdef, st)(*xs)

        super().__init__(fn, state, x64=x64)

    def describe(self):
        return f"flax.nnx {type(self.module).__name__}" + (" (float64)" if self.x64 else "")

    def input_specs(self):
        return None

    def output_names(self, n):
        return Adapter.output_names(self, n)

    def oracle(self):
        twin = NnxAdapter.__new__(NnxAdapter)
        JaxAdapter.__init__(twin, self.fn, self.params, x64=True)
        twin.module, twin.graphdef = self.module, self.graphdef
        return twin, "flax.nnx: float64 state under jax.enable_x64"

    def trace(self, inputs, device):
        return None

    def grads(self, inputs, cotangents, device):
        g = super().grads(inputs, cotangents, device)
        # nnx state leaves sit under ".value": "fc.kernel.value" -> "fc.kernel".
        params = {k.removesuffix(".value"): v for k, v in g.params.items()}
        return Grads(g.inputs, params)


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


# --------------------------------------------------------------------------- ONNX / IR


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

_FLOATS = None


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

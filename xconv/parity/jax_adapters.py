"""Adapters for JAX functions with params, Flax linen modules and Flax nnx modules."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from xconv.errors import require
from xconv.parity.adapters import Adapter, Grads, Trace, is_float, to_float64
from xconv.parity.localize import canonical_scope
from xconv.parity.onnx_adapters import _ir_input_specs, cast_model_to_double, trace_from_values


def _jax():
    return require("jax", "jax")


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
        self._depth: int | None = None

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

    def dot_precision(self, device, inputs):
        from xconv.parity.precision import jax_device_precision, jaxpr_dot_depth

        precision = jax_device_precision(self._device(device))
        if precision == "float32" or self.x64:
            return "float32", 1
        if self._depth is None:
            with self._ctx():
                xs = self._args(inputs, device)
                self._depth = jaxpr_dot_depth(self._call, self._params_on(device), xs)
        return precision, self._depth

    def precision_context(self, request):
        from xconv.parity.precision import jax_context

        return jax_context(request)

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
                fn64, _ = to_jax(  # the same param layout: it runs on self.params
                    model64,
                    registry=self.fn.registry,
                    kernel_layout=getattr(self.fn, "kernel_layout", "onnx"),
                )
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

    def source_names(self, names):
        # ``xconv.to_jax`` params nest each weight under its IR (source) name.
        if self.ir_model is None or not hasattr(self.fn, "weight_names"):
            return None
        return {n: n for n in names}, "the xconv.to_jax function's weight names"


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

    def source_names(self, names):
        return _recorded_source_names(self.module, names)

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
            self._call(self._params_on(device), self._args(inputs, device))
        return trace

    def _call(self, params, xs):
        if not self.x64:
            return self.module.apply(params, *xs)
        import flax.linen as nn

        with nn.intercept_methods(_compute_in_float64):
            return self.module.apply(params, *xs)

    def grads(self, inputs, cotangents, device):
        # Differentiate with respect to the "params" collection only.
        variables = self.params
        if not isinstance(variables, Mapping) or "params" not in variables:
            return super().grads(inputs, cotangents, device)
        rest = {k: v for k, v in variables.items() if k != "params"}
        sub = JaxAdapter(
            lambda p, *x: self._call({"params": p, **rest}, x), variables["params"], x64=self.x64
        )
        return sub.grads(inputs, cotangents, device)


def _recorded_source_names(module: Any, names):
    """``SOURCE_NAMES`` of a module ``xconv.to_flax`` generated: variable path -> source
    weight name (a path it omits kept its source name)."""
    from xconv.converters.flax.source_names import recorded_names

    found = recorded_names(module)
    if found is None:
        return None
    recorded = found[1]
    out = {}
    for n in names:
        key = n.replace(".", "/")
        out[n] = recorded.get(key, n)
    return out, f"SOURCE_NAMES of the generated {type(module).__name__}"


_LOW_FLOATS = ("float16", "bfloat16", "float32")


def _compute_in_float64(next_fun, args, kwargs, context):
    """Flax interceptor for the float64 oracle: a layer pinned to a low-precision compute or
    parameter dtype (``nn.Dense(dtype=jnp.float32)``) computes in float64 for this call."""
    mod = context.module
    saved = {}
    for attr in ("dtype", "param_dtype"):
        value = getattr(mod, attr, None)
        if value is not None and _dtype_name(value) in _LOW_FLOATS:
            saved[attr] = value
            object.__setattr__(mod, attr, np.float64)
    try:
        return next_fun(*args, **kwargs)
    finally:
        for attr, value in saved.items():
            object.__setattr__(mod, attr, value)


def _dtype_name(value) -> str:
    try:
        return np.dtype(value).name
    except TypeError:
        return str(value)


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

    def source_names(self, names):
        return _recorded_source_names(self.module, names)

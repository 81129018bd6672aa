"""Flax / JAX -> IR: trace with ``jax.make_jaxpr``, translate lax primitives to ONNX ops.

The parameters are jaxpr inputs (nothing is closed over), so each becomes an initializer named
by its variable-tree path joined with ``.`` (``Dense_0.kernel``; the collection level
``params``/``batch_stats`` is dropped unless two collections clash). Node scopes come from the
equations' name stacks: linen pushes module paths itself; for nnx each submodule call is
wrapped in ``jax.named_scope`` while tracing. LayerNorm and inference BatchNorm bodies are
recovered as single ``LayerNormalization`` / ``BatchNormalization`` nodes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import onnx_ir as ir

from xconv.converters.flax.importer import layers as fl
from xconv.converters.flax.importer.primitives import DOMAIN, INLINE, handler, registry, sub_jaxpr
from xconv.converters.flax.importer.symbolic import (
    BATCH,
    SEQ,
    ir_dim,
    static_dim,
    symbolic_specs,
)
from xconv.converters.flax.source_names import restore_source_names
from xconv.errors import ConversionError, MissingOp, UnsupportedOpError
from xconv.ir import OPSET
from xconv.ir.metadata import MODULE, SCOPE

logger = logging.getLogger(__name__)

BACKEND = "flax frontend"
REGISTRY_MODULE = "xconv.converters.flax.importer.primitives"


def from_flax(
    module: Any,
    variables: Any,
    example_inputs: Any,
    *,
    method: str | Callable[..., Any] = "__call__",
    dynamic_batch: bool = True,
    dynamic_seq: bool = True,
) -> ir.Model:
    """Convert a Flax linen module (with its variables) or an nnx module to the IR.

    Args:
        module: A ``flax.linen.Module`` or a ``flax.nnx.Module``.
        variables: The linen variables dict (``{"params": ..., "batch_stats": ...}``); None
            for nnx (the module holds its state; it is traced in eval mode on a copy).
        example_inputs: One array or a tuple of positional inputs.
        method: The method to trace (linen only): a name, or a callable ``fn(module, *inputs)``
            as ``Module.apply`` takes, e.g. ``lambda m, x: m(x, train=False)`` for a model
            whose ``__call__`` needs a keyword to run in eval mode.
        dynamic_batch: Trace with a symbolic leading dimension ``batch`` (``jax.export``
            shape polymorphism) shared by every input whose leading size equals the first
            input's, so the graph's inputs and outputs have the dim ``batch`` and the model runs
            at any batch size. Scalars and inputs with another leading size keep their example
            shape. When the model cannot be traced or converted that way (shape-dependent
            Python code, a primitive that needs static sizes) the example shapes are used,
            with a warning. False traces at the example shapes only.
        dynamic_seq: With ``dynamic_batch``, also try dim 1 of every integer input of rank
            >= 2 (token ids) as the symbol ``seq`` (shared by those of the first one's
            length), so the model runs at any sequence length. When ``jax.export`` cannot
            trace the model so (a reshape or a parameter fixes the length), that dim is
            traced at its example size, without a warning.

    Returns:
        The annotated ``onnx_ir.Model`` at opset ``xconv.ir.OPSET``.
    """
    from flax import linen as nn
    from flax import nnx

    inputs = _as_inputs(example_inputs)
    if isinstance(module, nnx.Module):
        model = _batched(lambda xs: _from_nnx(module, xs), inputs, dynamic_batch, dynamic_seq)
        return restore_source_names(model, module)
    if not isinstance(module, nn.Module):
        raise ConversionError(
            f"from_flax takes a flax.linen or flax.nnx Module, got {type(module).__name__}"
        )
    if variables is None:
        raise ConversionError("from_flax needs the linen module's variables dict")
    variables = _plain(variables)

    def fn(v, *xs):
        return module.apply(v, *xs, method=method)

    def convert(xs: tuple) -> ir.Model:
        classes: dict[str, type] = {}
        modules: dict[str, Any] = {}

        def record(next_fun, args, kwargs, context):
            path = "/".join(str(p) for p in context.module.path)
            classes.setdefault(path, type(context.module))
            modules.setdefault(path, context.module)
            with _as_computed(context.module):
                out = next_fun(*args, **kwargs)
            if context.method_name == "__call__":
                out = _mark_dropout(context.module, args, out)
            return out

        with nn.intercept_methods(record):
            closed = jax.make_jaxpr(fn)(variables, *xs)
        root = type(module).__name__
        return _build(closed, variables, xs, classes, modules, root, "flax.linen")

    return restore_source_names(_batched(convert, inputs, dynamic_batch, dynamic_seq), module)


def _batched(
    convert: Callable[[tuple], ir.Model], inputs: tuple, dynamic: bool, seq: bool = True
) -> ir.Model:
    """``convert`` at a symbolic batch size, or at the example shapes (warning) when that fails.

    With ``seq``, a symbolic ``seq`` (dim 1 of token-id inputs) is tried first; when
    ``jax.export`` or a handler cannot take it (a reshape or a parameter that fixes the
    length), the sequence dim is traced at its example size, silently: the batch stays
    symbolic. ``UnsupportedOpError`` is not retried: missing primitives are missing at any
    shape. When the model cannot be traced at the example shapes either (inputs that do not
    fit the module), the error is a ``ConversionError`` naming those shapes.
    """
    specs, symbolic = symbolic_specs(inputs, dynamic)
    if not symbolic:
        return _traced(convert, inputs)
    with_seq, has_seq = symbolic_specs(inputs, dynamic, seq=True) if seq else (specs, False)
    if has_seq:
        try:
            return convert(with_seq)
        except Exception as e:  # noqa: BLE001 (any failure: the batch-only attempt decides)
            logger.info("xconv: a symbolic sequence length failed (%s); traced it fixed", e)
    try:
        return convert(specs)
    except UnsupportedOpError:
        raise
    except Exception as e:  # jax shape-polymorphism errors have no common base class
        reason = _first_line(e)
    model = _traced(convert, inputs)
    warnings.warn(
        f"xconv: converting with a symbolic batch dimension failed ({reason}); converted at "
        "the example input shapes instead, so the model only runs at that batch size. Pass "
        "dynamic_batch=False to skip the attempt.",
        stacklevel=3,
    )
    return model


def _traced(convert: Callable[[tuple], ir.Model], inputs: tuple) -> ir.Model:
    try:
        return convert(inputs)
    except ConversionError:
        raise
    except jax.errors.ConcretizationTypeError:
        failure = None  # retried below
    except Exception as e:  # the user's model raised while being traced
        failure = e
    if failure is None:
        # Python code in the model needs the concrete value of something that depends on
        # constants only (``[float(r) for r in jnp.linspace(0, p, n)]``): trace again with
        # constant-only operations evaluated eagerly (slower, so only when needed).
        try:
            with jax.ensure_compile_time_eval():
                return convert(inputs)
        except ConversionError:
            raise
        except Exception as e:
            failure = e
    shapes = ", ".join(f"{np.dtype(x.dtype).name}{list(np.shape(x))}" for x in inputs)
    raise ConversionError(
        f"tracing the model with example inputs {shapes} failed: {_first_line(failure)}"
    ) from failure


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _from_nnx(module: Any, inputs: tuple) -> ir.Model:
    from flax import nnx

    # Random-number state (dropout keys) is not a weight: it stays out of the inputs.
    graphdef, rng_state, state = nnx.split(nnx.clone(module), nnx.RngState, ...)
    pure = _plain(state.to_pure_dict())
    classes: dict[str, type] = {}
    modules: dict[str, Any] = {}

    def fn(p, *xs):
        nnx.replace_by_pure_dict(state, p)
        m = nnx.merge(graphdef, rng_state, state)
        m.eval()
        paths = {}
        for path, sub in nnx.iter_modules(m):
            key = "/".join(str(q) for q in path)
            paths[id(sub)] = key
            classes.setdefault(key, type(sub))
            modules.setdefault(key, sub)
        types = {type(s) for _, s in nnx.iter_modules(m)}
        with _named_calls(paths, types), contextlib.ExitStack() as stack:
            for _, sub in nnx.iter_modules(m):
                stack.enter_context(_as_computed(sub))
            return m(*xs)

    closed = jax.make_jaxpr(fn)(pure, *inputs)
    # nnx state has no collection level: every path element is a module or variable name.
    return _build(closed, pure, inputs, classes, modules, None, "flax.nnx", collections=False)


#: The generated modules' CPU formulations of a layer's product, by layer kind: the attribute
#: the layer takes it as, the helper's name, and the ``lax`` function it computes
#: (``nn.Conv(..., conv_general_dilated=_matmul_conv)``: a matmul over its patches;
#: ``nn.Dense(..., dot_general=_flat_dot)``: a 2-D matmul over the flattened leading axes; see
#: ``xconv.converters.flax.source.helpers``).
GENERATED_FORMULATIONS = {
    "conv": ("conv_general_dilated", "_matmul_conv", "conv_general_dilated"),
    "dense": ("dot_general", "_flat_dot", "dot_general"),
}


@contextlib.contextmanager
def _as_computed(module: Any):
    """Trace a Flax layer given a generated CPU formulation (``GENERATED_FORMULATIONS``) with
    the ``lax`` function it computes, so the IR keeps the layer's one ``Conv`` or ``MatMul``
    rather than the formulation's reshapes, slices and matmul. Any other module is traced as
    it is."""
    from jax import lax

    attr, helper, plain = GENERATED_FORMULATIONS.get(fl.layer_kind(type(module)), ("", "", ""))
    f = getattr(module, attr, None) if attr else None
    if getattr(f, "__name__", None) != helper:
        yield
        return
    object.__setattr__(module, attr, getattr(lax, plain))
    try:
        yield
    finally:
        object.__setattr__(module, attr, f)


@contextlib.contextmanager
def _named_calls(paths: dict[int, str], types: set[type]):
    """Wrap each module class's ``__call__`` in ``jax.named_scope(path)`` while tracing."""
    saved = {}
    for cls in sorted(types, key=lambda c: c.__qualname__):
        if "__call__" not in vars(cls):
            continue
        original = vars(cls)["__call__"]

        def wrapped(self, *a, _orig=original, **k):
            path = paths.get(id(self))
            if not path:
                return _orig(self, *a, **k)
            with jax.named_scope(path):
                return _mark_dropout(self, a, _orig(self, *a, **k))

        saved[cls] = original
        cls.__call__ = wrapped
    try:
        yield
    finally:
        for cls, original in saved.items():
            cls.__call__ = original


def _xconv_dropout(x: Any) -> Any:
    """Identity marking where a Flax ``Dropout`` ran deterministically (see ``_mark_dropout``)."""
    return x


_DROPOUT_MARK = jax.jit(_xconv_dropout)
_DROPOUT_NAME = _xconv_dropout.__name__


def _mark_dropout(module: Any, args: Any, out: Any) -> Any:
    """A deterministic Dropout leaves no equation in the jaxpr; mark it with a named identity
    call so the IR keeps a ``Dropout`` node (an identity in inference) that target frameworks
    turn into their dropout layer, active in their train mode."""
    if fl.KINDS.get(type(module).__name__) == "dropout" and args and out is args[0]:
        return _DROPOUT_MARK(out)
    return out


def from_jax(
    fn: Callable[..., Any],
    params: Any,
    example_inputs: Any,
    *,
    dynamic_batch: bool = True,
    dynamic_seq: bool = True,
) -> ir.Model:
    """Convert a plain JAX function ``fn(params, *inputs)`` to the IR.

    ``params`` is any pytree of arrays; each leaf becomes an initializer named by its path.
    ``dynamic_batch`` makes the inputs' leading dimension the symbol ``batch``, as in
    ``from_flax`` (falling back to the example shapes, with a warning, when ``fn`` cannot be
    traced that way); ``dynamic_seq`` tries dim 1 of integer inputs as ``seq`` too.
    """
    inputs = _as_inputs(example_inputs)
    params = _plain(params)

    def convert(xs: tuple) -> ir.Model:
        closed = jax.make_jaxpr(fn)(params, *xs)
        return _build(closed, params, xs, {}, {}, None, None, collections=False)

    return _batched(convert, inputs, dynamic_batch, dynamic_seq)


def _as_inputs(example_inputs: Any) -> tuple:
    if isinstance(example_inputs, tuple | list):
        return tuple(np.asarray(x) if isinstance(x, np.generic) else x for x in example_inputs)
    return (example_inputs,)


def _plain(tree: Any) -> Any:
    """Frozen dicts / nnx states -> plain nested dicts (stable, sorted flattening)."""
    if hasattr(tree, "items"):
        return {str(k): _plain(v) for k, v in tree.items()}
    return tree


def _leaf_names(tree: Any, collections: bool) -> list[str]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    full = [[_key(k) for k in path] for path, _ in leaves]
    if not collections:
        return [".".join(p) or "param" for p in full]
    short = [".".join(p[1:]) if len(p) > 1 else ".".join(p) for p in full]
    if len(set(short)) != len(short):
        return [".".join(p) for p in full]
    return short


def _key(k: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def check_supported(jaxpr: Any) -> None:
    """Scan the whole jaxpr (sub-jaxprs included); raise once, listing every missing primitive."""
    missing: dict[str, list] = {}

    def walk(jx: Any, prefix: str) -> None:
        jx = getattr(jx, "jaxpr", jx)
        for eqn in jx.eqns:
            name = eqn.primitive.name
            scope = _join(prefix, str(eqn.source_info.name_stack))
            if name in INLINE:
                walk(sub_jaxpr(eqn), scope)
            elif name == "cond":
                for branch in eqn.params["branches"]:
                    walk(branch, scope)
            elif name == "scan":
                walk(eqn.params["jaxpr"], scope)
            elif name == "while":
                walk(eqn.params["cond_jaxpr"], scope)
                walk(eqn.params["body_jaxpr"], scope)
            elif (DOMAIN, name) not in registry:
                entry = missing.setdefault(name, [0, scope])
                entry[0] += 1

    walk(jaxpr, "")
    if missing:
        raise UnsupportedOpError(
            BACKEND,
            [
                MissingOp(name, "jax", count, first_scope=scope or None)
                for name, (count, scope) in sorted(missing.items())
            ],
            registry_module=REGISTRY_MODULE,
        )


def _join(prefix: str, stack: str) -> str:
    return f"{prefix}/{stack}" if prefix and stack else prefix or stack


class _Context:
    """Translation state: the graph being built, scopes, and per-node layer info."""

    def __init__(self, classes: dict[str, type], modules: dict[str, Any], root: str | None):
        self.graph = ir.Graph([], [], nodes=[], name="main", opset_imports={"": OPSET})
        self.classes = classes
        self.modules = modules
        self.root = root
        self.scope = ""
        self.node_info: dict[str, dict[str, Any]] = {}
        # Symbolic dims: symbol -> (graph input, axis) it is read from; built Shape values.
        self.dim_sources: dict[str, tuple[ir.Value, int]] = {}
        self.dim_cache: dict[tuple[int, str], ir.Value] = {}
        self._count = 0
        self._prefixes = {
            "/".join(path.split("/")[:k]) for path in classes for k in range(1, path.count("/") + 2)
        }
        attention = [p for p, c in classes.items() if fl.KINDS.get(c.__name__) == "attention"]
        self._attention = sorted(attention, key=len)

    def resolve(self, stack: str) -> str:
        parts = [p for p in stack.split("/") if p]
        if self.root is not None and parts and parts[0] == self.root:
            parts = parts[1:]
        # Keep the name-stack segments that extend a module path; others are pushed by a
        # helper method (linen's ``VGG._conv_block``), a user's ``jax.named_scope`` or a
        # transformation (``jvp(...)``), and are not modules.
        kept: list[str] = []
        for part in parts:
            if "/".join([*kept, part]) in self._prefixes:
                kept.append(part)
        best = ""
        for i in range(len(kept), 0, -1):
            candidate = "/".join(kept[:i])
            if candidate in self.classes:
                best = candidate
                break
        for path in self._attention:  # an attention layer's body is its whole subtree
            if best == path or best.startswith(path + "/"):
                return path
        return best

    def op(self, op_type: str, inputs: Sequence[ir.Value | None], attrs=None, num_outputs=1):
        self._count += 1
        name = f"{op_type.lower()}_{self._count}"
        node = ir.Node(
            "",
            op_type,
            list(inputs),
            attributes=[ir.convenience.convert_attribute(k, v) for k, v in (attrs or {}).items()],
            num_outputs=num_outputs,
            name=name,
        )
        for i, out in enumerate(node.outputs):
            out.name = f"{name}_out{i}" if num_outputs > 1 else name
        if self.scope:
            node.metadata_props[SCOPE] = self.scope
            cls = self.classes.get(self.scope)
            if cls is not None:
                node.metadata_props[MODULE] = fl.class_name(cls)
        self.graph.append(node)
        return node.outputs[0] if num_outputs == 1 else tuple(node.outputs)

    def dropout(self, x: ir.Value) -> ir.Value:
        """An inference-mode ``Dropout`` node with the scope's Flax module rate."""
        rate = float(getattr(self.modules.get(self.scope), "rate", 0.0))
        return self.op("Dropout", [x, self.const(np.asarray(rate, np.float32))])

    def const(self, array: Any) -> ir.Value:
        return self.op("Constant", [], {"value": ir.tensor(np.asarray(array))})

    def i64(self, values: Any) -> ir.Value:
        return self.const(np.asarray(values, np.int64))

    def inline(self, closed: Any, inputs: Sequence[ir.Value]) -> list[ir.Value]:
        jx = getattr(closed, "jaxpr", closed)
        consts = [self.const(np.asarray(c)) for c in getattr(closed, "consts", [])]
        if jx.constvars:  # a closed sub-jaxpr binds its consts to its constvars
            return _translate_with_consts(self, jx, consts, list(inputs))
        return self.translate(jx, [*consts, *inputs])

    def value_of(self, env: dict, atom: Any) -> ir.Value:
        if hasattr(atom, "val"):  # a Literal
            return self.const(np.asarray(atom.val, dtype=atom.aval.dtype))
        return env[atom]

    def translate(self, jx: Any, inputs: Sequence[ir.Value]) -> list[ir.Value]:
        env: dict[Any, ir.Value] = dict(zip(jx.invars, inputs, strict=True))
        outer = self.scope
        prefix_stack = getattr(self, "_stack", "")
        eqns = list(jx.eqns)
        stacks = [_join(prefix_stack, str(e.source_info.name_stack)) for e in eqns]
        scopes = [self.resolve(s) for s in stacks]
        i = 0
        while i < len(eqns):
            self.scope = scopes[i]
            j = i
            kind = fl.KINDS.get(getattr(self.classes.get(scopes[i]), "__name__", ""))
            run_start = i == 0 or scopes[i - 1] != scopes[i]
            if kind in ("layer_norm", "batch_norm") and run_start:
                # Only the whole run of the layer's equations is one norm: never a suffix of it.
                while j + 1 < len(eqns) and scopes[j + 1] == scopes[i]:
                    j += 1
                if self._recover(kind, jx, eqns, i, j, env):
                    i = j + 1
                    continue
            eqn = eqns[i]
            args = [self.value_of(env, v) for v in eqn.invars]
            self._stack = stacks[i]
            try:
                if eqn.primitive.name in INLINE and eqn.params.get("name") == _DROPOUT_NAME:
                    outs = [self.dropout(args[-1])]
                else:
                    outs = handler(eqn.primitive.name)(self, eqn, args)
            except ConversionError as e:
                if e.scope is None:
                    e.scope = self.scope or None
                    e.op = e.op or eqn.primitive.name
                raise
            finally:
                self._stack = prefix_stack
            for var, val in zip(eqn.outvars, outs, strict=True):
                env[var] = val
            i += 1
        self.scope = outer
        return [self.value_of(env, v) for v in jx.outvars]

    # --- recovered layers ------------------------------------------------------------

    def _recover(self, kind, jx, eqns, i, j, env) -> bool:
        run = eqns[i : j + 1]
        made = {v for e in run for v in e.outvars}
        ext = []
        for e in run:
            for v in e.invars:
                if not hasattr(v, "val") and v not in made and v not in ext:
                    ext.append(v)
        later = {v for e in eqns[j + 1 :] for v in e.invars if not hasattr(v, "val")}
        later |= {v for v in jx.outvars if not hasattr(v, "val")}
        outs = [v for v in made if v in later]
        if len(outs) != 1 or any(e.primitive.name in INLINE for e in run):
            return False
        weights = {}
        data = []
        for v in ext:
            val = env[v]
            if val.is_initializer() and val.name:
                weights[val.name.rsplit(".", 1)[-1]] = val
            elif val.producer() is None or val.producer().op_type != "Constant":
                data.append(v)  # (constants, e.g. a divisor evaluated at trace time, are not)
        if len(data) != 1 or tuple(data[0].aval.shape) != tuple(outs[0].aval.shape):
            return False
        x = env[data[0]]
        dtype = np.dtype(data[0].aval.dtype)
        module = self.modules.get(self.scope)
        rank = len(data[0].aval.shape)
        if kind == "layer_norm":
            axes = getattr(module, "reduction_axes", -1)
            if axes not in (-1, (-1,), rank - 1, (rank - 1,)) or set(weights) - {"scale", "bias"}:
                return False
            if getattr(module, "feature_axes", -1) not in (-1, (-1,), rank - 1, (rank - 1,)):
                return False
            n = int(data[0].aval.shape[-1])
            scale = weights.get("scale") or self.const(np.ones((n,), dtype))
            bias = weights.get("bias") or self.const(np.zeros((n,), dtype))
            eps = float(getattr(module, "epsilon", 1e-6))
            y = self.op("LayerNormalization", [x, scale, bias], {"axis": -1, "epsilon": eps})
        else:
            if {"mean", "var"} - set(weights) or any(
                e.primitive.name.startswith("reduce") for e in run
            ):
                return False
            axis = getattr(module, "axis", -1)
            axis = axis % rank if isinstance(axis, int) else None
            if axis is None:
                return False
            n = int(data[0].aval.shape[axis])
            scale = weights.get("scale") or self.const(np.ones((n,), dtype))
            bias = weights.get("bias") or self.const(np.zeros((n,), dtype))
            perm = [0, axis, *[d for d in range(1, rank) if d != axis]] if rank > 1 else [0]
            moved = perm != list(range(rank))
            if moved:
                x = self.op("Transpose", [x], {"perm": perm})
            eps = float(getattr(module, "epsilon", 1e-5))
            y = self.op(
                "BatchNormalization",
                [x, scale, bias, weights["mean"], weights["var"]],
                {"epsilon": eps, "momentum": float(getattr(module, "momentum", 0.99))},
            )
            if moved:
                y = self.op("Transpose", [y], {"perm": [int(p) for p in np.argsort(perm)]})
        env[outs[0]] = y
        return True


def _dead_code_eliminated(closed: Any) -> Any:
    """The jaxpr without equations no output depends on (a module that draws unused random
    weights during ``apply``); the inputs stay as they are. Unchanged if jax cannot do it."""
    try:
        from jax._src.interpreters import partial_eval as pe

        jx, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
    except Exception:  # a private jax API: keep the full jaxpr rather than fail
        return closed
    if len(jx.invars) != len(closed.jaxpr.invars) or len(jx.constvars) != len(closed.consts):
        return closed
    return type(closed)(jx, closed.consts)


def _build(closed, tree, inputs, classes, modules, root, source, collections=True) -> ir.Model:
    closed = _dead_code_eliminated(closed)
    check_supported(closed)
    ctx = _Context(classes, modules, root)
    jx = closed.jaxpr
    names = _leaf_names(tree, collections)
    leaves = jax.tree_util.tree_leaves(tree)
    n_params = len(leaves)
    values: list[ir.Value] = []
    for name, leaf in zip(names, leaves, strict=True):
        arr = np.asarray(leaf)
        tensor = ir.tensor(arr, name=name)
        value = ir.Value(
            name=name, type=ir.TensorType(tensor.dtype), shape=tensor.shape, const_value=tensor
        )
        ctx.graph.register_initializer(value)
        values.append(value)
    in_leaves = jax.tree_util.tree_leaves(inputs)
    for k, (var, _leaf) in enumerate(zip(jx.invars[n_params:], in_leaves, strict=True)):
        dtype = np.dtype(var.aval.dtype)
        value = ir.Value(
            name=f"input_{k}" if len(in_leaves) > 1 else "input",
            type=ir.TensorType(ir.DataType.from_numpy(dtype)),
            shape=ir.Shape([ir_dim(d) for d in var.aval.shape]),
        )
        for axis, d in enumerate(var.aval.shape):
            if static_dim(d) is None and str(d) in (BATCH, SEQ):
                ctx.dim_sources.setdefault(str(d), (value, axis))
        ctx.graph.inputs.append(value)
        values.append(value)
    consts = [ctx.const(np.asarray(c)) for c in closed.consts]
    outs = (
        ctx.translate(jx, [*consts, *values] if jx.constvars else values)
        if not jx.constvars
        else _translate_with_consts(ctx, jx, consts, values)
    )
    for k, out in enumerate(outs):
        if out.is_graph_input() or out.is_initializer() or out in ctx.graph.outputs:
            out = ctx.op("Identity", [out])
        out.name = f"output_{k}" if len(outs) > 1 else "output"
        ctx.graph.outputs.append(out)
    fl.mark_weights(ctx.graph, classes)
    fl.mark_layers(ctx.graph, classes, modules, ctx.node_info)
    model = ir.Model(ctx.graph, ir_version=10, producer_name="xconv")
    model.metadata_props["xconv.source"] = source or "jax"
    model.metadata_props["xconv.modules"] = json.dumps(
        {p: fl.class_name(c) for p, c in sorted(classes.items())}, sort_keys=True
    )
    from onnx_ir.passes.common import RemoveUnusedNodesPass, ShapeInferencePass

    RemoveUnusedNodesPass()(model)
    with contextlib.suppress(Exception):
        ShapeInferencePass()(model)
    if ctx.dim_sources:  # inference may lose a symbol (Reshape to -1): jax knows each one
        for out, var in zip(ctx.graph.outputs, jx.outvars, strict=True):
            out.shape = ir.Shape([ir_dim(d) for d in var.aval.shape])
    return model


def _translate_with_consts(ctx, jx, consts, values):
    env_inputs = dict(zip(jx.constvars, consts, strict=True))
    # Bind constvars by translating a jaxpr view whose invars include them.
    fake = type("J", (), {})()
    fake.invars = [*jx.constvars, *jx.invars]
    fake.eqns = jx.eqns
    fake.outvars = jx.outvars
    return ctx.translate(fake, [*env_inputs.values(), *values])


__all__ = ["check_supported", "from_flax", "from_jax"]

"""IR -> a pure, jittable JAX function ``fn(params, *inputs, rng=None) -> tuple``.

Nodes whose inputs are all known at trace time (shape arithmetic, constants) are evaluated
eagerly under ``jax.ensure_compile_time_eval`` and kept as numpy, so the shape bookkeeping
exporters leave behind folds away under ``jax.jit`` and shape-like inputs stay static.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx_ir as ir

from xconv.converters.jax.channels_last import NATIVE, ChannelsLast
from xconv.converters.jax.context import JaxContext
from xconv.converters.jax.kernel import to_bf16
from xconv.converters.ops import precision
from xconv.converters.ops.arrays import is_static
from xconv.converters.ops.context import find_handler, graph_env, handler_errors
from xconv.converters.registry import Registry, as_tuple
from xconv.errors import ConversionError
from xconv.ir.metadata import ROLE, get_scope
from xconv.ir.naming import flatten, nest
from xconv.ir.passes._utils import is_weight

logger = logging.getLogger(__name__)

#: Ops never folded at trace time, even with constant inputs: their results vary per call.
_STATEFUL = frozenset(
    {
        "RandomNormal",
        "RandomUniform",
        "RandomNormalLike",
        "RandomUniformLike",
        "Bernoulli",
        "Multinomial",
        "Dropout",
    }
)


#: Float inputs that configure an op rather than carry data (scales, regions of interest):
#: an initializer used only there is a constant, so it stays static under ``jax.jit``.
def _to_static(value: Any) -> Any:
    if value is None or isinstance(value, np.ndarray):
        return value
    if isinstance(value, list):
        return [_to_static(v) for v in value]
    if isinstance(value, jax.Array):
        return np.asarray(value)
    return value


def as_input(x: Any) -> Any:
    """A model input as the interpreter takes it: jax and numpy arrays as they are, anything
    else array-like (a torch tensor, a list) as a numpy array of its values (a tensor that
    records gradients read through ``detach()``; a dtype numpy lacks, such as torch's
    bfloat16, through DLPack)."""
    if isinstance(x, jax.Array | np.ndarray | np.generic):
        return x
    if callable(getattr(x, "detach", None)):  # autograd: the values, not the graph
        x = x.detach()
    try:
        return np.asarray(x)
    except TypeError:
        if hasattr(x, "__dlpack__"):
            return jnp.from_dlpack(x)
        raise


def _to_jax(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic) and value.dtype.kind not in "OSUV":
        return jnp.asarray(value)
    if isinstance(value, list):
        return [_to_jax(v) for v in value]
    return value


@dataclass
class Interpreter:
    """Evaluates an IR graph with a handler registry; one instance per converted model."""

    model: ir.Model
    registry: Registry
    constants: dict[ir.Value, Any] = field(default_factory=dict)
    capture: Callable[[ir.Node, tuple[Any, ...]], None] | None = None
    #: Compute dtype: None (float32, as the graph says) or ``"bfloat16"`` (see ``precision``).
    dtype: str | None = None
    #: Activation layouts of this run (None: every value in the IR's layout).
    layout: ChannelsLast | None = None

    @property
    def opset(self) -> int:
        return self.model.opset_imports.get("", 1)

    def run_graph(
        self,
        graph: ir.Graph,
        env: dict[ir.Value, Any],
        inputs: Iterable[Any],
        rng: Any = None,
    ) -> list[Any]:
        """Run ``graph`` given values for its inputs; ``env`` holds enclosing-scope values."""
        env = graph_env(graph, env, inputs, lambda a: a)
        for index, node in enumerate(graph):
            outputs = self.run_node(node, env, index, rng)
            for value, out in zip(node.outputs, outputs, strict=False):
                env[value] = out
        try:
            return [self._source(v, env[v]) for v in graph.outputs]
        except KeyError as e:
            raise ConversionError(f"graph output {e.args[0].name!r} is never computed") from None

    def run_node(
        self, node: ir.Node, env: dict[ir.Value, Any], index: int, rng: Any
    ) -> tuple[Any, ...]:
        handler, version = find_handler(self.registry, self.model.opset_imports, node)
        attrs = handler.parse_attributes(node)
        args = []
        for v in node.inputs:
            if v is None or v.name == "":
                args.append(None)
                continue
            if v not in env:
                raise ConversionError(
                    f"input {v.name!r} is used before it is computed (graph not sorted?)",
                    op=node.op_type,
                    node=node.name,
                    scope=get_scope(node),
                )
            args.append(env[v])

        def run_subgraph(graph: ir.Graph, sub_inputs: Iterable[Any]) -> list[Any]:
            return self.run_graph(graph, env, sub_inputs, rng)

        ctx = JaxContext(node, version, run_subgraph, rng, index)
        # A subgraph may read run-time values of the enclosing scope, so a node with one
        # (If/Loop/Scan/SequenceMap) is never folded as a whole; its inner nodes still are.
        has_subgraph = any(
            a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
            for a in node.attributes.values()
            if not a.is_ref()
        )
        static = (
            node.op_type not in _STATEFUL and not has_subgraph and all(is_static(a) for a in args)
        )
        perm = None
        if self.layout is not None and static:  # folded on the IR's layout
            args = self.layout.sources(node, args)
        elif self.layout is not None:
            args, perm = self.layout.prepare(node, args)
        lowered = None
        if self.dtype is not None and not static:
            args, attrs, lowered = _lower(node, args, attrs)
        with handler_errors(node):
            if lowered is not None and not isinstance(lowered, bool):
                outputs = lowered  # a Cast to float32 of a bfloat16 activation: no-op
            elif static:
                with jax.ensure_compile_time_eval():
                    outputs = as_tuple(handler.fn(ctx, *args, **attrs))
                outputs = tuple(_to_static(o) for o in outputs)
            else:
                native = None
                if perm is not None and node.op_type in NATIVE:
                    native = self.layout.native(node, args, attrs, perm)  # type: ignore[union-attr]
                outputs = native or as_tuple(handler.fn(ctx, *args, **attrs))
        if lowered is True:  # a float32 op (norm, softmax): its result in bfloat16
            outputs = tuple(_as_low(o) if _is_f32(o) else o for o in outputs)
        if self.layout is not None:
            outputs = self.layout.finish(node, outputs, perm)
        if self.capture is not None:
            self.capture(
                node,
                tuple(self._source(v, o) for v, o in zip(node.outputs, outputs, strict=False)),
            )
        return outputs

    def _source(self, value: ir.Value, a: Any) -> Any:
        """``value`` as computed (``a``) in the IR's layout."""
        return a if self.layout is None else self.layout.source(value, a)


def _is_f32(a: Any) -> bool:
    return isinstance(a, np.ndarray | np.generic | jax.Array) and a.dtype == np.float32


def _is_low(a: Any) -> bool:
    return isinstance(a, np.ndarray | np.generic | jax.Array) and a.dtype == jnp.bfloat16


def _as_low(a: Any) -> Any:
    return jnp.asarray(a, jnp.bfloat16)


def _lower(node: ir.Node, args: list[Any], attrs: dict[str, Any]) -> tuple[list, dict, Any]:
    """Apply the bfloat16 rules of :mod:`~xconv.converters.ops.precision` to one node that
    runs at run time: returns its operands, its attributes and True (round its float32
    results to bfloat16), a tuple (its outputs, already known) or False."""
    op = node.op_type
    floats = [
        i for i in precision.data_operands(op, len(args)) if _is_f32(args[i]) or _is_low(args[i])
    ]
    if all(is_static(args[i]) for i in floats):
        return args, attrs, False  # no run-time float operand: nothing is computed in float
    args = list(args)
    how = precision.mode(op)
    if how == "float32":
        for i in floats:
            if _is_low(args[i]):
                args[i] = jnp.asarray(args[i], jnp.float32)
        return args, attrs, True
    if how == "cast":
        target = attrs.get("to") if op == "Cast" else node.inputs[1].dtype
        if _is_low(args[0]) and target is not None and ir.DataType(target) == ir.DataType.FLOAT:
            return args, attrs, (args[0],)
        return args, attrs, False
    targets = _broadcast_targets(op, args, attrs)
    for i in floats:
        if _is_f32(args[i]):
            a, shape = args[i], targets.get(i)
            if shape is not None and not is_static(a) and a.shape != shape:
                # Cast after broadcasting (the same values): the gradient's sum over the
                # broadcast axes then accumulates in float32. A bfloat16 sum is what XLA:CPU
                # runs as a tree of unvectorised reduce-windows: the bias gradients were 10 %
                # of the transformer benchmark's bf16 training step.
                a = jnp.broadcast_to(a, shape)
            args[i] = to_bf16(a) if i == 1 and op == "Conv" else _as_low(a)  # a kernel
    if op in precision.FLOAT32_SOFTMAX and attrs.get("softmax_precision") is None:
        attrs = {**attrs, "softmax_precision": int(ir.DataType.FLOAT)}
    return args, attrs, False


def _broadcast_targets(op: str, args: list[Any], attrs: dict[str, Any]) -> dict[int, tuple]:
    """Operand index -> the shape it is broadcast to (its node's result's), for the
    elementwise ops that combine an activation with a parameter (a bias, a scale) and
    ``Gemm``'s ``C``."""
    if op in precision.BROADCASTING:
        try:
            shape = tuple(np.broadcast_shapes(*(np.shape(a) for a in args)))
        except ValueError:
            return {}  # the handler names the mismatch
        return dict.fromkeys(range(len(args)), shape)
    if op == "Gemm" and len(args) == 3 and args[2] is not None:
        a, b = args[0], args[1]
        m = a.shape[1] if attrs.get("transA") else a.shape[0]
        n = b.shape[0] if attrs.get("transB") else b.shape[1]
        return {2: (m, n)}
    return {}


@dataclass(frozen=True, eq=False)
class JaxFunction:
    """The converted function: ``fn(params, *inputs, rng=None) -> tuple of outputs``.

    ``inputs`` are jax or numpy arrays, or anything array-like (a torch tensor: its values).

    Pure: works under ``jax.jit``, ``jax.grad`` and ``jax.vmap``. ``params`` is a nested dict
    keyed by the source scope path of each weight.
    """

    model: ir.Model
    registry: Registry
    weight_names: tuple[str, ...]
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    #: Compute dtype: None (float32) or ``"bfloat16"`` (float32 params, bfloat16 compute).
    dtype: str | None = None
    #: ``"HWIO"``: the convolution kernels (and ``Gemm`` ``transB=1`` weights) named in
    #: ``kernel_perms`` are stored permuted, or ``"onnx"`` (params in the IR's layouts); see
    #: :func:`to_jax`'s ``kernel_layout``.
    kernel_layout: str = "onnx"
    #: weight name -> the permutation from its IR (OIHW) layout to the stored one.
    kernel_perms: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    #: Hold activations channels-last from the first convolution on (see
    #: :mod:`~xconv.converters.jax.channels_last`); inputs, outputs and intermediates keep
    #: the IR's layout either way.
    channels_last: bool = True

    def __call__(self, params: Mapping[str, Any], *inputs: Any, rng: Any = None) -> tuple:
        return tuple(_to_jax(o) for o in self._run(params, inputs, rng, None))

    def intermediates(
        self, params: Mapping[str, Any], *inputs: Any, rng: Any = None
    ) -> dict[str, Any]:
        """Every node output by value name, plus the graph outputs (for parity localisation)."""
        seen: dict[str, Any] = {}

        def capture(node: ir.Node, outputs: tuple[Any, ...]) -> None:
            for v, o in zip(node.outputs, outputs, strict=False):
                if v.name:
                    seen[v.name] = o

        self._run(params, inputs, rng, capture)
        return seen

    def _run(self, params, inputs, rng, capture) -> list[Any]:
        graph = self.model.graph
        if len(inputs) != len(self.input_names):
            raise TypeError(
                f"the model takes {len(self.input_names)} input(s) {list(self.input_names)}, "
                f"got {len(inputs)}"
            )
        # A sequence or optional input (a list, None) is taken as it is; a tensor input as
        # any array-like.
        types = {v.name: v.type for v in graph.inputs}
        inputs = [
            x if isinstance(types.get(n), ir.SequenceType | ir.OptionalType) else as_input(x)
            for n, x in zip(self.input_names, inputs, strict=True)
        ]
        flat = flatten(params, self.weight_names) if self.weight_names else {}
        env: dict[ir.Value, Any] = {}
        by_name = graph.initializers
        layout = ChannelsLast() if self.channels_last else None
        for name, x in flat.items():
            perm = self.kernel_perms.get(name)
            if perm is not None and layout is not None:
                # held as stored: the channels-last Conv reads the kernel in place, so its
                # gradient is the stored param's too (no transpose forward or backward)
                layout.held[by_name[name]] = perm
            elif perm is not None:
                # Back to the IR's layout inside the trace: XLA lays the convolution's kernel
                # out spatial-first itself, so this transpose of a (*k, I, O) kernel is a free
                # relabelling in a forward pass, where a stored OIHW kernel costs a copy.
                x = jnp.transpose(x, tuple(int(i) for i in np.argsort(perm)))
            env[by_name[name]] = x
        interp = Interpreter(
            self.model, self.registry, capture=capture, dtype=self.dtype, layout=layout
        )
        real_inputs = [v for v in graph.inputs if not v.is_initializer()]
        for value, x in zip(real_inputs, inputs, strict=True):
            env[value] = _as_low(x) if self.dtype is not None and _is_f32(x) else x
        # Initializers that are not weights become numpy constants in run_graph.
        return interp.run_graph(graph, env, [], rng)


def to_jax(
    model: ir.Model,
    *,
    registry: Registry | None = None,
    mesh: Any = None,
    rules: Any = None,
    dtype: Any = None,
    kernel_layout: str = "HWIO",
    params: Mapping[str, Any] | None = None,
) -> tuple[JaxFunction, dict]:
    """Convert an IR model to a pure JAX function and its parameters.

    Args:
        model: The IR model (see :func:`xconv.load`).
        registry: Handler registry to use (defaults to the JAX backend's).
        mesh: A ``jax.sharding.Mesh`` with axes ``("data", "model")`` or ``"DATAxMODEL"``:
            place the params on it (see :mod:`xconv.sharding`); ``fn`` is then a jitted
            ``ShardedFunction`` splitting inputs' batch over ``data``.
        rules: ``"fsdp"``, ``"tp"``, ``"fsdp+tp"`` (default with a mesh) or a rule table.
        dtype: Compute dtype: ``"float32"`` (default) or ``"bfloat16"``: params stay
            float32, matmuls / convolutions / attention run on bfloat16 operands, norms and
            softmax in float32, outputs come back bfloat16 (see
            :mod:`xconv.converters.ops.precision`).
        kernel_layout: ``"HWIO"`` (default): a kernel used only as ``Conv``'s weight is
            stored ``(*k, I, O)``, the layout XLA's CPU convolution reads, and a ``Gemm``
            ``transB=1`` weight ``(I, O)``; ``fn.kernel_perms`` lists the permuted weights and
            their permutations from the IR's layout (a weight read through ``Transpose``,
            ``x @ W.T``, stays ``(O, I)``: training steps ran 5-20 % faster so; see
            docs/design.md). ``"onnx"``: every param in the IR's layout, a convolution
            kernel ``(O, I, *k)`` as the source stores it; every jitted call then copies
            each kernel to XLA's layout (ResNet-50 batch 1 on CPU: 53 copies, 112 ms a call
            against 59 ms). XLA keeps a parameter's physical layout
            only as a copy back to row-major on CPU, so the stored shape is the only lever.
            The names and the computed function are the same at either layout; one layout on
            every backend, so a checkpoint saved on one machine loads on another. A mesh
            shards either (the sharding rules permute their specs with the kernel).
        params: Weights to use in place of the model's, nested as ``to_jax`` returns them
            and stored in ``kernel_layout`` (a saved ``params.msgpack`` read back, as a
            ``torch-to-jax`` folder's ``load()`` does): the model's own weights are then not
            read. Their names and shapes are checked against the model's; arrays are taken
            as they are (``jax.device_put``: an aligned numpy array is not copied on CPU).

    Returns:
        ``(fn, params)``: call ``fn(params, *inputs)`` to get a tuple of outputs. ``params``
        nests weights by source scope path: ``params["layer1"]["0"]["conv1"]["weight"]``.

    Raises:
        UnsupportedOpError: naming every op the backend lacks, before any work.
    """
    from xconv.converters.jax.registry import registry as default_registry

    low = precision.resolve_dtype(dtype)
    reg = registry or default_registry
    reg.check_supported(model)
    graph = model.graph
    annotated = any(ROLE in v.metadata_props for v in graph.initializers.values())
    shapes = {
        name: tuple(v.const_value.shape)
        for name, v in graph.initializers.items()
        if v.const_value is not None and is_weight(v, annotated)
    }
    input_names = tuple(v.name for v in graph.inputs if not v.is_initializer())
    perms = _kernel_perms(graph, shapes, kernel_layout)
    if params is None:
        weights = {name: graph.initializers[name].const_value.numpy() for name in shapes}
        for name, perm in perms.items():
            weights[name] = np.ascontiguousarray(np.transpose(weights[name], perm))
    else:
        weights = _given(params, shapes, perms)
    fn = JaxFunction(
        model=model,
        registry=reg,
        weight_names=tuple(sorted(shapes)),
        input_names=input_names,
        output_names=tuple(v.name for v in graph.outputs),
        dtype=low,
        kernel_layout=kernel_layout,
        kernel_perms=perms,
    )
    if mesh is not None:  # rules without a mesh are inert
        from xconv.sharding.place import to_jax_sharded

        return to_jax_sharded(model, fn, nest(weights), mesh, rules)
    # given params are taken as they are (JAX on CPU does not copy an aligned numpy array);
    # the model's own, read from its file, are copied
    place = jax.device_put if params is not None else jnp.asarray
    return fn, jax.tree_util.tree_map(place, nest(weights))


def _given(
    params: Mapping[str, Any], shapes: Mapping[str, tuple], perms: Mapping[str, tuple[int, ...]]
) -> dict[str, Any]:
    """``to_jax(params=...)``'s weights by name, each checked against the model's shape in the
    stored layout; every mismatch named at once."""
    try:
        flat = flatten(params, shapes)
    except (KeyError, TypeError) as e:
        raise ConversionError(
            f"to_jax(params=...): no weight at {e} of the model's {len(shapes)}; pass the "
            "tree to_jax returns for this model (nested by source scope path)"
        ) from e
    wrong = []
    for name, shape in shapes.items():
        want = tuple(shape[i] for i in perms[name]) if name in perms else shape
        if tuple(np.shape(flat[name])) != want:
            wrong.append(f"{name}: {tuple(np.shape(flat[name]))}, the model's {want}")
    if wrong:
        raise ConversionError(
            "to_jax(params=...): shapes differ from the model's: " + "; ".join(wrong)
        )
    return flat


#: ``to_jax``'s ``kernel_layout`` values.
KERNEL_LAYOUTS = ("onnx", "HWIO")


def _kernel_perms(
    graph: ir.Graph, shapes: Mapping[str, tuple], kernel_layout: str
) -> dict[str, tuple[int, ...]]:
    """The weights stored permuted for ``kernel_layout``: for ``"HWIO"``, each weight of rank
    >= 3 whose every use is ``Conv``'s weight input, ``(O, I, *k)`` -> ``(*k, I, O)``, and
    each 2-D weight whose every use is ``Gemm``'s ``transB=1`` B, ``(O, I)`` -> ``(I, O)``."""
    if kernel_layout not in KERNEL_LAYOUTS:
        raise ConversionError(
            f"to_jax: kernel_layout={kernel_layout!r}: expected one of {list(KERNEL_LAYOUTS)}"
        )
    if kernel_layout == "onnx":
        return {}
    perms: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        rank = len(shape)
        value = graph.initializers[name]
        uses = list(value.uses())
        if (
            value.is_graph_output()
            or not uses
            or any(i != 1 or n.domain not in ("", "ai.onnx") for n, i in uses)
        ):
            continue
        if rank >= 3 and all(n.op_type == "Conv" for n, _ in uses):
            perms[name] = (*range(2, rank), 1, 0)
        elif rank == 2 and all(n.op_type == "Gemm" and _trans_b(n) for n, _ in uses):
            perms[name] = (1, 0)
    return perms


def _trans_b(node: ir.Node) -> bool:
    attr = node.attributes.get("transB")
    return attr is not None and bool(attr.value)

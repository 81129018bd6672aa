"""TensorFlow -> IR: tf2onnx (opset 18) then ``xconv.load`` (opset 23), then annotations.

Route: every source becomes a concrete ``tf.function`` (or, for a frozen ``.pb``, a
GraphDef), which tf2onnx translates at opset 18. Two things keep the source's structure:

* Keras weights enter the traced function as *inputs* (``Model.stateless_call``), so
  tf2onnx never folds them (a BatchNorm's ``gamma * rsqrt(var + eps)`` would otherwise become
  one anonymous constant); afterwards they become initializers named by their Keras variable
  paths (``dense_1/kernel``) in Keras layout (Dense ``IO``, Conv2D ``HWIO``).
* tf2onnx's graph optimizers are limited to those that keep weight identity (transpose
  push-down, identity and back-to-back removal); ``fold_constants`` and
  ``merge_duplication`` (which merges equal zero biases across layers) are off, and so is
  grappler's constant folding.

Then the importer names each node's ``xconv.scope`` after its Keras layer, replaces the
decomposed BatchNormalization / LayerNormalization arithmetic with the single ONNX node,
pushes the NHWC<->NCHW transposes through elementwise activations so consecutive convs meet
without transposes, canonicalises, and marks layers (:mod:`xconv.converters.tf.keras_layers`).

tf2onnx gaps worked around: ``Erfc`` (exact GELU) is rewritten as ``1 - Erf``; captured
eager tensors are frozen as constants; output opset is 18 (tf2onnx's ceiling here).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import tensorflow as tf

from xconv.converters.tf import keras_layers
from xconv.converters.tf.inline import inline_calls
from xconv.errors import ConversionError, InvalidModelError
from xconv.ir.metadata import MODULE, SCOPE

logger = logging.getLogger(__name__)

#: tf2onnx's output opset (its newest well-tested one); ``xconv.load`` upgrades it to 23.
TF2ONNX_OPSET = 18
#: tf2onnx optimizers that never merge or fold weights.
SAFE_OPTIMIZERS = ("optimize_transpose", "remove_identity", "remove_back_to_back")
#: Keras layers recognised as one unit: their sublayers share the layer's scope.
_ATOMIC = frozenset({"MultiHeadAttention", "SeparableConv2D", "SeparableConv1D"})
_WEIGHT_PREFIX = "xconv_w"
_BINARY = frozenset({"Add", "Sub", "Mul", "Div", "Max", "Min"})
_UNARY = frozenset(
    {
        "Relu",
        "Sigmoid",
        "Tanh",
        "LeakyRelu",
        "Elu",
        "Selu",
        "Softplus",
        "HardSigmoid",
        "HardSwish",
        "Neg",
        "Abs",
        "Exp",
        "Erf",
        "Clip",
    }
)


def from_tf(obj: Any, example_inputs: Any = None) -> ir.Model:
    """Convert a TensorFlow / Keras model to the IR.

    Args:
        obj: A Keras 3 model (functional, Sequential or subclassed), a ``tf.function`` with an
            ``input_signature`` (or example inputs), a SavedModel directory, a ``.keras`` file
            or a frozen GraphDef ``.pb`` file.
        example_inputs: An array or a tuple of arrays; fixes the input signature (the batch
            dimension is left dynamic). Required for a subclassed model never called and for
            a ``tf.function`` without a signature.

    Returns:
        The model as an ``onnx_ir.Model`` at opset ``xconv.ir.OPSET``.

    Raises:
        ConversionError: The object cannot be traced or translated.
    """
    examples = _as_examples(example_inputs)
    if isinstance(obj, str | os.PathLike):
        path = Path(obj)
        if path.is_dir():
            return _from_saved_model(path, examples)
        if path.suffix == ".keras":
            import keras

            return _from_keras(keras.models.load_model(path), examples)
        if path.suffix == ".pb" and path.is_file():
            return _from_graph_def_file(path)
        raise ConversionError(
            f"{path}: expected a SavedModel directory, a .keras file or a frozen .pb GraphDef"
        )
    if _is_keras_model(obj):
        return _from_keras(obj, examples)
    if hasattr(obj, "get_concrete_function"):
        return _from_function(obj, examples)
    raise ConversionError(
        f"from_tf takes a Keras model, a tf.function, a SavedModel directory, a .keras or a "
        f".pb file, got {type(obj).__name__}"
    )


def load_source(source: Any) -> tuple[Any, Any]:
    """Open a TF source for conversion and checking: ``(object for from_tf, reference)``.

    The reference is a TensorFlow callable (a Keras model or a ``tf.function``) returning the
    model's outputs, for the parity check. Paths are opened once (a ``.keras`` file becomes
    the loaded model; a SavedModel or ``.pb`` stays a path, its reference a function).
    """
    if not isinstance(source, str | os.PathLike):
        return source, source
    path = Path(source)
    try:
        return _open(path)
    except ConversionError:
        raise
    except MemoryError as e:
        raise InvalidModelError(f"{path} declares data larger than memory: {e}") from e
    except Exception as e:
        # Keras, TensorFlow and protobuf raise every kind of error for a corrupt file.
        text = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise InvalidModelError(
            f"{path} is not a readable TensorFlow model (SavedModel folder, .keras or frozen "
            f".pb): {type(e).__name__}: {text}"
        ) from e


@contextlib.contextmanager
def _quiet_tf():
    """TensorFlow logs tracebacks (absl, up to ERROR: "Fingerprint was found, but there was
    an error when reading the proto") for unreadable SavedModels before raising or carrying
    on; the raised error is reported instead."""
    loggers = [logging.getLogger(n) for n in ("tensorflow", "absl")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _open(path: Path) -> tuple[Any, Any]:
    if path.suffix == ".keras" and path.is_file():
        import keras

        # safe_mode (the default, said out loud): a Lambda layer's pickled code is refused.
        with _quiet_tf():
            model = keras.models.load_model(path, safe_mode=True)
        return model, model
    if path.is_dir():
        with _quiet_tf():
            loaded = tf.saved_model.load(str(path))
        sig = (getattr(loaded, "signatures", {}) or {}).get("serving_default")
        if sig is None:
            return path, loaded.__call__
        names = sorted(sig.structured_input_signature[1])

        @tf.function
        def saved(*xs):
            out = sig(**dict(zip(names, xs, strict=True)))
            return [out[k] for k in sorted(out)]

        saved._xconv_loaded = loaded  # keeps the variables alive
        return path, saved
    if path.suffix == ".pb" and path.is_file():
        graph_def = tf.compat.v1.GraphDef()
        graph_def.ParseFromString(path.read_bytes())
        inputs, outputs = _graph_def_io(graph_def)
        wrapped = tf.compat.v1.wrap_function(
            lambda: tf.compat.v1.import_graph_def(graph_def, name=""), []
        )
        return path, wrapped.prune(
            [wrapped.graph.get_tensor_by_name(n) for n in inputs],
            [wrapped.graph.get_tensor_by_name(n) for n in outputs],
        )
    return path, None


# --- sources -----------------------------------------------------------------------------


def _as_examples(example_inputs: Any) -> tuple[np.ndarray, ...] | None:
    if example_inputs is None:
        return None
    if isinstance(example_inputs, tuple | list):
        return tuple(np.asarray(x) for x in example_inputs)
    return (np.asarray(example_inputs),)


def _is_keras_model(obj: Any) -> bool:
    try:
        import keras
    except ImportError:
        return False
    return isinstance(obj, keras.Model)


def _spec(x: np.ndarray, name: str) -> tf.TensorSpec:
    shape = [None, *x.shape[1:]] if x.ndim else []
    return tf.TensorSpec(shape, tf.as_dtype(x.dtype), name=name)


def _keras_specs(model: Any, examples: tuple[np.ndarray, ...] | None) -> list[tf.TensorSpec]:
    if examples is not None:
        return [_spec(x, f"input_{i}") for i, x in enumerate(examples)]
    inputs = getattr(model, "inputs", None)
    if not inputs:
        raise ConversionError(
            f"{type(model).__name__} has no declared inputs (subclassed model): pass "
            "example_inputs to from_tf"
        )
    return [
        tf.TensorSpec([None, *t.shape[1:]], t.dtype, name=f"input_{i}")
        for i, t in enumerate(inputs)
    ]


def _from_keras(model: Any, examples: tuple[np.ndarray, ...] | None) -> ir.Model:
    specs = _keras_specs(model, examples)
    if not model.built or not model.variables:
        if examples is None:
            raise ConversionError("the Keras model is not built: pass example_inputs")
        model(*examples) if len(examples) > 1 else model(examples[0])
    trainable = list(model.trainable_variables)
    frozen = list(model.non_trainable_variables)
    variables = trainable + frozen
    n = len(trainable)
    single = len(specs) == 1

    kwargs = {"training": False} if _takes_training(model) else {}

    def call(*args):
        xs, ws = args[: len(specs)], list(args[len(specs) :])
        out, _ = model.stateless_call(ws[:n], ws[n:], xs[0] if single else list(xs), **kwargs)
        return out

    weight_specs = [
        tf.TensorSpec(v.shape, tf.as_dtype(v.dtype), name=f"{_WEIGHT_PREFIX}{i}")
        for i, v in enumerate(variables)
    ]
    proto = _convert_function(tf.function(call), [*specs, *weight_specs])
    model_ir = _load(proto)
    owners = _owners(model, variables)
    _inputs_to_weights(model_ir.graph, variables)
    layers_by_path = _layer_paths(model)
    _set_scopes(model_ir.graph, owners, layers_by_path)
    _split_separable(model_ir.graph, owners)
    _replace_norms(model_ir.graph, owners)
    _split_activations(model_ir.graph, owners)
    _finish(model_ir, "keras")
    keras_layers.annotate_weights(model_ir.graph, owners)
    _canonicalize(model_ir)
    weights: dict[str, dict[str, str]] = {}
    scopes: dict[str, Any] = {}
    for path, (scope, layer, leaf) in owners.items():
        weights.setdefault(scope, {})[leaf] = path
        scopes[scope] = layer
    for path, layer in layers_by_path.items():
        scopes.setdefault(path, layer)
    keras_layers.annotate_layers(model_ir.graph, scopes, weights)
    return model_ir


def _takes_training(model: Any) -> bool:
    flag = getattr(model, "_call_has_training_arg", None)
    if flag is not None:
        return bool(flag)
    import inspect

    return "training" in inspect.signature(model.call).parameters


def _from_function(fn: Any, examples: tuple[np.ndarray, ...] | None) -> ir.Model:
    signature = getattr(fn, "input_signature", None)
    if examples is not None:
        specs = [_spec(x, f"input_{i}") for i, x in enumerate(examples)]
    elif signature:
        specs = list(signature)
    else:
        raise ConversionError(
            "the tf.function has no input_signature: give it one or pass example_inputs"
        )
    concrete = fn.get_concrete_function(*specs)
    captured = {id(v.handle) if hasattr(v, "handle") else id(v): v for v in concrete.variables}
    proto = _convert_function(fn, specs)
    model = _load(proto)
    _name_by_value(model.graph, list(captured.values()))
    _finish(model, "tf.function")
    _canonicalize(model)
    return model


def _from_saved_model(path: Path, examples: tuple[np.ndarray, ...] | None) -> ir.Model:
    try:
        loaded = tf.saved_model.load(str(path))
    except Exception as e:
        raise ConversionError(f"cannot load the SavedModel {path}: {_first_line(e)}") from e
    signatures = getattr(loaded, "signatures", {}) or {}
    if "serving_default" in signatures:
        sig = signatures["serving_default"]
        specs = [s for s in sig.structured_input_signature[1].values()] or list(
            sig.structured_input_signature[0]
        )
        names = sorted(sig.structured_input_signature[1])

        @tf.function
        def fn(*xs):
            out = sig(**dict(zip(names, xs, strict=True)))
            return [out[k] for k in sorted(out)]

        specs = [sig.structured_input_signature[1][k] for k in names] or specs
        proto = _convert_function(fn, list(specs))
    elif callable(loaded) and hasattr(loaded.__call__, "get_concrete_function"):
        return _from_function(loaded.__call__, examples)
    else:
        raise ConversionError(f"the SavedModel {path} has no serving_default signature")
    model = _load(proto)
    _name_by_value(model.graph, list(sig.variables))
    _finish(model, "saved_model")
    _canonicalize(model)
    return model


def _from_graph_def_file(path: Path) -> ir.Model:
    from tf2onnx import convert

    graph_def = tf.compat.v1.GraphDef()
    try:
        graph_def.ParseFromString(path.read_bytes())
    except Exception as e:
        raise ConversionError(f"{path} is not a GraphDef: {_first_line(e)}") from e
    inputs, outputs = _graph_def_io(graph_def)
    if not inputs or not outputs:
        raise ConversionError(f"{path}: no Placeholder inputs or no outputs found")
    try:
        with _quiet():
            proto, _ = convert.from_graph_def(
                graph_def,
                input_names=inputs,
                output_names=outputs,
                opset=TF2ONNX_OPSET,
                custom_op_handlers=_custom_handlers(),
            )
    except Exception as e:
        raise ConversionError(f"tf2onnx could not translate {path}: {_first_line(e)}") from e
    model = _load(proto)
    _finish(model, "graph_def")
    _canonicalize(model)
    return model


def _graph_def_io(graph_def) -> tuple[list[str], list[str]]:
    """Placeholders in; nodes nothing consumes out."""
    consumed = {i.split(":")[0].lstrip("^") for n in graph_def.node for i in n.input}
    inputs = [f"{n.name}:0" for n in graph_def.node if n.op == "Placeholder"]
    outputs = [
        f"{n.name}:0"
        for n in graph_def.node
        if n.name not in consumed and n.op not in ("Placeholder", "Const", "NoOp")
    ]
    return inputs, outputs


# --- tf2onnx -----------------------------------------------------------------------------


def _convert_function(fn: Any, specs: Sequence[tf.TensorSpec]):
    """Freeze and translate ``fn`` without grappler's or tf2onnx's weight-folding passes."""
    from tensorflow.python.framework.convert_to_constants import (
        convert_variables_to_constants_v2,
    )
    from tf2onnx import convert, optimizer, tf_loader

    if not isinstance(fn, tf.types.experimental.PolymorphicFunction):
        fn = tf.function(fn)
    try:
        concrete = fn.get_concrete_function(*specs)
    except Exception as e:
        raise ConversionError(f"TensorFlow could not trace the model: {_first_line(e)}") from e
    captured = _captured_constants(concrete)
    inputs = [t.name for t in concrete.inputs if t.dtype != tf.resource and t.name not in captured]
    outputs = [t.name for t in concrete.outputs if t.dtype != tf.resource]
    optimizers = {k: v for k, v in optimizer._get_optimizers().items() if k in SAFE_OPTIMIZERS}
    try:
        with tf.device("/cpu:0"), _quiet():
            frozen = convert_variables_to_constants_v2(
                concrete, lower_control_flow=False, aggressive_inlining=True
            )
            graph_def = frozen.graph.as_graph_def(add_shapes=True)
            graph_def = tf_loader.fix_freezing_errors_part2(graph_def)
            _freeze_captured(graph_def, captured)
            if inline_calls(graph_def):
                graph_def = _with_shapes(graph_def)
            proto, _ = convert._convert_common(
                graph_def,
                name=concrete.name,
                continue_on_error=False,
                opset=TF2ONNX_OPSET,
                custom_op_handlers=_custom_handlers(),
                input_names=inputs,
                output_names=outputs,
                tensors_to_rename=convert.tensor_names_from_structed(concrete, inputs, outputs),
                optimizers=optimizers,
            )
    except Exception as e:
        raise ConversionError(f"tf2onnx could not translate the model: {_first_line(e)}") from e
    return proto


def _with_shapes(graph_def: Any) -> Any:
    """``graph_def`` with ``_output_shapes`` on every node (inlined bodies have none, and
    tf2onnx needs them, e.g. to make a SAME convolution's pads explicit)."""
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    return graph.as_graph_def(add_shapes=True)


def _captured_constants(concrete: Any) -> dict[str, np.ndarray]:
    """``{placeholder tensor name: value}`` of the eager tensors ``concrete`` captures.

    A Keras layer's constants that are not variables (``Normalization``'s mean and variance
    given as arguments) enter the function as captured tensors; left alone they would become
    graph inputs.
    """
    out = {}
    for external, internal in concrete.graph.captures:
        if getattr(external, "dtype", None) == tf.resource or not hasattr(external, "numpy"):
            continue
        out[internal.name] = np.asarray(external.numpy())
    return out


def _freeze_captured(graph_def: Any, captured: Mapping[str, np.ndarray]) -> None:
    """Turn the placeholders of captured constants into ``Const`` nodes, in place."""
    if not captured:
        return
    by_node = {name.rsplit(":", 1)[0]: value for name, value in captured.items()}
    for node in graph_def.node:
        value = by_node.get(node.name)
        if value is None or node.op != "Placeholder":
            continue
        node.op = "Const"
        for key in [k for k in node.attr if k != "_output_shapes"]:
            del node.attr[key]
        node.attr["dtype"].type = tf.as_dtype(value.dtype).as_datatype_enum
        node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value))


def _erfc(ctx, node, name, args):
    """``erfc(x)`` as ``1 - erf(x)`` (tf2onnx has no Erfc; exact GELU uses it)."""
    from onnx import numpy_helper
    from tf2onnx import utils

    dtype = utils.map_onnx_to_numpy_type(ctx.get_dtype(node.input[0]))
    erf = ctx.make_node("Erf", [node.input[0]], op_name_scope=node.name)
    one = ctx.make_const(
        utils.make_name(f"{node.name}_one"),
        numpy_helper.to_array(numpy_helper.from_array(np.array(1, dtype=dtype))),
    )
    node.type = "Sub"
    ctx.replace_inputs(node, [one.output[0], erf.output[0]])


def _custom_handlers() -> dict[str, Any]:
    return {"Erfc": (_erfc, [])}


@contextlib.contextmanager
def _quiet():
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def _load(proto) -> ir.Model:
    from xconv.converters.onnx.io import load

    return load(proto)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:500]


# --- structure ---------------------------------------------------------------------------


def _layer_paths(model: Any) -> dict[str, Any]:
    """``{layer path: layer}`` of every sublayer; an atomic layer's sublayers are not listed."""
    out: dict[str, Any] = {}

    def walk(layer: Any, prefix: str) -> None:
        for sub in getattr(layer, "_layers", None) or []:
            if type(sub).__name__ == "InputLayer":
                continue
            path = getattr(sub, "path", None) or f"{prefix}{sub.name}"
            out.setdefault(path, sub)
            if not _atomic(sub):
                walk(sub, f"{path}/")

    walk(model, "")
    return out


def _atomic(layer: Any) -> bool:
    return type(layer).__name__ in _ATOMIC


def _owners(model: Any, variables: Sequence[Any]) -> dict[str, tuple[str, Any, str]]:
    """``{variable path: (layer scope, layer, leaf)}``."""
    layers = _layer_paths(model)
    owners: dict[str, tuple[str, Any, str]] = {}
    for v in variables:
        parts = v.path.split("/")
        for k in range(len(parts) - 1, 0, -1):
            prefix = "/".join(parts[:k])
            # The outermost atomic layer on the path owns the weight; else the innermost layer.
            atomic = next(
                (
                    "/".join(parts[:j])
                    for j in range(1, k + 1)
                    if "/".join(parts[:j]) in layers and _atomic(layers["/".join(parts[:j])])
                ),
                None,
            )
            scope = atomic or (prefix if prefix in layers else None)
            if scope:
                owners[v.path] = (scope, layers[scope], v.path[len(scope) + 1 :])
                break
    return owners


def _inputs_to_weights(graph: ir.Graph, variables: Sequence[Any]) -> None:
    """Turn the ``xconv_w<i>`` graph inputs into initializers named by Keras variable path."""
    for value in list(graph.inputs):
        match = re.fullmatch(rf"{_WEIGHT_PREFIX}(\d+)(:0)?", value.name or "")
        if not match:
            continue
        v = variables[int(match.group(1))]
        graph.inputs.remove(value)
        value.name = v.path
        value.const_value = ir.tensor(np.asarray(v.numpy()), name=v.path)
        graph.register_initializer(value)


def _name_by_value(graph: ir.Graph, variables: Sequence[Any]) -> None:
    """Rename frozen initializers to the captured variable they equal (unique match only)."""
    values = [(v.name.split(":")[0], np.asarray(v.numpy())) for v in variables]
    taken = set(graph.initializers)
    for name, value in list(graph.initializers.items()):
        if value.const_value is None:
            continue
        arr = value.const_value.numpy()
        hits = [n for n, a in values if a.shape == arr.shape and np.array_equal(a, arr)]
        if len(hits) == 1 and hits[0] not in taken:
            graph.initializers.pop(name)
            value.name = hits[0]
            graph.register_initializer(value)
            taken.add(hits[0])


def _set_scopes(
    graph: ir.Graph, owners: Mapping[str, tuple[str, Any, str]], layers: Mapping[str, Any]
) -> None:
    """Map tf2onnx's node-name prefixes (TF name scopes, ``conv2d_1``) to Keras layer paths.

    TF uniquifies name scopes (``conv2d`` may trace as ``conv2d_1``), so a prefix is mapped by
    the weights its nodes read; weightless layers (activations, pooling) by name.
    """
    by_prefix: dict[str, str] = {}
    for node in graph.all_nodes():
        prefix = _prefix(node.name)
        if not prefix or prefix in by_prefix:
            continue
        for x in node.inputs:
            if x is not None and x.name in owners:
                by_prefix[prefix] = owners[x.name][0]
                break
    claimed = set(by_prefix.values())
    names = sorted(layers, key=len, reverse=True)
    for node in graph.all_nodes():
        prefix = _prefix(node.name)
        if not prefix:
            continue
        if prefix not in by_prefix:
            exact = [p for p in names if p == prefix and p not in claimed]
            loose = [
                p
                for p in names
                if p not in claimed and re.fullmatch(re.escape(p) + r"(_\d+)+", prefix)
            ]
            hit = (exact or loose or [None])[0]
            by_prefix[prefix] = hit or ""
            if hit:
                claimed.add(hit)
        if by_prefix[prefix]:
            node.metadata_props[SCOPE] = by_prefix[prefix]
    _scope_helpers(graph)


def _scope_helpers(graph: ir.Graph) -> None:
    """Give an unscoped weight-preparing node (a kernel reshape tf2onnx added, reading only
    weights and constants) the scope of its consumers."""
    derived: set[int] = set()
    for node in graph:
        if all(
            x is None
            or x.is_initializer()
            or (x.producer() is not None and id(x.producer()) in derived)
            for x in node.inputs
        ):
            derived.add(id(node))
    for node in reversed(list(graph)):
        if node.metadata_props.get(SCOPE) or id(node) not in derived:
            continue
        scopes = {u.node.metadata_props.get(SCOPE) for o in node.outputs for u in o.uses()}
        if len(scopes) == 1 and None not in scopes and "" not in scopes:
            node.metadata_props[SCOPE] = scopes.pop()


def _prefix(name: str | None) -> str | None:
    if not name or "/" not in name:
        return None
    return name.split("/")[0]


def _split_separable(graph: ir.Graph, owners: Mapping[str, tuple[str, Any, str]]) -> None:
    """A SeparableConv is two convs: scope them ``<layer>/depthwise`` and ``<layer>/pointwise``."""
    depthwise = {p: s for p, (s, layer, leaf) in owners.items() if leaf == "depthwise_kernel"}
    scopes = set(depthwise.values())
    for node in graph.all_nodes():
        scope = node.metadata_props.get(SCOPE)
        if scope not in scopes:
            continue
        reads = _reaches(node, set(depthwise))
        node.metadata_props[SCOPE] = f"{scope}/{'depthwise' if reads else 'pointwise'}"


def _reaches(node: ir.Node, weights: set[str]) -> bool:
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        for x in n.inputs:
            if x is None:
                continue
            if x.name in weights:
                return True
            p = x.producer()
            if p is not None and id(p) not in seen and p.op_type in ("Transpose", "Reshape"):
                seen.add(id(p))
                stack.append(p)
        if n is not node:
            continue
        # the conv itself reads the reshaped kernel through its producers only
    return False


def _split_activations(graph: ir.Graph, owners: Mapping[str, tuple[str, Any, str]]) -> None:
    """Scope a layer's fused activation (``Dense(activation="relu")``) ``<layer>/activation``.

    The layer's body must compute the bare layer: an emitter replaces it with a native
    ``Dense``/``Conv``, which has no activation.
    """
    per_scope: dict[str, tuple[Any, set[str]]] = {}
    for path, (scope, layer, _leaf) in owners.items():
        per_scope.setdefault(scope, (layer, set()))[1].add(path)
    for scope, (layer, weights) in per_scope.items():
        activation = layer.get_config().get("activation") if hasattr(layer, "get_config") else None
        if activation in (None, "linear") or _atomic(layer):
            continue
        body = _body(graph, scope)
        readers = [n for n in body if any(x is not None and x.name in weights for x in n.inputs)]
        if not readers:
            continue
        core: set[int] = set()
        stack = [readers[-1]]
        ids = {id(n) for n in body}
        while stack:
            n = stack.pop()
            if id(n) in core:
                continue
            core.add(id(n))
            for x in n.inputs:
                p = x.producer() if x is not None else None
                if p is not None and id(p) in ids:
                    stack.append(p)
        for n in body:
            if id(n) not in core:
                n.metadata_props[SCOPE] = f"{scope}/activation"


def _body(graph: ir.Graph, scope: str) -> list[ir.Node]:
    return [n for n in graph if n.metadata_props.get(SCOPE) == scope]


def _boundary(graph: ir.Graph, body: list[ir.Node]) -> tuple[list[ir.Value], list[ir.Value]]:
    """Non-constant inputs from outside ``body`` and outputs used outside it."""
    ids = {id(n) for n in body}
    ins: list[ir.Value] = []
    outs: list[ir.Value] = []
    outputs = {id(v) for v in graph.outputs}
    for n in body:
        for x in n.inputs:
            if x is None or x.is_initializer():
                continue
            p = x.producer()
            if p is not None and (id(p) in ids or p.op_type == "Constant"):
                continue
            if all(x is not y for y in ins):
                ins.append(x)
        for o in n.outputs:
            if id(o) in outputs or any(id(u.node) not in ids for u in o.uses()):
                outs.append(o)
    return ins, outs


def _replace_norms(graph: ir.Graph, owners: Mapping[str, tuple[str, Any, str]]) -> None:
    """Put Keras's decomposed BatchNorm / LayerNorm arithmetic back into one ONNX node each."""
    per_scope: dict[str, tuple[Any, dict[str, str]]] = {}
    for path, (scope, layer, leaf) in owners.items():
        per_scope.setdefault(scope, (layer, {}))[1][leaf] = path
    for scope, (layer, leaves) in sorted(per_scope.items()):
        cls = type(layer).__name__
        if cls == "BatchNormalization":
            keys = ("gamma", "beta", "moving_mean", "moving_variance")
        elif cls == "LayerNormalization":
            keys = ("gamma", "beta")
        else:
            continue
        if any(k not in leaves for k in keys):
            logger.debug("%s: keeps its decomposed form (no scale or center)", scope)
            continue
        body = _body(graph, scope)
        ins, outs = _boundary(graph, body)
        if len(ins) != 1 or len(outs) != 1 or ins[0].shape is None:
            logger.debug(
                "%s: keeps its decomposed form (%d in, %d out)", scope, len(ins), len(outs)
            )
            continue
        _replace_norm(graph, scope, layer, cls, ins[0], outs[0], [leaves[k] for k in keys])


def _replace_norm(graph, scope, layer, cls, x, y, weights) -> None:
    cfg = layer.get_config()
    rank = len(x.shape)
    axis = cfg["axis"]
    axes = [a % rank for a in (axis if isinstance(axis, list | tuple) else [axis])]
    ws = [graph.initializers[w] for w in weights]
    new: list[ir.Node] = []
    if cls == "BatchNormalization":
        if axes != [rank - 1] and axes != [1]:
            return
        perm = [0, rank - 1, *range(1, rank - 1)] if axes == [rank - 1] and rank > 2 else None
        h = x
        if perm:
            t = ir.node("Transpose", [x], attributes={"perm": perm})
            new.append(t)
            h = t.outputs[0]
        bn = ir.node(
            "BatchNormalization",
            [h, *ws],
            attributes={"epsilon": float(cfg["epsilon"])},
            name=f"{scope}/BatchNormalization",
        )
        new.append(bn)
        out = bn.outputs[0]
        if perm:
            back = [0, *range(2, rank), 1]
            t2 = ir.node("Transpose", [out], attributes={"perm": back})
            new.append(t2)
            out = t2.outputs[0]
    else:
        if axes != [rank - 1]:
            return
        ln = ir.node(
            "LayerNormalization",
            [x, *ws],
            attributes={"axis": -1, "epsilon": float(cfg["epsilon"])},
            name=f"{scope}/LayerNormalization",
        )
        new.append(ln)
        out = ln.outputs[0]
    for n in new:
        n.metadata_props[SCOPE] = scope
        n.metadata_props[MODULE] = f"keras.layers.{cls}"
    producer = y.producer()
    graph.insert_before(producer, new)
    out.shape, out.type = y.shape, y.type
    _replace_value(graph, y, out)


def _replace_value(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    was_output = [i for i, v in enumerate(graph.outputs) if v is old]
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    if was_output:
        name = old.name
        old.name = None
        new.name = name


def _push_transposes(graph: ir.Graph) -> bool:
    """Move a Transpose below the node that reads it, so transpose pairs meet and cancel.

    ``U(T(x)) -> T(U(x))`` for elementwise unary ``U``; ``B(T(a), T(b)) -> T(B(a, b))`` for
    elementwise binary ``B`` with equal perms (residual adds); ``Pad(T(x), pads) ->
    T(Pad(x, pads'))`` with the pads permuted (Keras ZeroPadding2D). tf2onnx leaves these
    NHWC<->NCHW transposes around nodes it did not push through.
    """
    from xconv.ir.passes._utils import constant_of, is_annotated

    annotated = is_annotated(graph)
    changed = False
    for node in list(graph):
        if node.domain not in ("", "ai.onnx") or not node.inputs:
            continue
        op = node.op_type
        if op in _UNARY or op == "Pad":
            slots = [0]
        elif op in _BINARY and len(node.inputs) == 2:
            slots = [0, 1]
        else:
            continue
        ts = [_sole_transpose(node.inputs[i]) for i in slots]
        if any(t is None for t in ts):
            continue
        perm = list(ts[0].attributes["perm"].value)
        if any(list(t.attributes["perm"].value) != perm for t in ts):
            continue
        if op == "Pad":
            if len(node.inputs) > 3 or node.inputs[1] is None:
                continue
            pads = constant_of(node.inputs[1], annotated)
            if pads is None:
                continue
            pads = [int(p) for p in np.asarray(pads).reshape(-1)]
            rank = len(perm)
            if len(pads) != 2 * rank:
                continue
            inner = [0] * (2 * rank)
            for i, p in enumerate(perm):
                inner[p], inner[p + rank] = pads[i], pads[i + rank]
            const = ir.node(
                "Constant", [], attributes={"value": ir.tensor(np.array(inner, dtype=np.int64))}
            )
            graph.insert_before(node, const)
            node.replace_input_with(1, const.outputs[0])
        for i, t in zip(slots, ts, strict=True):
            node.replace_input_with(i, t.inputs[0])
        _transpose_output(graph, node, perm)
        changed = True
    return changed


def _sole_transpose(value: ir.Value | None) -> ir.Node | None:
    t = value.producer() if value is not None else None
    if t is None or t.op_type != "Transpose" or "perm" not in t.attributes:
        return None
    return t if len(list(value.uses())) == 1 else None


def _transpose_output(graph: ir.Graph, node: ir.Node, perm: list[int]) -> None:
    out = node.outputs[0]
    moved = ir.node("Transpose", [out], attributes={"perm": perm})
    for key in (SCOPE, MODULE):
        if key in node.metadata_props:
            moved.metadata_props[key] = node.metadata_props[key]
    moved.outputs[0].shape, moved.outputs[0].type = out.shape, out.type
    out.shape = None
    graph.insert_after(node, moved)
    for consumer, idx in [(u.node, u.idx) for u in out.uses() if u.node is not moved]:
        consumer.replace_input_with(idx, moved.outputs[0])
    for i, v in enumerate(graph.outputs):
        if v is out:
            graph.outputs[i] = moved.outputs[0]
            name = out.name
            out.name = None
            moved.outputs[0].name = name


def _const(value: ir.Value | None, annotated: bool) -> float | None:
    from xconv.ir.passes._utils import constant_of

    arr = constant_of(value, annotated)
    if arr is None or np.asarray(arr).size != 1:
        return None
    return float(np.asarray(arr).reshape(()))


def _split_const(node: ir.Node, annotated: bool) -> tuple[ir.Value | None, float | None]:
    """For a binary node with one scalar-constant input: ``(other input, constant)``."""
    if len(node.inputs) != 2:
        return None, None
    a, b = node.inputs
    ca, cb = _const(a, annotated), _const(b, annotated)
    if cb is not None and ca is None:
        return a, cb
    if ca is not None and cb is None:
        return b, ca
    return None, None


def _fuse_gelu(graph: ir.Graph) -> int:
    """``0.5 * x * (1 - erf(-x / sqrt(2)))`` (TF's exact GELU via Erfc) -> ``Gelu(x)``."""
    from xconv.ir.passes._utils import is_annotated

    annotated = is_annotated(graph)
    fused = 0
    for erf in [n for n in graph if n.op_type == "Erf"]:
        uses = list(erf.outputs[0].uses())
        if len(uses) != 1 or uses[0].node.op_type != "Sub" or uses[0].idx != 1:
            continue
        sub = uses[0].node
        if _const(sub.inputs[0], annotated) != 1.0:
            continue
        scaled = erf.inputs[0].producer()
        if scaled is None or scaled.op_type != "Mul":
            continue
        inner, k = _split_const(scaled, annotated)
        if inner is None or k is None:
            continue
        neg = inner.producer()
        if neg is not None and neg.op_type == "Neg" and abs(k - 0.5**0.5) < 1e-6:
            x = neg.inputs[0]
        elif abs(k + 0.5**0.5) < 1e-6:
            x = inner
        else:
            continue
        sub_uses = list(sub.outputs[0].uses())
        if len(sub_uses) != 1 or sub_uses[0].node.op_type != "Mul":
            continue
        final = sub_uses[0].node
        half = final.inputs[1 - sub_uses[0].idx]
        half_node = half.producer() if half is not None else None
        if half_node is None or half_node.op_type != "Mul":
            continue
        hx, h = _split_const(half_node, annotated)
        if hx is not x or h != 0.5:
            continue
        gelu = ir.node("Gelu", [x], attributes={"approximate": "none"}, name=f"{final.name}_gelu")
        for key in (SCOPE, MODULE):
            if key in final.metadata_props:
                gelu.metadata_props[key] = final.metadata_props[key]
        out = final.outputs[0]
        gelu.outputs[0].shape, gelu.outputs[0].type = out.shape, out.type
        graph.insert_before(final, gelu)
        _replace_value(graph, out, gelu.outputs[0])
        fused += 1
    return fused


def _finish(model: ir.Model, source: str) -> None:
    model.metadata_props["xconv.source"] = f"tf:{source}"


def _canonicalize(model: ir.Model) -> None:
    from xconv.ir.passes import canonicalize

    canonicalize(model)
    if _fuse_gelu(model.graph) + _reshapes_as_transposes(model.graph) + _explicit_pads(model.graph):
        canonicalize(model)
    for _ in range(8):
        if not _push_transposes(model.graph):
            break
        canonicalize(model)
    _unscope_layout_transposes(model.graph)


def _reshape_perm(node: ir.Node, annotated: bool) -> list[int] | None:
    """The perm of the Transpose a Reshape equals, when it only moves size-1 axes (and keeps
    the batch axis first); else None.

    tf2onnx writes an NHWC<->NCHW Transpose of a tensor whose spatial axes are 1 (a squeeze-
    and-excite block's pooled ``(N, 1, 1, C)``) as such a Reshape; as a Reshape it hides the
    layout change from the emitters, which then reshape in the wrong layout.
    """
    from xconv.ir.passes._utils import constant_of

    x = node.inputs[0]
    target = constant_of(node.inputs[1], annotated) if len(node.inputs) > 1 else None
    if x is None or x.shape is None or target is None:
        return None
    dims = list(x.shape)
    target = [int(t) for t in np.asarray(target).reshape(-1)]
    if len(dims) != len(target) or len(dims) < 3 or target[0] not in (0, -1):
        return None
    rest = dims[1:]
    if not all(isinstance(d, int) for d in rest) or any(t <= 0 for t in target[1:]):
        return None
    if (
        target[0] == -1
        and not isinstance(dims[0], int)
        and int(np.prod(target[1:])) != int(np.prod(rest))
    ):
        return None
    if [d for d in rest if d != 1] != [t for t in target[1:] if t != 1] or sorted(rest) != sorted(
        target[1:]
    ):
        return None
    big = [i + 1 for i, d in enumerate(rest) if d != 1]
    ones = [i + 1 for i, d in enumerate(rest) if d == 1]
    perm = [0] + [big.pop(0) if t != 1 else ones.pop(0) for t in target[1:]]
    return None if perm == sorted(perm) else perm


def _reshapes_as_transposes(graph: ir.Graph) -> int:
    """Rewrite each Reshape that only moves size-1 axes as the Transpose it is."""
    from xconv.ir.passes._utils import is_annotated

    annotated = is_annotated(graph)
    done = 0
    for node in [n for n in graph if n.op_type == "Reshape"]:
        perm = _reshape_perm(node, annotated)
        if perm is None:
            continue
        t = ir.node("Transpose", [node.inputs[0]], attributes={"perm": perm}, name=node.name)
        for key in (SCOPE, MODULE):
            if key in node.metadata_props:
                t.metadata_props[key] = node.metadata_props[key]
        out = node.outputs[0]
        t.outputs[0].shape, t.outputs[0].type = out.shape, out.type
        graph.insert_before(node, t)
        _replace_value(graph, out, t.outputs[0])
        graph.remove(node, safe=True)
        done += 1
    return done


def _explicit_pads(graph: ir.Graph) -> int:
    """Write ``auto_pad="SAME_*"`` of Conv / pooling nodes whose input's spatial size is known
    as explicit ``pads``.

    tf2onnx keeps ``SAME_UPPER`` for a ``padding="same"`` conv inside a nested function it got
    inlined (Keras 3's grouped / depthwise convs, ConvNeXt), and a source emitter wants pads.
    """
    done = 0
    for node in graph:
        if node.op_type not in ("Conv", "MaxPool", "AveragePool", "ConvInteger"):
            continue
        mode = node.attributes.get("auto_pad")
        if mode is None or mode.value not in ("SAME_UPPER", "SAME_LOWER"):
            continue
        x = node.inputs[0]
        if x is None or x.shape is None:
            continue
        spatial = list(x.shape)[2:]
        kernel = node.attributes.get("kernel_shape")
        if kernel is None and node.op_type == "Conv" and node.inputs[1] is not None:
            w = node.inputs[1].shape
            kernel_dims = list(w)[2:] if w is not None else []
        else:
            kernel_dims = list(kernel.value) if kernel is not None else []
        if not spatial or len(kernel_dims) != len(spatial):
            continue
        if not all(isinstance(d, int) for d in [*spatial, *kernel_dims]):
            continue
        rank = len(spatial)
        strides = list(node.attributes["strides"].value) if "strides" in node.attributes else []
        dilations = (
            list(node.attributes["dilations"].value) if "dilations" in node.attributes else []
        )
        strides, dilations = strides or [1] * rank, dilations or [1] * rank
        begin, end = [], []
        for n, k, st, dl in zip(spatial, kernel_dims, strides, dilations, strict=True):
            total = max((-(-n // st) - 1) * st + (k - 1) * dl + 1 - n, 0)
            small = total // 2
            begin.append(small if mode.value == "SAME_UPPER" else total - small)
            end.append(total - begin[-1])
        node.attributes.pop("auto_pad")
        node.attributes["pads"] = ir.AttrInt64s("pads", begin + end)
        done += 1
    return done


def _unscope_layout_transposes(graph: ir.Graph) -> None:
    """Take data-path Transposes (NHWC<->NCHW) out of layer scopes.

    tf2onnx names them after the conv they surround (``conv2d/BiasAdd__10``), but a layer's
    body must compute the layer in the IR's layout: an emitter replaces the body with one
    native layer, and a layout change inside it would be lost.
    """
    for node in graph:
        if node.op_type != "Transpose" or SCOPE not in node.metadata_props:
            continue
        if not _derives_from_weight(node.inputs[0]):
            del node.metadata_props[SCOPE]
            node.metadata_props.pop(MODULE, None)


def _derives_from_weight(value: ir.Value | None) -> bool:
    while value is not None and not value.is_initializer():
        producer = value.producer()
        if producer is None or producer.op_type not in ("Reshape", "Transpose", "Squeeze"):
            return False
        value = producer.inputs[0]
    return value is not None


__all__: Sequence[str] = ["SAFE_OPTIMIZERS", "TF2ONNX_OPSET", "from_tf", "load_source"]

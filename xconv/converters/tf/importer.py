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
This module captures the graph (tf2onnx); :mod:`xconv.converters.tf.scopes` ties nodes and
weights to their Keras layers and :mod:`xconv.converters.tf.rewrite` rewrites the graph.

tf2onnx gaps worked around: ``Erfc`` (exact GELU) is rewritten as ``1 - Erf``; captured
eager tensors are frozen as constants; output opset is 18 (tf2onnx's ceiling here).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import tensorflow as tf

from xconv.converters.tf import keras_layers
from xconv.converters.tf.dims import name_symbolic_dims, restore_unknown
from xconv.converters.tf.inline import inline_calls
from xconv.converters.tf.rewrite import _canonicalize
from xconv.converters.tf.scopes import (
    _WEIGHT_PREFIX,
    _inputs_to_weights,
    _layer_paths,
    _name_by_value,
    _owners,
    _replace_norms,
    _set_scopes,
    _split_activations,
    _split_separable,
)
from xconv.errors import ConversionError, InvalidModelError

logger = logging.getLogger(__name__)

#: tf2onnx's output opset (its newest well-tested one); ``xconv.load`` upgrades it to 23.
TF2ONNX_OPSET = 18
#: tf2onnx optimizers that never merge or fold weights.
SAFE_OPTIMIZERS = ("optimize_transpose", "remove_identity", "remove_back_to_back")


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
        The model as an ``onnx_ir.Model`` at opset ``xconv.ir.OPSET``. The signature's
        ``None`` dims are symbols named by role and shared across inputs: ``batch`` (dim 0),
        ``seq``, ``height`` / ``width``, else ``<input>_<axis>``
        (:mod:`xconv.converters.tf.dims`).

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
    layers_by_path = _layer_paths(model)
    if any(type(layer).__name__ in _RECURRENT for layer in layers_by_path.values()):
        # tf2onnx writes a recurrent layer as ONNX's LSTM (or a Loop) only from constant
        # weights: traced with the weights frozen in, they are named back by value (the
        # recurrent kernels, rearranged into W / R / B, keep tf2onnx's names).
        def frozen(*xs):
            return model(xs[0] if single else list(xs), **kwargs)

        model_ir = _load(_convert_function(tf.function(frozen), specs))
        cleared = name_symbolic_dims(model_ir)
        _name_by_value(model_ir.graph, variables, by_path=True)
    else:
        model_ir = _load(_convert_function(tf.function(call), [*specs, *weight_specs]))
        cleared = name_symbolic_dims(model_ir)
        _inputs_to_weights(model_ir.graph, variables)
    owners = _owners(model, variables)
    _set_scopes(model_ir.graph, owners, layers_by_path)
    keras_layers.recurrent_loops_as_ops(model_ir.graph, owners, layers_by_path)
    keras_layers.name_lstm_weights(model_ir.graph, owners)
    _split_separable(model_ir.graph, owners)
    _replace_norms(model_ir.graph, owners)
    _split_activations(model_ir.graph, owners)
    _finish(model_ir, "keras")
    keras_layers.flatten_depthwise_kernels(model_ir.graph, owners)
    keras_layers.annotate_weights(model_ir.graph, owners)
    _canonicalize(model_ir)
    restore_unknown(model_ir, cleared)
    weights: dict[str, dict[str, str]] = {}
    scopes: dict[str, Any] = {}
    for path, (scope, layer, leaf) in owners.items():
        weights.setdefault(scope, {})[leaf] = path
        scopes[scope] = layer
    for path, layer in layers_by_path.items():
        scopes.setdefault(path, layer)
    keras_layers.annotate_layers(model_ir.graph, scopes, weights)
    return model_ir


#: Keras layers whose weights must be constants for tf2onnx to translate them.
_RECURRENT = frozenset({"LSTM", "GRU", "SimpleRNN", "RNN", "Bidirectional"})


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
    cleared = name_symbolic_dims(model)
    _name_by_value(model.graph, list(captured.values()))
    _finish(model, "tf.function")
    _canonicalize(model)
    restore_unknown(model, cleared)
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
    cleared = name_symbolic_dims(model)
    _name_by_value(model.graph, list(sig.variables))
    _finish(model, "saved_model")
    _canonicalize(model)
    restore_unknown(model, cleared)
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
    cleared = name_symbolic_dims(model)
    _finish(model, "graph_def")
    _canonicalize(model)
    restore_unknown(model, cleared)
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


def _finish(model: ir.Model, source: str) -> None:
    model.metadata_props["xconv.source"] = f"tf:{source}"


__all__: Sequence[str] = ["SAFE_OPTIMIZERS", "TF2ONNX_OPSET", "from_tf", "load_source"]

"""Inline nested function calls of a frozen GraphDef before tf2onnx reads it.

Freezing inlines most calls, but not a function marked for XLA compilation: Keras 3 runs a
grouped convolution on CPU through ``tf.function(jit_compile=True)`` (ConvNeXt's depthwise
convs), which stays a ``PartitionedCall`` that tf2onnx cannot translate. Each call node is
replaced by its function's body, its nodes named ``<call node>/<body node>``, until no call
is left.
"""

from __future__ import annotations

from typing import Any

#: Ops that call a library function through their ``f`` attribute.
CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
_MAX_ROUNDS = 32


def inline_calls(graph_def: Any) -> int:
    """Inline every ``PartitionedCall``/``StatefulPartitionedCall`` of ``graph_def`` in place.

    Returns:
        The number of calls inlined.
    """
    library = {f.signature.name: f for f in graph_def.library.function}
    count = 0
    for _ in range(_MAX_ROUNDS):
        calls = [n for n in graph_def.node if n.op in CALL_OPS and n.attr["f"].func.name in library]
        if not calls:
            return count
        for call in calls:
            _inline(graph_def, call, library[call.attr["f"].func.name])
            count += 1
    raise ValueError(f"function calls nested deeper than {_MAX_ROUNDS} levels")


def _tensor(name: str) -> tuple[str, int]:
    node, _, index = name.partition(":")
    return node, int(index) if index else 0


def _inline(graph_def: Any, call: Any, fdef: Any) -> None:
    from tensorflow.python.framework.function_def_to_graph import function_def_to_graph_def

    body, flat = function_def_to_graph_def(fdef)
    args = [a.name for a in fdef.signature.input_arg]
    data_inputs = [i for i in call.input if not i.startswith("^")]
    controls = [i for i in call.input if i.startswith("^")]
    if len(data_inputs) != len(args):
        raise ValueError(f"{call.name}: {len(data_inputs)} inputs for {len(args)} arguments")
    bound = dict(zip(args, data_inputs, strict=True))
    prefix = call.name + "/"

    def rename(ref: str) -> str:
        if ref.startswith("^"):
            node = ref[1:]
            if node in bound:
                return "^" + _tensor(bound[node])[0]
            return "^" + prefix + node
        node, index = _tensor(ref)
        if node in bound:
            return bound[node]
        return f"{prefix}{node}:{index}"

    new_nodes = []
    for node in body.node:
        if node.op == "Placeholder" and node.name in bound:
            continue
        inlined = type(node)()
        inlined.CopyFrom(node)
        inlined.name = prefix + node.name
        del inlined.input[:]
        inlined.input.extend(rename(i) for i in node.input)
        if not any(i for i in node.input if not i.startswith("^")):
            inlined.input.extend(controls)  # keep the call's ordering on source nodes
        inlined.device = call.device or node.device
        new_nodes.append(inlined)

    # Output k of the call is the function's k-th return value.
    returns = []
    for out in fdef.signature.output_arg:
        nested = fdef.ret[out.name]
        returns.append(rename(flat.get(nested, nested)))
    for node in graph_def.node:
        if node.name == call.name:
            continue
        for i, ref in enumerate(node.input):
            if ref == "^" + call.name:
                node.input[i] = "^" + (_tensor(returns[0])[0] if returns else call.name)
                continue
            name, index = _tensor(ref)
            if name == call.name:
                node.input[i] = returns[index]
    position = next(i for i, node in enumerate(graph_def.node) if node.name == call.name)
    del graph_def.node[position]
    graph_def.node.extend(new_nodes)


__all__ = ["CALL_OPS", "inline_calls"]

"""Block-by-block parity: a float64 proof for models whose float64 copy would not fit.

The whole-model float64 oracle holds a float64 copy of every weight at once (twice the
model's float32 bytes). Layerwise parity instead runs the model one top-level block at a time
(a transformer layer ``model.layers.3``, a ResNet stage, the embeddings, the head), and for
each block runs three things on the *same* captured block inputs:

* the **oracle**: the reference block's float64 twin (:func:`float64_graph`: every floating
  dtype argument becomes ``float64``, so ``.to(torch.float32)`` inside RMSNorm does not drop
  precision; dtype asserts dropped; higher-order ops' subgraphs twinned; run under
  :func:`float64_defaults`) on its weights and inputs cast to float64;
* the **reference**: the same block in its own dtype, on the oracle's inputs rounded to it;
* the **candidate**: the IR sub-graph of the block (the nodes that compute the block's
  outputs from its inputs) run by the JAX runtime (``xconv.to_jax``'s interpreter, under
  ``jax.jit``: one program per block structure, shared by identical layers), on the same
  rounded inputs.

Each block output is judged with :func:`xconv.parity.metrics.compare` under the given policy
(oracle: ``|cand - oracle| <= k * |ref - oracle| + floor``). The oracle's outputs feed the
next block, so the chain of oracle blocks *is* the whole model's float64 run (its final
outputs are the whole-model oracle, used to judge the whole candidate as usual), while only
one block's float64 weights exist at a time. The first block that fails while its inputs
are exact (they always are: every block starts from the oracle's values) is the first
divergent block.

API (stable; the larger-than-RAM route reuses it with weights loaded per block)::

    from xconv.parity.layerwise import split_program, run_layerwise, BlockWeights

    blocks = split_program(program)           # list[Block] from a torch ExportedProgram
    result = run_layerwise(
        program,                              # torch.export.ExportedProgram (may be on meta)
        candidate_ir,                         # onnx_ir.Model from xconv.from_torch(program)
        inputs,                               # list of numpy arrays, the user inputs
        policy="oracle",
        weights=None,                         # BlockWeights or None (the program's own)
        progress=None,                        # Callable[[str], None], "block 3/18: ..."
    )
    result.oracle_outputs                     # float64 outputs of the whole model
    result.blocks                             # list[BlockResult], in execution order
    result.first_divergence                   # name of the first failing block, or None

``Block`` fields: ``name`` (module path, e.g. ``model.layers.3``, or ``a, b`` for glue runs),
``nodes`` (FX node names), ``inputs`` / ``outputs`` (value names crossing its boundary: FX
node names, which torch.onnx also gives the IR values), ``weights`` (``state_dict`` /
constant names it reads).

``BlockWeights`` is how weights reach a block lazily: a callable
``weights(block) -> ContextManager[Mapping[str, tensor | ndarray]]`` returning, on enter,
the block's weights keyed by ``state_dict`` name (``block.weights``; torch tensors or numpy
arrays, any float dtype), and freeing them on exit; a program traced on the meta device
works as long as ``weights`` provides every name. The candidate reads its own initializers
(``const_value.numpy()``, so an ``onnx_ir.LazyTensor`` loads then, and is dropped with the
block); an initializer with no ``const_value`` at all is read from the same mapping by name. With ``weights=None`` the program's own
``state_dict`` / constants are used (no copy; float64 casts are per block).

``check_parity(reference, candidate, inputs, layerwise=True)`` (CLI ``--parity layerwise``)
uses this when the reference is an ``ExportedProgram``: the chained oracle judges the whole
candidate's outputs and the per-block results fill ``report.scopes`` and
``report.first_divergence``.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xconv.parity.adapters import Adapter
from xconv.parity.localize import ScopeResult
from xconv.parity.metrics import Metrics, compare
from xconv.parity.policies import Policy, resolve_policy

logger = logging.getLogger(__name__)

BlockWeights = Callable[["Block"], contextlib.AbstractContextManager[Mapping[str, Any]]]
Progress = Callable[[str], None]

_INDEX = re.compile(r"^\d+$")


@dataclass(frozen=True)
class Block:
    """One top-level block of a program: a run of consecutive graph nodes.

    Attributes:
        name: The block's module path (``model.layers.3``), or the module paths of a run of
            glue nodes between blocks joined by ``", "``.
        nodes: FX node names, in execution order.
        inputs: Names of the values the block reads from earlier blocks or user inputs.
        outputs: Names of the values it makes that later blocks or the model outputs read.
        weights: ``state_dict`` (and lifted constant) names of the weights it reads.
    """

    name: str
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    weights: tuple[str, ...]


@dataclass
class BlockResult:
    """One block's verdict: its outputs compared (candidate vs reference, oracle-judged)."""

    block: Block
    index: int
    passed: bool
    outputs: list[Metrics] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0

    def as_scope(self) -> ScopeResult:
        """The block as a report scope row (its main output: the last one)."""
        if self.outputs:
            main = max(self.outputs, key=lambda m: (not m.passed, m.severity))
        else:
            main = Metrics(name=self.block.name, passed=self.passed, shape=(), dtype="-")
            main.error = self.error
        return ScopeResult(
            name=self.block.name,
            index=self.index,
            output=main,
            inputs_ok=True,
            status="ok" if self.passed else "diverged",
        )


@dataclass
class LayerwiseResult:
    oracle_outputs: list[np.ndarray]
    blocks: list[BlockResult]
    policy: Policy
    notes: list[str] = field(default_factory=list)
    #: What made the proof weaker than one float64 oracle per block, machine-readable:
    #: ``{"kind": "merged_blocks", "message": ...}`` per boundary the candidate cannot cut.
    downgrades: list[dict[str, str]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(b.passed for b in self.blocks)

    @property
    def unrunnable(self) -> BlockResult | None:
        """The block that could not run at all (the run stops there), or None."""
        return next((b for b in self.blocks if b.error and not b.outputs), None)

    @property
    def first_divergence(self) -> str | None:
        return next((b.block.name for b in self.blocks if not b.passed), None)


# ----------------------------------------------------------------------------- splitting


def _stack_paths(node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    return [v[0] for v in stack.values() if isinstance(v, tuple) and v and v[0]]


def _container(paths: Sequence[Sequence[str]]) -> str | None:
    """The shallowest module path with two or more numbered children (``model.layers``)."""
    children: dict[str, set[str]] = {}
    for stack in paths:
        for p in stack:
            parent, _, last = p.rpartition(".")
            if parent and _INDEX.match(last):
                children.setdefault(parent, set()).add(last)
    found = [(p.count("."), -len(c), p) for p, c in children.items() if len(c) >= 2]
    return min(found)[2] if found else None


def split_program(program: Any) -> list[Block]:
    """Split an ``ExportedProgram``'s graph into top-level blocks, in execution order.

    The blocks are the numbered children of the shallowest repeated container
    (``transformer.h.0`` ... ``transformer.h.11``); the runs of nodes between them
    (embeddings, final norm, head, mask arithmetic) form glue blocks. A model with no
    repeated container is one block.
    """
    return _build(program, _runs(program))


def _runs(program: Any) -> list[tuple[str, list[Any]]]:
    calls = [n for n in program.graph.nodes if n.op not in ("placeholder", "output")]
    stacks = {n: _stack_paths(n) for n in calls}
    container = _container(list(stacks.values()))
    depth = container.count(".") + 1 if container else 0

    def key(node) -> tuple[str, bool]:
        stack = stacks[node]
        if container:
            for p in stack:
                parent, _, last = p.rpartition(".")
                if parent == container and _INDEX.match(last):
                    return p, True
        shallow = [p for p in stack if p.count(".") <= depth] or stack[:1]
        return (shallow[-1] if shallow else "<model>"), False

    runs: list[tuple[list[str], bool, list[Any]]] = []
    for node in calls:
        k, is_block = key(node)
        last = runs[-1] if runs else None
        if last is not None and (last[0] == [k] if is_block else not last[1]):
            if k not in last[0]:
                last[0].append(k)
            last[2].append(node)
        else:
            runs.append(([k], is_block, [node]))
    return [(_name(names), nodes) for names, _, nodes in runs]


def _name(keys: list[str]) -> str:
    """Module paths of a run, leaving out those enclosing another one (``m.transformer``)."""
    own = [k for k in keys if not any(o != k and o.startswith(k + ".") for o in keys)]
    return ", ".join(own or keys)


def _weight_placeholders(program: Any) -> dict[str, str]:
    """Placeholder name -> state_dict / constant name, for every non-user input."""
    out = {}
    for spec in program.graph_signature.input_specs:
        if spec.target is not None and spec.kind.name != "USER_INPUT":
            out[spec.arg.name] = spec.target
    return out


def _build(program: Any, runs: Sequence[tuple[str, Sequence[Any]]]) -> list[Block]:
    graph = program.graph
    weight_of = _weight_placeholders(program)
    owner = {n: i for i, (_, nodes) in enumerate(runs) for n in nodes}
    out_node = next(n for n in graph.nodes if n.op == "output")
    blocks = []
    for i, (name, nodes) in enumerate(runs):
        inputs: list[str] = []
        weights: list[str] = []
        outputs: list[str] = []
        for n in nodes:
            for a in n.all_input_nodes:
                if a.op == "placeholder" and a.name in weight_of:
                    if weight_of[a.name] not in weights:
                        weights.append(weight_of[a.name])
                elif a.op == "get_attr":  # a subgraph: each block that reads it holds it
                    continue
                elif owner.get(a) != i and a.name not in inputs:
                    inputs.append(a.name)
            if n.op == "get_attr":
                continue
            if any(u is out_node or owner.get(u, i) > i for u in n.users):
                outputs.append(n.name)
        blocks.append(
            Block(name, tuple(n.name for n in nodes), tuple(inputs), tuple(outputs), tuple(weights))
        )
    return blocks


def _cuttable_blocks(program: Any, cand: IRBlocks) -> tuple[list[Any], list[Any]]:
    """The program's blocks, each one the candidate can be cut at (a block it cannot cut is
    merged into the next), and the candidate's plan for each."""
    blocks, plans, _ = _cuttable_blocks_merged(program, cand)
    return blocks, plans


def _cuttable_blocks_merged(program: Any, cand: IRBlocks) -> tuple[list[Any], list[Any], list]:
    """:func:`_cuttable_blocks`, and why each boundary it could not cut was merged away
    (``"block a (cannot cut: why) merged into the next"``)."""
    blocks = split_program(program)
    merged: list[str] = []
    for _ in range(len(blocks)):
        plans = [cand.plan(b) for b in blocks]
        bad = {i for i, p in enumerate(plans) if isinstance(p, str)}
        if not bad or len(blocks) == 1:
            break
        merged += [
            f"block {blocks[i].name} merged with its neighbour (cannot cut the candidate "
            f"there: {plans[i]})"
            for i in sorted(bad)
        ]
        blocks = _merge_into_next(program, blocks, bad)
    plans = [cand.plan(b) for b in blocks]
    for b, p in zip(blocks, plans, strict=True):
        if isinstance(p, str):
            raise ValueError(f"cannot cut the candidate at block {b.name}: {p}")
    return blocks, plans, merged


def _input_env(program: Any, inputs: Sequence[Any]) -> tuple[dict[str, np.ndarray], dict]:
    """The user inputs by program input name (floats as float64), and their torch dtypes."""
    import torch

    from xconv.parity.adapters import to_numpy

    user = _user_inputs(program)
    if len(inputs) != len(user):
        raise ValueError(f"the program takes {len(user)} input(s) {user}, got {len(inputs)}")
    env64: dict[str, np.ndarray] = {}
    dtypes: dict[str, Any] = {}
    for name, x in zip(user, inputs, strict=True):
        arr = to_numpy(x)
        dtypes[name] = (
            torch.from_numpy(np.zeros((), arr.dtype)).dtype if arr.dtype.kind != "V" else None
        )
        env64[name] = arr.astype(np.float64) if arr.dtype.kind == "f" else arr
    return env64, dtypes


def _merge_into_next(program: Any, blocks: Sequence[Block], bad: set[int]) -> list[Block]:
    """Blocks ``bad`` joined with their successors (a boundary the candidate cannot cut at);
    a bad last block is joined with its predecessor."""
    by_name = {n.name: n for n in program.graph.nodes}
    runs: list[tuple[str, list[Any]]] = []
    pending: list[Block] = []
    last = len(blocks) - 1
    if last in bad and last - 1 not in bad:  # the last block: joined with the one before
        bad = (bad - {last}) | {last - 1}
    for i, b in enumerate(blocks):
        pending.append(b)
        if i in bad and i + 1 < len(blocks):
            continue
        name = pending[0].name if len(pending) == 1 else f"{pending[0].name} .. {b.name}"
        runs.append((name, [by_name[n] for x in pending for n in x.nodes]))
        pending = []
    return _build(program, runs)


# ------------------------------------------------------------------------ reference side


def block_module(program: Any, block: Block, *, float64: bool = False):
    """The block as a ``torch.fx.GraphModule``: ``gm(*block_inputs, *weights) -> tuple``.

    Weights are passed in ``block.weights`` order. With ``float64=True`` the graph is the
    oracle's float64 twin (:func:`float64_graph`); call it under :func:`float64_defaults`.
    """
    from torch import fx

    by_name = {n.name: n for n in program.graph.nodes}
    place_of = {t: p for p, t in _weight_placeholders(program).items()}
    g = fx.Graph()
    env: dict[Any, Any] = {}
    for name in block.inputs:
        env[by_name[name]] = g.placeholder(_ident(name))
    for w in block.weights:
        env[by_name[place_of[w]]] = g.placeholder(_ident(place_of[w]))
    attrs = _copy_nodes(g, [by_name[n] for n in block.nodes], env, program.graph_module, float64)
    g.output(tuple(env[by_name[o]] for o in block.outputs))
    return fx.GraphModule(attrs, g)


#: Ops that only check a tensor's dtype / device / layout (the program's own guards, e.g.
#: ``aten._assert_tensor_metadata(x, dtype=torch.float32)`` before each ``.to``): the float64
#: twin drops them, as its tensors are float64 by design.
_DTYPE_CHECKS = ("aten._assert_tensor_metadata",)
#: Ops whose dtype argument reinterprets bits (``x.view(torch.int32)``), never cast.
_BIT_VIEWS = ("aten.view.dtype",)


def float64_graph(gm: Any) -> Any:
    """The float64 twin of a ``torch.fx.GraphModule`` (and, recursively, of the subgraphs of
    its higher-order ops): every floating dtype argument (``.to(torch.float32)``, ``full(...,
    dtype=torch.float16)``, ``.float()``) becomes ``torch.float64`` and complex ones
    ``complex128``; dtype checks (``aten._assert_tensor_metadata``) are dropped; autocast
    regions (``wrap_with_autocast``) are disabled; subgraphs (``get_attr`` of a GraphModule:
    ``wrap_with_set_grad_enabled``, ``cond``, ...) are replaced by their twins, float tensor
    attributes by float64 copies. Factories without a dtype and int-by-float promotions take
    torch's default dtype: run the twin under :func:`float64_defaults`. The weights it is
    given must be float64 too (the caller casts them).
    """
    from torch import fx

    g = fx.Graph()
    env: dict[Any, Any] = {}
    attrs = _copy_nodes(g, list(gm.graph.nodes), env, gm, True)
    return fx.GraphModule(attrs, g)


def _copy_nodes(g, nodes, env, root, float64: bool) -> dict[str, Any]:
    """Copy ``nodes`` into ``g`` (``env`` maps old nodes to new ones; a ``get_attr`` read but
    not copied is added); the attributes the copy reads, by target (float64 twins when
    ``float64``)."""
    import torch
    from torch import fx

    attrs: dict[str, Any] = {}

    def attr(target: str):
        if target not in attrs:
            obj = _attr(root, target)
            if float64 and isinstance(obj, fx.GraphModule):
                obj = float64_graph(obj)
            elif float64 and isinstance(obj, torch.Tensor) and obj.is_floating_point():
                obj = obj.detach().double()
            attrs[target] = obj
        return target

    def arg(a):
        if a not in env and a.op == "get_attr":
            env[a] = g.get_attr(attr(a.target))
        return env[a]

    for node in nodes:
        if node.op == "get_attr":
            env[node] = g.get_attr(attr(node.target))
            continue
        name = _op_name(node)
        if float64 and name.startswith(_DTYPE_CHECKS):
            continue
        if node.op == "output":
            g.output(fx.node.map_arg(node.args[0], arg))
            continue
        new = g.node_copy(node, arg)
        if float64 and not name.startswith(_BIT_VIEWS):
            new.args = fx.node.map_aggregate(new.args, lambda a: _wide(torch, a))
            new.kwargs = fx.node.map_aggregate(new.kwargs, lambda a: _wide(torch, a))
            if name == "wrap_with_autocast":  # (device, dtype, enabled, cache, fn, *args)
                new.args = (*new.args[:2], False, *new.args[3:])
        env[node] = new
    return attrs


def _attr(root, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _op_name(node) -> str:
    """``aten.to.dtype``-style name of a call, ``""`` for other nodes."""
    if node.op != "call_function":
        return ""
    target = node.target
    name = getattr(target, "_name", None) or getattr(target, "__name__", str(target))
    overload = getattr(target, "_overloadname", None)
    name = name.replace("::", ".")
    return f"{name}.{overload}" if overload and not name.endswith(f".{overload}") else name


def _wide(torch, a):
    """A floating dtype argument as float64 (complex as complex128); anything else as is."""
    if not isinstance(a, torch.dtype):
        return a
    if a.is_floating_point:
        return torch.float64
    if a.is_complex:
        return torch.complex128
    return a


@contextlib.contextmanager
def float64_defaults() -> Iterator[None]:
    """torch's default dtype float64 for the duration (the float64 twin's factories without a
    dtype, ``torch.ones(n)``, and int-by-float promotions, ``positions * 0.5``)."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _ident(name: str) -> str:
    return re.sub(r"\W", "_", name)


def program_weights(program: Any) -> BlockWeights:
    """The default :data:`BlockWeights`: the program's own ``state_dict`` and constants."""
    state = program.state_dict
    constants = program.constants

    @contextlib.contextmanager
    def weights(block: Block) -> Iterator[Mapping[str, Any]]:
        yield {w: state[w] if w in state else constants[w] for w in block.weights}

    return weights


def float64_program(program: Any) -> Callable[..., tuple]:
    """The whole program in float64 (weights cast, the graph's float64 twin from
    :func:`float64_graph`), as a function of the user inputs. ``ExportedProgram.module()
    .double()`` does not work: the unlifted module's guards pin the input dtypes, ops inside
    carry ``dtype=torch.float32`` and dtype asserts, and higher-order ops hold subgraphs."""
    import torch

    block = _build(
        program,
        [("<model>", [n for n in program.graph.nodes if n.op not in ("placeholder", "output")])],
    )[0]
    gm = block_module(program, block, float64=True)
    with program_weights(program)(block) as w:
        weights = [_to_torch64(torch, w[name]) for name in block.weights]
    user = _user_inputs(program)
    order = [user.index(n) if n in user else None for n in block.inputs]

    def run(*xs):
        if any(i is None for i in order):
            raise ValueError(f"block inputs {block.inputs} are not all user inputs {user}")
        args = [_to_torch64(torch, xs[i]) for i in order]
        with torch.no_grad(), float64_defaults():
            return _outputs_in_order(program, block, gm(*args, *weights))

    return run


def _outputs_in_order(program, block, outs) -> tuple:
    where = dict(zip(block.outputs, outs, strict=True))
    return tuple(where[n] for n in _user_outputs(program))


def _user_inputs(program) -> list[str]:
    return [s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]


def _user_outputs(program) -> list[str]:
    return [
        s.arg.name for s in program.graph_signature.output_specs if s.kind.name == "USER_OUTPUT"
    ]


def _to_torch64(torch, x):
    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
    return t.detach().double() if t.is_floating_point() else t


def _to_torch(torch, x: np.ndarray, dtype):
    t = torch.from_numpy(np.ascontiguousarray(x))
    return t.to(dtype) if dtype is not None and t.dtype != dtype else t


# ------------------------------------------------------------------------ candidate side


class IRBlocks:
    """Runs blocks of the candidate IR with the JAX runtime's interpreter: under ``jax.jit``
    per block structure, else op by op (see :meth:`run`).

    ``placement`` (e.g. ``xconv.sharding.parity.LayerwisePlacement``) puts each weight
    (``placement.weight(name, array)``) and each block input (``placement.input(array)``)
    on a mesh: every op then runs partitioned over it. Default: the default device.
    """

    def __init__(self, model: Any, program: Any = None, placement: Any = None) -> None:
        from xconv.converters.jax.interpreter import Interpreter
        from xconv.converters.jax.registry import registry

        registry.check_supported(model)
        self.model = model
        self.placement = placement
        self.interp = Interpreter(model, registry)
        self.nodes = list(model.graph)
        self.position = {id(n): i for i, n in enumerate(self.nodes)}
        self.values: dict[str, Any] = _fx_values(model, program)
        #: compiled block programs by structure (False: this structure runs op by op)
        self._compiled: dict[Any, Any] = {}
        self._structures: dict[int, Any] = {}  # id(block) -> (block, _structure(...))

    def plan(self, block: Block) -> list[Any] | str:
        """The IR nodes computing ``block.outputs`` from ``block.inputs``, or why not."""
        # A symbolic size entering the block (``sym_size_int``) that the IR does not hold
        # by that name: the block computes it from its tensor inputs.
        missing = [
            n for n in (*block.inputs, *block.outputs)
            if n not in self.values and not (n in block.inputs and n.startswith("sym_size"))
        ]  # fmt: skip
        if missing:
            return f"no IR value named {missing[:3]}"
        stop = {id(self.values[n]) for n in block.inputs if n in self.values}
        graph_inputs = {id(v) for v in self.model.graph.inputs}
        seen: set[int] = set()
        todo = [self.values[n] for n in block.outputs]
        picked: set[int] = set()
        while todo:
            v = todo.pop()
            if v is None or id(v) in seen or id(v) in stop:
                continue
            seen.add(id(v))
            if id(v) in graph_inputs:
                return f"the IR needs the model input {v.name!r} here"
            node = v.producer()
            if node is None:  # an initializer
                continue
            if id(node) not in picked:
                picked.add(id(node))
                todo.extend(node.inputs)
        return [n for n in self.nodes if id(n) in picked]

    def scalar(self, name: str, x: Any) -> np.ndarray:
        """A symbolic size crossing blocks (a Python int) as the IR value's shape."""
        arr = np.asarray(x, dtype=np.int64)
        value = self.values.get(name)
        if value is None:  # a size the block recomputes (see plan)
            return arr
        shape = value.shape
        if shape is not None and all(isinstance(d, int) for d in shape):
            arr = arr.reshape(tuple(shape))
        return arr

    def run(
        self,
        nodes: list[Any],
        block: Block,
        inputs: Mapping[str, np.ndarray],
        weights: Mapping[str, Any],
    ) -> list[np.ndarray]:
        """The block's outputs on ``inputs``: compiled once per block structure (a model's
        identical layers share one ``jax.jit`` program, their own weights its arguments),
        else op by op (a size computed from a block input, a subgraph, a mesh)."""
        got = self._run_compiled(nodes, block, inputs, weights)
        if got is not None:
            return got
        return self._run_eager(nodes, block, inputs, weights)

    def _run_compiled(self, nodes, block, inputs, weights) -> list[np.ndarray] | None:
        import jax

        if self.placement is not None:
            return None
        # once per block, not per input set (block names repeat: ``<model>``)
        if id(block) not in self._structures:
            self._structures[id(block)] = (block, _structure(
                nodes, [self.values.get(n) for n in block.inputs],
                [self.values[n] for n in block.outputs],
            ))  # fmt: skip
        key = self._structures[id(block)][1]
        if key is None:
            return None
        sig, feeds, params = key
        entry = self._compiled.get(sig)
        if entry is None:
            entry = self._compiled[sig] = self._compile(nodes, feeds, params, sig)
        if entry is False:
            return None
        fx_name = {id(self.values[n]): n for n in block.inputs if n in self.values}
        names = [fx_name[id(v)] for v in feeds]
        if any(n not in inputs for n in names):
            return None
        args = [np.asarray(inputs[n]) for n in names]
        # A size crossing into the block (a 0-d integer) is a constant of its program: the
        # ops that shape arrays with it need its value while tracing.
        sizes = tuple(
            (i, int(a)) for i, a in enumerate(args) if a.ndim == 0 and a.dtype.kind in "iu"
        )
        static = {i for i, _ in sizes}
        args = [None if i in static else a for i, a in enumerate(args)]
        ws = [_initializer_data(v, weights) for v in params]
        try:
            outs = entry(args, [jax.device_put(w) for w in ws], sizes)
        except Exception:  # noqa: BLE001 (a value the op needs while tracing: op by op)
            logger.debug("block %s runs op by op", block.name, exc_info=True)
            self._compiled[sig] = False
            return None
        # JAX's int32 where the IR says int64 (x64 off): the dtype the op-by-op run gives
        return [
            _as_ir_dtype(np.asarray(o), self.values[n])
            for n, o in zip(block.outputs, outs, strict=True)
        ]

    def _compile(self, nodes, feeds, params, sig):
        """``fn(inputs, weights) -> outputs`` over this block's own nodes under ``jax.jit``:
        a later block of the same structure (``sig``) runs it with its arrays."""
        import jax

        outputs = sig[-1]

        def fn(args, ws, sizes):
            env: dict[Any, Any] = dict(zip(feeds, args, strict=True))
            for i, n in sizes:
                env[feeds[i]] = np.asarray(n, dtype=feeds[i].dtype.numpy())
            env.update(zip(params, ws, strict=True))
            for node in nodes:
                for v in node.inputs:
                    if v is not None and v not in env and v.const_value is not None:
                        env[v] = v.const_value.numpy()
                outs = self.interp.run_node(node, env, self.position[id(node)], None)
                env.update(zip(node.outputs, outs, strict=False))
            return [env[nodes[j].outputs[i]] if j >= 0 else env[feeds[i]] for j, i in outputs]

        return jax.jit(fn, static_argnums=2)

    def _run_eager(self, nodes, block, inputs, weights) -> list[np.ndarray]:
        import jax
        import jax.numpy as jnp

        env: dict[Any, Any] = {}
        put = self.placement
        for name, x in inputs.items():
            if name not in self.values:  # a size the block recomputes (see plan)
                continue
            env[self.values[name]] = put.input(x) if put is not None else jnp.asarray(x)
        for node in nodes:
            for v in node.inputs:
                if v is None or v in env or not (v.is_initializer() or v.const_value):
                    continue
                data = _initializer_data(v, weights)
                # device_put takes an aligned CPU array (torch storage) without a copy.
                if not v.is_initializer():
                    env[v] = data
                elif put is not None:
                    env[v] = put.weight(v.name, data)
                else:
                    env[v] = jax.device_put(data)
            outs = self.interp.run_node(node, env, self.position[id(node)], None)
            for v, o in zip(node.outputs, outs, strict=False):
                env[v] = o
        return [np.asarray(env[self.values[n]]) for n in block.outputs]


def _initializer_data(v: Any, weights: Mapping[str, Any]) -> np.ndarray:
    """An initializer's or constant's array: its own data, else the given weight."""
    if v.const_value is not None:
        return v.const_value.numpy()
    if v.name in weights:
        return _numpy(weights[v.name])
    raise ValueError(f"initializer {v.name!r} has no data and no given weight")


def _as_ir_dtype(arr: np.ndarray, value: Any) -> np.ndarray:
    dtype = getattr(value, "dtype", None)
    if dtype is None or dtype.is_floating_point() or arr.dtype.kind not in "iub":
        return arr
    want = dtype.numpy()
    return arr if arr.dtype == want else arr.astype(want)


def _structure(nodes: list[Any], ins: list[Any], outs: list[Any]):
    """A block's structure, the same for identical layers: ``(signature, feeds, params)``.

    The signature lists each node's op, attributes and where each input comes from (a block
    input by position, a weight by order of first read, a constant by its bytes, an earlier
    node's output), then the outputs. ``feeds`` are the block inputs the nodes read, in that
    order; ``params`` the weights. None for a block with a subgraph or reading a value from
    outside the block.
    """
    import hashlib

    import onnx_ir as ir

    block_inputs = {id(v) for v in ins if v is not None}
    feeds: list[Any] = []
    params: list[Any] = []
    seen_feed: dict[int, int] = {}
    seen_param: dict[int, int] = {}
    made: dict[int, tuple[int, int]] = {}
    parts = []
    for j, node in enumerate(nodes):
        attrs = []
        for name, a in sorted(node.attributes.items()):
            if a.is_ref() or a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
                return None
            value = a.value
            if isinstance(value, ir.TensorProtocol):
                value = (str(value.dtype), tuple(value.shape), value.numpy().tobytes())
            attrs.append((name, repr(value)))
        refs = []
        for v in node.inputs:
            if v is None or not v.name:
                refs.append(None)
            elif id(v) in made:
                refs.append(("n", *made[id(v)]))
            elif id(v) in block_inputs:
                if id(v) not in seen_feed:
                    seen_feed[id(v)] = len(feeds)
                    feeds.append(v)
                refs.append(("in", seen_feed[id(v)]))
            elif v.is_initializer():
                if id(v) not in seen_param:
                    seen_param[id(v)] = len(params)
                    params.append(v)
                refs.append(("w", seen_param[id(v)], str(v.dtype), tuple(v.shape or ())))
            elif v.const_value is not None:
                data = v.const_value.numpy()
                digest = hashlib.sha1(np.ascontiguousarray(data).tobytes()).hexdigest()
                refs.append(("c", str(data.dtype), data.shape, digest))
            else:
                return None
        for i, o in enumerate(node.outputs):
            made[id(o)] = (j, i)
        parts.append((node.op_type, node.domain, tuple(attrs), tuple(refs)))
    out_refs = []
    for v in outs:
        if id(v) in made:
            out_refs.append(made[id(v)])
        elif id(v) in seen_feed:
            out_refs.append((-1, seen_feed[id(v)]))
        else:
            return None
    return (tuple(parts), tuple(out_refs)), feeds, params


def _fx_values(model: Any, program: Any) -> dict[str, Any]:
    """The IR value computing each node of ``program``, by FX node name.

    First the importer's marks (``value.meta[FX_NODE]``, set by ``from_torch`` from the
    decomposed nodes' provenance) when they name this very graph; else IR values by name,
    where the name is not a mark's (torch renumbers ``view_N`` when it decomposes a
    ``reshape``: the IR's ``view_8`` can be the program's ``view_5``) and the shapes agree.
    Nodes the IR computes no value for are followed to their source: value-preserving ops
    (dropout, clone, a cast to the same dtype) to their input, the outputs of a higher-order
    op (``wrap_with_set_grad_enabled``, inlined by the decompositions) into its subgraph.
    """
    from xconv.ir.metadata import FX_GRAPH, FX_NODE

    named: dict[str, Any] = {v.name: v for v in model.graph.inputs}
    for n in model.graph:
        for v in n.outputs:
            if v.name:
                named[v.name] = v
    if program is None:
        return named
    ref = model.meta.get(FX_GRAPH)
    marked: dict[str, Any] = {}
    if ref is not None and ref() is program.graph:
        for v in named.values():
            for mark in v.meta.get(FX_NODE, ()):
                marked[mark] = v
    found: dict[str, Any] = {}
    for v in model.graph.inputs:
        found[v.name] = v
    nodes = list(program.graph.nodes)
    for node in nodes:  # own values first, then the ones followed to a source
        v = marked.get(node.name)
        if v is None and node.name in named:
            v = named[node.name]
            if (marked and FX_NODE in v.meta and node.name not in v.meta[FX_NODE]) or not (
                _agrees(v, node)
            ):
                v = None
        if v is not None:
            found[node.name] = v
    for node in nodes:
        if node.name not in found:
            v = _followed(node, program.graph_module, found, marked, named)
            if v is not None:
                found[node.name] = v
    return found


def _followed(node, root, found, marked, named) -> Any:
    """The IR value of an FX node the IR has no own value for (see :func:`_fx_values`)."""
    seen = 0
    call = None  # the higher-order op whose subgraph ``node`` is in
    while seen < 64:
        seen += 1
        if call is None and node.name in found:
            return found[node.name]
        if call is not None:
            v = marked.get(f"{call.name}:{node.name}") or _nth_of_kind(node, call, marked)
            if v is None and not marked and node.name in named and _agrees(named[node.name], node):
                v = named[node.name]
            if v is not None:
                return v
        if _is_alias(node):
            node = node.all_input_nodes[0]
            continue
        if call is not None and node.op == "placeholder":  # a subgraph input: the operand
            operands = _operands(call)
            index = [n for n in node.graph.nodes if n.op == "placeholder"].index(node)
            if operands is None or index >= len(operands):
                return None
            node, call = operands[index], None
            continue
        item = _subgraph_output(node, root)
        if item is None:
            return None
        node, call = item
    return None


def _kind(name: str) -> str:
    return re.sub(r"_\d+$", "", name)


def _nth_of_kind(node, call, marked) -> Any:
    """The IR value of a subgraph node whose name the decompositions renumbered (a dynamic
    shape's size arithmetic shifts ``mul_1`` to ``mul_92``): the k-th ``mul`` of the
    subgraph is the k-th ``mul`` marked for the call, when both have as many."""
    kind = _kind(node.name)
    same = [n for n in node.graph.nodes if n.op == "call_function" and _kind(n.name) == kind]
    prefix = f"{call.name}:"
    found = [
        v for m, v in marked.items() if m.startswith(prefix) and _kind(m[len(prefix) :]) == kind
    ]
    if len(found) != len(same) or node not in same:
        return None
    v = found[same.index(node)]
    return v if _agrees(v, node) else None


def _operands(call) -> list[Any] | None:
    """The operands a higher-order op passes to its subgraph: the arguments after it."""
    for i, a in enumerate(call.args):
        if getattr(a, "op", None) == "get_attr":
            return list(call.args[i + 1 :])
    return None


def _subgraph_output(node, root) -> tuple[Any, Any] | None:
    """For ``getitem(call, i)`` of a higher-order op: (the subgraph's i-th output, call)."""
    import operator

    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    call, index = node.args
    if getattr(call, "op", None) != "call_function" or not isinstance(index, int):
        return None
    sub = next((a for a in call.args if getattr(a, "op", None) == "get_attr"), None)
    if sub is None or _operands(call) is None:
        return None
    gm = _attr(root, sub.target)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if not isinstance(out, tuple | list) or index >= len(out):
        return None
    return out[index], call


def _agrees(value, node) -> bool:
    """Whether an IR value can hold an FX node's tensor: same rank and static dims."""
    val = node.meta.get("val")
    shape = getattr(value, "shape", None)
    if val is None or shape is None or not hasattr(val, "shape"):
        return True
    if len(shape) != len(val.shape):
        return False
    for a, b in zip(shape, val.shape, strict=True):
        if isinstance(a, int) and isinstance(b, int) and a != b:
            return False
    return True


_ALIASES = frozenset(
    {"dropout", "clone", "alias", "detach", "contiguous", "lift_fresh_copy", "identity"}
)


def _is_alias(node) -> bool:
    """Whether an FX node returns its first input's values unchanged (inference mode)."""
    if node.op != "call_function" or not node.all_input_nodes:
        return False
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    if name in _ALIASES:
        return True
    if name in ("_to_copy", "to"):
        src, out = node.all_input_nodes[0].meta.get("val"), node.meta.get("val")
        return getattr(src, "dtype", 0) == getattr(out, "dtype", 1)
    return False


def _numpy(x: Any) -> np.ndarray:
    from xconv.parity.adapters import to_numpy

    return to_numpy(x)


# ------------------------------------------------------------------------------ the run


def run_layerwise(
    program: Any,
    candidate_ir: Any,
    inputs: Sequence[Any],
    *,
    policy: str | Policy = "oracle",
    weights: BlockWeights | None = None,
    progress: Progress | None = None,
    placement: Any = None,
) -> LayerwiseResult:
    """Check ``candidate_ir`` against ``program`` one block at a time (see module doc).

    Args:
        program: The reference ``torch.export.ExportedProgram``.
        candidate_ir: The ``onnx_ir.Model`` converted from it (value names follow the
            program's node names, as ``xconv.from_torch`` leaves them).
        inputs: The user inputs (numpy or torch), in the program's order.
        policy: Parity policy name or :class:`Policy`.
        weights: Provides each block's weights lazily; default the program's own.
        progress: Called with ``"block i/n: name"`` as each block starts.
        placement: Runs the candidate blocks sharded over a mesh (see :class:`IRBlocks`).

    Returns:
        A :class:`LayerwiseResult` with the float64 outputs of the whole model and a
        :class:`BlockResult` per block.
    """
    return run_layerwise_sets(
        program,
        candidate_ir,
        [("example", inputs)],
        policy=policy,
        weights=weights,
        progress=progress,
        placement=placement,
    )["example"]


@dataclass
class _SetState:
    """One input set's walk through the blocks: its float64 values, their dtypes, results."""

    env64: dict[str, np.ndarray]
    dtypes: dict[str, Any]
    results: list[BlockResult] = field(default_factory=list)


def run_layerwise_sets(
    program: Any,
    candidate_ir: Any,
    sets: Sequence[tuple[str, Sequence[Any]]],
    *,
    policy: str | Policy = "oracle",
    weights: BlockWeights | None = None,
    progress: Progress | None = None,
    placement: Any = None,
) -> dict[str, LayerwiseResult]:
    """:func:`run_layerwise` on several input sets at once, one :class:`LayerwiseResult` per
    set name. Each block's weights are read, cast to float64 and its graphs built once for
    all the sets (the float64 cast of a 0.8B model's weights is most of a set's cost)."""
    import time

    pol = resolve_policy(policy)
    weights = weights or program_weights(program)
    cand = IRBlocks(candidate_ir, program, placement)
    blocks, plans, merged = _cuttable_blocks_merged(program, cand)
    downgrades = [{"kind": "merged_blocks", "message": m} for m in merged]

    by_name = {n.name: n for n in program.graph.nodes}
    states = {name: _SetState(*_input_env(program, xs)) for name, xs in sets}
    last_use: dict[str, int] = {}
    for i, b in enumerate(blocks):
        for n in b.inputs:
            last_use[n] = i
    outputs = _user_outputs(program)
    for n in outputs:
        last_use[n] = len(blocks)

    def done(notes: list[str], complete: bool) -> dict[str, LayerwiseResult]:
        return {
            name: LayerwiseResult(
                [st.env64[n] for n in outputs] if complete else [],
                st.results,
                pol,
                list(notes),
                list(downgrades),
            )
            for name, st in states.items()
        }

    for i, block in enumerate(blocks):
        (progress or logger.info)(f"block {i + 1}/{len(blocks)}: {block.name}")
        t = time.perf_counter()
        try:
            res = _run_block(
                program, block, plans[i], cand, list(states.values()), by_name, weights, pol
            )
        except Exception as e:
            logger.debug("block %s failed", block.name, exc_info=True)
            why = f"{type(e).__name__}: {e}"
            for st in states.values():
                st.results.append(BlockResult(block, i, False, [], why))
            return done([f"block {block.name} could not run: {why}"], complete=False)
        seconds = (time.perf_counter() - t) / max(len(states), 1)
        for st, r in zip(states.values(), res, strict=True):
            r.index, r.seconds = i, seconds
            st.results.append(r)
            for n in list(st.env64):
                if last_use.get(n, -1) <= i:
                    del st.env64[n]
    note = (
        f"float64 oracle run block by block ({len(blocks)} blocks); candidate blocks: the "
        "IR sub-graph of each block run by the JAX runtime"
    )
    return done([note], complete=True)


def _run_block(program, block, nodes, cand, states, by_name, weights, pol) -> list[BlockResult]:
    """``block`` on every set in ``states`` (its weights read and cast once): the float64
    oracle, the float32 reference and the candidate, each fed the oracle's inputs."""
    import torch

    from xconv.parity.adapters import to_numpy

    # Symbolic sizes (``sym_size_int`` of a dynamic-shape program) cross blocks as ints.
    ints = [not isinstance(by_name[n].meta.get("val"), torch.Tensor | None) for n in block.inputs]
    with weights(block) as w:
        gm64 = block_module(program, block, float64=True)
        with torch.no_grad():
            w64 = [_to_torch64(torch, w[name]) for name in block.weights]
            oracles = []
            for st in states:
                args64 = [
                    int(st.env64[n]) if i else _to_torch64(torch, st.env64[n])
                    for n, i in zip(block.inputs, ints, strict=True)
                ]
                with float64_defaults():
                    oracles.append([to_numpy(o) for o in gm64(*args64, *w64)])
            del w64, gm64
            gm = block_module(program, block)
            own = [
                w[name]
                if isinstance(w[name], torch.Tensor)
                else torch.from_numpy(np.ascontiguousarray(w[name]))
                for name in block.weights
            ]
            ins = [
                [
                    int(st.env64[n]) if i else _to_torch(torch, st.env64[n], st.dtypes.get(n))
                    for n, i in zip(block.inputs, ints, strict=True)
                ]
                for st in states
            ]
            refs = [[to_numpy(o) for o in gm(*xs, *own)] for xs in ins]
        gots = []
        for xs in ins:
            cand_in = {
                n: cand.scalar(n, x) if i else to_numpy(x)
                for n, x, i in zip(block.inputs, xs, ints, strict=True)
            }
            gots.append(cand.run(nodes, block, cand_in, w))
    results = []
    for st, got, ref, oracle in zip(states, gots, refs, oracles, strict=True):
        metrics = []
        for name, c, r, o in zip(block.outputs, got, ref, oracle, strict=True):
            st.dtypes[name] = _dtype_of(by_name[name], torch)
            metrics.append(compare(f"{block.name}:{name}", c, r, pol, o if _floating(r) else None))
            st.env64[name] = o
        results.append(BlockResult(block, 0, all(m.passed for m in metrics), metrics))
    return results


def _floating(a: np.ndarray) -> bool:
    """Float arrays, bfloat16 / float8 included (ml_dtypes' kind is ``V``)."""
    return a.dtype.kind == "f" or a.dtype.name.startswith(("bfloat16", "float8"))


def _dtype_of(node, torch):
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def layerwise_oracle(
    reference: Any,
    candidate: Any,
    layerwise: Any,
    sets: Sequence[tuple[str, Sequence[np.ndarray]]],
    pol: Policy,
) -> dict[str, LayerwiseResult]:
    """``check_parity``'s hook: the layerwise run on each input set, by name, for
    ``reference`` (an ExportedProgram or its adapter) against the candidate's IR
    (``layerwise`` itself when it is an ``onnx_ir.Model``, else the candidate adapter's,
    else the program converted). A :class:`LayerwiseResult` passed as ``layerwise`` (run
    earlier on the same inputs, e.g. before the candidate was loaded, to keep peak memory
    down) is used as is for every set."""
    if isinstance(layerwise, LayerwiseResult):  # run beforehand, on the same inputs
        return {name: layerwise for name, _ in sets}
    program = getattr(reference, "program", reference)
    if type(program).__name__ != "ExportedProgram":
        raise TypeError(
            "layerwise parity needs a torch.export.ExportedProgram reference (a .pt2), got "
            f"{type(program).__name__}"
        )
    model = layerwise if type(layerwise).__name__ == "Model" else None
    if model is None:
        model = getattr(candidate, "ir_model", None)
    if model is None:
        from xconv.converters.torch.importer.trace import from_torch

        model = from_torch(program)
    return run_layerwise_sets(program, model, sets, policy=pol)


# --------------------------------------------------------------- a reference run ahead


def _key(arrays: Sequence[np.ndarray]) -> str:
    import hashlib

    h = hashlib.sha1()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(memoryview(a.reshape(-1).view(np.uint8)))
    return h.hexdigest()


def recorded_reference(
    reference: Any,
    sets: Sequence[tuple[str, Sequence[np.ndarray]]],
    ran: Mapping[str, list[np.ndarray]] | None = None,
):
    """The reference run now on every input set, as an adapter that replays its outputs.

    The pipeline runs the reference (float32, whole model: its weights are in memory
    already) on each set before the candidate is loaded, so that the reference's weights
    can be released first and the two models never hold memory at the same time.
    ``check_parity`` then takes the returned adapter as the reference; asked for inputs it
    did not record, it raises (the reference is gone). ``ran``: outputs already run, by
    input key, reused as they are.
    """
    from xconv.parity.adapters import wrap

    ref = wrap(reference)
    dev = ref.devices()[0]
    ref.prepare(dev)
    ran = ran or {}
    outputs = {}
    for _, xs in sets:
        key = _key(xs)
        outputs[key] = ran[key] if key in ran else ref.run(xs, dev)

    n = len(next(iter(outputs.values()), []))
    return _Recorded(ref.framework, ref.describe(), ref.output_names(n), outputs)


class _Recorded(Adapter):
    """Replays a reference's outputs recorded by :func:`recorded_reference`. It holds no
    reference to the model, so dropping the model releases its weights."""

    def __init__(self, framework: str, description: str, names: list[str], outputs) -> None:
        self.framework = framework
        self.description = description
        self.names = names
        self.outputs = outputs

    def describe(self) -> str:
        return self.description

    def output_names(self, n: int) -> list[str]:
        return list(self.names[:n]) if len(self.names) >= n else super().output_names(n)

    def run(self, inputs, device):
        try:
            return self.outputs[_key([np.asarray(x) for x in inputs])]
        except KeyError:
            raise ValueError(
                "the reference was run ahead on its input sets only (its weights are "
                "released before the candidate loads)"
            ) from None

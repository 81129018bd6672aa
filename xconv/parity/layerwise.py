"""Block-by-block parity: a float64 proof for models whose float64 copy would not fit.

The whole-model float64 oracle holds a float64 copy of every weight at once (twice the
model's float32 bytes). Layerwise parity instead runs the model one top-level block at a time
(a transformer layer ``model.layers.3``, a ResNet stage, the embeddings, the head), and for
each block runs three things on the *same* captured block inputs:

* the **oracle**: the reference block with its weights and inputs cast to float64 (a
  graph-level cast: every ``dtype=torch.float32`` argument in the block's graph becomes
  ``float64``, so ``.to(torch.float32)`` inside RMSNorm does not drop precision);
* the **reference**: the same block in its own dtype, on the oracle's inputs rounded to it;
* the **candidate**: the IR sub-graph of the block (the nodes that compute the block's
  outputs from its inputs) run by the JAX runtime (``xconv.to_jax``'s interpreter), on the
  same rounded inputs.

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

    @property
    def passed(self) -> bool:
        return all(b.passed for b in self.blocks)

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
                elif owner.get(a) != i and a.name not in inputs:
                    inputs.append(a.name)
            if any(u is out_node or owner.get(u, i) > i for u in n.users):
                outputs.append(n.name)
        blocks.append(
            Block(name, tuple(n.name for n in nodes), tuple(inputs), tuple(outputs), tuple(weights))
        )
    return blocks


def _cuttable_blocks(program: Any, cand: IRBlocks) -> tuple[list[Any], list[Any]]:
    """The program's blocks, each one the candidate can be cut at (a block it cannot cut is
    merged into the next), and the candidate's plan for each."""
    blocks = split_program(program)
    for _ in range(len(blocks)):
        plans = [cand.plan(b) for b in blocks]
        bad = {i for i, p in enumerate(plans) if isinstance(p, str)}
        if not bad or len(blocks) == 1:
            break
        blocks = _merge_into_next(program, blocks, bad)
    plans = [cand.plan(b) for b in blocks]
    for b, p in zip(blocks, plans, strict=True):
        if isinstance(p, str):
            raise ValueError(f"cannot cut the candidate at block {b.name}: {p}")
    return blocks, plans


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
    """Blocks ``bad`` joined with their successors (a boundary the candidate cannot cut at)."""
    by_name = {n.name: n for n in program.graph.nodes}
    runs: list[tuple[str, list[Any]]] = []
    pending: list[Block] = []
    for i, b in enumerate(blocks):
        pending.append(b)
        if i in bad and i + 1 < len(blocks):
            continue
        name = pending[0].name if len(pending) == 1 else f"{pending[0].name} .. {b.name}"
        runs.append((name, [by_name[n] for x in pending for n in x.nodes]))
        pending = []
    return _build(program, runs)


# ------------------------------------------------------------------------ reference side


def _float_dtype(torch, dtype) -> bool:
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point


def block_module(program: Any, block: Block, *, float64: bool = False):
    """The block as a ``torch.fx.GraphModule``: ``gm(*block_inputs, *weights) -> tuple``.

    Weights are passed in ``block.weights`` order. With ``float64=True`` every floating
    dtype argument in the graph (``.to(torch.float32)``, ``full(..., dtype=float32)``,
    dtype assertions) becomes ``torch.float64`` (the graph-level cast of the oracle).
    """
    import torch
    from torch import fx

    by_name = {n.name: n for n in program.graph.nodes}
    place_of = {t: p for p, t in _weight_placeholders(program).items()}
    g = fx.Graph()
    env: dict[Any, Any] = {}
    for name in block.inputs:
        env[by_name[name]] = g.placeholder(_ident(name))
    for w in block.weights:
        env[by_name[place_of[w]]] = g.placeholder(_ident(place_of[w]))

    def cast(a):
        return torch.float64 if _float_dtype(torch, a) else a

    for name in block.nodes:
        node = by_name[name]
        new = g.node_copy(node, lambda a: env[a])
        if float64:
            new.args = fx.node.map_aggregate(new.args, cast)
            new.kwargs = fx.node.map_aggregate(new.kwargs, cast)
        env[node] = new
    g.output(tuple(env[by_name[o]] for o in block.outputs))
    return fx.GraphModule(program.graph_module, g)


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
    """The whole program in float64 (weights cast, graph-level dtype cast), as a function of
    the user inputs. ``ExportedProgram.module().double()`` does not work: the unlifted
    module's guards pin the input dtypes and ops inside carry ``dtype=torch.float32``."""
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
        with torch.no_grad():
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
    """Runs blocks of the candidate IR with the JAX runtime's interpreter (eager).

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
        self.values: dict[str, Any] = {v.name: v for v in model.graph.inputs}
        for n in self.nodes:
            for v in n.outputs:
                if v.name:
                    self.values[v.name] = v
        if program is not None:  # FX values the IR dropped (dropout, clone): their input
            for node in program.graph.nodes:
                source = node
                while source.name not in self.values and _is_alias(source):
                    source = source.all_input_nodes[0]
                if node.name not in self.values and source.name in self.values:
                    self.values[node.name] = self.values[source.name]

    def plan(self, block: Block) -> list[Any] | str:
        """The IR nodes computing ``block.outputs`` from ``block.inputs``, or why not."""
        missing = [n for n in (*block.inputs, *block.outputs) if n not in self.values]
        if missing:
            return f"no IR value named {missing[:3]}"
        stop = {id(self.values[n]) for n in block.inputs}
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

    def run(
        self,
        nodes: list[Any],
        block: Block,
        inputs: Mapping[str, np.ndarray],
        weights: Mapping[str, Any],
    ) -> list[np.ndarray]:
        import jax
        import jax.numpy as jnp

        env: dict[Any, Any] = {}
        put = self.placement
        for name, x in inputs.items():
            env[self.values[name]] = put.input(x) if put is not None else jnp.asarray(x)
        for node in nodes:
            for v in node.inputs:
                if v is None or v in env or not (v.is_initializer() or v.const_value):
                    continue
                if v.const_value is not None:
                    data = v.const_value.numpy()
                elif v.name in weights:
                    data = _numpy(weights[v.name])
                else:
                    raise ValueError(f"initializer {v.name!r} has no data and no given weight")
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
    import time

    pol = resolve_policy(policy)
    weights = weights or program_weights(program)
    cand = IRBlocks(candidate_ir, program, placement)
    blocks, plans = _cuttable_blocks(program, cand)
    notes: list[str] = []

    by_name = {n.name: n for n in program.graph.nodes}
    env64, dtypes = _input_env(program, inputs)
    last_use: dict[str, int] = {}
    for i, b in enumerate(blocks):
        for n in b.inputs:
            last_use[n] = i
    outputs = _user_outputs(program)
    for n in outputs:
        last_use[n] = len(blocks)

    results: list[BlockResult] = []
    for i, block in enumerate(blocks):
        (progress or logger.info)(f"block {i + 1}/{len(blocks)}: {block.name}")
        t = time.perf_counter()
        try:
            res = _run_block(program, block, plans[i], cand, env64, dtypes, by_name, weights, pol)
        except Exception as e:
            logger.debug("block %s failed", block.name, exc_info=True)
            results.append(BlockResult(block, i, False, [], f"{type(e).__name__}: {e}"))
            notes.append(f"block {block.name} could not run: {type(e).__name__}: {e}")
            return LayerwiseResult([], results, pol, notes)
        res.index = i
        res.seconds = time.perf_counter() - t
        results.append(res)
        for n in list(env64):
            if last_use.get(n, -1) <= i:
                del env64[n]
    oracle_outputs = [env64[n] for n in outputs]
    notes.append(
        f"float64 oracle run block by block ({len(blocks)} blocks); candidate blocks: the "
        "IR sub-graph of each block run by the JAX runtime"
    )
    return LayerwiseResult(oracle_outputs, results, pol, notes)


def _run_block(program, block, nodes, cand, env64, dtypes, by_name, weights, pol) -> BlockResult:
    import torch

    from xconv.parity.adapters import to_numpy

    ins64 = [env64[n] for n in block.inputs]
    with weights(block) as w:
        gm64 = block_module(program, block, float64=True)
        with torch.no_grad():
            w64 = [_to_torch64(torch, w[name]) for name in block.weights]
            oracle = gm64(*[_to_torch64(torch, x) for x in ins64], *w64)
            del w64, gm64
            oracle = [to_numpy(o) for o in oracle]
            gm = block_module(program, block)
            own = [
                w[name]
                if isinstance(w[name], torch.Tensor)
                else torch.from_numpy(np.ascontiguousarray(w[name]))
                for name in block.weights
            ]
            ins = [
                _to_torch(torch, x, dtypes.get(n)) for n, x in zip(block.inputs, ins64, strict=True)
            ]
            ref = [to_numpy(o) for o in gm(*ins, *own)]
        cand_in = {n: to_numpy(x) for n, x in zip(block.inputs, ins, strict=True)}
        got = cand.run(nodes, block, cand_in, w)
    metrics = []
    for name, c, r, o in zip(block.outputs, got, ref, oracle, strict=True):
        dtypes[name] = _dtype_of(by_name[name], torch)
        metrics.append(compare(f"{block.name}:{name}", c, r, pol, o if _floating(r) else None))
        env64[name] = o
    return BlockResult(block, 0, all(m.passed for m in metrics), metrics)


def _floating(a: np.ndarray) -> bool:
    """Float arrays, bfloat16 / float8 included (ml_dtypes' kind is ``V``)."""
    return a.dtype.kind == "f" or a.dtype.name.startswith(("bfloat16", "float8"))


def _dtype_of(node, torch):
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def layerwise_oracle(
    reference: Any, candidate: Any, layerwise: Any, arrays: Sequence[np.ndarray], pol: Policy
) -> LayerwiseResult:
    """``check_parity``'s hook: the layerwise run for ``reference`` (an ExportedProgram or
    its adapter) against the candidate's IR (``layerwise`` itself when it is an
    ``onnx_ir.Model``, else the candidate adapter's, else the program converted). A
    :class:`LayerwiseResult` passed as ``layerwise`` (run earlier on the same inputs, e.g.
    before the candidate was loaded, to keep peak memory down) is used as is."""
    if isinstance(layerwise, LayerwiseResult):  # run beforehand, on the same inputs
        return layerwise
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
    return run_layerwise(program, model, arrays, policy=pol)


# --------------------------------------------------------------- a reference run ahead


def _key(arrays: Sequence[np.ndarray]) -> str:
    import hashlib

    h = hashlib.sha1()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(memoryview(a.reshape(-1).view(np.uint8)))
    return h.hexdigest()


def recorded_reference(reference: Any, sets: Sequence[tuple[str, Sequence[np.ndarray]]]):
    """The reference run now on every input set, as an adapter that replays its outputs.

    The pipeline runs the reference (float32, whole model: its weights are in memory
    already) on each set before the candidate is loaded, so that the reference's weights
    can be released first and the two models never hold memory at the same time.
    ``check_parity`` then takes the returned adapter as the reference; asked for inputs it
    did not record, it raises (the reference is gone).
    """
    from xconv.parity.adapters import wrap

    ref = wrap(reference)
    dev = ref.devices()[0]
    ref.prepare(dev)
    outputs = {_key(xs): ref.run(xs, dev) for _, xs in sets}

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

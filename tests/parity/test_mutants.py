"""Mutation suite: plant faults in correct conversions and check that parity catches each one.

Each fixture model (``fixtures/torch_models.py``: ResNet, transformer, multi-head attention)
and a tiny Llama-shaped ``transformers`` model (GQA, rotary positions, RMSNorm, causal mask)
is converted once with :func:`xconv.from_torch`. Every mutant edits a copy of that IR (a
weight, an attribute, an inserted node) and runs it on onnxruntime as the candidate against
the torch module under the default policy. A mutant is killed when the check fails and, where
the fault sits in a module scope, names that scope as the first divergence. The correct
conversions must pass on the default input sets (no false failure). The kill rate is printed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import pytest
import torch

import xconv
from xconv.ir.metadata import get_scope

transformers = pytest.importorskip("transformers")


# --------------------------------------------------------------------------- IR edits


def _copy(model: ir.Model) -> ir.Model:
    return ir.from_proto(ir.to_proto(model))


def _nodes(model: ir.Model, scope: str, op: str | None = None) -> list[ir.Node]:
    found = [n for n in model.graph if (get_scope(n) == scope) and (op is None or n.op_type == op)]
    if not found:
        raise LookupError(f"no {op or 'node'} in scope {scope!r}")
    return found


def _const(v: ir.Value) -> np.ndarray:
    if v.const_value is not None:
        return v.const_value.numpy()
    prod = v.producer()
    if prod is not None and prod.op_type == "Constant":
        return prod.attributes["value"].value.numpy()
    raise LookupError(f"{v.name} is not a constant")


def _set_const(model: ir.Model, v: ir.Value, array: np.ndarray) -> None:
    """Give the constant ``v`` a new value (a fresh initializer, so shared uses keep theirs
    only when they do not read ``v``)."""
    new = ir.Value(name=f"{v.name}_mutant", shape=ir.Shape(array.shape))
    new.const_value = ir.tensor(array, name=new.name)
    new.dtype = new.const_value.dtype
    model.graph.register_initializer(new)
    for use in list(v.uses()):
        use.node.replace_input_with(use.idx, new)


def _weight_input(node: ir.Node, index: int = 1) -> ir.Value:
    """The constant behind a node's weight input (through the exporter's Transpose)."""
    v = node.inputs[index]
    prod = v.producer()
    if v.const_value is None and prod is not None and prod.op_type == "Transpose":
        return prod.inputs[0]
    return v


def scale_weight(scope: str, op: str, factor: float, index: int = 1):
    def edit(m: ir.Model) -> None:
        node = _nodes(m, scope, op)[0]
        v = _weight_input(node, index)
        w = _const(v)
        _set_const(m, v, (w.astype(np.float64) * factor).astype(w.dtype))

    return edit


def edit_weight(scope: str, op: str, fn: Callable[[np.ndarray], np.ndarray], index: int = 1):
    def edit(m: ir.Model) -> None:
        node = _nodes(m, scope, op)[0]
        v = _weight_input(node, index)
        _set_const(m, v, np.ascontiguousarray(fn(_const(v).copy())))

    return edit


def set_attr(scope: str, op: str, name: str, value, which: int = 0):
    def edit(m: ir.Model) -> None:
        node = _nodes(m, scope, op)[which]
        if isinstance(value, float):
            node.attributes[name] = ir.AttrFloat32(name, value)
        elif isinstance(value, str):
            node.attributes[name] = ir.AttrString(name, value)
        elif isinstance(value, int):
            node.attributes[name] = ir.AttrInt64(name, value)
        else:
            node.attributes[name] = ir.AttrInt64s(name, list(value))

    return edit


def drop_input(scope: str, op: str, index: int):
    def edit(m: ir.Model) -> None:
        node = _nodes(m, scope, op)[0]
        node.replace_input_with(index, None)

    return edit


def _after(m: ir.Model, value: ir.Value, build) -> None:
    """Insert ``build(value) -> (nodes, out)`` after ``value``'s producer; route its uses
    (and a graph output) through ``out``."""
    producer = value.producer()
    nodes, out = build(value)
    for i, n in enumerate(nodes):
        n.name = f"mutant_{value.name}_{i}"
        for o in n.outputs:
            o.name = o.name or f"{n.name}_out"
        if producer is not None and get_scope(producer):
            n.metadata_props["xconv.scope"] = get_scope(producer)
    out.dtype, out.shape = value.dtype or ir.DataType.FLOAT, value.shape
    uses = list(value.uses())
    m.graph.insert_after(producer, nodes)
    for use in uses:
        if use.node not in nodes:
            use.node.replace_input_with(use.idx, out)
    outs = m.graph.outputs
    for i, o in enumerate(outs):
        if o is value:
            outs[i] = out
            out.name, value.name = value.name, f"{value.name}_pre_mutant"


def zero_init(name: str):
    """Drop a bias held as an initializer (``nn.MultiheadAttention`` biases start at zero,
    so dropping those would change nothing)."""

    def edit(m: ir.Model) -> None:
        v = m.graph.initializers[name]
        _set_const(m, v, np.zeros_like(_const(v)))

    return edit


def scale_init(name: str, factor: float):
    def edit(m: ir.Model) -> None:
        v = m.graph.initializers[name]
        w = _const(v)
        _set_const(m, v, (w.astype(np.float64) * factor).astype(w.dtype))

    return edit


def round_trip(scope: str, op: str, dtype: ir.DataType):
    def edit(m: ir.Model) -> None:
        node = _nodes(m, scope, op)[-1]

        def build(v):
            a = ir.Node("", "Cast", [v], [ir.AttrInt64("to", dtype)], num_outputs=1)
            back = v.dtype or ir.DataType.FLOAT
            b = ir.Node("", "Cast", [a.outputs[0]], [ir.AttrInt64("to", back)], num_outputs=1)
            return [a, b], b.outputs[0]

        _after(m, node.outputs[0], build)

    return edit


def perturb_output(index: int, fn: Callable[[np.ndarray, np.ndarray], np.ndarray]):
    """Add a constant ``fn(zeros, example output)`` to graph output ``index``."""

    def edit(m: ir.Model, example: np.ndarray) -> None:
        out = m.graph.outputs[index]
        delta = fn(np.zeros(example.shape, np.float32), example)

        def build(v):
            c = ir.Value(name=f"{v.name}_delta", shape=ir.Shape(delta.shape))
            c.const_value = ir.tensor(delta, name=c.name)
            c.dtype = c.const_value.dtype
            m.graph.register_initializer(c)
            add = ir.Node("", "Add", [v, c], num_outputs=1)
            return [add], add.outputs[0]

        _after(m, out, build)

    edit.needs_example = True
    return edit


def scale_output(index: int, factor: float):
    def edit(m: ir.Model) -> None:
        out = m.graph.outputs[index]

        def build(v):
            c = ir.Value(name=f"{v.name}_factor", shape=ir.Shape([]))
            c.const_value = ir.tensor(np.array(factor, np.float32), name=c.name)
            c.dtype = c.const_value.dtype
            m.graph.register_initializer(c)
            mul = ir.Node("", "Mul", [v, c], num_outputs=1)
            return [mul], mul.outputs[0]

        _after(m, out, build)

    return edit


def swap_outputs(m: ir.Model) -> None:
    outs = m.graph.outputs
    a, b = outs[0], outs[1]
    outs[0], outs[1] = b, a


def eps_add(scope: str, eps: float):
    """RMSNorm written out (x * rsqrt(mean(x^2) + eps)): change the scalar eps of its Add."""

    def edit(m: ir.Model) -> None:
        for node in _nodes(m, scope, "Add"):
            for v in node.inputs:
                try:
                    c = _const(v)
                except LookupError:
                    continue
                if c.size == 1:
                    _set_const(m, v, np.full(c.shape, eps, c.dtype))
                    return
        raise LookupError(f"no scalar Add in {scope!r}")

    return edit


# --------------------------------------------------------------------------- models


@dataclass
class Subject:
    module: torch.nn.Module
    inputs: tuple[np.ndarray, ...]
    model: ir.Model


def _subject(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> Subject:
    module = module.eval()
    return Subject(module, tuple(a.numpy() for a in args), xconv.from_torch(module, args))


@pytest.fixture(scope="module")
def subjects() -> dict[str, Subject]:
    from fixtures.torch_models import FIXTURES

    out = {name: _subject(*FIXTURES[name]()) for name in ("resnet", "transformer", "mha_weights")}
    out["llama"] = llama_subject()
    return out


def llama_subject() -> Subject:
    """A 2-layer Llama (random weights, seed 0) on a 4 x 40 batch of token ids."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    ids = torch.randint(0, 100, (4, 40), generator=torch.Generator().manual_seed(1))
    return _subject(transformers.LlamaModel(cfg), (ids,))


def _rope(base: float, dim: int = 16) -> Callable[[np.ndarray], np.ndarray]:
    return lambda w: (1.0 / base ** (np.arange(0, dim, 2) / dim)).astype(w.dtype)


def _swap_kv_heads(w: np.ndarray) -> np.ndarray:
    half = w.shape[0] // 2  # two kv heads of 16 rows each
    return np.concatenate([w[half:], w[:half]])


def _one_element(delta: np.ndarray, y: np.ndarray) -> np.ndarray:
    i = (1, 17, 5)
    delta[i] = 1e-3 * max(abs(float(y[i])), float(np.sqrt(np.mean(y**2))))
    return delta


def _at(value: float) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    def fn(delta, y):
        delta[(0, 3, 7)] = value
        return delta

    return fn


# name -> (subject, edit, scope the fault sits in, or None where there is no scope)
MUTANTS: dict[str, tuple[str, Callable, str | None]] = {
    # ResNet fixture: convolutions, batch norm, pooling, linear head.
    "resnet/stem_weight_x1.001": ("resnet", scale_weight("conv1", "Conv", 1 + 1e-3), "conv1"),
    "resnet/block_weight_x0.999": (
        "resnet",
        scale_weight("layer2.0.conv2", "Conv", 1 - 1e-3),
        "layer2.0.conv2",
    ),
    "resnet/bn_eps_1e-3": (
        "resnet",
        set_attr("bn1", "BatchNormalization", "epsilon", 1e-3),
        "bn1",
    ),
    "resnet/block_bn_eps_1e-3": (
        "resnet",
        set_attr("layer1.0.bn2", "BatchNormalization", "epsilon", 1e-3),
        "layer1.0.bn2",
    ),
    "resnet/padding_off_by_one": (
        "resnet",
        set_attr("conv1", "Conv", "pads", (3, 3, 1, 1)),
        "conv1",
    ),
    "resnet/kernel_transposed": (
        "resnet",
        edit_weight("layer1.0.conv1", "Conv", lambda w: np.swapaxes(w, 2, 3)),
        "layer1.0.conv1",
    ),
    "resnet/downsample_kernel_transposed_io": (
        "resnet",
        edit_weight("layer1.0.conv2", "Conv", lambda w: np.swapaxes(w, 0, 1)),
        "layer1.0.conv2",
    ),
    "resnet/dropped_bias": ("resnet", drop_input("fc", "Gemm", 2), "fc"),
    "resnet/head_weight_x1.001": ("resnet", scale_weight("fc", "Gemm", 1 + 1e-3), "fc"),
    "resnet/float16_round_trip": (
        "resnet",
        round_trip("layer2.0.conv1", "Conv", ir.DataType.FLOAT16),
        "layer2.0.conv1",
    ),
    "resnet/bfloat16_round_trip": (
        "resnet",
        round_trip("layer1.0.conv2", "Conv", ir.DataType.BFLOAT16),
        "layer1.0.conv2",
    ),
    "resnet/nan_weight": (
        "resnet",
        edit_weight(
            "fc", "Gemm", lambda w: np.where(np.arange(w.size).reshape(w.shape) == 3, np.nan, w)
        ),
        "fc",
    ),
    "resnet/inf_weight": (
        "resnet",
        edit_weight(
            "fc", "Gemm", lambda w: np.where(np.arange(w.size).reshape(w.shape) == 5, np.inf, w)
        ),
        "fc",
    ),
    "resnet/zero_output": ("resnet", scale_output(0, 0.0), None),
    # Transformer fixture: embeddings, layer norms, SDPA (causal and not), GELU both ways.
    "transformer/gelu_exact_to_tanh": (
        "transformer",
        set_attr("layers.0.act", "Gelu", "approximate", "tanh"),
        "layers.0.act",
    ),
    "transformer/gelu_tanh_to_exact": (
        "transformer",
        set_attr("layers.1.act", "Gelu", "approximate", "none"),
        "layers.1.act",
    ),
    "transformer/ln_eps_1e-3": (
        "transformer",
        set_attr("layers.0.ln1", "LayerNormalization", "epsilon", 1e-3),
        "layers.0.ln1",
    ),
    "transformer/ln_eps_1e-4_for_1e-6": (
        "transformer",
        set_attr("layers.1.ln3", "LayerNormalization", "epsilon", 1e-4),
        "layers.1.ln3",
    ),
    "transformer/causal_mask_off": (
        "transformer",
        set_attr("layers.0.self_attn", "Attention", "is_causal", 0),
        "layers.0.self_attn",
    ),
    "transformer/causal_mask_on": (
        "transformer",
        set_attr("layers.1.attn", "Attention", "is_causal", 1),
        "layers.1.attn",
    ),
    "transformer/attention_scale_1/d": (
        "transformer",
        set_attr("layers.0.attn", "Attention", "scale", 1.0 / 8),
        "layers.0.attn",
    ),
    "transformer/embedding_x1.001": (
        "transformer",
        scale_weight("tok", "Gather", 1 + 1e-3, index=0),
        "tok",
    ),
    "transformer/position_off_by_one": (
        "transformer",
        edit_weight("pos", "Gather", lambda w: np.roll(w, 1, axis=0), index=0),
        "pos",
    ),
    "transformer/dropped_bias": ("transformer", zero_init("layers.0.ff1.bias"), "layers.0.ff1"),
    "transformer/float16_round_trip": (
        "transformer",
        round_trip("layers.0.ff1", "MatMul", ir.DataType.FLOAT16),
        "layers.0.ff1",
    ),
    "transformer/bfloat16_round_trip": (
        "transformer",
        round_trip("layers.1.ff2", "MatMul", ir.DataType.BFLOAT16),
        "layers.1.ff2",
    ),
    "transformer/head_weight_x0.999": (
        "transformer",
        scale_weight("head", "MatMul", 1 - 1e-3),
        "head",
    ),
    "transformer/ff_weight_transposed": (
        "transformer",
        edit_weight("layers.1.self_attn.proj", "MatMul", lambda w: w.T),
        "layers.1.self_attn.proj",
    ),
    # nn.MultiheadAttention with averaged weights: an explicit softmax, two outputs.
    "mha/softmax_axis": ("mha_weights", set_attr("attn", "Softmax", "axis", 1), "attn"),
    "mha/swapped_outputs": ("mha_weights", swap_outputs, None),
    "mha/out_proj_x1.001": ("mha_weights", scale_weight("attn", "Gemm", 1 + 1e-3), "attn"),
    "mha/in_proj_x0.999": ("mha_weights", scale_init("attn.in_proj_weight", 1 - 1e-3), "attn"),
    # Tiny Llama: GQA, rotary positions, RMSNorm written out, SiLU MLP.
    "llama/rope_base_5e5": ("llama", "rope", "rotary_emb"),
    "llama/attention_scale_hidden": (
        "llama",
        set_attr("layers.0.self_attn", "Attention", "scale", 1 / math.sqrt(64)),
        "layers.0.self_attn",
    ),
    "llama/causal_mask_off": (
        "llama",
        drop_input("layers.1.self_attn", "Attention", 3),
        "layers.1.self_attn",
    ),
    "llama/gqa_head_mapping": ("llama", "gqa", "layers.1.self_attn"),
    "llama/rmsnorm_eps_1e-3": (
        "llama",
        eps_add("layers.0.input_layernorm", 1e-3),
        "layers.0.input_layernorm",
    ),
    "llama/mlp_weight_x1.001": (
        "llama",
        scale_weight("layers.1.mlp.down_proj", "MatMul", 1 + 1e-3),
        "layers.1.mlp.down_proj",
    ),
    "llama/q_proj_x0.999": (
        "llama",
        scale_weight("layers.0.self_attn.q_proj", "MatMul", 1 - 1e-3),
        "layers.0.self_attn.q_proj",
    ),
    "llama/o_proj_transposed": (
        "llama",
        edit_weight("layers.0.self_attn.o_proj", "MatMul", lambda w: w.T),
        "layers.0.self_attn.o_proj",
    ),
    "llama/float16_round_trip": (
        "llama",
        round_trip("layers.1.mlp.up_proj", "MatMul", ir.DataType.FLOAT16),
        "layers.1.mlp.up_proj",
    ),
    "llama/bfloat16_round_trip": (
        "llama",
        round_trip("layers.0.mlp.down_proj", "MatMul", ir.DataType.BFLOAT16),
        "layers.0.mlp.down_proj",
    ),
    "llama/one_wrong_element_in_1e4": ("llama", perturb_output(0, _one_element), "norm"),
    "llama/nan_injection": ("llama", perturb_output(0, _at(np.nan)), "norm"),
    "llama/inf_injection": ("llama", perturb_output(0, _at(np.inf)), "norm"),
    "llama/zero_output": ("llama", scale_output(0, 0.0), "norm"),
}


def _resolve(edit):
    if edit == "rope":

        def rope(m: ir.Model) -> None:
            v = m.graph.initializers["rotary_emb.inv_freq"]
            _set_const(m, v, _rope(5e5)(_const(v)))

        return rope
    if edit == "gqa":

        def gqa(m: ir.Model) -> None:
            for proj in ("k_proj", "v_proj"):
                v = m.graph.initializers[f"layers.1.self_attn.{proj}.weight"]
                # torch Linear weights are [out, in]: kv heads are row blocks.
                _set_const(m, v, _swap_kv_heads(_const(v)))

        return gqa
    return edit


def _mutate(subject: Subject, edit) -> ir.Model:
    model = _copy(subject.model)
    edit = _resolve(edit)
    if getattr(edit, "needs_example", False):
        example = subject.module(*[torch.from_numpy(x) for x in subject.inputs])
        first = (
            example[0]
            if isinstance(example, tuple)
            else getattr(example, "last_hidden_state", example)
        )
        edit(model, first.detach().numpy())
    else:
        edit(model)
    return model


def _killed(report, scope: str | None) -> tuple[bool, str]:
    if report.passed:
        return False, "passed"
    if (
        scope is None
        or report.first_divergence is None
        and any(m.error for r in report.matrix for m in r.outputs)
    ):
        return True, "failed"
    first = report.first_divergence
    if first is not None and (first == scope or first.startswith(scope + ".")):
        return True, f"failed at {first}"
    return False, f"failed but localised to {first!r}, not {scope!r}"


def test_correct_conversions_pass(subjects):
    for name, s in subjects.items():
        report = xconv.check_parity(s.module, s.model, s.inputs)
        assert report.passed, f"{name}: " + report.summary()
        assert len(report.input_sets) >= 3, name


def test_mutants_are_all_killed(subjects, capsys):
    assert len(MUTANTS) >= 40
    results = {}
    for name, (subject, edit, scope) in MUTANTS.items():
        s = subjects[subject]
        model = _mutate(s, edit)
        report = xconv.check_parity(s.module, model, s.inputs, n_random=0, edges=False)
        results[name] = _killed(report, scope)
    killed = sum(ok for ok, _ in results.values())
    with capsys.disabled():
        print(
            f"\nparity mutation suite: {killed}/{len(results)} mutants killed "
            f"({100 * killed / len(results):.1f} %)"
        )
        for name, (ok, why) in results.items():
            if not ok:
                print(f"  SURVIVED {name}: {why}")
    survivors = {n: why for n, (ok, why) in results.items() if not ok}
    assert not survivors, survivors

"""Which ``xconv.layer`` groups the PyTorch source emitter writes as native ``torch.nn``
layers (the rest are written op by op through the templates)."""

from __future__ import annotations

import onnx_ir as ir

from xconv.converters.codegen import (
    LayerBody,
    layer_bodies,
)
from xconv.ir.passes._utils import static_dims

#: role -> torch attribute per native layer kind (dotted for nested ones).
TORCH_NAMES: dict[str, dict[str, str]] = {
    "dense": {"kernel": "weight", "bias": "bias"},
    "conv": {"kernel": "weight", "bias": "bias"},
    "conv_transpose": {"kernel": "weight", "bias": "bias"},
    "batch_norm": {
        "scale": "weight",
        "bias": "bias",
        "mean": "running_mean",
        "var": "running_var",
        "num_batches": "num_batches_tracked",
    },
    "layer_norm": {"scale": "weight", "bias": "bias"},
    "group_norm": {"scale": "weight", "bias": "bias"},
    "rms_norm": {"scale": "weight"},
    "embedding": {"embedding": "weight"},
    "dropout": {},
    "attention": {
        "in_proj_kernel": "in_proj_weight",
        "in_proj_bias": "in_proj_bias",
        "out_proj_kernel": "out_proj.weight",
        "out_proj_bias": "out_proj.bias",
    },
}


def plan_layers(graph: ir.Graph, annotated: bool) -> dict[ir.Node, LayerBody]:
    """Map each node of a layer body that one native torch layer can replace to its layer."""
    plans: dict[ir.Node, LayerBody] = {}
    for layer in layer_bodies(graph, annotated):
        if not layer.inputs and layer.kind == "embedding" and len(layer.constants) == 1:
            # constant positions: ``self.pos(torch.tensor([[0, 1, ...]]))``
            layer.inputs = list(layer.constants)
        if len(layer.inputs) == 1 and len(layer.outputs) == 1 and _native_ok(layer):
            for n in layer.body:
                plans[n] = layer
    return plans


#: What ``jnp.take`` (Flax's ``Embed``) adds around its Gather: negative ids wrap, out-of-range
#: ids clamp or give NaN rows. For valid ids these are identities; ``nn.Embedding`` raises on
#: invalid ids instead, a loud difference only for inputs a model never receives.
_TAKE_INDEXING = frozenset(
    {"Less", "Add", "Where", "Min", "Max", "Cast", "GreaterOrEqual", "LessOrEqual", "And"}
)

#: Ops a layer body may hold besides Constants for the native layer to replace it exactly
#: (layout plumbing around the anchor); a body holding anything else stays inline.
_PLUMBING = frozenset({"Transpose", "Reshape", "Identity", "Cast", "Squeeze", "Unsqueeze"})
BODY_OPS: dict[str, frozenset[str]] = {
    "dense": _PLUMBING | {"Gemm", "MatMul", "Add", "Flatten"},
    "conv": _PLUMBING | {"Conv", "Add", "Pad"},
    "conv_transpose": _PLUMBING | {"ConvTranspose", "Add"},
    "batch_norm": _PLUMBING | {"BatchNormalization"},
    "embedding": _PLUMBING | {"Gather"} | _TAKE_INDEXING,
    "dropout": _PLUMBING | {"Dropout"},
}


#: Ops allowed on the body's data path (between its input and its output): the native layer
#: replaces exactly these. Plumbing such as a Transpose is fine on the weight path (a kernel
#: stored HWIO), but on the data path it changes the layer's input layout, which the native
#: torch layer would silently drop.
DATA_PATH_OPS: dict[str, frozenset[str]] = {
    "dense": frozenset({"Gemm", "MatMul", "Add", "Identity"}),
    "conv": frozenset({"Conv", "Add", "Pad", "Identity"}),
    "conv_transpose": frozenset({"ConvTranspose", "Add", "Identity"}),
    "batch_norm": frozenset({"BatchNormalization", "Identity"}),
    "embedding": frozenset({"Gather", "Identity", "Reshape", "Squeeze", "Unsqueeze"})
    | _TAKE_INDEXING,
    "dropout": frozenset({"Dropout", "Identity"}),
}


def _data_path(p: LayerBody) -> list[ir.Node]:
    """Body nodes that depend on the layer's (non-constant) input."""
    reached = set(p.inputs)
    path = []
    for n in p.body:
        if any(v in reached for v in n.inputs if v is not None):
            path.append(n)
            reached.update(n.outputs)
    return path


def _native_ok(p: LayerBody) -> bool:
    known = TORCH_NAMES.get(p.kind)
    if p.kind == "attention" and "q_kernel" in p.weights:
        return _separate_qkv_ok(p)
    if known is None or not set(p.weights) <= set(known):
        return False
    allowed = BODY_OPS.get(p.kind)
    if allowed is not None and any(
        n.op_type not in allowed for n in p.body if n.op_type != "Constant"
    ):
        return False
    on_path = DATA_PATH_OPS.get(p.kind)
    if on_path is not None and any(n.op_type not in on_path for n in _data_path(p)):
        return False
    h, roles = p.hyper, set(p.weights)
    if p.kind in ("dense", "conv", "conv_transpose") and (
        "kernel" not in roles or ("bias" in roles) != bool(h["use_bias"])
    ):
        return False
    if p.kind in ("conv", "conv_transpose") and not 1 <= h["ndim"] <= 3:
        return False
    if any(lo != hi for lo, hi in h.get("padding", ())) and (
        p.kind != "conv" or (h.get("padding_mode") or "zeros") != "zeros"
    ):
        return False  # asymmetric zero padding is an F.pad before the Conv call
    if p.kind == "embedding":
        ids, out = static_dims(p.inputs[0]), static_dims(p.outputs[0])
        if ids is not None and out is not None and out != (*ids, h["features"]):
            return False
    if p.kind == "batch_norm":
        rank = None if p.inputs[0].shape is None else len(p.inputs[0].shape)
        return rank in (2, 3, 4, 5) and (
            {"mean", "var"} <= roles if h["track_running_stats"] else True
        )
    if p.kind == "embedding":
        return "embedding" in roles
    if p.kind == "attention":
        need = {"in_proj_kernel", "out_proj_kernel"}
        if h["use_bias"]:
            need |= {"in_proj_bias", "out_proj_bias"}
        return roles == need and not h.get("causal")
    return True


#: Ops of an unmasked scaled-dot-product attention body with separate q/k/v projections
#: (Flax's ``MultiHeadDotProductAttention``): projections, scaling, a stable softmax, output.
_PLAIN_ATTENTION_OPS = frozenset(
    {"Einsum", "MatMul", "Reshape", "Transpose", "Add", "Mul", "Sub", "Div", "Exp", "Softmax"}
    | {"ReduceMax", "ReduceSum", "Max", "Cast", "Identity", "Constant", "Squeeze", "Unsqueeze"}
)


def _separate_qkv_ok(p: LayerBody) -> bool:
    """Separate ``(E, H, D)`` q/k/v kernels and an ``(H, D, E)`` output kernel pack into
    ``nn.MultiheadAttention`` when ``H * D == E`` and the body applies no mask (a mask,
    constant or not, shows as a ``Where``/extra ``Add`` operand outside this op set)."""
    h, w = p.hyper, p.weights
    need = {"q_kernel", "k_kernel", "v_kernel", "out_proj_kernel"}
    if h["use_bias"]:
        need |= {"q_bias", "k_bias", "v_bias", "out_proj_bias"}
    if set(w) != need or any(n.op_type not in _PLAIN_ATTENTION_OPS for n in p.body):
        return False
    e = h["embed_dim"]
    shapes = [static_dims(w[r]) for r in ("q_kernel", "k_kernel", "v_kernel")]
    out = static_dims(w["out_proj_kernel"])
    if any(s is None or len(s) != 3 or s[0] != e or s[1] * s[2] != e for s in shapes):
        return False
    return out is not None and len(out) == 3 and out[0] * out[1] == e and out[2] == e

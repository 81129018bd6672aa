"""Call text the two source emitters share for the ops beyond a single framework call:
data-dependent shapes (Unique, NonMaxSuppression: numpy text applied eagerly), boxes and
sampling (RoiAlign, MaxRoiPool, DeformConv), subgraphs (FlexAttention; If, Scan and Loop as
nested functions), sequences and optionals, the scatters (Col2Im, MaxUnpool, TensorScatter)
and ConvTranspose's padding. Like :mod:`xconv.converters.expressions`, of which it is the
second half: each emitter writes the helpers' bodies in its framework. Framework-free.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from xconv.converters.codegen import TemplateCall, scalar_literal
from xconv.converters.registry import REQUIRED

#: ONNX Unique in numpy (framework-free): the text of the ``_unique`` helper both source
#: emitters write, applied eagerly to the input's numbers (its output shapes depend on them),
#: as ``ops/indexing.unique`` computes it for the runtimes.
UNIQUE = '''
def _unique(x, axis=None, ordered=True):
    """ONNX Unique of a numpy array, over its slices along ``axis`` (its elements when None):
    (Y, the indices of their first occurrences, inverse_indices, counts), the last three
    int64; sorted when ``ordered``, else in the order of first occurrence."""
    kwargs = {} if axis is None else {"axis": axis % x.ndim}
    y, first, inverse, counts = np.unique(
        x, return_index=True, return_inverse=True, return_counts=True, **kwargs
    )
    inverse = inverse.reshape(-1)
    if not ordered:
        order = np.argsort(first, kind="stable")
        rank_of = np.empty_like(order)
        rank_of[order] = np.arange(order.size)
        first, counts, inverse = first[order], counts[order], rank_of[inverse]
        y = np.take(x, first, axis=kwargs.get("axis"))
    return (y, *(np.asarray(v, dtype=np.int64) for v in (first, inverse, counts)))
'''


def unique_call(c: TemplateCall, x: str) -> str:
    """``_unique(x, axis=..., ordered=False)`` of a Unique node (``x`` the numpy input's
    expression), the helper added to ``c.helpers``; see :func:`unique_outputs`."""
    c.helpers.add("unique")
    axis = "" if c.attrs["axis"] is None else f", axis={int(c.attrs['axis'])}"
    ordered = "" if c.attrs["sorted"] else ", ordered=False"
    return f"_unique({x}{axis}{ordered})"


def unique_outputs(c: TemplateCall) -> str:
    """What selects a Unique node's outputs from ``_unique``'s four: ``[0]`` (one array),
    ``[:n]``, or nothing for all four."""
    n = len(c.node.outputs)
    return "[0]" if n == 1 else "" if n == 4 else f"[:{n}]"


#: ONNX NonMaxSuppression in numpy (framework-free): the text of the
#: ``_non_max_suppression`` helper both source emitters write, applied eagerly (the number of
#: boxes kept depends on the scores), as ``ops/nms.non_max_suppression`` computes it.
NON_MAX_SUPPRESSION = '''
def _non_max_suppression(boxes, scores, max_out=None, iou=None, score_min=None, center=False):
    """ONNX NonMaxSuppression of numpy boxes (batch, n, 4) and scores (batch, classes, n): the
    (batch, class, box) int64 indices of the boxes kept per batch and class, highest score
    first (ties by box index), at most ``max_out`` of them, none overlapping a kept one by an
    IoU above ``iou``, none scoring at most ``score_min``. An absent or empty optional input
    counts as absent; ``center`` reads boxes as (x, y, w, h), else as two corners (y, x)."""
    boxes, scores = np.asarray(boxes, np.float64), np.asarray(scores, np.float64)
    max_out = 0 if max_out is None or not np.size(max_out) else max(int(np.ravel(max_out)[0]), 0)
    iou = 0.0 if iou is None or not np.size(iou) else float(np.ravel(iou)[0])
    score_min = None if score_min is None or not np.size(score_min) else np.ravel(score_min)[0]
    a, b, c, d = (boxes[..., i] for i in range(4))
    if center:
        corners = np.stack([a - c / 2, b - d / 2, a + c / 2, b + d / 2], axis=-1)
    else:
        lo_x, lo_y = np.minimum(b, d), np.minimum(a, c)
        corners = np.stack([lo_x, lo_y, np.maximum(b, d), np.maximum(a, c)], axis=-1)
    selected = []
    for n in range(scores.shape[0]):
        for k in range(scores.shape[1]):
            s, kept = scores[n, k], []
            candidates = np.arange(s.shape[0])
            if score_min is not None:
                candidates = candidates[s[candidates] > float(score_min)]
            for i in candidates[np.argsort(-s[candidates], kind="stable")]:
                if len(kept) >= max_out:
                    break
                box, others = corners[n, i], corners[n, kept]
                ix = np.minimum(box[2], others[:, 2]) - np.maximum(box[0], others[:, 0])
                iy = np.minimum(box[3], others[:, 3]) - np.maximum(box[1], others[:, 1])
                inter = np.where((ix > 0) & (iy > 0), ix * iy, 0.0)
                area = (box[2] - box[0]) * (box[3] - box[1])
                areas = (others[:, 2] - others[:, 0]) * (others[:, 3] - others[:, 1])
                union = area + areas - inter
                valid = (inter > 0) & (area > 0) & (areas > 0) & (union > 0)
                with np.errstate(divide="ignore", invalid="ignore"):
                    overlap = np.where(valid, inter / np.where(union > 0, union, 1), 0.0)
                if (valid & (overlap > iou)).any():
                    continue
                kept.append(int(i))
                selected.append((n, k, int(i)))
    return np.array(selected, dtype=np.int64).reshape(-1, 3)
'''


def non_max_suppression_call(c: TemplateCall) -> str:
    """``_non_max_suppression(boxes=..., scores=..., ...)`` of a NonMaxSuppression node, its
    array arguments by keyword (each emitter's ``_eagerly`` reads them as numpy), the helper
    added to ``c.helpers``. A constant optional input of one number is written as a Python
    number (a float32 threshold as its exact float64 value, as the runtimes read it); one
    absent, or empty by its static shape, is left out."""
    c.helpers.add("non_max_suppression")
    args = [f"boxes={c.args[0]}", f"scores={c.args[1]}"]
    for i, name in ((2, "max_out"), (3, "iou"), (4, "score_min")):
        shape = c.shapes[i] if i < len(c.shapes) else None
        if not c.has(i) or (shape is not None and 0 in shape):
            continue
        value = c.consts[i]
        if value is not None and np.size(value) == 1:
            v = np.asarray(value).reshape(-1)[0]
            number = float(v) if np.issubdtype(v.dtype, np.floating) else int(v)
            args.append(f"{name}={number!r}")
        else:
            args.append(f"{name}={c.args[i]}")
    if c.attrs["center_point_box"]:
        args.append("center=True")
    return f"_non_max_suppression({', '.join(args)})"


# ---------------------------------------------------------------- RoiAlign, MaxRoiPool, DeformConv


def roi_align_call(c: TemplateCall, since16: bool = True) -> str:
    """RoiAlign as ``_roi_align(x, rois, batch_indices, (ph, pw), ...)`` (the helper added to
    ``c.helpers``). With sampling_ratio 0 over constant rois the adaptive grid is computed
    here (``ops/detection.roi_grid``); over rois computed at run time the helper reads it from
    their values. Before opset 16 the only coordinate mode was output_half_pixel."""
    from xconv.converters.ops.detection import roi_grid

    a = c.attrs
    if a["mode"] not in ("avg", "max"):
        raise c.fail(f"mode={a['mode']!r}; ONNX defines 'avg', 'max'")
    modes = ("half_pixel", "output_half_pixel")
    if a["coordinate_transformation_mode"] not in modes:
        raise c.fail(f"coordinate_transformation_mode={a['coordinate_transformation_mode']!r}")
    half = a["coordinate_transformation_mode"] == "half_pixel"
    if not since16 and "coordinate_transformation_mode" not in c.node.attributes:
        half = False
    size = (int(a["output_height"]), int(a["output_width"]))
    ratio, scale = int(a["sampling_ratio"]), float(a["spatial_scale"])
    extra = [f"ratio={ratio}"] * (ratio > 0) + [f"scale={scale!r}"] * (scale != 1.0)
    extra += ["half=False"] * (not half) + [f'mode="{a["mode"]}"'] * (a["mode"] != "avg")
    if ratio <= 0 and c.consts[1] is not None:
        dtype = c.node.inputs[0].dtype
        dt = dtype.numpy() if dtype is not None and dtype.is_floating_point() else np.float32
        extra.append(f"grid={roi_grid(np.asarray(c.consts[1]), dt, scale, half, size)}")
    c.helpers.add("roi_align")
    return f"_roi_align({', '.join([*c.args[:3], str(size), *extra])})"


def max_roi_pool_call(c: TemplateCall) -> str:
    """MaxRoiPool as ``_max_roi_pool(x, rois, (ph, pw)[, scale=s])`` (the helper added)."""
    size = tuple(int(v) for v in c.attrs["pooled_shape"])
    if len(size) != 2:
        raise c.fail(f"pooled_shape={list(size)}; it has two values (height, width)")
    scale = float(c.attrs["spatial_scale"])
    c.helpers.add("max_roi_pool")
    extra = f", scale={scale!r}" if scale != 1.0 else ""
    return f"_max_roi_pool({c.args[0]}, {c.args[1]}, {size}{extra})"


def deform_conv_call(c: TemplateCall) -> str:
    """DeformConv as ``_deform_conv(x, w, offset[, b][, mask=m], ...)``, the attributes
    other than their defaults as keywords (the helper added)."""
    a = c.attrs
    args = [c.args[0], c.args[1], c.args[2]]
    if c.has(3):
        args.append(c.args[3])
    if c.has(4):
        args.append(f"mask={c.args[4]}")
    for key in ("strides", "pads", "dilations"):
        v = a[key]
        if v is not None and any(int(x) != (0 if key == "pads" else 1) for x in v):
            args.append(f"{key}={tuple(int(x) for x in v)}")
    if int(a["group"]) != 1:
        args.append(f"groups={int(a['group'])}")
    if int(a["offset_group"]) != 1:
        args.append(f"offset_groups={int(a['offset_group'])}")
    c.helpers.add("deform_conv")
    return f"_deform_conv({', '.join(args)})"


#: FlexAttention's attributes (ai.onnx.preview; ``ops/attention.flex_attention``).
FLEX_ATTENTION_ATTRS = {
    "scale": None,
    "score_mod": None,
    "prob_mod": None,
    "softmax_precision": None,
}


def flex_attention_call(c: TemplateCall, dtype: Callable[[ir.DataType], str]) -> str:
    """``_flex_attention(q, k, v[, scale=][, score_mod=][, prob_mod=][, compute=])`` for
    FlexAttention: its score_mod / prob_mod subgraphs arrive as the names of the functions
    the emitter nested in the caller (each returns a 1-tuple); ``softmax_precision`` is
    written with the emitter's ``dtype`` (the helper added)."""
    a, args = c.attrs, list(c.args[:3])
    if a["scale"] is not None:
        args.append(f"scale={scalar_literal(float(a['scale']))}")
    args += [f"{k}={a[k]}" for k in ("score_mod", "prob_mod") if a[k] is not None]
    if a["softmax_precision"] is not None:
        args.append(f"compute={dtype(ir.DataType(int(a['softmax_precision'])))}")
    c.helpers.add("flex_attention")
    return f"_flex_attention({', '.join(args)})"


def conv_padding_of(c: TemplateCall, n: int) -> list[tuple[int, int]]:
    """A Conv's ``(low, high)`` padding per spatial axis, auto_pad SAME_UPPER / SAME_LOWER
    resolved as the runtimes resolve it (``ops/shapes.conv_padding``: the input's spatial
    sizes and the kernel's, from the weight's shape or ``kernel_shape``, then needed)."""
    from xconv.converters.ops.shapes import conv_padding, ints

    a, shape = c.attrs, c.shapes[0]
    spatial = None if shape is None or len(shape) != n + 2 else shape[2:]
    w = c.shapes[1] if len(c.shapes) > 1 else None
    kernel = a["kernel_shape"] or (w[2:] if w is not None and len(w) == n + 2 else None)
    if a["auto_pad"] in ("SAME_UPPER", "SAME_LOWER") and (
        spatial is None or kernel is None or None in (*spatial, *kernel)
    ):
        raise c.fail(f"auto_pad {a['auto_pad']} over an input or kernel of unknown spatial size")
    # Explicit pads and VALID do not depend on the sizes: symbolic ones (a dynamic height and
    # width) stand in as 1.
    if spatial is not None and None in spatial:
        spatial = None
    if kernel is not None and None in kernel:
        kernel = None
    padding = conv_padding(
        c.node, a["auto_pad"], tuple(int(d) for d in spatial or (1,) * n),
        tuple(int(k) for k in kernel or (1,) * n), ints(a["strides"], n, 1),
        ints(a["dilations"], n, 1), a["pads"],
    )  # fmt: skip
    return [(int(lo), int(hi)) for lo, hi in padding]


def conv_transpose_padding_of(c: TemplateCall, n: int, kernel) -> list[tuple[int, int]]:
    """ConvTranspose as the runtimes run it, a stride-1 convolution of the stride-dilated
    input: that convolution's ``(low, high)`` padding per spatial axis (negative crops), from
    ``ops/shapes.conv_transpose_padding`` (output_shape and auto_pad SAME_* need the input's
    spatial sizes)."""
    from xconv.converters.ops.shapes import conv_transpose_padding, ints

    a, shape = c.attrs, c.shapes[0]
    spatial = None if shape is None or len(shape) != n + 2 else shape[2:]
    if spatial is None or any(d is None for d in spatial):
        if a["output_shape"] is not None or a["auto_pad"] in ("SAME_UPPER", "SAME_LOWER"):
            raise c.fail("output_shape or auto_pad SAME_* over an input of unknown spatial size")
        spatial = (1,) * n  # explicit pads do not depend on it
    padding = conv_transpose_padding(
        c.node, a["auto_pad"], tuple(int(d) for d in spatial), tuple(kernel),
        ints(a["strides"], n, 1), ints(a["dilations"], n, 1), ints(a["output_padding"], n, 0),
        a["output_shape"], a["pads"],
    )  # fmt: skip
    return [(int(lo), int(hi)) for lo, hi in padding]


# ---------------------------------------------------------------- sequences and optionals
# An ONNX sequence is a Python list in both sources (as in the runtimes, ``ops/sequence``), an
# empty optional None; ``position`` below is a position written as a Python int expression.


def sequence_construct_expr(c: TemplateCall) -> str:
    """SequenceConstruct: the list of its inputs."""
    return f"[{', '.join(a for a in c.args if a)}]"


def sequence_insert_expr(c: TemplateCall, position: str | None) -> str:
    """SequenceInsert: a new list with the tensor before ``position`` (negative: counted from
    the end, as Python slices count), appended when absent."""
    seq, tensor = c.args[0], c.args[1]
    if position is None:
        return f"[*{seq}, {tensor}]"
    return f"[*{seq}[:{position}], {tensor}, *{seq}[{position}:]]"


def sequence_erase_expr(c: TemplateCall, position: str | None) -> str:
    """SequenceErase: a new list without the element at ``position`` (the last when absent)."""
    seq = c.args[0]
    if position is None:
        return f"{seq}[:-1]"
    return f"[t for i, t in enumerate({seq}) if i != {position} % len({seq})]"


def optional_expr(c: TemplateCall) -> str:
    """Optional: its input, or None (an empty optional)."""
    return c.args[0] if c.has(0) else "None"


#: Col2Im's scatter positions in numpy (framework-free): the text of ``_col2im_index`` both
#: source emitters write, as ``ops/nn.col2im_index`` computes it for the runtimes.
COL2IM_INDEX = '''
def _col2im_index(image, block, strides, dilations, pads):
    """Col2Im: the flat image position of every (kernel offset, block position), in numpy;
    positions outside the image go to a dump slot, prod(image)."""
    n = len(image)
    counts = [
        (image[i] + pads[i] + pads[i + n] - ((block[i] - 1) * dilations[i] + 1)) // strides[i] + 1
        for i in range(n)
    ]
    total = int(np.prod(image))
    index = np.zeros((int(np.prod(block)), int(np.prod(counts))), dtype=np.int64)
    valid = np.ones_like(index, dtype=bool)
    kgrid = np.stack(np.meshgrid(*[np.arange(b) for b in block], indexing="ij"), 0)
    lgrid = np.stack(np.meshgrid(*[np.arange(c) for c in counts], indexing="ij"), 0)
    for i in range(n):
        pos = lgrid[i].reshape(1, -1) * strides[i] - pads[i] + kgrid[i].reshape(-1, 1) * dilations[i]
        valid &= (pos >= 0) & (pos < image[i])
        index = index * image[i] + np.clip(pos, 0, image[i] - 1)
    return np.where(valid, index, total).reshape(-1)
'''


def col2im_call(c: TemplateCall) -> str:
    """``_col2im(x, image_shape, block_shape, strides, dilations, pads)`` for Col2Im, the
    attributes resolved to tuples of the image's rank (the helpers added)."""
    from xconv.converters.ops.shapes import ints

    shape = c.shapes[1]
    if shape is None or len(shape) != 1 or shape[0] is None:
        raise c.fail("Col2Im's image_shape of unknown length")
    n, a = int(shape[0]), c.attrs
    geometry = [ints(a["strides"], n, 1), ints(a["dilations"], n, 1), ints(a["pads"], 2 * n, 0)]
    c.helpers |= {"col2im_index", "col2im"}
    return f"_col2im({', '.join(c.args[:3])}, {', '.join(str(g) for g in geometry)})"


def max_unpool_call(c: TemplateCall) -> str:
    """``_max_unpool(x, indices, kernel, strides, pads[, output_shape])`` for MaxUnpool (the
    helper added)."""
    from xconv.converters.ops.shapes import ints

    n = c.need_rank() - 2
    a = c.attrs
    args = [c.args[0], c.args[1], str(tuple(int(k) for k in a["kernel_shape"]))]
    args += [str(ints(a["strides"], n, 1)), str(ints(a["pads"], 2 * n, 0))]
    if c.has(2):
        args.append(c.args[2])
    c.helpers.add("max_unpool")
    return f"_max_unpool({', '.join(args)})"


def tensor_scatter_call(c: TemplateCall) -> str:
    """``_tensor_scatter(past_cache, update[, write_indices], axis=[, circular=True])`` for
    TensorScatter, the axis made positive (the helper added)."""
    rank = c.need_rank()
    axis = int(c.attrs["axis"])
    if not -rank <= axis < rank or axis % rank == 0:
        raise c.fail(f"axis {axis} must name a sequence axis after the batch axis")
    mode = c.attrs["mode"]
    if mode not in ("linear", "circular"):
        raise c.fail(f"mode={mode!r}; ONNX defines 'linear', 'circular'")
    args = list(c.args[:2]) + ([c.args[2]] if c.has(2) else [])
    args.append(f"axis={axis % rank}")
    if mode == "circular":
        args.append("circular=True")
    c.helpers.add("tensor_scatter")
    return f"_tensor_scatter({', '.join(args)})"


# ------------------------------------------------------------------ control flow


def one_output(c: TemplateCall, expr: str) -> str:
    """A helper's tuple of results as the node's outputs: its item for a single output."""
    return f"{expr}[0]" if len(c.node.outputs) == 1 else expr


def tuple_text(items: list[str]) -> str:
    """``(a,)`` / ``(a, b)``: the text of a tuple of expressions."""
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"


def _axes(c: TemplateCall, values, n: int, what: str) -> list[int]:
    if values is None:
        return [0] * n
    if len(values) != n:
        raise c.fail(f"{what} has {len(values)} entries, expected {n}")
    return [int(v) for v in values]


#: Scan-9's attributes (Scan-8's: ``SCAN_8_ATTRS``).
SCAN_ATTRS = {
    "body": REQUIRED,
    "num_scan_inputs": REQUIRED,
    "scan_input_axes": None,
    "scan_input_directions": None,
    "scan_output_axes": None,
    "scan_output_directions": None,
}
SCAN_8_ATTRS = {"body": REQUIRED, "num_scan_inputs": REQUIRED, "directions": None}


def scan_call(c: TemplateCall) -> str:
    """Scan (opset 9+) as ``_scan(body, states, xs, in_axes=..., ...)`` of the emitter's
    ``_scan`` helper (added to ``c.helpers``); the body is the nested function's name."""
    c.helpers.add("scan")
    n_in = c.attrs["num_scan_inputs"]
    n_state = len(c.args) - n_in
    body = c.node.attributes["body"].value
    n_out = len(body.outputs) - n_state
    in_axes = _axes(c, c.attrs["scan_input_axes"], n_in, "scan_input_axes")
    for k, a in enumerate(in_axes):
        if a < 0:
            in_axes[k] = a % c.need_rank(n_state + k)
    keywords = [
        ("in_axes", in_axes),
        ("in_reverse", _axes(c, c.attrs["scan_input_directions"], n_in, "scan_input_directions")),
        ("out_axes", _axes(c, c.attrs["scan_output_axes"], n_out, "scan_output_axes")),
        ("out_reverse", _axes(c, c.attrs["scan_output_directions"], n_out, "scan_output_dirs")),
    ]
    extra = [
        f"{k}={tuple_text([str(bool(v)) if 'reverse' in k else str(v) for v in vs])}"
        for k, vs in keywords
        if any(vs)
    ]
    states = tuple_text(c.args[:n_state]) if n_state else "()"
    xs = tuple_text(c.args[n_state:])
    return one_output(c, f"_scan({', '.join([c.attrs['body'], states, xs, *extra])})")


def scan_8_call(c: TemplateCall) -> str:
    """Scan-8 (a batch axis first, sequence_lens) as ``_scan_batched(body, lens, states, xs,
    reverse=...)`` of the emitter's helpers."""
    c.helpers |= {"scan", "scan_batched"}
    n_in = c.attrs["num_scan_inputs"]
    lens, inputs = c.args[0] or "None", c.args[1:]
    n_state = len(inputs) - n_in
    dirs = _axes(c, c.attrs["directions"], n_in, "directions")
    states = tuple_text(inputs[:n_state]) if n_state else "()"
    args = [c.attrs["body"], lens, states, tuple_text(inputs[n_state:])]
    if any(dirs):
        args.append(f"reverse={tuple_text([str(bool(d)) for d in dirs])}")
    return one_output(c, f"_scan_batched({', '.join(args)})")


def loop_call(c: TemplateCall, empty: Callable[[ir.Value], str]) -> str:
    """Loop as ``_loop(body, trip_count, cond, carried, empty=...)`` of the emitter's helper;
    ``empty(value)`` writes a scan output of a loop that never runs."""
    c.helpers.add("loop")
    body = c.node.attributes["body"].value
    carried = c.args[2:]
    n_scan = len(body.outputs) - 1 - len(carried)
    trip, cond = c.args[0] or "None", c.args[1] or "None"
    args = [c.attrs["body"], trip, cond, tuple_text(carried) if carried else "()"]
    if n_scan:
        outs = body.outputs[1 + len(carried) :]
        args.append(f"empty={tuple_text([empty(v) for v in outs])}")
    return one_output(c, f"_loop({', '.join(args)})")

"""PyTorch source templates for resampling: Resize (``F.interpolate`` where it computes ONNX's
Resize exactly, else the generated ``_resize``), GridSample (``F.grid_sample``) and AffineGrid
(``F.affine_grid``). Importing this module registers them in ``templates.registry``.
"""

from __future__ import annotations

from xconv.converters import expressions as ex
from xconv.converters.ops.resize import RESIZE_ATTRS
from xconv.converters.torch.source.templates import OpCall, registry, template
from xconv.errors import UnsupportedAttributeError

#: F.interpolate's mode per rank for ONNX's linear and cubic modes.
_INTERPOLATE = {"linear": {3: "linear", 4: "bilinear", 5: "trilinear"}, "cubic": {4: "bicubic"}}


registry.helpers["resize_plan"] = ex.RESIZE_PLAN
registry.helpers["resize"] = '''
def _resize(x, scales, sizes, mode, coord, nearest_mode="round_prefer_floor", **kw):
    """ONNX Resize (``_resize_plan``'s keywords) where F.interpolate computes it otherwise: per
    axis that changes, a gather of the nearest inputs, or of the taps and their weighted sum.
    Integers and float16 / bfloat16 interpolate in float32."""
    dtype = x.dtype
    if mode != "nearest" and dtype not in (torch.float32, torch.float64):
        x = x.float()
    scales = None if scales is None else [float(s) for s in scales]
    sizes = None if sizes is None else [int(s) for s in sizes]
    shape = tuple(x.shape)
    for axis, index, weights in _resize_plan(shape, scales, sizes, mode, coord, nearest_mode, **kw):
        index = torch.as_tensor(index, device=x.device)
        if weights is None:
            x = torch.index_select(x, axis, index)
            continue
        taps = torch.index_select(x, axis, index.reshape(-1))
        taps = taps.reshape(*x.shape[:axis], *index.shape, *x.shape[axis + 1 :])
        weights = torch.as_tensor(weights, dtype=x.dtype, device=x.device)
        x = (taps * weights.reshape(weights.shape + (1,) * (x.dim() - axis - 1))).sum(axis + 1)
    if x.dtype != dtype and not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        x = torch.clamp(torch.round(x), info.min, info.max)
    return x.to(dtype)
'''


@template("Resize", **RESIZE_ATTRS)
def _resize(c: OpCall) -> str:
    """``F.interpolate`` where it computes ONNX's Resize exactly, else the generated
    ``_resize`` (which plans each axis as the runtimes do: other modes and coordinates,
    antialias, axes, scales or sizes the graph computes)."""
    try:
        return _interpolate_call(c)
    except UnsupportedAttributeError:
        return ex.resize_call(c, lambda i, what: c.args[i])


def _interpolate_call(c: OpCall) -> str:
    """``F.interpolate`` where it computes ONNX's Resize exactly: over the spatial axes only;
    ``nearest`` rounded down from ``asymmetric`` coordinates (torch's ``"nearest"``) or from
    ``tf_half_pixel_for_nn`` ones (its ``"nearest-exact"``: Keras' ``Resizing``);
    ``linear`` (and 4-D ``cubic`` at ``a = -0.75``, torch's) with ``align_corners``, or half
    pixel coordinates where no output axis has one element (there ``half_pixel`` and
    ``pytorch_half_pixel`` both differ from torch 2.x, which samples the middle). The scales
    are passed as given (torch then maps coordinates by them, as ONNX does), else the
    sizes."""
    a = c.attrs
    modes = ("nearest", "linear", "cubic")
    out, factors, from_scales = ex.resize_plan(c, modes)
    mode, coord, rank = a["mode"], a["coordinate_transformation_mode"], len(out)
    if not 3 <= rank <= 5 or factors[:2] != [1.0, 1.0]:
        raise c.fail("Resize of the batch or channel axis has no F.interpolate counterpart")
    if mode == "nearest":
        torch_mode = {"asymmetric": "nearest", "tf_half_pixel_for_nn": "nearest-exact"}
        if coord not in torch_mode or a["nearest_mode"] != "floor":
            raise c.fail(
                f"Resize nearest with {coord} / {a['nearest_mode']}: F.interpolate's "
                "'nearest' is asymmetric / floor, its 'nearest-exact' tf_half_pixel_for_nn / floor"
            )
        mode, extra = torch_mode[coord], ""
    else:
        torch_mode = _INTERPOLATE[mode].get(rank)
        wide = all(
            f is not None and f >= 2 if o is None else o > 1
            for o, f in zip(out[2:], factors[2:], strict=True)
        )
        half = coord in ("half_pixel", "pytorch_half_pixel") and wide
        if torch_mode is None or not (half or coord == "align_corners"):
            raise c.fail(f"Resize {mode} of rank {rank} with {coord} has no F.interpolate mode")
        if mode == "cubic" and a["cubic_coeff_a"] != -0.75:
            raise c.fail(f"Resize cubic_coeff_a={a['cubic_coeff_a']} (torch's bicubic: -0.75)")
        fractional = [
            n is not None and f is not None and n * f != int(n * f)
            for n, f in zip(c.shapes[0][2:], factors[2:], strict=True)
        ]
        if coord == "align_corners" and from_scales and any(fractional):
            # ONNX maps by the unrounded size (in * scale - 1), torch by the output's
            raise c.fail("Resize align_corners with a scale that gives a fractional size")
        mode = torch_mode
        extra = f", align_corners={coord == 'align_corners'}"
    if from_scales:
        spatial = [float(f) for f in factors[2:]]
        arg = f"scale_factor={spatial[0] if len(set(spatial)) == 1 else tuple(spatial)}"
    else:
        spatial = [int(o) for o in out[2:]]
        arg = f"size={spatial[0] if len(set(spatial)) == 1 else tuple(spatial)}"
    return f'F.interpolate({c.args[0]}, {arg}, mode="{mode}"{extra})'


#: ONNX GridSample's modes (opset 20 names, and opset 16's) as F.grid_sample's.
_GRID_MODES = {"linear": "bilinear", "bilinear": "bilinear", "nearest": "nearest",
               "cubic": "bicubic", "bicubic": "bicubic"}  # fmt: skip


@template("GridSample", align_corners=0, mode="linear", padding_mode="zeros")
def _grid_sample(c: OpCall) -> str:
    """``F.grid_sample``, which ONNX's GridSample follows (modes, padding, align_corners)."""
    a = c.attrs
    mode = _GRID_MODES.get(a["mode"])
    if mode is None or a["padding_mode"] not in ("zeros", "border", "reflection"):
        raise c.fail(f"GridSample mode={a['mode']!r}, padding_mode={a['padding_mode']!r}")
    if mode == "bicubic" and c.need_rank() != 4:
        raise c.fail("GridSample cubic of a 5-D input (F.grid_sample's bicubic is 2-D)")
    return (
        f'F.grid_sample({c.args[0]}, {c.args[1]}, mode="{mode}", '
        f'padding_mode="{a["padding_mode"]}", align_corners={bool(a["align_corners"])})'
    )


@template("AffineGrid", align_corners=0)
def _affine_grid(c: OpCall) -> str:
    """``F.affine_grid``, which ONNX's AffineGrid follows."""
    corners = bool(c.attrs["align_corners"])
    return f"F.affine_grid({c.args[0]}, {c.ints(1)}, align_corners={corners})"

"""JAX registration of the shape, layout and construction ops (Reshape, Concat, Pad,
Resize, ...), written once in :mod:`xconv.converters.ops.shape` and
:mod:`xconv.converters.ops.resize`.

Shape-like inputs (shapes, axes, pads, repeats, sizes) are read with ``ctx.static`` so they
are known at trace time under ``jax.jit``. When every input of a node is numpy (constants,
folded shape arithmetic) the handlers compute with numpy, so 64-bit shape values keep their
dtype and their value even with JAX's 64-bit types off.
"""

from __future__ import annotations

from xconv.converters.jax.kernel import KERNEL
from xconv.converters.jax.registry import REQUIRED, builtin
from xconv.converters.ops.attrs import check_choice
from xconv.converters.ops.resize import register_resize_ops
from xconv.converters.ops.shape import (
    register_constant_ops,
    register_construction_ops,
    register_shape_ops,
)

# Shape, Size, Reshape, Flatten, Squeeze, Unsqueeze, Transpose, Concat, Split, Expand, Tile:
# written once in converters/ops/shape.py.
register_shape_ops(builtin, KERNEL, REQUIRED)
# Identity, Constant, ConstantOfShape; Pad, Range, EyeLike, Trilu, DepthToSpace,
# SpaceToDepth, CenterCropPad: converters/ops/shape.py too; Resize, Upsample: ops/resize.py.
register_constant_ops(builtin, KERNEL)
register_construction_ops(builtin, KERNEL, REQUIRED)
register_resize_ops(builtin, KERNEL)


__all__ = ["check_choice"]

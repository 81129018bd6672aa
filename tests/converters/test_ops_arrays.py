"""The one axis rule and the one namespace selector both runtimes use."""

from __future__ import annotations

import numpy as np
import pytest

from xconv.converters.ops.arrays import is_static, namespace, normalize_axis


class _Ctx:
    @staticmethod
    def error(message: str) -> Exception:
        return ValueError(message)


@pytest.mark.parametrize(("axis", "rank", "want"), [(0, 3, 0), (-1, 3, 2), (-3, 3, 0), (0, 0, 0)])
def test_normalize_axis_in_range(axis, rank, want):
    assert normalize_axis(_Ctx, axis, rank) == want


@pytest.mark.parametrize(("axis", "rank"), [(3, 3), (-4, 3), (-1, 0), (1, 0)])
def test_normalize_axis_out_of_range(axis, rank):
    with pytest.raises(ValueError, match=f"axis {axis} is out of range"):
        normalize_axis(_Ctx, axis, rank)


def test_namespace_is_numpy_only_for_static_inputs():
    backend = object()
    static = np.ones(2)
    assert namespace(backend, static, None, 3) is np
    assert namespace(backend, static, [np.int64(1), 2]) is np
    assert namespace(backend, static, object()) is backend
    assert is_static([np.ones(1), 2.0]) and not is_static([object()])


def test_namespace_numpy_for_arrays_the_backend_cannot_hold():
    backend, odd = object(), object()
    assert namespace(backend, odd, numpy_for=lambda a: a is odd) is np
    assert namespace(backend, object(), numpy_for=lambda a: a is odd) is backend

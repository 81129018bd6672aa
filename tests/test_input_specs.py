"""``--input-shape`` / ``--input-dtype``: one grammar (:mod:`xconv.inputs`) on every route. The
torch importer's tensors and the other routes' numpy arrays are built from the same parsed
specs, so a spec means the same thing everywhere and fails with the same error."""

from __future__ import annotations

import numpy as np
import pytest

from xconv.errors import UsageError
from xconv.inputs import InputSpec, example_arrays, parse_spec, parse_specs


@pytest.mark.parametrize(
    ("spec", "dtype", "want"),
    [
        ("2,3,224,224", "float32", InputSpec((2, 3, 224, 224), "float32")),
        ("2x3x224x224", "float32", InputSpec((2, 3, 224, 224), "float32")),
        (" 2, 16 ", "int64", InputSpec((2, 16), "int64")),
        ("2x16:i64", "float32", InputSpec((2, 16), "int64")),  # the spec's dtype wins
        ("4:BF16", "float32", InputSpec((4,), "bfloat16")),
        ("3:long", "float32", InputSpec((3,), "int64")),
        ("1,5:bool", "float32", InputSpec((1, 5), "bool")),
        ("", "float64", InputSpec((), "float64")),
        ("scalar:int32", "float32", InputSpec((), "int32")),
        ("0,4", "half", InputSpec((0, 4), "float16")),
    ],
)
def test_the_grammar(spec, dtype, want):
    assert parse_spec(spec, dtype) == want


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("2,a", r"--input-shape '2,a': bad shape '2,a': write sizes separated by ','"),
        ("2;3", "bad shape '2;3'"),
        ("2,-1", "sizes must be >= 0"),
        ("2:float8", "unknown dtype 'float8'; known: bf16, bfloat16, bool"),
    ],
)
def test_a_bad_spec_names_its_bad_part(spec, message):
    with pytest.raises(UsageError, match=message):
        parse_spec(spec)


def test_dtypes_are_one_for_all_or_one_each():
    assert [s.dtype for s in parse_specs(["2", "3"], "int64")] == ["int64", "int64"]
    assert [s.dtype for s in parse_specs(["2", "3"], ["int64"])] == ["int64", "int64"]
    assert [s.dtype for s in parse_specs(["2", "3:bool"], ["f16", "int8"])] == ["float16", "bool"]
    assert [s.dtype for s in parse_specs(["2"], ())] == ["float32"]
    with pytest.raises(UsageError, match="2 --input-shape but 3 --input-dtype"):
        parse_specs(["2", "3"], ["int64", "int32", "bool"])


def test_numpy_values_are_deterministic_by_kind():
    x, ids, flags, half = example_arrays(["2x3", "1,4:int64", "2:bool", "3:bf16"])
    assert x.dtype == np.float32 and x.shape == (2, 3) and x.std() > 0
    assert (x == example_arrays(["2x3"])[0]).all()  # the same seed for the same position
    assert ids.dtype == np.int64 and (ids == 0).all()
    assert flags.dtype == bool and flags.all()
    assert str(half.dtype) == "bfloat16"


def test_torch_and_numpy_routes_read_specs_alike():
    torch = pytest.importorskip("torch")
    from xconv.converters.torch.importer.files import example_inputs

    specs, dtypes = ["2x3", "1,4:i64", "2:bool", "3"], ["float32", "float32", "float32", "bf16"]
    tensors = example_inputs(specs, dtypes)
    arrays = example_arrays(specs, dtypes)
    assert [tuple(t.shape) for t in tensors] == [a.shape for a in arrays]
    assert [str(t.dtype).removeprefix("torch.") for t in tensors] == [str(a.dtype) for a in arrays]
    assert tensors[2].all() and arrays[2].all()  # :bool is all True on both
    assert tensors[3].dtype == torch.bfloat16
    for route in (lambda s: example_inputs([s]), lambda s: example_arrays([s])):
        with pytest.raises(UsageError, match="bad shape '2,a'"):
            route("2,a")

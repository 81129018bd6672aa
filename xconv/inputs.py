"""Example-input specs: the one grammar of ``--input-shape`` / ``--input-dtype`` on every route.

A spec is sizes separated by ``,`` or ``x`` (``2,3,224,224``, ``2x3x224x224``; ``""`` or
``scalar`` for a 0-d input), optionally followed by ``:dtype`` (``2,16:int64``), which
overrides ``--input-dtype`` for that input. Dtypes are numpy's names and their short forms
(``f32``, ``bf16``, ``i64``, ``long``, ``half``, ...). Values are deterministic: floating
inputs standard normal from a fixed seed per input, integer inputs zeros (token ids valid for
any vocabulary), booleans all True. The torch importer makes tensors of the same specs
(:func:`xconv.converters.torch.importer.files.example_inputs`); the other routes take
:func:`example_arrays`. Framework-free: numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from xconv.errors import UsageError

#: Each accepted dtype name -> its canonical name.
DTYPES = {
    "float32": "float32", "float": "float32", "f32": "float32",
    "float16": "float16", "half": "float16", "f16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float64": "float64", "double": "float64", "f64": "float64",
    "int64": "int64", "long": "int64", "i64": "int64",
    "int32": "int32", "int": "int32", "i32": "int32",
    "int16": "int16", "i16": "int16",
    "int8": "int8", "i8": "int8", "uint8": "uint8", "u8": "uint8",
    "bool": "bool",
}  # fmt: skip

#: The seed of the first input's values; input ``i`` uses ``SEED + i``.
SEED = 0


@dataclass(frozen=True)
class InputSpec:
    """One example input: its sizes and canonical dtype name (a key's value in :data:`DTYPES`)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def floating(self) -> bool:
        return self.dtype.startswith(("float", "bfloat"))


def parse_spec(spec: str, dtype: str = "float32") -> InputSpec:
    """``"2,3,224,224"``, ``"2x16:int64"`` -> :class:`InputSpec`; ``dtype`` applies when the
    spec names none. Raises :class:`~xconv.errors.UsageError` (exit 2) naming the bad part."""
    shape_text, _, dtype_text = spec.partition(":")
    name = (dtype_text or dtype or "float32").strip().lower()
    if name not in DTYPES:
        raise UsageError(
            f"--input-shape {spec!r}: unknown dtype {name!r}; known: " + ", ".join(sorted(DTYPES))
        )
    text = shape_text.strip().lower()
    sizes = [] if text in ("", "scalar") else text.replace("x", ",").split(",")
    try:
        shape = tuple(int(d) for d in sizes)
    except ValueError:
        raise UsageError(
            f"--input-shape {spec!r}: bad shape {shape_text!r}: write sizes separated by ',' "
            "or 'x', e.g. 2,3,224,224 or 2x16:int64"
        ) from None
    if any(d < 0 for d in shape):
        raise UsageError(f"--input-shape {spec!r}: sizes must be >= 0")
    return InputSpec(shape, DTYPES[name])


def parse_specs(specs: Sequence[str], dtypes: str | Sequence[str] = "float32") -> list[InputSpec]:
    """One spec per input; ``dtypes`` is one for all or one per input (a spec's own
    ``:dtype`` wins)."""
    if isinstance(dtypes, str):
        dtypes = [dtypes]
    dtypes = list(dtypes) or ["float32"]
    if len(dtypes) == 1:
        dtypes = dtypes * len(specs)
    if len(dtypes) != len(specs):
        raise UsageError(
            f"{len(specs)} --input-shape but {len(dtypes)} --input-dtype: give one dtype for "
            "all or one per shape"
        )
    return [parse_spec(s, d) for s, d in zip(specs, dtypes, strict=True)]


def numpy_dtype(name: str) -> np.dtype:
    """A canonical dtype name as numpy's dtype (``bfloat16`` through ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def example_array(spec: InputSpec, index: int = 0) -> np.ndarray:
    """The deterministic example value of input ``index`` (see the module docstring)."""
    dtype = numpy_dtype(spec.dtype)
    if spec.floating:
        rng = np.random.default_rng(SEED + index)
        return rng.standard_normal(spec.shape).astype(np.float32).astype(dtype)
    if spec.dtype == "bool":
        return np.ones(spec.shape, bool)
    return np.zeros(spec.shape, dtype)


def example_arrays(
    specs: Sequence[str], dtypes: str | Sequence[str] = "float32"
) -> tuple[np.ndarray, ...]:
    """The example inputs of ``--input-shape`` / ``--input-dtype`` as numpy arrays."""
    return tuple(example_array(s, i) for i, s in enumerate(parse_specs(specs, dtypes)))


__all__ = ["DTYPES", "InputSpec", "example_array", "example_arrays", "parse_spec", "parse_specs"]

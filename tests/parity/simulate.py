"""Reduced-precision accelerators simulated on the CPU, for parity tests without a device.

``simulated_accelerator("gpu")`` adds a device ``gpu:0`` to every JAX / Flax adapter: it runs
on the CPU, but reports an NVIDIA H100 (``tpu``: a TPU v5e) to the precision logic, and while
a row runs there every float32 ``dot_general`` / ``conv_general_dilated`` rounds its inputs
to the mantissa that device's effective matmul precision keeps (TF32: 10 bits; one bfloat16
pass: 7; three: 16; 'highest': none), accumulating in float32, as the hardware does. The
device matrix is then what a real accelerator gives: ``cpu:0`` at float32 and ``gpu:0`` at
JAX's default there, with the precision the policy sees named in the report.

The rounding wraps the two primitives' ``bind`` (so every route to them, jnp, lax, Flax
layers, inside jit or scan bodies, is rounded), only while a simulated row runs; JAX's
caches are cleared around those rows, so no trace made at one precision serves the other.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import numpy as np
from jax import lax

from xconv.parity import precision as prec
from xconv.parity.jax_adapters import JaxAdapter

#: (platform, device_kind, compute_capability) each simulated accelerator reports.
KINDS = {
    "gpu": ("gpu", "NVIDIA H100 80GB HBM3 (simulated on CPU)", "9.0"),
    "tpu": ("tpu", "TPU v5 lite (simulated on CPU)", None),
}
#: Mantissa bits the inputs of a dot keep at each precision (None: left as float32).
MANTISSA = {"float32": None, "bf16_3x": 16, "tf32": 10, "bf16": 7}

_ROUNDING: contextvars.ContextVar[int | None] = contextvars.ContextVar("_ROUNDING", default=None)


def _rounding_bind(original):
    def bind(*args, **params):
        bits = _ROUNDING.get()
        if bits is not None:
            args = tuple(
                lax.reduce_precision(a, exponent_bits=8, mantissa_bits=bits)
                if getattr(a, "dtype", None) == np.float32
                else a
                for a in args
            )
        return original(*args, **params)

    return bind


@contextlib.contextmanager
def rounded_dots(bits: int | None) -> Iterator[None]:
    """Every float32 dot / conv traced inside rounds its inputs to ``bits`` mantissa bits."""
    token = _ROUNDING.set(bits)
    jax.clear_caches()
    try:
        yield
    finally:
        _ROUNDING.reset(token)
        jax.clear_caches()


@contextlib.contextmanager
def simulated_accelerator(kind: str = "gpu") -> Iterator[str]:
    """Give JAX adapters a simulated ``<kind>:0`` device (see the module docstring); yields
    its name."""
    platform, device_kind, cc = KINDS[kind]
    name = f"{platform}:0"
    saved = {
        attr: getattr(JaxAdapter, attr) for attr in ("devices", "_device", "run", "dot_precision")
    }
    prims = (lax.dot_general_p, lax.conv_general_dilated_p)

    def precision_now() -> str:
        return prec.jax_precision(platform, device_kind, cc, prec.jax_setting())

    def devices(self):
        return [*saved["devices"](self), name]

    def _device(self, dev):
        return saved["_device"](self, "cpu:0" if dev == name else dev)

    def run(self, inputs, device):
        if device != name or self.x64:
            return saved["run"](self, inputs, device)
        with rounded_dots(MANTISSA[precision_now()]):
            return saved["run"](self, inputs, device)

    def dot_precision(self, device, inputs):
        if device != name or self.x64:
            return saved["dot_precision"](self, device, inputs)
        p = precision_now()
        if p == "float32":
            return "float32", 1
        xs = self._args(inputs, device)
        return p, prec.jaxpr_dot_depth(self._call, self._params_on(device), xs)

    for attr, fn in (
        ("devices", devices),
        ("_device", _device),
        ("run", run),
        ("dot_precision", dot_precision),
    ):
        setattr(JaxAdapter, attr, fn)
    for p in prims:
        p.bind = _rounding_bind(type(p).bind.__get__(p))
    try:
        yield name
    finally:
        for attr, fn in saved.items():
            setattr(JaxAdapter, attr, fn)
        for p in prims:
            del p.bind
        jax.clear_caches()

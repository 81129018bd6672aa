"""On the CPU, the exact Gelu of a large input ends in a select (``where(x == x, y, x)``, the
same values) in ``to_jax`` (``elementwise._Kernel.gelu``): it keeps XLA:CPU from merging the
GELU with the products beside it into one slower YNNPACK fusion. A small input keeps the plain
form. That is the runtime's formulation: the generated Flax writes ``jax.nn.gelu`` as a person
does. Both compute torch's numbers."""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import xconv  # noqa: E402
from tests.converters.jax.generated import import_generated  # noqa: E402
from xconv.converters.jax import elementwise  # noqa: E402


class _Layer(torch.nn.Module):
    """BERT-base's layer from the attention's output projection on: Linear, residual,
    LayerNorm, Linear, exact GELU, Linear, residual, LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.out = torch.nn.Linear(768, 768)
        self.norm1 = torch.nn.LayerNorm(768)
        self.up = torch.nn.Linear(768, 3072)
        self.down = torch.nn.Linear(3072, 768)
        self.norm2 = torch.nn.LayerNorm(768)

    def forward(self, attended, x):
        h = self.norm1(self.out(attended) + x)
        return self.norm2(self.down(torch.nn.functional.gelu(self.up(h))) + h)


def _fusions(hlo: str) -> list[str]:
    """The bodies of the compiled module's fused computations."""
    return re.findall(r"\n%fused_computation[^\n]*\{\n(.*?)\n\}", hlo, re.S)


@pytest.fixture(scope="module")
def layer():
    torch.manual_seed(0)
    module = _Layer().eval()
    example = (torch.randn(2, 8, 768), torch.randn(2, 8, 768))
    return module, xconv.from_torch(module, example, dynamic_batch=True)


def _converted(model, how: str, tmp):
    """``(fn, params)``: ``fn(params, attended, x)`` returns the outputs' tuple."""
    if how == "to_jax":
        return xconv.to_jax(model)
    folder = xconv.to_flax(model, tmp / "flax")
    flax_model, variables = import_generated(folder).load(folder)
    return (lambda v, *xs: (flax_model.apply(v, *xs),)), variables


def test_the_generated_gelu_is_jax_nn_gelu_with_torchs_numbers(layer, tmp_path):
    module, model = layer
    fn, params = _converted(model, "generated Flax", tmp_path)
    src = (tmp_path / "flax" / "model.py").read_text()
    assert "jax.nn.gelu(" in src and "x == x" not in src and "default_backend" not in src
    for batch, tokens in ((3, 128), (1, 8)):
        xs = [torch.randn(batch, tokens, 768) for _ in range(2)]
        with torch.no_grad():
            want = module(*xs).numpy()
        got = np.asarray(jax.jit(fn)(params, *(x.numpy() for x in xs))[0])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU formulation")
@pytest.mark.parametrize(("batch", "tokens", "split"), [(3, 128, True), (1, 8, False)])
def test_a_large_gelu_ends_in_a_select_with_torchs_numbers(layer, batch, tokens, split, tmp_path):
    how = "to_jax"
    module, model = layer
    # the GELU's input: batch × tokens × 3072 elements (1.2·10⁶ at 3 × 128)
    assert (batch * tokens * 3072 >= elementwise.GELU_SPLIT) is split
    fn, params = _converted(model, how, tmp_path)
    fn = jax.jit(fn)
    xs = [torch.randn(batch, tokens, 768) for _ in range(2)]
    with torch.no_grad():
        want = module(*xs).numpy()
    got = np.asarray(fn(params, *(x.numpy() for x in xs))[0])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert (
        fn.lower(params, *(x.numpy() for x in xs)).as_text().count("stablehlo.select") > 0
    ) is split


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU formulation")
def test_the_gelu_is_not_fused_with_the_products(layer, tmp_path):
    # BERT-base at batch 32: without the select, XLA:CPU fused the GELU with all three products
    fn, params = _converted(layer[1], "to_jax", tmp_path)
    spec = jax.ShapeDtypeStruct((32, 128, 768), np.float32)
    hlo = jax.jit(fn).lower(params, spec, spec).compile().as_text()
    erf = [f.count(" dot(") for f in _fusions(hlo) if " erf(" in f]
    assert erf and not any(erf), erf


def test_the_split_gelu_has_the_plain_forms_values():
    x = np.random.default_rng(0).uniform(-6, 6, elementwise.GELU_SPLIT).astype(np.float32)
    x[:5] = [np.nan, np.inf, -np.inf, 0.0, -0.0]
    got = jax.jit(lambda v: elementwise._Kernel.gelu(v, False))(x)
    plain = jax.jit(lambda v: v * 0.5 * (1 + jax.lax.erf(v * 0.7071067811865476)))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))  # NaN where NaN

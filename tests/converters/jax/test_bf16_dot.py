"""On the CPU, ``to_jax`` computes a product of two bfloat16 operands (MatMul, Gemm, a
two-operand Einsum, the attention reference's matmuls, a patch matmul) as bfloat16 products
accumulated in float32 and rounded once (formulation ``bf16_dot``): the values XLA gives the
bfloat16 dot, and gradients whose products take bfloat16 operands too. Under ``"reference"``
every product is JAX's own, whose gradient products run in float32. The formulation is the
runtime's: the Flax emitter's bfloat16 modules write JAX's own products under either."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402

import xconv  # noqa: E402
from xconv.converters.jax import kernel  # noqa: E402
from xconv.converters.jax.linalg import _transposable  # noqa: E402
from xconv.converters.ops import formulation  # noqa: E402

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU formulation")


def _all_eqns(jaxpr) -> list:
    """Every equation of ``jaxpr`` and of the jaxprs it calls."""
    found = []
    for eqn in jaxpr.eqns:
        found.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _all_eqns(inner)
    return found


def _dots(jaxpr) -> list:
    """Every ``dot_general`` equation in ``jaxpr`` and the jaxprs it calls."""
    return [e for e in _all_eqns(jaxpr) if e.primitive.name == "dot_general"]


def _train(model, xs, choice: str, path: str = "to_jax", out_dir=None, **to_jax):
    """A bfloat16 conversion of ``model`` under ``bf16_dot=choice`` (a jitted function keeps
    the formulation it was traced with): ``to_jax``'s (given ``to_jax``'s other arguments),
    or the linen / nnx module ``to_flax`` writes to ``out_dir/choice``. Its output on ``xs``,
    the mean square's value and gradient for its params, and that step's jaxpr."""
    with formulation.use(bf16_dot=choice):
        if path == "to_jax":
            fn, params = xconv.to_jax(model, dtype="bfloat16", **to_jax)
            apply = lambda p: fn(p, xs)[0]  # noqa: E731
        else:
            from tests.converters.jax.generated import import_generated

            out = xconv.to_flax(model, out_dir / choice, api=path, dtype="bfloat16")
            gen = import_generated(out)
            if path == "linen":
                flax_model, params = gen.load(out)
                apply = lambda p: flax_model.apply(p, xs)  # noqa: E731
            else:
                from flax import nnx

                graph, params = nnx.split(gen.load(out))
                apply = lambda p: nnx.merge(graph, p)(xs)  # noqa: E731

        def loss(p):
            return jnp.mean(apply(p).astype(jnp.float32) ** 2)

        step = jax.value_and_grad(loss)
        out = np.asarray(apply(params), np.float32)
        return out, step(params), jax.make_jaxpr(step)(params).jaxpr


def _assert_same(got, want) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


def _bf16_accumulating(eqn) -> bool:
    operands = {str(v.aval.dtype) for v in eqn.invars}
    return operands == {"bfloat16"} and eqn.params["preferred_element_type"] == jnp.float32


SHAPES = [
    ((6, 8), (8, 3)),
    ((4, 5, 8), (8, 3)),
    ((2, 3, 5, 8), (2, 3, 8, 4)),
    ((8,), (8, 3)),
    ((5, 8), (8,)),
    ((5, 8), (2, 8, 3)),
]


@pytest.mark.parametrize(("a_shape", "b_shape"), SHAPES)
def test_a_bf16_matmul_and_its_gradient_keep_xlas_values_with_bf16_operands(a_shape, b_shape):
    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in (a_shape, b_shape))
    ct = jnp.asarray(rng.standard_normal(jnp.matmul(a, b).shape), jnp.bfloat16)

    def pullback(f):
        y, vjp = jax.vjp(f, a, b)
        return (y, *vjp(ct))

    got, want = pullback(kernel.matmul), pullback(jnp.matmul)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    dots = _dots(jax.make_jaxpr(lambda a, b: pullback(kernel.matmul))(a, b).jaxpr)
    assert len(dots) == 3 and all(map(_bf16_accumulating, dots)), dots
    with formulation.use(bf16_dot="reference"):
        plain = _dots(jax.make_jaxpr(lambda a, b: pullback(kernel.matmul))(a, b).jaxpr)
    assert not any(map(_bf16_accumulating, plain))


def test_a_matmul_broadcasting_a_batch_axis_of_one_or_in_float32_stays_jaxs():
    a = jnp.ones((2, 1, 5, 8), jnp.bfloat16)
    b = jnp.ones((3, 8, 4), jnp.bfloat16)
    assert kernel.matmul_spec(a.shape, b.shape) is None
    assert not any(map(_bf16_accumulating, _dots(jax.make_jaxpr(kernel.matmul)(a, b).jaxpr)))
    f32 = jax.make_jaxpr(kernel.matmul)(a[0, 0].astype(jnp.float32), b[0].astype(jnp.float32))
    assert _dots(f32.jaxpr)[0].params["preferred_element_type"] == jnp.float32
    assert {str(v.aval.dtype) for v in _dots(f32.jaxpr)[0].invars} == {"float32"}


def test_einsums_whose_gradients_are_einsums_take_the_bf16_form():
    assert _transposable("bhqd,bhkd->bhqk")
    assert _transposable("ij,jk->ik")
    assert not _transposable("ii,ij->j")  # an index twice in one operand
    assert not _transposable("ij,jk->k")  # i only in a: its gradient would broadcast
    assert not _transposable("...ij,jk->...ik")
    assert not _transposable("ij,jk")


def _graph_of_products() -> onnx.ModelProto:
    """MatMul on tokens, Gemm (transposed B, a bias), a batched Einsum, all bfloat16."""
    bf = TensorProto.BFLOAT16
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Reshape", ["h", "rows"], ["h2"]),
        helper.make_node("Gemm", ["h2", "g", "c"], ["y"], transB=1),
        helper.make_node("Einsum", ["x", "h"], ["s"], equation="btd,bte->bde"),
    ]
    rng = np.random.default_rng(1)

    def init(name, *shape):
        return onnx.numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    inits = [init("w", 8, 6), init("g", 5, 6), init("c", 5)]
    inits = [helper.make_tensor(t.name, bf, t.dims, onnx.numpy_helper.to_array(t)) for t in inits]
    inits.append(onnx.numpy_helper.from_array(np.array([-1, 6], np.int64), "rows"))
    graph = helper.make_graph(
        nodes,
        "products",
        [helper.make_tensor_value_info("x", bf, [2, 4, 8])],
        [
            helper.make_tensor_value_info("y", bf, None),
            helper.make_tensor_value_info("s", bf, None),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _step_and_dots(model, choice: str, x):
    """``to_jax``'s loss value and gradient (params and input) under ``bf16_dot=choice``
    (a jitted function keeps the formulation it was traced with), and its products."""
    with formulation.use(bf16_dot=choice):
        fn, params = xconv.to_jax(model)

        def loss(p, x):
            outs = fn(p, x)
            return sum(jnp.sum(o.astype(jnp.float32) ** 2) for o in outs)

        step = jax.value_and_grad(loss, argnums=(0, 1))
        return step(params, x), _dots(jax.make_jaxpr(step)(params, x).jaxpr)


def test_to_jax_products_of_a_bf16_graph_and_their_gradients_keep_their_values():
    model = xconv.load(_graph_of_products())
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 4, 8)), jnp.bfloat16)
    got, dots = _step_and_dots(model, "auto", x)
    assert len(dots) == 9 and all(map(_bf16_accumulating, dots)), dots
    want, plain = _step_and_dots(model, "reference", x)
    # JAX's own: only the Einsum's forward product accumulates bfloat16 operands in float32
    assert sum(map(_bf16_accumulating, plain)) == 1
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


class _Block(torch.nn.Module):
    """Self-attention (SDPA with a padding mask: the reference form in bfloat16 on the CPU)
    and an MLP on (B, T, E) tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        h = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + h.transpose(1, 2).reshape(b, t, 16)
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def test_a_bf16_torch_block_trains_with_bf16_products_and_the_reference_numbers():
    torch.manual_seed(0)
    module = _Block().eval()
    x = torch.randn(3, 5, 16)
    model = xconv.from_torch(module, x, dynamic_batch=True)
    out, got, jaxpr = _train(model, jnp.asarray(x.numpy()), "auto")
    dots = _dots(jaxpr)
    assert len(dots) >= 15 and all(map(_bf16_accumulating, dots)), dots
    _, want, plain = _train(model, jnp.asarray(x.numpy()), "reference")
    assert not any(map(_bf16_accumulating, _dots(plain)))
    _assert_same(got, want)
    # and the source's numbers, at the bf16 policy's order of error
    ref = module(x).detach().numpy()
    assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) < 5e-2


def test_bf16_products_are_fusion_boundaries():
    # Without the boundary XLA:CPU merged each of BERT-base's layers into one slower fused
    # GEMM (kernel._einsum_f32): every bfloat16 product of the training step passes one.
    torch.manual_seed(0)
    module = _Block().eval()
    x = torch.randn(3, 5, 16)
    model = xconv.from_torch(module, x, dynamic_batch=True)
    counts = {}
    for choice in ("auto", "reference"):
        with formulation.use(bf16_dot=choice):
            fn, params = xconv.to_jax(model, dtype="bfloat16")
            loss = lambda p, fn=fn: jnp.sum(fn(p, x.numpy())[0].astype(jnp.float32) ** 2)  # noqa: E731
            text = jax.jit(jax.grad(loss)).lower(params).as_text()
        ops = ("dot_general", "optimization_barrier")
        counts[choice] = [text.count(f"stablehlo.{op}") for op in ops]
    dots, barriers = counts["auto"]
    assert dots >= 12 and barriers == dots, counts
    assert counts["reference"][1] == 0, counts


class _Encoder(torch.nn.Module):
    """torch's MultiheadAttention (the generated ``_torch_mha``) and an MLP on tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        x = x + self.attn(x, x, x, need_weights=False)[0]
        x = x + self.down(torch.nn.functional.gelu(self.up(x)))
        return self.head(x.mean(1))


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_generated_bf16_flax_writes_jaxs_own_products_with_the_source_numbers(tmp_path, api):
    torch.manual_seed(0)
    module = _Encoder().eval()
    x = torch.randn(3, 5, 16)
    model = xconv.from_torch(module, x, dynamic_batch=True)
    xs = jnp.asarray(x.numpy())
    _, got, jaxpr = _train(model, xs, "auto", api, tmp_path)
    src = (tmp_path / "auto" / "model.py").read_text()
    _, want, plain = _train(model, xs, "reference", api, tmp_path)
    assert src == (tmp_path / "reference" / "model.py").read_text()
    for gone in ("_bf16_einsum", "_flat_dot", "dot_general", "default_backend"):
        assert gone not in src, gone
    # the attention's scores only (jax.nn.dot_product_attention's float32 logits)
    assert sum(map(_bf16_accumulating, _dots(jaxpr))) == 1, _dots(jaxpr)
    _assert_same(got, want)
    # the source's numbers at the bf16 policy's order of error
    loss_ref = float((module(x) ** 2).mean())
    assert abs(float(got[0]) - loss_ref) / loss_ref < 5e-2


def test_a_bf16_convolution_run_as_a_patch_matmul_keeps_its_values():
    # a 1x1 convolution and a 3x3 one on 64 channels: matmuls over their patches on the CPU
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Conv2d(64, 64, 1), torch.nn.ReLU(), torch.nn.Conv2d(64, 8, 3, padding=1)
    ).eval()
    x = torch.randn(2, 64, 6, 6)
    model = xconv.from_torch(module, x)
    _, got, jaxpr = _train(model, jnp.asarray(x.numpy()), "auto")
    # each layer's product and its gradient's two
    dots = _dots(jaxpr)
    assert len(dots) == 6 and all(map(_bf16_accumulating, dots)), dots
    _, want, plain = _train(model, jnp.asarray(x.numpy()), "reference")
    assert not any(map(_bf16_accumulating, _dots(plain)))
    _assert_same(got, want)


def test_a_bf16_patch_matmul_that_stacks_its_views_runs_in_float32_with_the_same_values():
    # an ONNX-layout 3x3 kernel outweighing its patches (batch 1, 2x2 input): the views
    # stacked in float32, one float32 product on the operands' float32 copies
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU()).eval()
    x = jnp.asarray(torch.randn(1, 64, 2, 2).numpy())
    model = xconv.from_torch(module, torch.as_tensor(np.asarray(x)))
    out, got, jaxpr = _train(model, x, "auto", kernel_layout="onnx")
    dots = _dots(jaxpr)
    assert [str(v.aval.dtype) for v in dots[0].invars] == ["float32", "float32"], dots
    # and the kernel's gradient: JAX's gradient of the float32 product and the casts around it
    assert len(dots) == 2 and not any(map(_bf16_accumulating, dots)), dots
    ref, want, plain = _train(model, x, "reference", kernel_layout="onnx")
    assert str(_dots(plain)[0].invars[0].aval.dtype) == "bfloat16"
    np.testing.assert_array_equal(out, ref)
    _assert_same(got, want)


def test_fast_casts_keep_xlas_values_and_gradients():
    rng = np.random.default_rng(0)
    special = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 3.4e38, -3.4e38, 1e-40, -1e-45]
    ties = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-126 * (1 + 2**-8)]  # halfway: to even
    a = jnp.asarray(np.concatenate([special, ties, rng.standard_normal(10_000) * 1e3]), "float32")
    fast, slow = jax.jit(kernel.to_bf16)(a), a.astype(jnp.bfloat16)
    assert fast.dtype == jnp.bfloat16
    bits = lambda v: np.asarray(v).view(np.uint16)  # noqa: E731
    nan = np.isnan(np.asarray(a))
    assert np.isnan(np.asarray(fast, np.float32))[nan].all()
    np.testing.assert_array_equal(bits(fast)[~nan], bits(slow)[~nan])
    back = jax.jit(kernel.to_f32)(slow)
    assert back.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(back)[~nan], np.asarray(slow, np.float32)[~nan])
    # gradients: the cotangent cast back, as the casts' own
    c = jnp.asarray(rng.standard_normal(a.shape), "float32")
    g_fast = jax.grad(lambda v: jnp.sum(kernel.to_f32(kernel.to_bf16(v)) * c))(a)
    g_slow = jax.grad(lambda v: jnp.sum(v.astype(jnp.bfloat16).astype(jnp.float32) * c))(a)
    np.testing.assert_array_equal(np.asarray(g_fast), np.asarray(g_slow))
    # under "reference", and for static (numpy) values, the casts are JAX's own
    with formulation.use(bf16_dot="reference"):
        jaxpr = jax.make_jaxpr(lambda v: kernel.to_bf16(v))(a)  # not jit's trace cache
    assert [e.primitive.name for e in jaxpr.eqns] == ["convert_element_type"]
    assert isinstance(kernel.to_bf16(np.ones(3, np.float32)), jax.Array)


def test_only_convolution_kernels_are_cast_by_bit_operations():
    # A kernel's cast XLA:CPU fuses with its transpose into a slow copy; elsewhere its own
    # casts fuse into the ops beside them and are the faster (kernel.to_bf16).
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Conv2d(4, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(512, 10)
    ).eval()
    x = torch.randn(1, 4, 10, 10)
    model = xconv.from_torch(module, x)
    fn, params = xconv.to_jax(model, dtype="bfloat16")
    eqns = _all_eqns(jax.make_jaxpr(lambda p: fn(p, x.numpy())[0])(params).jaxpr)

    def cast_sizes(name, dtype):
        return sorted(
            e.invars[0].aval.size
            for e in eqns
            if e.primitive.name == name and e.invars[0].aval.dtype == dtype
        )

    assert cast_sizes("bitcast_convert_type", jnp.float32) == [8 * 4 * 3 * 3]  # the kernel
    converts = cast_sizes("convert_element_type", jnp.float32)
    assert 512 * 10 in converts and 8 * 4 * 3 * 3 not in converts  # the Linear's weight
    with formulation.use(bf16_dot="reference"):
        fn, params = xconv.to_jax(model, dtype="bfloat16")
        plain = _all_eqns(jax.make_jaxpr(lambda p: fn(p, x.numpy())[0])(params).jaxpr)
    assert not any(e.primitive.name == "bitcast_convert_type" for e in plain)


@pytest.mark.parametrize("path", ["to_jax", "linen", "nnx"])
def test_a_bf16_convolution_runs_forward_in_float32_with_the_same_values(tmp_path, path):
    """to_jax's bfloat16 convolution runs forward on float32 copies (the same values); the
    generated Flax writes JAX's own convolution under either formulation."""
    # 8 input channels: a convolution on every path (too few channels for a patch matmul)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU()).eval()
    x = torch.randn(2, 8, 9, 9)
    model = xconv.from_torch(module, x)

    def operands(jaxpr):
        convs = [e for e in _all_eqns(jaxpr) if e.primitive.name == "conv_general_dilated"]
        return sorted(str(e.invars[0].aval.dtype) for e in convs)

    _, got, jaxpr = _train(model, jnp.asarray(x.numpy()), "auto", path, tmp_path)
    # to_jax: the forward convolution on float32 operands, its gradient's two on bfloat16 ones
    # (the input's unused: XLA drops it); the generated Flax: JAX's own
    runtime = ["bfloat16", "bfloat16", "float32"]
    assert operands(jaxpr) == (runtime if path == "to_jax" else ["bfloat16"] * 2)
    _, want, plain = _train(model, jnp.asarray(x.numpy()), "reference", path, tmp_path)
    assert operands(plain) == ["bfloat16"] * 2  # JAX's own: the kernel's gradient only
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))

"""A dense layer's product on XLA:CPU: Flax's ``(in, out)`` kernel, flattened or not, against
torch's ``(out, in)``.

The same function four ways, side by side in one process: a stack of pre-LN MLP blocks
(LayerNorm, Dense to 4·d, exact GELU, Dense back to d, residual) on ``(batch, seq, d)``
inputs, with its kernels held and contracted as

* ``flax nn.Dense``: Flax's layer, kernel ``(in, out)``, ``x @ kernel`` (what the hand-written
  Flax models of ``bench_throughput.py`` write);
* ``nn.Dense(dot_general=_flat_dot)``: the same layer given a flattening product (the
  formulation ``dense``, which the generated Flax wrote before it became backend-neutral and
  ``to_jax`` applies): one 2-D matmul over the flattened ``batch·seq`` rows;
* ``(in, out), x @ k``: the same product written out;
* ``(out, in), x @ w.T``: the source's layout, as ``to_jax`` holds a torch ``Linear`` weight
  (``Transpose`` + ``MatMul`` in the IR).

Timed: the jitted forward and a jitted SGD step (forward, 0.5·mean(out²), backward, update),
in interleaved rounds (``bench_throughput.interleaved_medians``), one intra-op thread. The
``Eigen dots`` column counts the dots XLA:CPU compiles outside its XNNPACK fusions (top-level
``dot`` instructions of the compiled step): with an ``(in, out)`` kernel the weight gradient
of a 3-D input is such a dot, contracting the batch and sequence axes; flattened first, it is
a 2-D one.

A second table times one product with a torch ``Linear``'s ``(out, in)`` weight over few rows,
as ``to_jax`` holds it: ``x @ w.T``, and weight-major (``kernel.weight_product``: ``(w @
x.T).T``, the weight the left operand), beside the ``(in, out)`` kernel's ``x @ k``; forward
and SGD step (of ``w`` and the bias), at 2-256 rows and BERT-base's and the transformer
benchmark's widths. Its ``to_jax`` column says which form ``kernel.weight_major`` picks there.

    python benchmarks/bench_dense_layout.py            # writes benchmarks/dense_layout.md
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _doc  # noqa: E402
from benchmarks.bench_throughput import (  # noqa: E402
    _limit_threads,
    interleaved_medians,
)

OUT_MD = Path(__file__).with_name("dense_layout.md")
LR = 1e-3
#: (name, d, layers, seq): the transformer benchmark's MLP width and BERT-base's.
SHAPES = (("transformer MLP", 256, 4, 128), ("BERT-base MLP", 768, 2, 128))
BATCHES = (1, 16)


def _flat_dot():
    """A dense layer's ``dot_general`` that contracts a (..., in) input as one 2-D matmul over
    its flattened leading axes (the ``dense`` formulation)."""
    from jax import lax

    def flat_dot(lhs, rhs, dimension_numbers, out_sharding=None, **kwargs):
        contract, batch = dimension_numbers
        plain = tuple(map(tuple, contract)) == ((lhs.ndim - 1,), (0,)) and not any(batch)
        if out_sharding is not None or lhs.ndim < 3 or rhs.ndim != 2 or not plain:
            return lax.dot_general(lhs, rhs, dimension_numbers, out_sharding=out_sharding, **kwargs)
        flat = lhs.reshape(-1, lhs.shape[-1])
        y = lax.dot_general(flat, rhs, (((1,), (0,)), ((), ())), **kwargs)
        return y.reshape(*lhs.shape[:-1], rhs.shape[-1])

    return flat_dot


def _paths(d: int, layers: int):
    """name -> (apply(params, x), params) for the four formulations, equal weights."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    blocks = []
    for _ in range(layers):
        k1 = (rng.standard_normal((d, 4 * d)) / np.sqrt(d)).astype(np.float32)
        k2 = (rng.standard_normal((4 * d, d)) / np.sqrt(4 * d)).astype(np.float32)
        b1 = (0.1 * rng.standard_normal(4 * d)).astype(np.float32)
        b2 = (0.1 * rng.standard_normal(d)).astype(np.float32)
        blocks.append((k1, b1, k2, b2))

    def gelu(x):
        return x * 0.5 * (1 + jax.lax.erf(x * 0.7071067811865476))

    def norm(x):
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5)

    def stack(matmul):
        def apply(params, x):
            for k1, b1, k2, b2 in params:
                x = x + matmul(gelu(matmul(norm(x), k1) + b1), k2) + b2
            return x

        return apply

    class Block(nn.Module):
        dot_general: Any = None

        @nn.compact
        def __call__(self, x):
            h = nn.Dense(4 * d, name="ff1", dot_general=self.dot_general)(norm(x))
            return x + nn.Dense(d, name="ff2", dot_general=self.dot_general)(gelu(h))

    class Stack(nn.Module):
        dot_general: Any = None

        @nn.compact
        def __call__(self, x):
            for i in range(layers):
                x = Block(self.dot_general, name=f"block_{i}")(x)
            return x

    flax_params = {
        f"block_{i}": {
            "ff1": {"kernel": jnp.asarray(k1), "bias": jnp.asarray(b1)},
            "ff2": {"kernel": jnp.asarray(k2), "bias": jnp.asarray(b2)},
        }
        for i, (k1, b1, k2, b2) in enumerate(blocks)
    }
    as_jnp = [tuple(jnp.asarray(a) for a in b) for b in blocks]
    flat_dot = _flat_dot()
    torch_layout = [
        (jnp.asarray(k1.T.copy()), jnp.asarray(b1), jnp.asarray(k2.T.copy()), jnp.asarray(b2))
        for k1, b1, k2, b2 in blocks
    ]
    return {
        "flax nn.Dense, (in, out)": (lambda p, x: Stack().apply({"params": p}, x), flax_params),
        "nn.Dense(dot_general=_flat_dot)": (
            lambda p, x: Stack(flat_dot).apply({"params": p}, x),
            flax_params,
        ),
        "(in, out), x @ k": (stack(lambda x, k: x @ k), as_jnp),
        "(out, in), x @ w.T": (stack(lambda x, w: x @ w.T), torch_layout),
    }


def _step(apply):
    import jax
    import jax.numpy as jnp

    def loss(p, x):
        return 0.5 * jnp.mean(jnp.square(apply(p, x)))

    def step(p, x):
        grads = jax.grad(loss)(p, x)
        return jax.tree_util.tree_map(lambda a, g: a - LR * g, p, grads)

    return jax.jit(step)


def _eigen_dots(compiled_text: str) -> int:
    entry = compiled_text[compiled_text.find("\nENTRY ") :]
    return len(re.findall(r"= \S+ dot\(", entry))


def _time_paths(paths: dict, x, repeat: int) -> list[dict]:
    """Each ``name -> (apply, params)`` of ``paths`` on ``x``: its jitted forward and SGD step
    timed in interleaved rounds, ratios to the first path's, the compiled step's Eigen dots,
    and the forward's max |diff| against the first path's."""
    import jax

    calls, info, reference = [], [], None
    for name, (apply, params) in paths.items():
        infer, step = jax.jit(apply), _step(apply)
        out = np.asarray(infer(params, x))
        reference = out if reference is None else reference
        dots = _eigen_dots(step.lower(params, x).compile().as_text())
        for fn in (infer, step):
            jax.block_until_ready(fn(params, x))  # compile + warm-up
        calls += [
            lambda f=infer, p=params, x=x: jax.block_until_ready(f(p, x)),
            lambda f=step, p=params, x=x: jax.block_until_ready(f(p, x)),
        ]
        info.append((name, dots, float(np.max(np.abs(out - reference)))))
    times = interleaved_medians(calls, repeat)
    return [
        {
            "path": name,
            "infer_ms": 1e3 * times[2 * i],
            "infer_ratio": times[2 * i] / times[0],
            "train_ms": 1e3 * times[2 * i + 1],
            "train_ratio": times[2 * i + 1] / times[1],
            "eigen_dots": dots,
            "max_err": err,
        }
        for i, (name, dots, err) in enumerate(info)
    ]


def measure(repeat: int) -> list[dict]:
    import jax

    rows = []
    for shape_name, d, layers, seq in SHAPES:
        paths = _paths(d, layers)
        for batch in BATCHES:
            x = np.random.default_rng(1).standard_normal((batch, seq, d)).astype(np.float32)
            shape = f"{shape_name} (d={d}, {layers} blocks, seq {seq})"
            for row in _time_paths(paths, jax.device_put(x), repeat):
                rows.append({"shape": shape, "batch": batch, **row})
            print(f"{shape_name} b={batch}: done", file=sys.stderr)
    return rows


#: (in, out) widths and row counts of the single products.
PRODUCT_WIDTHS = ((768, 768), (3072, 768), (768, 3072), (1024, 256))
PRODUCT_ROWS = (2, 8, 32, 64, 96, 128, 256)


def measure_products(repeat: int) -> list[dict]:
    """One ``(out, in)`` weight's product three ways (see the module's doc) per width and row
    count: forward and SGD-step medians, interleaved."""
    import jax
    import jax.numpy as jnp

    from xconv.converters.jax.kernel import weight_major, weight_product

    forms = {
        "(out, in), x @ w.T": (lambda x, w: x @ w.T, False),
        "(out, in), weight-major": (lambda x, w: weight_product(x, w.T), False),
        "(in, out), x @ k": (lambda x, k: x @ k, True),
    }
    rows = []
    rng = np.random.default_rng(0)
    for d_in, d_out in PRODUCT_WIDTHS:
        w = (rng.standard_normal((d_out, d_in)) / np.sqrt(d_in)).astype(np.float32)
        b = (0.1 * rng.standard_normal(d_out)).astype(np.float32)
        for m in PRODUCT_ROWS:
            x = jax.device_put(rng.standard_normal((m, d_in)).astype(np.float32))
            paths = {
                name: (
                    lambda p, x, product=product: product(x, p[0]) + p[1],
                    (jnp.asarray(w.T.copy() if kernel else w), jnp.asarray(b)),
                )
                for name, (product, kernel) in forms.items()
            }
            picked = "weight-major" if weight_major(x, jnp.asarray(w).T) else "x @ w.T"
            for row in _time_paths(paths, x, repeat):
                rows.append({"width": f"{d_in} -> {d_out}", "rows": m, "to_jax": picked, **row})
        print(f"products {d_in} -> {d_out}: done", file=sys.stderr)
    return rows


def render(rows: list[dict], run: str, products: list[dict] = ()) -> str:
    lines = [
        "# Dense kernel layout on XLA:CPU",
        "",
        "Written by `benchmarks/bench_dense_layout.py`; do not edit by hand.",
        "",
        f"- run: {run}",
        "- one intra-op thread; median of interleaved rounds; ratios to `flax nn.Dense` "
        "(< 1: faster); max |diff| of the forward against it",
        "- Eigen dots: dots of the compiled training step left outside XLA:CPU's XNNPACK fusions",
        "",
        "| model | batch | kernel, product | forward ms | ×nn.Dense | training step ms "
        "| ×nn.Dense | Eigen dots (step) | max diff |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['batch']} | {r['path']} | {r['infer_ms']:.2f} "
            f"| ×{r['infer_ratio']:.2f} | {r['train_ms']:.2f} | ×{r['train_ratio']:.2f} "
            f"| {r['eigen_dots']} | {r['max_err']:.1e} |"
        )
    if products:
        lines += [
            "",
            "## One product with a torch `Linear`'s `(out, in)` weight, few rows",
            "",
            "Ratios to `(out, in), x @ w.T` (< 1: faster); `to_jax`: the form "
            "`kernel.weight_major` picks for a float32 `MatMul(x, Transpose(w))` on the CPU.",
            "",
            "| in -> out | rows | weight, product | forward ms | ×x @ w.T | SGD step ms "
            "| ×x @ w.T | to_jax | max diff |",
            "|---|---:|---|---:|---:|---:|---:|---|---:|",
        ]
        for r in products:
            lines.append(
                f"| {r['width']} | {r['rows']} | {r['path']} | {r['infer_ms']:.3f} "
                f"| ×{r['infer_ratio']:.2f} | {r['train_ms']:.3f} | ×{r['train_ratio']:.2f} "
                f"| {r['to_jax']} | {r['max_err']:.1e} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--out", type=Path, default=OUT_MD)
    args = parser.parse_args(argv)
    commit = _doc.commit_or_refuse("bench_dense_layout", args.out, OUT_MD)
    if commit is None:
        return 2
    _limit_threads(1)
    import jax

    load = _doc.load()
    rows = measure(args.repeat)
    products = measure_products(args.repeat)
    stamp = _doc.run_stamp(commit, load, f"jax {jax.__version__}")
    _doc.write(args.out, render(rows, stamp, products))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Softmax attention's core on XLA:CPU: ``jax.nn.dot_product_attention`` against the
head-major einsums that ``to_jax``'s fused ``Attention`` runs (and the generated Flax's
``_dot_product_attention`` helper ran before the generated source became backend-neutral).

The same function four ways, side by side in one process, on ``(batch, seq, heads, 64)``
q, k, v (the transformer benchmark's 4 heads and BERT-base's 12, seq 128), float32 and
bfloat16:

* ``jax.nn.dot_product_attention``: jax's XLA implementation (sequence-major einsums, scores
  and softmax in float32), which the generated Flax writes;
* ``flax nn.dot_product_attention``: Flax's function, as the hand-written Flax models of
  ``bench_throughput.py`` call it (query pre-scaled, softmax in the inputs' dtype);
* ``sequence-major einsums``: ``bqhd,bkhd->bhqk`` on the (B, S, H, D) arrays, scores in float32;
* ``_dot_product_attention``: head-major einsums (the heads transposed to (B, H, S, D),
  ``bhqd,bhkd->bhqk``, scores and softmax in float32).

Timed: the jitted forward and the jitted gradient of 0.5·mean(out²) with respect to q, k, v,
in interleaved rounds (``bench_throughput.interleaved_medians``), one intra-op thread.

    python benchmarks/bench_attention_core.py          # writes benchmarks/attention_core.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _doc  # noqa: E402
from benchmarks.bench_throughput import (  # noqa: E402
    _limit_threads,
    interleaved_medians,
)

OUT_MD = Path(__file__).with_name("attention_core.md")
#: (name, heads): the transformer benchmark's attention and BERT-base's; seq 128, head dim 64.
SHAPES = (("transformer", 4), ("BERT-base", 12))
BATCHES = (1, 16)
SEQ, HEAD_DIM = 128, 64


def _helper():
    """Attention on (B, S, H, D) arrays as einsums over head-major (B, H, S, D) heads, scores
    and softmax in float32."""
    import math

    import jax
    import jax.numpy as jnp

    def head_major(q, k, v):
        q, k, v = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))
        acc = jnp.promote_types(q.dtype, jnp.float32)
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=acc)
        probs = jax.nn.softmax(scores / math.sqrt(q.shape[-1]), axis=-1).astype(v.dtype)
        return jnp.swapaxes(jnp.einsum("bhqk,bhkd->bhqd", probs, v), 1, 2)

    return head_major


def paths() -> dict:
    """name -> attention(q, k, v) on (B, S, H, D) arrays."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    def sequence_major(q, k, v):
        scale = 1 / np.sqrt(q.shape[-1])
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)

    return {
        "jax.nn.dot_product_attention": jax.nn.dot_product_attention,
        "flax nn.dot_product_attention": lambda q, k, v: nn.dot_product_attention(q, k, v),
        "sequence-major einsums": sequence_major,
        "_dot_product_attention": _helper(),
    }


def _grad(attention):
    import jax
    import jax.numpy as jnp

    def loss(q, k, v):
        return 0.5 * jnp.mean(jnp.square(attention(q, k, v).astype(jnp.float32)))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def measure(repeat: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    rows = []
    for dtype_name, dtype in (("fp32", jnp.float32), ("bf16", jnp.bfloat16)):
        for shape_name, heads in SHAPES:
            for batch in BATCHES:
                rng = np.random.default_rng(batch)
                qkv = [
                    jax.device_put(
                        jnp.asarray(rng.standard_normal((batch, SEQ, heads, HEAD_DIM)), dtype)
                    )
                    for _ in range(3)
                ]
                calls, info, reference = [], [], None
                for name, attention in paths().items():
                    infer, grad = jax.jit(attention), _grad(attention)
                    out = np.asarray(infer(*qkv), np.float32)
                    reference = out if reference is None else reference
                    jax.block_until_ready(grad(*qkv))  # compile
                    calls += [
                        lambda f=infer, a=qkv: jax.block_until_ready(f(*a)),
                        lambda f=grad, a=qkv: jax.block_until_ready(f(*a)),
                    ]
                    info.append((name, float(np.max(np.abs(out - reference)))))
                times = interleaved_medians(calls, repeat)
                for i, (name, err) in enumerate(info):
                    rows.append(
                        {
                            "dtype": dtype_name,
                            "shape": f"{shape_name} ({heads} heads)",
                            "batch": batch,
                            "path": name,
                            "infer_ms": 1e3 * times[2 * i],
                            "infer_ratio": times[2 * i] / times[0],
                            "grad_ms": 1e3 * times[2 * i + 1],
                            "grad_ratio": times[2 * i + 1] / times[1],
                            "max_err": err,
                        }
                    )
                print(f"{dtype_name} {shape_name} b={batch}: done", file=sys.stderr)
    return rows


def render(rows: list[dict], run: str) -> str:
    lines = [
        "# Attention's core on XLA:CPU",
        "",
        "Written by `benchmarks/bench_attention_core.py`; do not edit by hand.",
        "",
        f"- run: {run}",
        f"- q, k, v: (batch, {SEQ}, heads, {HEAD_DIM}); one intra-op thread; median of "
        "interleaved rounds; ratios to `jax.nn.dot_product_attention` (< 1: faster); max |diff| "
        "of the forward against it",
        "- gradient: of 0.5·mean(out²) with respect to q, k and v",
        "",
        "| dtype | attention | batch | formulation | forward ms | ×jax.nn | gradient ms "
        "| ×jax.nn | max diff |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['shape']} | {r['batch']} | {r['path']} | {r['infer_ms']:.2f} "
            f"| ×{r['infer_ratio']:.2f} | {r['grad_ms']:.2f} | ×{r['grad_ratio']:.2f} "
            f"| {r['max_err']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=11)
    parser.add_argument("--out", type=Path, default=OUT_MD)
    args = parser.parse_args(argv)
    commit = _doc.commit_or_refuse("bench_attention_core", args.out, OUT_MD)
    if commit is None:
        return 2
    _limit_threads(1)
    import jax

    load = _doc.load()
    rows = measure(args.repeat)
    run = _doc.run_stamp(commit, load, f"jax {jax.__version__}")
    _doc.write(args.out, render(rows, run))
    return 0


if __name__ == "__main__":
    sys.exit(main())

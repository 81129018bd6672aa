"""Speed of the interop bridges.

1. ``xconv.torch2jax`` (through the IR) vs the PyPI ``torch2jax`` package (``t2j``, which
   runs the torch module's Python code on JAX arrays) on an MLP, a ResNet-style CNN and a
   transformer encoder block, both jitted, same weights, same inputs: call overhead (batch 1)
   and throughput (batch 32). Reported as time ratios xconv / t2j (< 1: xconv faster).
   Each time is the best of three medians, the contenders alternating.
2. ``xconv.jax2torch`` call overhead vs calling the jitted JAX function directly, forward
   only (no grad) and forward + backward (vs ``jax.jit(jax.vjp)`` + the vjp).

The PyPI ``torch2jax`` is imported from ``--peers`` (default ``/work/peers``: ``pip install
--target /work/peers --no-deps torch2jax``), put on ``sys.path`` by this script only.

    python benchmarks/bench_interop.py [--repeat 20]     # writes benchmarks/interop.md
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _doc  # noqa: E402
from benchmarks._timing import median_seconds  # noqa: E402

OUT_MD = Path(__file__).with_name("interop.md")
PEERS = "/work/peers"
NAMES = {
    "mlp": "MLP 16-32-32-8",
    "cnn": "ResNet-style CNN 3×32×32",
    "transformer": "transformer block, MHA+MLP",
}


def _models():
    """Models built only from ops the peer implements (it lacks avg_pool2d and Tensor.split,
    so the fixtures' ResNetTiny and EncoderLayer are trimmed to their common subset)."""
    import torch
    from torch import nn

    from fixtures.torch_models import MLP, BasicBlock, _build

    class CNN(nn.Module):
        """ResNet-style: conv + BN + max pool stem, two residual blocks, global pool, head."""

        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 8, 5, stride=2, padding=2, bias=False)
            self.bn1 = nn.BatchNorm2d(8)
            self.relu = nn.ReLU()
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
            self.layer1 = BasicBlock(8, 8)
            self.layer2 = BasicBlock(8, 16, stride=2)
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(16, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer2(self.layer1(x))
            return self.fc(torch.flatten(self.avgpool(x), 1))

    class Block(nn.Module):
        """Pre-LN transformer encoder block: multi-head self-attention and a GELU MLP."""

        def __init__(self, d: int = 32, heads: int = 4) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
            self.ln2 = nn.LayerNorm(d)
            self.ff1 = nn.Linear(d, 4 * d)
            self.act = nn.GELU()
            self.ff2 = nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.ln1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.ff2(self.act(self.ff1(self.ln2(x))))

    return {
        "mlp": (_build(MLP), lambda b: torch.randn(b, 16)),
        "cnn": (_build(CNN), lambda b: torch.randn(b, 3, 32, 32)),
        "transformer": (_build(Block), lambda b: torch.randn(b, 10, 32)),
    }


def bench_torch2jax(name, module, make_input, batch, repeat):
    import jax
    import jax.numpy as jnp
    import torch

    import xconv

    x = make_input(batch)
    xj = jnp.asarray(x.numpy())
    with torch.no_grad():
        ref = module(x).numpy()
    fn, params = xconv.torch2jax(module, x)
    ours = jax.jit(fn)
    out = {"xconv_err": float(np.abs(np.asarray(ours(params, xj)) - ref).max())}
    runs = {"xconv_ms": lambda: jax.block_until_ready(ours(params, xj))}
    try:
        from torch2jax import t2j

        f = t2j(module)
        state = {k: t2j(v) for k, v in module.state_dict().items()}
        theirs = jax.jit(lambda sd, x: f(x, state_dict=sd))
        out["t2j_err"] = float(np.abs(np.asarray(theirs(state, xj)) - ref).max())
        runs["t2j_ms"] = lambda: jax.block_until_ready(theirs(state, xj))
    except Exception as e:  # the peer does not cover every torch op
        out["t2j_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    out.update(_interleaved(runs, repeat))
    return out


def _interleaved(runs, repeat, rounds=3):
    """Best of ``rounds`` medians per contender, rounds alternating (shared, noisy CPUs)."""
    best = {k: float("inf") for k in runs}
    for _ in range(rounds):
        for k, fn in runs.items():
            best[k] = min(best[k], 1e3 * median_seconds(fn, repeat=repeat))
    return best


def bench_jax2torch(repeat, batch=1):
    """jax2torch around the jitted xconv MLP, vs the jitted JAX function itself."""
    import jax
    import jax.numpy as jnp
    import torch

    import xconv
    from fixtures.torch_models import MLP, _build

    x = torch.randn(batch, 16)
    fn, params = xconv.torch2jax(_build(MLP), x)
    jax_fn = jax.jit(lambda x: fn(params, x))
    xj = jnp.asarray(x.numpy())
    wrapped = xconv.jax2torch(lambda x: fn(params, x))
    xg = x.clone().requires_grad_()
    vjp = jax.jit(lambda x: jax.vjp(lambda x: fn(params, x), x))
    apply = jax.jit(lambda f, g: f(g))
    ones = jnp.ones((batch, 8), jnp.float32)

    def jax_fwd_bwd():
        y, f = vjp(xj)
        jax.block_until_ready(apply(f, ones))

    def torch_fwd_bwd():
        xg.grad = None
        wrapped(xg).sum().backward()

    def torch_fwd():
        with torch.no_grad():
            wrapped(x)

    # Same numbers first.
    wrapped(xg).sum().backward()
    want = apply(vjp(xj)[1], ones)[0]
    err = float(np.abs(xg.grad.numpy() - np.asarray(want)).max())
    runs = {
        "jax_ms": lambda: jax.block_until_ready(jax_fn(xj)),
        "j2t_ms": torch_fwd,
        "jax_fb_ms": jax_fwd_bwd,
        "j2t_fb_ms": torch_fwd_bwd,
    }
    return {**_interleaved(runs, repeat), "grad_err": err}


def render(rows: list[dict], bridge: dict, run: str) -> str:
    lines = [
        "# Interop bridges",
        "",
        "Written by `benchmarks/bench_interop.py`; do not edit by hand.",
        "",
        f"- run: {run}",
        "- each time the best of three medians of `--repeat` calls, the contenders alternating",
        "",
        "**`xconv.torch2jax` (through the IR) vs PyPI `torch2jax` (`t2j`)**, both under "
        "`jax.jit`, same weights and inputs; xconv / t2j = time ratio (< 1: xconv faster); "
        "errors: max |Δ| against torch eager. The CNN and transformer block are built only from "
        "ops `t2j` implements.",
        "",
        "| model (batch) | xconv ms | t2j ms | xconv / t2j | xconv max err | t2j max err |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "t2j_ms" in r:
            theirs = (
                f"{r['t2j_ms']:.3f} | {r['xconv_ms'] / r['t2j_ms']:.2f} | {r['xconv_err']:.1e} "
                f"| {r['t2j_err']:.1e}"
            )
        else:
            theirs = f"— | — | {r['xconv_err']:.1e} | does not run: {r['t2j_error']}"
        lines.append(f"| {NAMES[r['model']]} ({r['batch']}) | {r['xconv_ms']:.3f} | {theirs} |")
    lines += [
        "",
        "**`xconv.jax2torch` call overhead**: the jitted xconv MLP (batch 1) called from torch "
        "vs called from JAX directly (forward + backward: against `jax.jit(jax.vjp)` and the "
        f"vjp); input-gradient max |Δ| {bridge['grad_err']:.1e}.",
        "",
        "| path | JAX ms | jax2torch ms | ratio |",
        "|---|---:|---:|---:|",
        f"| forward, `torch.no_grad()` | {bridge['jax_ms']:.3f} | {bridge['j2t_ms']:.3f} "
        f"| {bridge['j2t_ms'] / bridge['jax_ms']:.1f}× |",
        f"| forward + backward (vjp), input grad | {bridge['jax_fb_ms']:.3f} "
        f"| {bridge['j2t_fb_ms']:.3f} | {bridge['j2t_fb_ms'] / bridge['jax_fb_ms']:.1f}× |",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--peers", default=PEERS, help="folder with torch2jax (pip --target)")
    p.add_argument("--out", type=Path, default=OUT_MD)
    args = p.parse_args(argv)
    commit = _doc.commit_or_refuse("bench_interop", args.out, OUT_MD)
    if commit is None:
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if os.path.isdir(args.peers):
        sys.path.insert(0, args.peers)
    import jax
    import torch

    load = _doc.load()
    rows = []
    for name, (module, make_input) in _models().items():
        for batch in (1, 32):
            r = bench_torch2jax(name, module, make_input, batch, args.repeat)
            rows.append({"model": name, "batch": batch, **r})
            print(f"torch2jax {name} b={batch}: done", file=sys.stderr)
    bridge = bench_jax2torch(args.repeat)
    versions = f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}"
    try:
        from importlib.metadata import version

        versions += f", torch2jax {version('torch2jax')}"
    except Exception:  # noqa: BLE001 - not installed: its rows say it does not run
        pass
    _doc.write(args.out, render(rows, bridge, _doc.run_stamp(commit, load, versions)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

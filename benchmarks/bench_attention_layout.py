"""Attention and layout formulations of the JAX runtime and the generated Flax, side by side.

The issue-19 rows: a transformer (4 pre-LN ``nn.TransformerEncoderLayer``, d=256, 4 heads,
seq 128) and a ResNet-18-style CNN (widths / 4, 3x64x64), batch 1 and 32, fp32, CPU. Every
path runs under ``jax.jit`` in this one process; each is timed in interleaved rounds (the
median of a round's calls, then the median over rounds) so load drift hits all paths alike.
Ratios are to a hand-written Flax model of the same architecture (< 1 = faster).

"before" is ``xconv.converters.ops.formulation.use(attention="reference")`` (the step-by-step
ONNX Attention, and the older einsum helper in the generated Flax), "after" the default
``auto``. The CNN has no attention: its before/after pair shows the noise of the run, and its
to_jax vs hand-written ratio is the per-call overhead of the channels-first runtime. The
generated Flax is written once under each setting. PyPI ``torch2jax`` (t2j) is timed when
importable (``--t2j-path`` adds its folder to ``sys.path``).

    flock /tmp/heavy.lock python benchmarks/bench_attention_layout.py \\
        --t2j-path /path/to/torch2jax --out benchmarks/attention_layout.md
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._timing import median_seconds  # noqa: E402

SEQ, D_MODEL, HEADS, LAYERS = 128, 256, 4, 4
WIDTHS, IMAGE = (16, 32, 64, 128), 64


# ------------------------------------------------------------------ torch sources


def torch_transformer():
    import torch
    from torch import nn

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            layer = nn.TransformerEncoderLayer(
                D_MODEL, HEADS, 4 * D_MODEL, dropout=0.0, batch_first=True, norm_first=True
            )
            self.enc = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)

        def forward(self, x):
            return self.enc(x)

    torch.manual_seed(0)
    return Encoder().eval()


def torch_cnn():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            return torch.relu(y + (x if self.down is None else self.down(x)))

    class ResNet18q(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(
                nn.Conv2d(3, WIDTHS[0], 7, 2, 3, bias=False),
                nn.BatchNorm2d(WIDTHS[0]),
                nn.ReLU(),
                nn.MaxPool2d(3, 2, 1),
            )
            blocks, cin = [], WIDTHS[0]
            for i, w in enumerate(WIDTHS):
                blocks += [Block(cin, w, 1 if i == 0 else 2), Block(w, w, 1)]
                cin = w
            self.blocks = nn.Sequential(*blocks)
            self.fc = nn.Linear(WIDTHS[-1], 10)

        def forward(self, x):
            x = self.blocks(self.stem(x))
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    torch.manual_seed(0)
    return ResNet18q().eval()


# ------------------------------------------------------------------ hand-written Flax


def flax_transformer():
    import flax.linen as nn
    import jax

    class Encoder(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(LAYERS):
                h = nn.LayerNorm(epsilon=1e-5)(x)
                x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D_MODEL)(h)
                h = nn.LayerNorm(epsilon=1e-5)(x)
                x = x + nn.Dense(D_MODEL)(jax.nn.relu(nn.Dense(4 * D_MODEL)(h)))
            return x

    return Encoder()


def flax_cnn():
    import flax.linen as nn
    import jax

    def bn():
        return nn.BatchNorm(use_running_average=True, epsilon=1e-5)

    class Block(nn.Module):
        cout: int
        stride: int

        @nn.compact
        def __call__(self, x):
            s = (self.stride, self.stride)
            y = jax.nn.relu(bn()(nn.Conv(self.cout, (3, 3), s, padding=1, use_bias=False)(x)))
            y = bn()(nn.Conv(self.cout, (3, 3), padding=1, use_bias=False)(y))
            if self.stride != 1 or x.shape[-1] != self.cout:
                x = bn()(nn.Conv(self.cout, (1, 1), s, use_bias=False)(x))
            return jax.nn.relu(y + x)

    class ResNet18q(nn.Module):
        @nn.compact
        def __call__(self, x):  # NCHW in, as the source
            x = x.transpose(0, 2, 3, 1)
            x = nn.Conv(WIDTHS[0], (7, 7), (2, 2), padding=3, use_bias=False)(x)
            x = jax.nn.relu(bn()(x))
            x = nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
            for i, w in enumerate(WIDTHS):
                x = Block(w, 1 if i == 0 else 2)(x)
                x = Block(w, 1)(x)
            return nn.Dense(10)(x.mean(axis=(1, 2)))

    return ResNet18q()


# ------------------------------------------------------------------ paths


def _load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_paths(row: str, batch: int, tmp: Path, t2j_ok: bool) -> tuple[dict, np.ndarray]:
    """{path name: zero-argument callable that blocks until its result is ready}."""
    import jax
    import jax.numpy as jnp
    import torch

    import xconv
    from xconv.converters.ops import formulation

    module = torch_transformer() if row == "transformer" else torch_cnn()
    shape = (batch, SEQ, D_MODEL) if row == "transformer" else (batch, 3, IMAGE, IMAGE)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = module(x).numpy()
    xj = jnp.asarray(x.numpy())
    paths, errs = {}, {}

    hand = flax_transformer() if row == "transformer" else flax_cnn()
    hv = hand.init(jax.random.PRNGKey(0), xj)
    hf = jax.jit(hand.apply)
    paths["hand-written Flax"] = lambda: jax.block_until_ready(hf(hv, xj))

    if t2j_ok:
        from torch2jax import t2j

        f = t2j(module)
        sd = {k: t2j(v) for k, v in module.state_dict().items()}
        tf = jax.jit(lambda sd, x: f(x, state_dict=sd))
        try:
            errs["t2j"] = float(np.max(np.abs(np.asarray(tf(sd, xj)) - ref)))
            paths["PyPI torch2jax (t2j)"] = lambda: jax.block_until_ready(tf(sd, xj))
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this model
            print(f"t2j fails on {row}: {type(e).__name__}: {e}", file=sys.stderr)

    model = xconv.from_torch(module, (x,))
    settings = {"before": {"attention": "reference"}, "after": {}}
    for tag, choice in settings.items():
        with formulation.use(**choice):
            fn, params = xconv.to_jax(model)
            jf = jax.jit(fn)
            errs[f"to_jax {tag}"] = float(np.max(np.abs(np.asarray(jf(params, xj)[0]) - ref)))
            out = xconv.to_flax(model, tmp / f"{row}{batch}_{tag}")
        gen = _load_module(out / "model.py", f"gen_{row}{batch}_{tag}")
        gm, gv = gen.load(out)
        gf = jax.jit(gm.apply)
        errs[f"generated Flax {tag}"] = float(np.max(np.abs(np.asarray(gf(gv, xj)) - ref)))
        paths[f"xconv to_jax, {tag}"] = lambda jf=jf, p=params: jax.block_until_ready(jf(p, xj))
        paths[f"xconv generated Flax, {tag}"] = lambda gf=gf, gv=gv: jax.block_until_ready(
            gf(gv, xj)
        )
    return paths, errs


def measure(paths: dict, rounds: int, repeat: int) -> dict[str, float]:
    per: dict[str, list[float]] = {k: [] for k in paths}
    for fn in paths.values():
        fn()  # compile
    for _ in range(rounds):
        for name, fn in paths.items():
            per[name].append(median_seconds(fn, warmup=1, repeat=repeat, min_time=0.05))
    return {k: statistics.median(v) for k, v in per.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--rows", default="transformer,cnn")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--t2j-path", help="a folder holding PyPI torch2jax (pip install --target)")
    p.add_argument("--out", type=Path, help="write the markdown table here")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.t2j_path:
        sys.path.insert(0, args.t2j_path)
    t2j_ok = importlib.util.find_spec("torch2jax") is not None
    import jax

    load_before = os.getloadavg()
    start = time.perf_counter()
    tables = []
    with tempfile.TemporaryDirectory() as tmp:
        for row in args.rows.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                paths, errs = build_paths(row, batch, Path(tmp), t2j_ok)
                times = measure(paths, args.rounds, args.repeat)
                tables.append((row, batch, times, errs))
                base = times["hand-written Flax"]
                for name, t in times.items():
                    print(f"{row:11} b={batch:<3} {name:32} {t * 1e3:9.3f} ms  x{t / base:.2f}")
    load_after = os.getloadavg()
    lines = [
        "# Attention and layout formulations: before / after",
        "",
        "Written by `benchmarks/bench_attention_layout.py` (one process, jax "
        f"{jax.__version__}, backend `{jax.default_backend()}`, fp32). Load average "
        f"{load_before[0]:.1f} / {load_before[1]:.1f} / {load_before[2]:.1f} at the start, "
        f"{load_after[0]:.1f} / {load_after[1]:.1f} / {load_after[2]:.1f} at the end (1/5/15 "
        f"min), {time.perf_counter() - start:.0f} s. Each time is the median over "
        f"{args.rounds} interleaved rounds of a round's median call; ratio to the hand-written "
        'Flax model (< 1 = faster). "before": `formulation.use(attention="reference")`, '
        '"after": the default. max |err| is against torch eager.',
        "",
    ]
    for row, batch, times, errs in tables:
        base = times["hand-written Flax"]
        lines += [
            f"## {row}, batch {batch}",
            "",
            "| path | ms / call | vs hand-written | after / before | max abs err |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, t in times.items():
            change = ""
            if name.endswith(", after"):
                change = f"x{t / times[name.replace(', after', ', before')]:.2f}"
            key = {"PyPI torch2jax (t2j)": "t2j"}.get(
                name, name.replace("xconv ", "").replace(",", "")
            )
            err = errs.get(key)
            lines.append(
                f"| {name} | {t * 1e3:.3f} | x{t / base:.2f} | {change} | "
                f"{'' if err is None else f'{err:.1e}'} |"
            )
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()

"""How close bfloat16 conversions come to the bf16 parity bound (docs/design.md numbers).

    python benchmarks/bf16_margin.py [make_resnet make_transformer ...]

For each ``fixtures/torch_models.py`` model: convert with ``to_jax(dtype="bfloat16")`` and
``to_flax(dtype="bfloat16")`` (linen), check parity against the torch model under
``bf16_policy`` on every input set, and print the worst ``err / bound`` over all outputs and
input sets (``> 1`` fails), also in units of ``2^-8 * sqrt(L)``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fixtures"))

MODELS = (
    "make_resnet",
    "make_transformer",
    "make_conv_zoo",
    "make_norm_zoo",
    "make_mlp",
    "make_seq_model",
    "make_mha_weights",
)


def main(names: list[str]) -> None:
    import torch_models

    import xconv
    from xconv.converters.ops.precision import rounding_depth
    from xconv.parity.checker import check_parity
    from xconv.parity.policies import BF16_FACTOR, bf16_policy
    from xconv.pipeline import _load_generated

    print("| model | L | to_jax err/bound | linen err/bound | linen in u*sqrt(L) |")
    print("|---|---:|---:|---:|---:|")
    for name in names:
        module, x = getattr(torch_models, name)()
        x = x if isinstance(x, tuple) else (x,)
        irm = xconv.from_torch(module, x)
        depth = rounding_depth(irm)
        policy = bf16_policy(depth)
        fn, params = xconv.to_jax(irm, dtype="bfloat16")
        out = xconv.to_flax(irm, Path(tempfile.mkdtemp()) / "m", dtype="bfloat16")
        linen = _load_generated(out / "model.py").load(out)
        worst = []
        for candidate in ((fn, params), linen):
            r = check_parity(module, candidate, x, policy=policy, intermediates=False)
            rows = [row for row in r.matrix if row.role == "candidate"]
            worst.append(max(o.excess or 0.0 for row in rows for o in row.outputs))
        print(
            f"| {name} | {depth} | {worst[0]:.3f} | {worst[1]:.3f} | {worst[1] * BF16_FACTOR:.2f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:] or list(MODELS))

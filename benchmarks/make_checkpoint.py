"""Write a random Llama-shape checkpoint of a given size: sharded safetensors + index + config.

    python benchmarks/make_checkpoint.py --params 7e9 --dtype bfloat16 --shard-size 2GB -o DIR

The shape follows the Llama family for the size asked: a standard size (7e9, 13e9, 70e9, within
5 %) gets that Llama-2 model's shape exactly (7e9: 32 layers of hidden 4096, MLP 11008, 32
heads, vocab 32000 = 6.74 B parameters); any other size gets the hidden size, MLP width, heads
and vocab of the nearest family shape and the most layers that stay within the budget. Memory stays bounded:
each shard's header is written first and its tensors are generated and written one at a time.
Values are random and small (|w| in [2^-7, 2^-5) for matrices, [1, 1 + 2^-5) for norm scales), so
the model runs a finite forward pass; they are drawn as bits, which is fast enough for 7 B.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xconv.weights.shards import ShardWriter, numpy_dtype, write_index  # noqa: E402

#: (hidden, intermediate, heads, kv heads, vocab): Llama-family shapes, small to large.
SHAPES = (
    (64, 172, 4, 2, 256),
    (256, 688, 4, 2, 1024),
    (512, 1376, 8, 4, 8000),
    (1024, 2816, 16, 8, 32000),
    (2048, 5632, 32, 8, 32000),
    (4096, 11008, 32, 32, 32000),
    (8192, 28672, 64, 8, 32000),
)


#: Llama-2's sizes: {nominal parameters: ((hidden, intermediate, heads, kv heads, vocab), layers)}.
STANDARD = {
    7e9: ((4096, 11008, 32, 32, 32000), 32),
    13e9: ((5120, 13824, 40, 40, 32000), 40),
    70e9: ((8192, 28672, 64, 8, 32000), 80),
}


def llama_config(params: float, dtype: str, layers: int | None = None) -> dict:
    """A LlamaConfig dict: a standard size's own shape, else at most ``params`` parameters."""
    standard = [v for size, v in STANDARD.items() if abs(params / size - 1) <= 0.05]
    if standard:
        (h, f, heads, kv, vocab), n = standard[0]
    else:
        # The widest shape that still gets Llama's depth (about hidden / 128 layers).
        best = SHAPES[0]
        for shape in SHAPES:
            h, f, heads, kv, vocab = shape
            if (params - 2 * vocab * h) / _layer_params(h, f, heads, kv) >= h / 128:
                best = shape
        h, f, heads, kv, vocab = best
        n = max(1, int((params - 2 * vocab * h - h) // _layer_params(h, f, heads, kv)))
    n = layers or n
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": f,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_hidden_layers": n,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": dtype,
    }


def _layer_params(h: int, f: int, heads: int, kv: int) -> int:
    d = h // heads
    return h * h * 2 + 2 * h * kv * d + 3 * h * f + 2 * h


def tensor_specs(cfg: dict, dtype: np.dtype) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """The state_dict of ``LlamaForCausalLM(cfg)``: names and shapes in the HF order."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    specs = [("model.embed_tokens.weight", (v, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (f, h)),
            (p + "mlp.up_proj.weight", (f, h)),
            (p + "mlp.down_proj.weight", (h, f)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    specs += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return [(n, s, dtype) for n, s in specs]


def random_tensor(rng: np.random.Generator, name: str, shape, dtype: np.dtype) -> np.ndarray:
    """Small random values built from random bits: sign, exponent in [-7, -6], mantissa."""
    size = int(np.prod(shape))
    norm = name.endswith("norm.weight")
    if dtype.itemsize == 2 and dtype.name == "bfloat16":
        bits = rng.integers(0, 1 << 16, size, dtype=np.uint16)
        # norm scales: 1 + k/128 (k < 4); others: sign, exponent 2^-7 or 2^-6, mantissa
        keep = (bits & 0x0003) | (127 << 7)
        small = (bits & 0x807F) | ((120 + ((bits >> 7) & 1)) << 7)
        out = keep if norm else small
        return out.astype(np.uint16).view(dtype).reshape(shape)
    values = rng.standard_normal(size, dtype=np.float32) * np.float32(0.02)
    if norm:
        values = 1 + values
    return values.astype(dtype).reshape(shape)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.eE+]+)\s*([KMGT]?i?B?)\s*", text)
    if not m:
        raise SystemExit(f"bad size {text!r}; e.g. 2GB, 500MB, 1e9")
    unit = m.group(2).upper().rstrip("B").rstrip("I")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[unit]
    if "I" in m.group(2).upper():
        scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def make_checkpoint(
    out: Path,
    params: float,
    *,
    dtype: str = "bfloat16",
    shard_size: int = 2_000_000_000,
    layers: int | None = None,
    seed: int = 0,
) -> dict:
    """Write the checkpoint into ``out``; returns the config dict."""
    out.mkdir(parents=True, exist_ok=True)
    dt = numpy_dtype(dtype)
    cfg = llama_config(params, dtype, layers)
    specs = tensor_specs(cfg, dt)
    groups: list[list] = [[]]
    size = 0
    for spec in specs:
        n = int(np.prod(spec[1])) * dt.itemsize
        if groups[-1] and size + n > shard_size:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += n
    rng = np.random.default_rng(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for k, group in enumerate(groups, start=1):
        name = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        writer = ShardWriter(out / name, group, metadata={"format": "pt"})
        try:
            for tname, shape, tdt in group:
                writer.write(tname, random_tensor(rng, tname, shape, tdt))
                weight_map[tname] = name
        except BaseException:
            writer.abort()
            raise
        writer.close()
        total += writer.nbytes
    write_index(out / "model.safetensors.index.json", weight_map, total)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return cfg


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--params",
        type=float,
        required=True,
        help="Parameter count: 7e9, 13e9 and 70e9 (within 5 %%) give that Llama-2 "
        "model's shape (7e9: 32 layers, 6.74 B); other counts the nearest family shape with "
        "the most layers within the count.",
    )
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--shard-size", default="2GB", help="Largest shard (2GB, 500MB).")
    ap.add_argument("--layers", type=int, default=None, help="Override the layer count.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--out", type=Path, required=True)
    a = ap.parse_args(argv)
    cfg = make_checkpoint(
        a.out, a.params, dtype=a.dtype, shard_size=parse_size(a.shard_size), layers=a.layers,
        seed=a.seed,
    )  # fmt: skip
    n = sum(int(np.prod(s)) for _, s, _ in tensor_specs(cfg, numpy_dtype(a.dtype)))
    print(f"wrote {a.out}: {n:,} parameters, {cfg['num_hidden_layers']} layers")


if __name__ == "__main__":
    main()

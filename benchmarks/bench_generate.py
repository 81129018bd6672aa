"""Generation speed of a converted causal LM against torch and the hand-written Flax model.

One script, side by side on this machine: for each model row (random weights, built from a
config, saved with ``save_pretrained``) and batch size, a 128-token prompt and 128 new greedy
tokens, through

* **torch eager**: transformers' ``generate`` with its cache (the installed release);
* **transformers 4.46 Flax**: ``FlaxGPT2LMHeadModel`` / ``FlaxLlamaForCausalLM`` (the last
  release with Flax LMs, installed beside with ``pip install --target``; ``--transformers4``),
  loaded from the same folder (``from_pt=True``), its ``generate`` under ``jax.jit``;
* **xconv Flax**: ``xconv torch-to-flax FOLDER --generate``'s model.py, its ``generate``;
* **xconv JAX**: ``xconv torch-to-jax FOLDER --generate``'s model.py (the runtime's
  ``fn, params``), its ``generate``.

Each engine runs in its own process (its peak RSS is its own). Time to first token is a
``max_new_tokens=1`` call (prefill and one pick); tokens/s counts the other 127 tokens of
every row: ``batch * 127 / (t(128) - t(1))``. JAX programs are compiled before timing
(one untimed call per shape); the conversion's own time is reported beside.
``tokens = torch`` says whether the engine's greedy tokens equal torch eager's.

    python benchmarks/bench_generate.py --rows gpt2,llama --transformers4 DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OUT_MD = ROOT / "benchmarks" / "generate.md"
PROMPT, NEW = 128, 128
ENGINES = ("torch eager", "transformers 4.46 Flax", "xconv Flax", "xconv JAX")
#: Each xconv engine's CLI target.
TARGETS = {"xconv Flax": "flax", "xconv JAX": "jax"}
ROWS = {"gpt2": "GPT-2 124M", "llama": "Llama-shape 0.8B"}


def _build(row: str, folder: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    if row == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    else:
        config = transformers.LlamaConfig(
            hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
            tie_word_embeddings=True, max_position_embeddings=2048,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    model.eval().save_pretrained(folder)


def _prompt(batch: int, vocab: int):
    import numpy as np

    return np.random.default_rng(batch).integers(3, vocab, (batch, PROMPT), dtype=np.int64)


def _timed(fn, n: int) -> float:
    fn(n)  # compile / warm up at this shape
    start = time.perf_counter()
    fn(n)
    return time.perf_counter() - start


def _worker(engine: str, folder: Path, xconv_dir: Path, batch: int) -> dict:
    import numpy as np

    config = json.loads((folder / "config.json").read_text())
    ids = _prompt(batch, config["vocab_size"])
    if engine == "torch eager":
        import torch
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        prompt = torch.from_numpy(ids)

        def run(n):
            with torch.no_grad():
                return model.generate(prompt, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, eos_token_id=None,
                                      pad_token_id=0).numpy()  # fmt: skip

    elif engine in TARGETS:
        import importlib.util

        xconv_dir = xconv_dir / TARGETS[engine]
        spec = importlib.util.spec_from_file_location("generated", xconv_dir / "model.py")
        generated = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(generated)
        module, variables = generated.load(xconv_dir)

        def run(n):
            out = generated.generate(module, variables, ids, n, eos_token_id=None)
            return np.asarray(out)

    else:
        import jax
        import transformers

        cls = {"gpt2": transformers.FlaxGPT2LMHeadModel,
               "llama": transformers.FlaxLlamaForCausalLM}[config["model_type"]]  # fmt: skip
        model = cls.from_pretrained(folder, from_pt=True)
        compiled = {}

        def run(n):
            if n not in compiled:
                compiled[n] = jax.jit(
                    lambda x, params, n=n: model.generate(
                        x, params=params, max_new_tokens=n, do_sample=False, pad_token_id=0,
                        eos_token_id=None,
                    ).sequences
                )  # fmt: skip
            return np.asarray(compiled[n](ids, model.params))

    first = _timed(run, 1)
    full = _timed(run, NEW)
    tokens = run(NEW)
    from benchmarks._memory import rss_kib

    return {
        "ttft_s": first,
        "tokens_per_s": batch * (NEW - 1) / max(full - first, 1e-9),
        "peak_gib": rss_kib("VmHWM") / 2**20,
        "tokens": tokens[:, PROMPT:].tolist(),
    }


def _run_worker(engine: str, folder: Path, xconv_dir: Path, batch: int, tf4: str | None) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if engine.startswith("transformers 4.46"):
        if not tf4:
            return {"error": "transformers 4.46 not installed (--transformers4 DIR)"}
        env["PYTHONPATH"] = os.pathsep.join([tf4, str(ROOT)])
    cmd = [sys.executable, __file__, "--worker", engine, "--folder", str(folder),
           "--xconv-dir", str(xconv_dir), "--batch", str(batch)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _versions(tf4: str | None) -> str:
    import jax
    import torch
    import transformers

    return (f"torch {torch.__version__}, jax {jax.__version__}, transformers "
            f"{transformers.__version__}" + (", transformers 4.46.3 (Flax)" if tf4 else ""))  # fmt: skip


def render(rows: list[dict], stamp: str) -> str:
    lines = [
        "# Generation speed",
        "",
        f"Written by `benchmarks/bench_generate.py` ({stamp}).",
        "",
        f"Prompt {PROMPT} tokens, {NEW} new greedy tokens; random weights. Tokens/s over the "
        f"{NEW - 1} tokens after the first, summed over the batch; TTFT is a one-token "
        "`generate` (prefill and one pick), compiled programs warm. Peak is each engine's "
        "process. `vs Flax` is xconv's tokens/s over the hand-written Flax model's.",
        "xconv JAX runs the converted function through xconv's runtime (`to_jax`), the "
        "`torch-to-jax --generate` output.",
        "",
        "| model | batch | engine | TTFT s | tokens/s | vs Flax | tokens = torch | peak GiB |",
        "|---|---:|---|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['engine']} | — | — | — | "
                         f"{r['error']} | — |")  # fmt: skip
            continue
        ratio = r.get("vs_flax")
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['engine']} | {r['ttft_s']:.3f} | "
            f"{r['tokens_per_s']:.1f} | {'' if ratio is None else f'{ratio:.2f}x'} | "
            f"{r['equal']} | {r['peak_gib']:.2f} |"
        )
    conversions = sorted({(r["model"], TARGETS[r["engine"]], r["convert_s"])
                          for r in rows if "convert_s" in r})  # fmt: skip
    lines += ["", "Conversion (`xconv torch-to-TARGET FOLDER --generate --no-check`): " + ", ".join(
        f"{m} to {t} {s:.0f} s" for m, t, s in conversions) + "."]  # fmt: skip
    lines += ["", "torch.compile and torchax rows are not run here: not measured, not claimed."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="gpt2,llama")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--work", default="/tmp/xconv_bench_generate")
    p.add_argument("--transformers4", default=os.environ.get("XCONV_TRANSFORMERS4"))
    p.add_argument("--out", type=Path, default=OUT_MD)
    p.add_argument("--worker")
    p.add_argument("--folder", type=Path)
    p.add_argument("--xconv-dir", type=Path)
    p.add_argument("--batch", type=int)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, args.folder, args.xconv_dir, args.batch)))
        return
    from benchmarks import _doc

    commit = _doc.commit_or_refuse("bench_generate", args.out, OUT_MD)
    if commit is None:
        sys.exit(2)
    load_before = _doc.load()
    work = Path(args.work)
    rows = []
    for row in args.rows.split(","):
        folder, xconv_dir = work / row / "hf", work / row / "xconv"
        if not (folder / "config.json").exists():
            _build(row, folder)
        convert_s = {}
        for engine, target in TARGETS.items():
            start = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "xconv.cli", f"torch-to-{target}", str(folder), "-o",
                 str(xconv_dir / target), "--generate", "--no-check"], check=True,
                env=dict(os.environ, HF_HUB_OFFLINE="1"), stdout=subprocess.DEVNULL,
            )  # fmt: skip
            convert_s[engine] = time.perf_counter() - start
        for batch in (int(b) for b in args.batches.split(",")):
            results = {e: _run_worker(e, folder, xconv_dir, batch, args.transformers4)
                       for e in ENGINES}  # fmt: skip
            reference = results["torch eager"].get("tokens")
            flax = results["transformers 4.46 Flax"].get("tokens_per_s")
            for engine, result in results.items():
                entry = {"model": ROWS[row], "batch": batch, "engine": engine, **result}
                if "tokens" in result:
                    entry["equal"] = "yes" if result["tokens"] == reference else "no"
                if engine in TARGETS:
                    entry["convert_s"] = convert_s[engine]
                    if flax and "tokens_per_s" in result:
                        entry["vs_flax"] = result["tokens_per_s"] / flax
                rows.append(entry)
                print(json.dumps({k: v for k, v in entry.items() if k != "tokens"}), flush=True)
    _doc.write(
        args.out, render(rows, _doc.run_stamp(commit, load_before, _versions(args.transformers4)))
    )


if __name__ == "__main__":
    main()

"""Real-size models through xconv: time and peak memory, side by side with torch.onnx.export.

For each row a model is built from a transformers 5 config with random weights (offline),
exported with ``torch.export`` and saved as ``.pt2``. Then, each in its own child process
(peak RSS from ``resource.getrusage(RUSAGE_CHILDREN)`` of that child alone, wall time around
it):

* ``torch.onnx.export`` of the loaded program (``dynamo=True, optimize=False``, the
  exporter xconv itself uses), the baseline;
* each xconv command as a user types it (``xconv torch-to-onnx|torch-to-flax model.pt2``),
  conversion alone (``--no-check``) and with its parity check; the parity policy and verdict
  come from the written ``parity.json``.

Rows are functions in :data:`ROWS` (name -> builder returning ``(module, example_args)``);
further rows (e.g. checkpoints streamed from disk) append to it. The table goes to
``benchmarks/scale.md``; the machine's load average is printed with it, since every number
is a wall time on a shared machine.

    python benchmarks/bench_scale.py [--rows gpt2,bert] [--work DIR] [--out benchmarks/scale.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._memory import run_measured  # noqa: E402

# ------------------------------------------------------------------------------- models


def _lm(model):
    """Wrap a transformers LM so the exported program returns the logits tensor only."""
    import torch

    class LM(torch.nn.Module):
        def __init__(self, inner) -> None:
            super().__init__()
            self.model = inner

        def forward(self, input_ids):
            return self.model(input_ids=input_ids, use_cache=False).logits

    return LM(model)


def gpt2_tiny():
    """Two layers x 64: the smoke test of this script (not a default row)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500))
    return _lm(model), (torch.randint(0, 500, (1, 16)),)


def gpt2():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config())
    return _lm(model), (torch.randint(0, 50257, (1, 128)),)


def bert_base():
    import torch
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(), add_pooling_layer=False)

    class Bert(torch.nn.Module):
        def __init__(self, inner) -> None:
            super().__init__()
            self.model = inner

        def forward(self, input_ids):
            return self.model(input_ids=input_ids).last_hidden_state

    return Bert(model), (torch.randint(0, 30522, (1, 128)),)


def vit_b16():
    import torch
    from transformers import ViTConfig, ViTForImageClassification

    model = ViTForImageClassification(ViTConfig(num_labels=1000))

    class ViT(torch.nn.Module):
        def __init__(self, inner) -> None:
            super().__init__()
            self.model = inner

        def forward(self, pixel_values):
            return self.model(pixel_values=pixel_values).logits

    return ViT(model), (torch.randn(1, 3, 224, 224),)


def resnet50():
    import torch
    from transformers import ResNetConfig, ResNetForImageClassification

    model = ResNetForImageClassification(ResNetConfig(num_labels=1000))

    class ResNet(torch.nn.Module):
        def __init__(self, inner) -> None:
            super().__init__()
            self.model = inner

        def forward(self, pixel_values):
            return self.model(pixel_values=pixel_values).logits

    return ResNet(model), (torch.randn(1, 3, 224, 224),)


def llama_08b():
    """Llama shape, 0.8 B: 16 layers x 2048, GQA 32/8 heads, vocab 32k, tied embeddings."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
    )
    return _lm(LlamaForCausalLM(config)), (torch.randint(0, 32000, (1, 128)),)


#: name -> builder; rows run in this order.
ROWS: dict[str, Callable[[], tuple]] = {
    "GPT-2 124M": gpt2,
    "BERT-base": bert_base,
    "ViT-B/16": vit_b16,
    "ResNet-50": resnet50,
    "Llama-shape 0.8B": llama_08b,
    "GPT-2 tiny": gpt2_tiny,
}
KEYS = {
    "gpt2": "GPT-2 124M",
    "bert": "BERT-base",
    "vit": "ViT-B/16",
    "resnet": "ResNet-50",
    "llama": "Llama-shape 0.8B",
}
#: Not run by default.
EXTRA_KEYS = {"tiny": "GPT-2 tiny"}

#: xconv commands measured per row: (label, argv after ``xconv``; {pt2} and {out} filled in).
COMMANDS = [
    ("torch-to-flax + parity", ["torch-to-flax", "{pt2}", "-o", "{out}"]),
    ("torch-to-flax", ["torch-to-flax", "{pt2}", "-o", "{out}", "--no-check"]),
]


# ------------------------------------------------------------------------- child runs


@dataclass
class Run:
    seconds: float
    peak_gib: float
    rc: int
    extra: dict = field(default_factory=dict)
    tail: str = ""


#: Folders put before the repository on every child's ``PYTHONPATH`` (``--transformers``:
#: another transformers release installed with ``pip install --no-deps --target DIR``).
PATH_FIRST: list[str] = []


def _child(argv: list[str], cwd: Path) -> Run:
    """Run ``argv`` in a fresh process; its wall time and its own peak RSS."""
    path = os.pathsep.join([*PATH_FIRST, str(ROOT)])
    env = dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1", TERM="dumb")
    run = run_measured(argv, env=env, cwd=cwd)
    return Run(
        run.seconds, run.peak_gib, run.returncode, tail=run.stdout[-4000:] + run.stderr[-4000:]
    )


_MAKE = """
import json, sys, time, torch
sys.path.append({root!r})
from benchmarks.bench_scale import ROWS
torch.manual_seed(0)
module, args = ROWS[{name!r}]()
module.eval()
params = sum(p.numel() for p in module.parameters())
t = time.perf_counter()
program = torch.export.export(module, args, strict=False)
torch.export.save(program, {pt2!r})
import importlib.metadata as md, transformers
versions = {{"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0],
            "jax": md.version("jax")}}
print(json.dumps({{"params": params, "export_s": time.perf_counter() - t, "versions": versions}}))
"""

_ONNX = """
import json, sys, time, contextlib, io, logging, torch
program = torch.export.load({pt2!r})
t = time.perf_counter()
logging.disable(logging.WARNING)
with contextlib.redirect_stdout(io.StringIO()):
    torch.onnx.export(program, (), dynamo=True, optimize=False, opset_version=23)
print(json.dumps({{"export_s": time.perf_counter() - t}}))
"""


def measure(name: str, work: Path, commands=COMMANDS) -> dict:
    pt2 = work / "model.pt2"
    made = _child([sys.executable, "-c", _MAKE.format(root=str(ROOT), name=name, pt2=str(pt2))],
                  work)  # fmt: skip
    if made.rc != 0:
        raise RuntimeError(f"{name}: building the model failed:\n{made.tail}")
    info = json.loads(made.tail.strip().splitlines()[0])
    row: dict = {"model": name, "params": info["params"], "pt2_bytes": pt2.stat().st_size,
                 "versions": info["versions"]}  # fmt: skip
    onnx = _child([sys.executable, "-c", _ONNX.format(pt2=str(pt2))], work)
    row["onnx"] = {
        "s": onnx.seconds,
        "call_s": json.loads(onnx.tail.strip().splitlines()[0])["export_s"] if onnx.rc == 0
        else None,
        "peak_gib": onnx.peak_gib,
        "rc": onnx.rc,
    }  # fmt: skip
    xconv = [sys.executable, "-m", "xconv.cli"]
    for label, argv in commands:
        out = work / "out"
        shutil.rmtree(out, ignore_errors=True)
        run = _child([*xconv, *(a.format(pt2=pt2, out=out) for a in argv)], work)
        entry = {"s": run.seconds, "peak_gib": run.peak_gib, "rc": run.rc}
        parity = out / "parity.json"
        if parity.is_file():
            report = json.loads(parity.read_text())
            entry["policy"] = report.get("policy", "?").split(" ")[0]
            entry["passed"] = report.get("passed")
            entry["blocks"] = len(report.get("scopes") or [])
        spent = re.search(r"seconds: ([^\n]*)", run.tail)
        if spent:
            entry["stages"] = spent.group(1).strip()
        if run.rc != 0:
            entry["error"] = run.tail.strip().splitlines()[-1][:200] if run.tail.strip() else "?"
        row[label] = entry
        shutil.rmtree(out, ignore_errors=True)
    return row


# ------------------------------------------------------------------------------- table


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def render(rows: list[dict], notes: list[str]) -> str:
    labels = [label for label, _ in COMMANDS]
    head = ["model", "params", ".pt2 GiB", "torch.onnx.export s / peak GiB"]
    head += [f"xconv {label} s / peak GiB" for label in labels]
    head += ["conversion / export", "peak budget GiB", "parity", "transformers / torch / jax"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "legacy" in r:  # measured before rows recorded their versions: kept as written
            lines.append(r["legacy"].rstrip().rstrip("|").rstrip() + " | not recorded |")
            continue
        cells = [r["model"], f"{r['params'] / 1e6:.0f} M", _gib(r["pt2_bytes"])]
        o = r["onnx"]
        cells.append(f"{o['s']:.1f} / {o['peak_gib']:.2f}" if o["rc"] == 0 else "failed")
        for label in labels:
            e = r.get(label)
            if e is None:
                cells.append("-")
            elif e["rc"] != 0 and "passed" not in e:
                cells.append(f"exit {e['rc']}: {e.get('error', '')}")
            else:
                cells.append(f"{e['s']:.1f} / {e['peak_gib']:.2f}" + (
                    f" (exit {e['rc']})" if e["rc"] else ""))  # fmt: skip
        conv = r.get("torch-to-flax")
        cells.append(f"{conv['s'] / o['s']:.2f}x" if conv and o["rc"] == 0 else "-")
        cells.append(f"{2 * r['pt2_bytes'] / 2**30 + 1.5:.2f}")
        p = r.get("torch-to-flax + parity", {})
        if "passed" in p:
            verdict = "passed" if p["passed"] else "FAILED"
            blocks = f", {p['blocks']} blocks" if p.get("blocks") else ""
            cells.append(f"{verdict} ({p['policy']}{blocks})")
        else:
            cells.append("-")
        v = r.get("versions") or {}
        cells.append(" / ".join(v.get(k, "?") for k in ("transformers", "torch", "jax")))
        lines.append("| " + " | ".join(cells) + " |")
    stages = []
    for r in rows:
        if "legacy" in r:
            stages.extend([r["legacy_stages"]] if r.get("legacy_stages") else [])
            continue
        conv = r.get("torch-to-flax", {}).get("stages")
        checked = r.get("torch-to-flax + parity", {}).get("stages")
        if conv or checked:
            o = r["onnx"]
            base = f"torch.onnx.export call {o['call_s']:.1f} of {o['s']:.1f}; " if o.get(
                "call_s") else ""  # fmt: skip
            tf = (r.get("versions") or {}).get("transformers", "?")
            stages.append(
                f"- {r['model']} (transformers {tf}): {base}`--no-check`: {conv or '-'}; "
                f"with parity: {checked or '-'}"
            )
    if stages:
        stages = [
            "Where the time goes (seconds per stage inside each xconv process: `load` =",
            "`torch.export.load`, `import` = torch.onnx's translation + xconv's annotation,",
            "`emit` = Flax source and `variables.msgpack`, `model.onnx` = the IR file with its",
            "weights in `model.onnx.data`, `parity` = the check; the rest of a process's wall",
            "time is Python start, imports and exit). The baseline does not write a file; xconv",
            "writes the weights twice (`variables.msgpack`, `model.onnx.data`):",
            "",
            *stages,
            "",
        ]
    return "\n".join([*_preamble(), "", *lines, "", *stages, *notes, ""])


def _preamble() -> list[str]:
    return [
        "# Real-size models: time and peak memory",
        "",
        "Written by `python benchmarks/bench_scale.py` (do not edit by hand). Random weights",
        "from transformers 5 configs, exported with `torch.export` to `.pt2`, batch 1 (128",
        "tokens / 224x224 images). Each number is one child process: wall seconds from start",
        "to exit (Python start, imports and loading the `.pt2` included, for both sides) and",
        "its peak RSS. `conversion / export` is `xconv torch-to-flax --no-check` over",
        "`torch.onnx.export` (the target: <= 2x). The peak budget is the issue's bound for the",
        "whole command with parity: 2 x the model's bytes + 1.5 GiB. Each row names the",
        "transformers, torch and jax releases it ran on (export and conversion under the same",
        "ones; `--transformers DIR` runs another transformers release); rows are kept per",
        "(model, transformers release) in `benchmarks/scale.json`, each run replacing its own.",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(KEYS), help=f"comma list of {list(KEYS)}")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "scale.md")
    parser.add_argument(
        "--store",
        type=Path,
        default=ROOT / "benchmarks" / "scale.json",
        help="every row measured so far, per (model, transformers release)",
    )
    parser.add_argument("--transformers", type=Path, default=None,
                        help="a folder holding another transformers release "
                        "(pip install --no-deps --target DIR transformers==X)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.transformers is not None:
        PATH_FIRST.append(str(args.transformers.resolve()))
    keys = {**KEYS, **EXTRA_KEYS}
    names = [keys[k.strip()] for k in args.rows.split(",") if k.strip()]
    rows = json.loads(args.store.read_text()) if args.store.is_file() else []
    load = os.getloadavg()
    for name in names:
        work = Path(tempfile.mkdtemp(prefix="xconv-scale-", dir=args.work))
        try:
            t = time.perf_counter()
            row = measure(name, work)
            row["machine"] = _notes(load)[0]
            rows = _merge(rows, row)
            print(f"{name}: {time.perf_counter() - t:.0f} s", json.dumps(row), flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            # Written after every row, so a long run leaves what it measured so far.
            args.store.write_text(json.dumps(rows, indent=1) + "\n")
            _write(args.out, render(rows, _machines(rows)))
    _write(args.out, render(rows, _machines(rows)))  # --rows '': the stored rows, rendered
    print(render(rows, _machines(rows)))


def _merge(rows: list[dict], row: dict) -> list[dict]:
    """``rows`` with ``row`` in place of the one for the same model and transformers release
    (a row without recorded versions, for the same model, included), in :data:`ROWS` order."""

    def key(r: dict) -> tuple[str, str]:
        return r["model"], (r.get("versions") or {}).get("transformers", "")

    kept = [r for r in rows if key(r) != key(row) and not ("legacy" in r and r["model"] ==
                                                          row["model"])]  # fmt: skip
    order = list(ROWS)
    return sorted(
        [*kept, row],
        key=lambda r: (
            order.index(r["model"]) if r["model"] in order else 99,
            key(r)[1],
        ),  # fmt: skip
    )


def _write(path: Path, table: str) -> None:
    """Write the in-memory table, keeping the streamed section bench_stream.py writes."""
    from benchmarks.bench_stream import BEGIN, END

    old = path.read_text() if path.is_file() else ""
    kept = old[old.index(BEGIN) : old.index(END) + len(END)] if BEGIN in old and END in old else ""
    path.write_text(table.rstrip("\n") + ("\n\n" + kept if kept else "") + "\n")


def _machines(rows: list[dict]) -> list[str]:
    """Where and under what load each row ran (rows come from different runs)."""
    lines = []
    for r in rows:
        tf = (r.get("versions") or {}).get("transformers", "versions not recorded")
        lines.append(f"- {r['model']} ({tf}): {r.get('machine', '?')}")
    return ["Machines:", "", *lines] if lines else []


def _notes(load: tuple[float, ...]) -> list[str]:
    now = os.getloadavg()
    return [
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}; load average {load[0]:.1f} at the start, "
        f"{now[0]:.1f} at the end (a shared machine: wall times are noisy).",
    ]


if __name__ == "__main__":
    main()

"""Throughput of converted models vs every other way to run them: the seed's ResNet-50 table.

    python benchmarks/bench_throughput.py                       # every model; writes throughput.md
    python benchmarks/bench_throughput.py --models cnn --dtypes bf16   # refresh a part of it
    python benchmarks/bench_throughput.py --render              # rewrite the doc, run nothing
    python benchmarks/bench_throughput.py --models cnn --quick --no-write   # smoke run

Rows are kept in ``throughput.json`` beside the doc (``benchmarks/throughput_store.py``): a run
merges the rows it measured (by path, dtype, mode and batch) and rewrites the doc, whose
model sections list the runs their rows come from (commit, load average, arguments). From a
tree with uncommitted changes the script refuses to write the default doc (``--allow-dirty``
writes it with the rows' commit marked ``plus uncommitted changes``).

Models (random weights, ``torch.manual_seed(0)``): ResNet-50 (transformers ``ResNetConfig()``
defaults, 1000 classes, 3x224x224), BERT-base (``BertConfig()`` defaults, no pooler, seq 128,
last hidden state), a ResNet-18-style CNN (basic blocks, widths/4, 3x64x64, 10 classes) and a
small transformer encoder (4 pre-LN layers, d=256, 4 heads, seq 128, GELU MLP).

Each model runs in one fresh process, every path in it, on the same weights and inputs:

* torch eager and ``torch.compile`` (default backend);
* onnxruntime on ``torch.onnx.export``'s model and on xconv's (``xconv.save(...,
  canonical=True)`` of ``from_torch(..., dynamic_batch=True)``, as the ``onnx`` target writes);
* the PyPI peers ``torch2jax`` (``t2j``) and ``torchax`` under ``jax.jit``, imported from
  ``--peers`` (default ``/work/peers``; ``pip install --target /work/peers --no-deps torch2jax
  torchax``) and only there; a peer that is missing or fails says why in its row;
* the hand-written Flax models of ``benchmarks/flax_models.py`` (NHWC images, fed NHWC);
* xconv ``to_jax`` at its default ``kernel_layout`` and at the other one, and the Flax code
  ``xconv.to_flax`` writes (its ``model.py`` imported).

Inference: the output of one call. Training: one SGD step on ``0.5 * mean(out**2)`` with the
model in eval mode (batch norm on running statistics, dropout off) on every path, so each
path computes the same function; the JAX paths jit value_and_grad + the update together.
A time is the median of ``--repeat`` calls after the first (compile) call and one more warm-up;
throughput = batch / median. Ratios are time ratios (< 1: faster than the reference).

bfloat16: the hand-written Flax models with ``dtype=bfloat16`` (float32 parameters), torch
eager under ``torch.autocast(bfloat16)``, and xconv's paths when ``to_jax`` / ``to_flax``
take ``dtype=`` (detected with ``inspect.signature``; the row says when they do not).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import _memory  # noqa: E402
from benchmarks import throughput_store as store  # noqa: E402

OUT_MD = ROOT / "benchmarks" / "throughput.md"
PEERS = "/work/peers"
#: bf16 outputs vs torch's fp32 outputs: max |diff| over the reference's max |value|.
BF16_BOUND = 5e-2
LR = 1e-3

MODELS = {
    "cnn": "ResNet-18-style CNN, widths/4, 3×64×64",
    "transformer": "transformer, 4 pre-LN layers, d=256, 4 heads, seq 128",
    "resnet50": "ResNet-50 (ResNetConfig defaults, 1000 classes), 3×224×224",
    "bert": "BERT-base (BertConfig defaults, no pooler), seq 128",
}
DEFAULT_BATCHES = {
    "resnet50": (1, 8, 32),
    "bert": (1, 4, 32),
    "cnn": (1, 32, 128),
    "transformer": (1, 16),
}
#: The big models' training steps run at these batches only (a BERT-base b=4 step is ~30 s
#: on one shared core, a ResNet-50 b=32 step ~10 s); --train-all-batches lifts it.
TRAIN_BATCHES = {"resnet50": (1, 8), "bert": (1,)}
#: The big models' bf16 rows run at these batches only (XLA:CPU's bf16 convolutions and
#: matmuls are slow enough that larger batches do not fit the run); --bf16-all-batches lifts it.
BF16_BATCHES = {"resnet50": (1,), "bert": (1,)}
#: torch.compile runs for these models by default (--compile-models): compiling the full
#: ResNet-50 / BERT-base graphs, forward and backward, takes minutes on 2 shared cores.
COMPILE_MODELS = "cnn"
#: The doc's section order.
MODEL_ORDER = ["resnet50", "bert", "cnn", "transformer"]
UNIT = {"cnn": "img/s", "transformer": "seq/s", "resnet50": "img/s", "bert": "seq/s"}

# Paths, in table order. Kinds: torch, ort, jax (peer), hand (hand-written Flax), xconv.
PATHS = [
    ("torch eager", "torch"),
    ("torch.compile", "torch"),
    ("onnxruntime, torch.onnx export", "ort"),
    ("onnxruntime, xconv .onnx", "ort-xconv"),
    ("torch2jax (t2j) + jit", "jax"),
    ("torchax + jit", "jax"),
    ("hand-written Flax + jit", "hand"),
    ("xconv to_jax + jit", "xconv"),
    ('xconv to_jax(kernel_layout="HWIO") + jit', "xconv"),
    ('xconv to_jax(kernel_layout="onnx") + jit', "xconv"),
    ("xconv generated Flax + jit", "xconv"),
]


@dataclass
class Row:
    path: str
    dtype: str
    infer: dict = field(default_factory=dict)  # batch -> seconds per call
    train: dict = field(default_factory=dict)
    infer_compile: dict = field(default_factory=dict)  # batch -> first-call seconds
    train_compile: dict = field(default_factory=dict)
    infer_peak: dict = field(default_factory=dict)  # batch -> first call's peak RSS added, MiB
    train_peak: dict = field(default_factory=dict)
    conversion_s: float | None = None
    parity: str = ""
    note: str = ""


# --- models --------------------------------------------------------------------------------


def build_torch(name: str):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name in ("cnn", "resnet50"):
        from transformers import ResNetConfig, ResNetForImageClassification

        config = (
            ResNetConfig(num_labels=1000)
            if name == "resnet50"
            else ResNetConfig(
                layer_type="basic",
                depths=[2, 2, 2, 2],
                hidden_sizes=[16, 32, 64, 128],
                embedding_size=16,
                num_labels=10,
            )
        )
        inner = ResNetForImageClassification(config)

        class Images(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = inner

            def forward(self, pixel_values):
                return self.model(pixel_values=pixel_values).logits

        return Images().eval()
    if name == "bert":
        from transformers import BertConfig, BertModel

        inner = BertModel(BertConfig(), add_pooling_layer=False)

        class Text(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = inner

            def forward(self, input_ids):
                return self.model(input_ids=input_ids).last_hidden_state

        return Text().eval()

    class Block(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
            self.ln2 = nn.LayerNorm(d)
            self.ff1 = nn.Linear(d, 4 * d)
            self.act = nn.GELU()
            self.ff2 = nn.Linear(4 * d, d)

        def forward(self, x):
            h = self.ln1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.ff2(self.act(self.ff1(self.ln2(x))))

    class Encoder(nn.Module):
        def __init__(self, d: int = 256, heads: int = 4, layers: int = 4) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.norm = nn.LayerNorm(d)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.norm(x)

    return Encoder().eval()


def make_input(name: str, batch: int) -> np.ndarray:
    rng = np.random.default_rng(batch)
    if name == "cnn":
        return rng.standard_normal((batch, 3, 64, 64), dtype=np.float32)
    if name == "resnet50":
        return rng.standard_normal((batch, 3, 224, 224), dtype=np.float32)
    if name == "bert":
        return rng.integers(0, 30522, (batch, 128)).astype(np.int64)
    return rng.standard_normal((batch, 128, 256), dtype=np.float32)


def hand_flax(name: str, module, dtype):
    """The hand-written Flax model, its variables (torch's weights) and its input transform."""
    from benchmarks import flax_models as fm

    state = module.model.state_dict() if hasattr(module, "model") else module.state_dict()
    example = make_input(name, 1)
    if name in ("cnn", "resnet50"):
        flax_module = (
            fm.ResNet(dtype=dtype)
            if name == "resnet50"
            else fm.ResNet(
                depths=(2, 2, 2, 2),
                hidden_sizes=(16, 32, 64, 128),
                embedding_size=16,
                bottleneck=False,
                num_classes=10,
                dtype=dtype,
            )
        )
        nhwc = example.transpose(0, 2, 3, 1)
        return (
            flax_module,
            fm.from_torch_state(flax_module, nhwc, fm.resnet_state(state)),
            (lambda x: np.ascontiguousarray(x.transpose(0, 2, 3, 1))),
        )
    if name == "bert":
        flax_module = fm.Bert(dtype=dtype)
        return (
            flax_module,
            fm.from_torch_state(flax_module, example.astype(np.int32), state),
            (lambda x: x.astype(np.int32)),
        )
    flax_module = fm.Encoder(dtype=dtype)
    return flax_module, fm.from_torch_state(flax_module, example, state), (lambda x: x)


def jax_paths(name: str, module, tmp: Path, dtype: str = "fp32") -> dict[str, JaxPath]:
    """The hand-written Flax, ``to_jax`` and the generated Flax of ``module`` as the table
    runs them, in ``dtype`` ("fp32" or "bf16"): for the scripts that study those paths
    (``bench_roofline.py``, ``profile_step.py``)."""
    import jax.numpy as jnp
    import torch

    import xconv

    kw = {"dtype": "bfloat16"} if dtype == "bf16" else {}
    model = xconv.from_torch(module, torch.as_tensor(make_input(name, 2)), dynamic_batch=True)
    hand, variables, prep = hand_flax(name, module, jnp.bfloat16 if kw else jnp.float32)
    fixed = {k: v for k, v in variables.items() if k != "params"}
    out = {
        "hand-written Flax": JaxPath(
            lambda p, f, x, m=hand: m.apply({"params": p, **f}, x),
            variables["params"],
            fixed,
            prepare=prep,
        )
    }
    for key, layout in (("xconv to_jax", None), ("xconv to_jax (other layout)", _other_layout())):
        fn, params = xconv.to_jax(model, **kw, **({"kernel_layout": layout} if layout else {}))
        trainable, fixed = _split(params, {n for n, _ in module.named_parameters()})
        out[key] = JaxPath(lambda p, f, x, fn=fn: fn(_nest({**p, **f}), x)[0], trainable, fixed)
    flax_dir = xconv.to_flax(model, tmp / f"flax_{name}_{dtype}", **kw)
    module_name = f"xconv_paths_{name}_{dtype}"
    generated, variables = _import_file(flax_dir / "model.py", module_name).load(flax_dir)
    fixed = {k: v for k, v in variables.items() if k != "params"}
    out["xconv generated Flax"] = JaxPath(
        lambda p, f, x, m=generated: _first(m.apply({"params": p, **f}, x)),
        variables["params"],
        fixed,
    )
    return out


# --- timing --------------------------------------------------------------------------------


def timed_first(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def first_call(fn) -> tuple[float, float | None]:
    """The first (compiling) call's seconds and the peak resident memory it added to the
    process in MiB (``/proc``'s peak mark reset before it; None where that cannot be read):
    what the path needs beside what the process already holds, its compilation included."""
    try:
        base = _memory.reset_peak()
    except OSError:
        base = None
    seconds = timed_first(fn)
    return seconds, (_memory.peak_above_mib(base) if base else None)


def warm_up(fn, first_s: float) -> None:
    """One warm-up call beyond the first, unless that call was a long one."""
    if first_s < 1.0:
        fn()


def interleaved_medians(calls: list, repeat: int, seed: int = 0) -> list[float | BaseException]:
    """The median of ``repeat`` timed calls of each of ``calls``, taken in rounds (one call of
    each per round), so a slow spell of a shared machine falls on every path alike instead of
    on whichever path was being timed; each round in a fresh (seeded) order, so no path always
    follows the same one (a call after a bfloat16 one ran up to 20 % slower: BERT b=1, the
    same function at two rows). A call that raises gives its exception."""
    times: list[list[float]] = [[] for _ in calls]
    failed: list[BaseException | None] = [None] * len(calls)
    rng = random.Random(seed)
    for _ in range(repeat):
        order = list(range(len(calls)))
        rng.shuffle(order)
        for i in order:
            fn = calls[i]
            if failed[i] is not None:
                continue
            try:
                start = time.perf_counter()
                fn()
                times[i].append(time.perf_counter() - start)
            except Exception as e:  # noqa: BLE001 - one broken path must not lose the others
                failed[i] = e
    return [
        f if f is not None else statistics.median(t) for t, f in zip(times, failed, strict=True)
    ]


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:110] if text else ''}".replace("|", "\\|")


# --- paths ---------------------------------------------------------------------------------


class JaxPath:
    """A pure ``apply(params, x)`` with its params (trainable) and fixed state: jitted
    inference and a jitted SGD step."""

    def __init__(self, apply, params, fixed=None, prepare=lambda x: x) -> None:
        import jax
        import jax.numpy as jnp

        self.apply, self.params, self.fixed, self.prepare = apply, params, fixed, prepare
        self._infer = jax.jit(apply)

        def loss(p, f, x):
            out = apply(p, f, x) if fixed is not None else apply(p, x)
            return 0.5 * jnp.mean(jnp.square(out.astype(jnp.float32)))

        def step(p, f, x):
            value, grads = jax.value_and_grad(loss)(p, f, x)
            return value, jax.tree_util.tree_map(lambda a, g: a - LR * g.astype(a.dtype), p, grads)

        self._step = jax.jit(step)
        if fixed is not None:
            self._infer = jax.jit(lambda p, f, x: apply(p, f, x))

    def inputs(self, x: np.ndarray):
        import jax

        return jax.device_put(self.prepare(x))

    def jitted(self, mode: str, x) -> tuple[Any, tuple]:
        """The jitted inference (``"infer"``) or SGD step (``"train"``) and its arguments for
        input ``x`` (as :meth:`inputs` gives it)."""
        if mode == "train":
            return self._step, (self.params, self.fixed, x)
        args = (self.params, self.fixed, x) if self.fixed is not None else (self.params, x)
        return self._infer, args

    def infer(self, x):
        import jax

        fn, args = self.jitted("infer", x)
        return lambda: jax.block_until_ready(fn(*args))

    def train(self, x):
        import jax

        fn, args = self.jitted("train", x)
        return lambda: jax.block_until_ready(fn(*args))

    def output(self, x):
        fn, args = self.jitted("infer", x)
        return np.asarray(fn(*args), dtype=np.float32)


class Bench:
    def __init__(self, name: str, batches, repeat: int, dtypes, args) -> None:
        import torch

        self.name, self.batches, self.repeat, self.dtypes, self.args = (
            name,
            batches,
            repeat,
            dtypes,
            args,
        )
        self.module = build_torch(name)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.module.to(self.device)
        self.rows: list[Row] = []
        #: (row, "infer" | "train", batch, call): compiled and warm, timed by time_pending.
        self.pending: list[tuple[Row, str, int, Any]] = []
        self.meta: dict[str, Any] = {}
        self.tmp = Path(tempfile.mkdtemp(prefix=f"xconv_tp_{name}_"))
        self.bf16_policy = None

    # helpers
    def torch_in(self, x):
        import torch

        return torch.as_tensor(x).to(self.device)

    def reference(self, x) -> np.ndarray:
        import torch

        with torch.no_grad():
            return self.module(self.torch_in(x)).float().cpu().numpy()

    def parity(self, candidate, x, got: np.ndarray | None = None, bf16: bool = False) -> str:
        """xconv.check_parity verdict vs the torch module: the oracle policy in fp32, xconv's
        bf16 policy (where this commit has one) for bf16 candidates, else the bf16 bound."""
        ref = self.reference(x)
        rel = (
            float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-12))
            if got is not None
            else None
        )
        if candidate is None or (bf16 and self.bf16_policy is None):
            verdict = "pass" if rel <= BF16_BOUND else "FAIL"
            return f"{verdict} (max rel err {rel:.1e}{'; bound ' + format(BF16_BOUND, '.0e') if bf16 else ''})"
        import xconv

        policy = self.bf16_policy if bf16 else "oracle"
        try:
            report = xconv.check_parity(
                self.module,
                candidate,
                [x],
                policy=policy,
                intermediates=False,
                n_random=0,
                edges=False,
                devices=_parity_devices(),
            )
        except Exception as e:  # noqa: BLE001 - the verdict cell says what went wrong
            return f"error: {_short(e)}"
        what = "bf16 policy, " if bf16 else ""
        err = f"max rel err {rel:.1e}" if bf16 else f"max err {float(np.abs(got - ref).max()):.1e}"
        failing = sorted(
            {r.device for r in report.matrix if r.role == "candidate" and not r.passed}
        )
        on_cpu = [d for d in failing if d.startswith("cpu")]
        where = f" on {', '.join(failing)}" if len(on_cpu) < len(failing) else ""
        verdict = f"{'pass' if report.passed else 'FAIL'}{where} ({what}{err})"
        # check_parity runs a JAX/Flax candidate that fails off the CPU only again at matmul
        # precision "highest" (JAX's float32 dots default to TF32 on GPUs) and notes the result.
        for note in report.notes:
            if "default_matmul_precision('highest')" in note:
                again = "pass" if ": passes at" in note else "FAIL"
                verdict += f"; {again} at matmul precision highest"
        return verdict

    def measure(self, row: Row, infer, train=None) -> None:
        """``infer(batch)`` / ``train(batch)`` give a zero-argument call for that batch: its
        first (compile) call is timed now, the rest with every other path's in
        :meth:`time_pending`."""
        batches = self.batches
        if row.dtype == "bf16" and not self.args.bf16_all_batches and self.name in BF16_BATCHES:
            batches = [b for b in batches if b in BF16_BATCHES[self.name]] or batches[:1]
        for b in batches:
            if not self.args.no_infer:
                with _note_errors(row, f"inference b={b}"):
                    call = infer(b)
                    row.infer_compile[b], row.infer_peak[b] = first_call(call)
                    warm_up(call, row.infer_compile[b])
                    self.pending.append((row, "infer", b, call))
            train_ok = self.args.train_all_batches or b in TRAIN_BATCHES.get(self.name, (b,))
            if train is not None and not self.args.no_train and train_ok:
                with _note_errors(row, f"training b={b}"):
                    call = train(b)
                    row.train_compile[b], row.train_peak[b] = first_call(call)
                    warm_up(call, row.train_compile[b])
                    self.pending.append((row, "train", b, call))
        self.rows.append(row)

    def time_pending(self, kind: str | None = None) -> None:
        """Time the registered calls (of ``kind``'s paths only, if given): per dtype, mode and
        batch, every path's calls interleaved (the ratios compare paths of one dtype)."""
        groups: dict[tuple[str, str, int], list[tuple[Row, Any]]] = {}
        mine, rest = [], []
        for entry in self.pending:
            (mine if kind is None or _kind(entry[0].path) == kind else rest).append(entry)
        self.pending = rest
        for row, mode, b, call in mine:
            groups.setdefault((row.dtype, mode, b), []).append((row, call))
        for (_, mode, b), entries in groups.items():
            results = interleaved_medians([call for _, call in entries], self.repeat)
            for (row, _), got in zip(entries, results, strict=True):
                if isinstance(got, BaseException):
                    what = "inference" if mode == "infer" else "training"
                    row.note = (row.note + "; " if row.note else "") + (
                        f"{what} b={b} failed: {_short(got)}"
                    )
                else:
                    getattr(row, mode)[b] = got
        for row in self.rows:
            print(
                f"[{self.name}] {row.path} {row.dtype}: infer {row.infer} train {row.train} "
                f"{row.parity} {row.note}",
                file=sys.stderr,
                flush=True,
            )

    # torch
    def torch_rows(self) -> None:
        import torch

        x1 = make_input(self.name, 1)

        def infer_for(module, autocast=False):
            def make(b):
                x = self.torch_in(make_input(self.name, b))

                def run():
                    with torch.no_grad(), _autocast(autocast, self.device):
                        module(x)
                    if self.device == "cuda":
                        torch.cuda.synchronize()

                return run

            return make

        def train_for(module, autocast=False):
            opt = torch.optim.SGD(module.parameters(), lr=LR)

            def make(b):
                x = self.torch_in(make_input(self.name, b))

                def run():
                    with _autocast(autocast, self.device):
                        out = module(x)
                    loss = 0.5 * out.float().square().mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    if self.device == "cuda":
                        torch.cuda.synchronize()

                return run

            return make

        trained = copy.deepcopy(self.module)  # the SGD steps must not move the shared weights
        self.measure(
            Row("torch eager", "fp32", parity="reference"),
            infer_for(self.module),
            train_for(trained),
        )
        if "bf16" in self.dtypes:
            with torch.no_grad(), _autocast(True, self.device):
                got = self.module(self.torch_in(x1)).float().cpu().numpy()
            row = Row(
                "torch eager",
                "bf16",
                parity=self.parity(None, x1, got, bf16=True),
                note="torch.autocast(bfloat16)",
            )
            self.measure(
                row, infer_for(self.module, True), train_for(copy.deepcopy(self.module), True)
            )
        if self.args.no_compile or self.name not in self.args.compile_models.split(","):
            why = "--no-compile / --quick" if self.args.no_compile else "not in --compile-models"
            self.rows.append(Row("torch.compile", "fp32", note=f"not run ({why})"))
            return
        # Timed first, its parity after: the first call at each batch is the one that compiles.
        note = "first call per batch compiles (dynamic shapes after the second size)"
        row = Row("torch.compile", "fp32", note=note)
        compiled = torch.compile(self.module)
        self.measure(row, infer_for(compiled), train_for(torch.compile(copy.deepcopy(self.module))))
        try:
            with torch.no_grad():
                got = compiled(self.torch_in(x1)).float().cpu().numpy()
            row.parity = self.parity(None, x1, got)
        except Exception as e:  # noqa: BLE001
            row.note = f"does not run: {_short(e)}"

    # onnxruntime
    def ort_rows(self, model) -> None:
        import onnxruntime as ort
        import torch

        import xconv

        x1 = make_input(self.name, 1)

        def session_row(path_name: str, path: Path, seconds: float, note: str = "") -> None:
            options = ort.SessionOptions()
            if self.args.threads:
                options.intra_op_num_threads, options.inter_op_num_threads = self.args.threads, 1
            sess = ort.InferenceSession(str(path), options, providers=ort.get_available_providers())
            name = sess.get_inputs()[0].name
            row = Row(path_name, "fp32", conversion_s=seconds, note=note)
            got = np.asarray(sess.run(None, {name: x1})[0])
            row.parity = self.parity(str(path), x1, got)

            def make(b):
                feed = {name: make_input(self.name, b)}
                return lambda: sess.run(None, feed)

            self.measure(row, make)

        path = self.tmp / "torch_export.onnx"
        try:
            batch = torch.export.Dim("batch", min=1, max=1024)
            start = time.perf_counter()
            torch.onnx.export(
                self.module.cpu(),
                (torch.as_tensor(make_input(self.name, 2)),),
                str(path),
                dynamo=True,
                dynamic_shapes=({0: batch},),
                external_data=False,
            )
            seconds = time.perf_counter() - start
            self.module.to(self.device)
            session_row(
                "onnxruntime, torch.onnx export",
                path,
                seconds,
                "torch.onnx.export(dynamo=True), dynamic batch",
            )
        except Exception as e:  # noqa: BLE001
            self.module.to(self.device)
            self.rows.append(
                Row("onnxruntime, torch.onnx export", "fp32", note=f"export failed: {_short(e)}")
            )
        path = self.tmp / "xconv.onnx"
        if model is None:
            why = f"from_torch failed: {self.meta['from_torch_error']}"
            self.rows.append(Row("onnxruntime, xconv .onnx", "fp32", note=why))
            return
        try:
            start = time.perf_counter()
            xconv.save(model, path, canonical=True)  # as the onnx target writes it
            seconds = self.meta["from_torch_s"] + time.perf_counter() - start
            session_row(
                "onnxruntime, xconv .onnx",
                path,
                seconds,
                "from_torch(dynamic_batch=True) + xconv.save(canonical=True)",
            )
        except Exception as e:  # noqa: BLE001
            self.rows.append(Row("onnxruntime, xconv .onnx", "fp32", note=f"failed: {_short(e)}"))

    # JAX
    def jax_row(self, row: Row, path: JaxPath | None, candidate=None, bf16=False) -> None:
        if path is None:
            self.rows.append(row)
            return
        x1 = make_input(self.name, 1)
        if not row.parity:
            try:
                got = path.output(path.inputs(x1))
                row.parity = self.parity(candidate, x1, got, bf16=bf16)
            except Exception as e:  # noqa: BLE001
                row.parity = f"error: {_short(e)}"
        self.measure(
            row,
            lambda b: path.infer(path.inputs(make_input(self.name, b))),
            lambda b: path.train(path.inputs(make_input(self.name, b))),
        )

    def peer_rows(self) -> None:
        added = self.args.peers and os.path.isdir(self.args.peers)
        if added:
            sys.path.insert(0, self.args.peers)
        try:
            self._t2j_row()
            # torchax's import registers a "jax" torch device, after which torch's training
            # step on CUDA fails ("PyTorch is not linked with support for jax devices"):
            # torch's calls are timed before it.
            self.time_pending("torch")
            self._torchax_row()
        finally:
            if added:
                sys.path.remove(self.args.peers)

    def _t2j_row(self) -> None:
        row = Row("torch2jax (t2j) + jit", "fp32")
        try:
            from torch2jax import t2j
        except Exception as e:  # noqa: BLE001
            row.note = f"not installed ({_short(e)})"
            return self.jax_row(row, None)
        try:
            start = time.perf_counter()
            module = self.module.cpu()
            f = t2j(module)
            names = {n for n, _ in module.named_parameters()}
            state = {k: t2j(v) for k, v in module.state_dict().items()}
            params = {k: v for k, v in state.items() if k in names}
            buffers = {k: v for k, v in state.items() if k not in names}
            row.conversion_s = time.perf_counter() - start
            self.module.to(self.device)
            apply = lambda p, fixed, x: f(x, state_dict={**p, **fixed})  # noqa: E731
            prep = (lambda x: x.astype(np.int32)) if self.name == "bert" else (lambda x: x)
            path = JaxPath(apply, params, buffers, prepare=prep)
            path.output(path.inputs(make_input(self.name, 1)))
        except Exception as e:  # noqa: BLE001
            row.note = f"does not run: {_short(e)}"
            return self.jax_row(row, None)
        self.jax_row(row, path, (lambda p, x: f(x, state_dict={**p, **buffers}), params))

    def _torchax_row(self) -> None:
        row = Row("torchax + jit", "fp32")
        try:
            import torch
            import torchax
        except Exception as e:  # noqa: BLE001
            reason = (
                "not installed"
                if isinstance(e, ModuleNotFoundError)
                else (f"does not import with torch {torch.__version__}")
            )
            row.note = f"{reason} ({_short(e)})"
            return self.jax_row(row, None)
        try:
            start = time.perf_counter()
            params, fn = torchax.extract_jax(self.module.cpu())
            row.conversion_s = time.perf_counter() - start
            self.module.to(self.device)
            # Train what torch trains (its integer buffers made jax.grad fail); batch-norm
            # statistics stay fixed as on every path.
            trainable, fixed = _split(params, {n for n, _ in self.module.named_parameters()})
            path = JaxPath(lambda p, f, x: fn({**p, **f}, (x,)), trainable, fixed)
            path.output(path.inputs(make_input(self.name, 1)))
        except Exception as e:  # noqa: BLE001
            row.note = f"does not run: {_short(e)}"
            return self.jax_row(row, None)
        self.jax_row(row, path, (lambda p, x: fn(p, (x,)), params))

    def hand_rows(self) -> None:
        import jax.numpy as jnp

        for dtype in self.dtypes:
            row = Row("hand-written Flax + jit", dtype)
            try:
                start = time.perf_counter()
                module, variables, prep = hand_flax(
                    self.name, self.module.cpu(), jnp.bfloat16 if dtype == "bf16" else jnp.float32
                )
                row.conversion_s = time.perf_counter() - start
                self.module.to(self.device)
                fixed = {k: v for k, v in variables.items() if k != "params"}
                apply = lambda p, f, x, m=module: m.apply({"params": p, **f}, x)  # noqa: E731
                path = JaxPath(apply, variables["params"], fixed, prepare=prep)
                candidate = (lambda v, x, m=module, pr=prep: m.apply(v, pr(x)), variables)
            except Exception as e:  # noqa: BLE001
                row.note = f"does not run: {_short(e)}"
                path = candidate = None
            row.note = row.note or "weights loaded from torch's state_dict; " + (
                "NHWC input" if self.name in ("cnn", "resnet50") else "int32 ids"
            )
            self.jax_row(row, path, candidate, bf16=dtype == "bf16")

    def xconv_rows(self, model) -> None:
        import xconv

        if model is None:
            why = f"from_torch failed: {self.meta['from_torch_error']}"
            for dtype in self.dtypes:
                for path in ("xconv to_jax + jit", "xconv generated Flax + jit"):
                    self.rows.append(Row(path, dtype, note=why))
            return
        for dtype in self.dtypes:
            kw: dict[str, Any] = {}
            if dtype == "bf16":
                kw = {"dtype": "bfloat16"}
            for layout in (None,) if self.args.one_layout else (None, _other_layout()):
                self._to_jax_row(model, dtype, kw, layout)
            # generated Flax
            row = Row("xconv generated Flax + jit", dtype)
            if kw and "dtype" not in inspect.signature(xconv.to_flax).parameters:
                row.note = "not available at this commit (to_flax takes no dtype=)"
                self.jax_row(row, None)
                continue
            try:
                start = time.perf_counter()
                out = xconv.to_flax(model, self.tmp / f"flax_{dtype}", **kw)
                generated = _import_file(out / "model.py", f"xconv_tp_{self.name}_{dtype}")
                module, variables = generated.load(out)
                row.conversion_s = self.meta["from_torch_s"] + time.perf_counter() - start
                fixed = {k: v for k, v in variables.items() if k != "params"}
                apply = lambda p, f, x, m=module: _first(m.apply({"params": p, **f}, x))  # noqa: E731
                path = JaxPath(apply, variables["params"], fixed)
                self.jax_row(row, path, (module, variables), bf16=bool(kw))
            except Exception as e:  # noqa: BLE001
                row.note = f"does not run: {_short(e)}"
                self.jax_row(row, None)

    def _to_jax_row(self, model, dtype: str, kw: dict, layout: str | None) -> None:
        """``to_jax`` at its default kernel layout (``layout`` None) or at ``layout``."""
        import xconv

        if layout is None:
            row = Row("xconv to_jax + jit", dtype)
        else:
            row = Row(f'xconv to_jax(kernel_layout="{layout}") + jit', dtype)
            kw = {**kw, "kernel_layout": layout}
        missing = [k for k in kw if k not in inspect.signature(xconv.to_jax).parameters]
        if missing:
            row.note = f"not available at this commit (to_jax takes no {missing[0]}=)"
            return self.jax_row(row, None)
        try:
            start = time.perf_counter()
            fn, params = xconv.to_jax(model, **kw)
            row.conversion_s = self.meta["from_torch_s"] + time.perf_counter() - start
            if layout is None:
                row.note = f"kernel_layout={getattr(fn, 'kernel_layout', 'onnx')!r} (default)"
            # Train what torch trains: params named like the module's parameters (state_dict
            # keys); batch-norm statistics stay fixed as on every path.
            trainable, fixed = _split(params, {n for n, _ in self.module.named_parameters()})
            apply = lambda p, f, x, fn=fn: fn(_nest({**p, **f}), x)[0]  # noqa: E731
            path = JaxPath(apply, trainable, fixed)
        except Exception as e:  # noqa: BLE001
            row.note = f"does not run: {_short(e)}"
            return self.jax_row(row, None)
        self.jax_row(row, path, (fn, params), bf16="dtype" in kw)

    def run(self) -> dict:
        import torch

        import xconv

        x2 = torch.as_tensor(make_input(self.name, 2))
        start = time.perf_counter()
        try:
            model = xconv.from_torch(self.module.cpu(), x2, dynamic_batch=True)
            self.meta["from_torch_s"] = time.perf_counter() - start
            self.bf16_policy = _bf16_policy(model)
        except Exception as e:  # noqa: BLE001 - the other paths still run; xconv's rows say why
            traceback.print_exc()
            model, self.meta["from_torch_error"] = None, _short(e)
        self.module.to(self.device)
        steps = {
            "torch": self.torch_rows,
            "ort": lambda: self.ort_rows(model),
            "peers": self.peer_rows,
            "hand": self.hand_rows,
            "xconv": lambda: self.xconv_rows(model),
        }
        for key, step in steps.items():
            if key in self.args.skip:
                continue
            try:
                step()
            except Exception:  # noqa: BLE001 - one broken path must not lose the others
                traceback.print_exc()
        self.time_pending()
        shutil.rmtree(self.tmp, ignore_errors=True)  # the .onnx files and generated Flax
        return {
            "model": self.name,
            "batches": list(self.batches),
            "meta": self.meta,
            "rows": [asdict(r) for r in self.rows],
        }


def _parity_devices() -> str:
    """Where a parity check runs its candidate: every device on the CPU machine; on a GPU
    machine the GPU only (the CPU's verdicts are the CPU table's; each check there also
    compiled the path for the host's XLA, the likely reason a lent device's run ran out)."""
    import jax

    backend = jax.default_backend()
    return "all" if backend == "cpu" else backend


def _other_layout() -> str:
    """The ``kernel_layout`` that ``to_jax``'s default is not (its second row)."""
    import xconv

    param = inspect.signature(xconv.to_jax).parameters.get("kernel_layout")
    return "onnx" if param is not None and param.default == "HWIO" else "HWIO"


def _bf16_policy(model):
    """xconv's parity policy for bfloat16-compute conversions, where this commit has one."""
    try:
        from xconv.converters.ops.precision import rounding_depth
        from xconv.parity.policies import bf16_policy
    except ImportError:
        return None
    return bf16_policy(rounding_depth(model))


def _split(params, names: set[str]) -> tuple[dict, dict]:
    """Flatten ``params`` (nested by scope) to dotted keys: (those in ``names``, the rest)."""
    import jax

    flat = {
        ".".join(str(k.key) for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    return (
        {k: v for k, v in flat.items() if k in names},
        {k: v for k, v in flat.items() if k not in names},
    )


def _nest(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        *scopes, leaf = key.split(".")
        node = out
        for s in scopes:
            node = node.setdefault(s, {})
        node[leaf] = value
    return out


def _first(out):
    return out[0] if isinstance(out, tuple | list) else out


@contextlib.contextmanager
def _autocast(enabled: bool, device: str):
    import torch

    if not enabled:
        yield
        return
    with torch.autocast(device, dtype=torch.bfloat16):
        yield


@contextlib.contextmanager
def _note_errors(row: Row, what: str):
    try:
        yield
    except Exception as e:  # noqa: BLE001
        row.note = (row.note + "; " if row.note else "") + f"{what} failed: {_short(e)}"


def _import_file(path: Path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# --- the table -----------------------------------------------------------------------------

JAX_KINDS = {"jax", "hand"}


def _kind(path: str) -> str:
    return dict(PATHS)[path]


def _computes_it(row: dict) -> bool:
    """Whether a path computes the source's function: one whose parity verdict is a FAIL runs
    something else (t2j maps torch's exact GELU to ``jax.nn.gelu``'s tanh default) and is no
    bar for the others. A FAIL that passes at matmul precision ``"highest"`` (JAX's TF32 dots
    on a GPU, which every JAX path runs at its default) is that precision, not another
    function."""
    verdict = row["parity"] or ""
    return not verdict.startswith("FAIL") or verdict.endswith("; pass at matmul precision highest")


def _ratio(t: float | None, ref: float | None) -> str:
    return f"×{t / ref:.2f}" if t and ref else "—"


def render_model(result: dict) -> list[str]:
    name, batches, rows = result["model"], result["batches"], result["rows"]
    for r in rows:
        for key in store.timing_keys():
            r[key] = {int(k): v for k, v in r.get(key, {}).items()}
    unit = UNIT[name]
    lines = [f"### {MODELS[name]}", ""]
    if result.get("runs") or result.get("last_error"):
        lines += [
            "Measured in these runs (the `run` column: which run measured each batch; rows "
            "merge across runs in `benchmarks/throughput.json`):",
            "",
            *store.run_lines(result),
            "",
        ]
    meta = result["meta"]
    lines.append(
        f"from_torch (dynamic batch) failed: {meta['from_torch_error']}"
        if "from_torch_error" in meta
        else f"from_torch (dynamic batch): {meta.get('from_torch_s', float('nan')):.1f} s. "
        "Conversion s includes it for xconv's rows."
    )
    lines.append("")
    misses: list[str] = []
    for mode in ("infer", "train"):
        if not any(r[mode] for r in rows):
            continue  # no row ran this mode (--no-train): no empty table
        title = "Inference" if mode == "infer" else "Training step (SGD, eval-mode model)"
        head = ["path", "dtype"]
        for b in batches:
            head += [f"b={b} {unit}", "×best JAX", "×hand Flax"]
        head += [
            "compile s (b=" + "/".join(map(str, batches)) + ")",
            "peak MiB (b=" + "/".join(map(str, batches)) + ")",
            "conversion s",
            "parity vs torch (b=1)",
            "note",
            "run",
        ]
        lines += [
            f"**{title}**",
            "",
            "| " + " | ".join(head) + " |",
            "|"
            + "|".join("---" if i < 2 else "---:" for i in range(len(head) - 3))
            + "|---|---|---|",
        ]
        for dtype in ("fp32", "bf16"):
            order = [p for p, _ in PATHS]
            drows = sorted(
                (r for r in rows if r["dtype"] == dtype), key=lambda r: order.index(r["path"])
            )
            if not drows:
                continue
            best: dict[int, float | None] = {}
            hand: dict[int, float | None] = {}
            per: dict[int, dict[str, list[float] | None]] = {}
            for b in batches:
                peers = [
                    r[mode].get(b)
                    for r in drows
                    if _kind(r["path"]) in JAX_KINDS and r[mode].get(b) and _computes_it(r)
                ]
                best[b] = min(peers) if peers else None
                hand[b] = next((r[mode].get(b) for r in drows if _kind(r["path"]) == "hand"), None)
                per[b] = {
                    "best": _per_process(
                        [
                            r
                            for r in drows
                            if _kind(r["path"]) in JAX_KINDS and r[mode].get(b) and _computes_it(r)
                        ],
                        mode,
                        b,
                    ),
                    "hand": _per_process([r for r in drows if _kind(r["path"]) == "hand"], mode, b),
                    "ort": _per_process(
                        [r for r in drows if r["path"] == "onnxruntime, torch.onnx export"],
                        mode,
                        b,
                    ),
                }
            for r in drows:
                if mode == "train" and _kind(r["path"]).startswith("ort"):
                    continue
                cells = [r["path"], dtype]
                for b in batches:
                    t = r[mode].get(b)
                    cells += [f"{b / t:,.1f}" if t else "—", _ratio(t, best[b]), _ratio(t, hand[b])]
                compile_s = "/".join(
                    f"{r[mode + '_compile'][b]:.1f}" if b in r[mode + "_compile"] else "—"
                    for b in batches
                )
                peak = "/".join(
                    f"{r[mode + '_peak'][b]:,.0f}" if r[mode + "_peak"].get(b) is not None else "—"
                    for b in batches
                )
                conv = f"{r['conversion_s']:.1f}" if r["conversion_s"] is not None else "—"
                runs = r.get("run", {}).get(mode, {})
                run = "/".join(str(runs[b]) if b in runs else "—" for b in batches)
                cells += [compile_s, peak, conv, r["parity"] or "—", r["note"] or "", run]
                lines.append("| " + " | ".join(cells) + " |")
                misses += _targets(r, rows, mode, batches, best, hand, per)
        lines.append("")
    lines += [
        "Targets (xconv JAX paths ≤ ×1.00 best JAX and ≤ ×0.95 hand-written Flax; xconv .onnx ≤ ×1.00 "
        "the torch.onnx export on onnxruntime):",
        "",
    ]
    lines += [f"- {m}" for m in misses] or ["- every measured target met"]
    lines.append("")
    return lines


def _per_process(rows: list[dict], mode: str, b: int) -> list[float] | None:
    """Each process's fastest timing among ``rows`` at batch ``b`` (in process order), or
    None unless every row has every process's timing."""
    lists = [r.get("processes", {}).get(mode, {}).get(b) for r in rows]
    if not lists or any(not ts or None in ts for ts in lists):
        return None
    if len({len(ts) for ts in lists}) != 1:
        return None
    return [min(ts) for ts in zip(*lists, strict=True)]


def _spread(r: dict, mode: str, b: int, ref: list[float] | None) -> str:
    """The range of ``r``'s ratio to ``ref`` over the processes that timed both (each
    process's ratio pairs calls interleaved in its own rounds), or ``""``."""
    mine = _per_process([r], mode, b)
    if mine is None or ref is None or len(ref) != len(mine):
        return ""
    ratios = sorted(t / u for t, u in zip(mine, ref, strict=True))
    return f"; ×{ratios[0]:.2f}–×{ratios[-1]:.2f} in the {len(ratios)} processes"


def _targets(r, rows, mode, batches, best, hand, per=None) -> list[str]:
    kind = _kind(r["path"])
    out = []
    for b in batches:
        t = r[mode].get(b)
        label = f"{r['path']} {r['dtype']} {mode} b={b}"
        ref = (per or {}).get(b, {})
        if kind == "xconv":
            if not t:  # a batch no path of this dtype ran (bf16 skips some) is no miss
                if hand[b] or best[b] or not any(r[mode].values()):
                    out.append(f"{label}: not measured ({r['note'] or 'no timing'})")
                continue
            if best[b] and t / best[b] > 1.0:
                spread = _spread(r, mode, b, ref.get("best"))
                out.append(
                    f"{label}: ×{t / best[b]:.2f} the best JAX path (target ≤ ×1.00{spread})"
                )
            if hand[b] and t / hand[b] > 0.95:
                spread = _spread(r, mode, b, ref.get("hand"))
                out.append(
                    f"{label}: ×{t / hand[b]:.2f} the hand-written Flax (target ≤ ×0.95{spread})"
                )
        elif kind == "ort-xconv" and mode == "infer":
            export = next(
                (x["infer"].get(b) for x in rows if x["path"] == "onnxruntime, torch.onnx export"),
                None,
            )
            if t and export and t / export > 1.0:
                spread = _spread(r, mode, b, ref.get("ort"))
                out.append(
                    f"{label}: ×{t / export:.2f} the torch.onnx export (target ≤ ×1.00{spread})"
                )
    return out


def render(sections: dict[str, list[dict]], header: dict) -> str:
    """The doc: ``sections`` maps a backend (``cpu``, ``gpu``) to its models' results."""
    lines = [
        "# Throughput: converted models vs every other way to run them",
        "",
        "Written by `python benchmarks/bench_throughput.py` — do not edit by hand. Runs of "
        "`--models` / `--dtypes` / `--batches` merge their rows into "
        "`benchmarks/throughput.json` and rewrite this doc from it (`--render`: rewrite only); "
        "each model section lists the runs its rows come from, with commit, load average and "
        "arguments (`--threads 1`: one intra-op thread for torch, onnxruntime and XLA). "
        "The script refuses to write this doc from a tree with uncommitted changes.",
        "",
        f"- machine: {header['machine']} (shared machine: treat ratios as ±15 %)",
        f"- versions at the last write: {header['versions']}",
        "- repeats: median of `--repeat` (default 5) calls after the compile call and one "
        "warm-up (no extra warm-up after a first call over 1 s); the paths' calls interleaved "
        "(one call of each path per round, per dtype, batch and mode, each round in a fresh "
        "seeded order), so a slow spell of the shared machine falls on every path alike and no "
        "path always follows the same one (runs before 2026-12-02 15:30 UTC kept one order, "
        "fp32 and bf16 paths together; before 11:55 UTC each path's calls ran in a block); "
        "a run with `--processes N` (its arguments say) ran the model in N fresh processes, "
        "and each timing is the median of the N processes' medians; a missed target then "
        "names the range of its ratio over the N processes (each process's timing of the path "
        "÷ its own timing of the path compared with: their calls interleaved in its rounds)",
        "- default batches: "
        + "; ".join(f"{m} b={'/'.join(map(str, b))}" for m, b in DEFAULT_BATCHES.items())
        + "; bf16 rows of "
        + ", ".join(f"{m} at b={'/'.join(map(str, b))}" for m, b in BF16_BATCHES.items())
        + " only (`--bf16-all-batches`); training of "
        + ", ".join(f"{m} at b={'/'.join(map(str, b))}" for m, b in TRAIN_BATCHES.items())
        + f" only (`--train-all-batches`); torch.compile for {COMPILE_MODELS} (`--compile-models`)",
        "- throughput in items/s (higher is better); ×best JAX = time / fastest of t2j, torchax and "
        "the hand-written Flax in the same dtype, of those whose parity verdict is not a FAIL "
        "(a failing path computes another function; one that fails only at JAX's default GPU "
        "precision and passes at matmul precision highest counts); ×hand Flax = time / "
        "hand-written Flax (< 1: faster)",
        "- peak MiB: the resident memory the path's first call at that batch added to the "
        "process (`/proc` peak mark reset before it; the compilation included), measured in runs "
        "since 2026-12-04 (— before)",
        "- `xconv to_jax + jit`: `to_jax`'s default `kernel_layout`; "
        '`xconv to_jax(kernel_layout="HWIO") + jit`: convolution kernels stored (*k, I, O)',
        "- training step: forward, 0.5·mean(out²), backward, SGD update; eval-mode model on every "
        "path (frozen batch-norm statistics), so every path computes the same function",
        "- parity: `xconv.check_parity(torch module, path, b=1 input, intermediates=False, n_random=0, "
        f"edges=False)` verdict (oracle policy) with max |err|; bf16 rows of xconv and the hand-written "
        "Flax: xconv's bf16 policy where this commit has one (`xconv.parity.policies.bf16_policy`), "
        f"else, and for torch autocast, max |err| / max |torch fp32| ≤ {BF16_BOUND:.0e}",
        "",
    ]
    for backend, title in (("cpu", "CPU"), ("gpu", "GPU")):
        results = sections.get(backend) or []
        lines += [f"## {title}", ""]
        if results and backend == "gpu":
            lines += [
                "Every path on the GPU: the JAX paths on `jax.devices()[0]`, torch on CUDA. Each "
                "run line names the device and the versions it ran with (the lent machine's "
                "image, not the header's). Paths a run left out (its arguments: `--skip`, "
                "`--no-compile`, `--one-layout`) have no timings. `peak MiB` here is the host "
                "memory the first call added, not the device's. Parity: the candidate on the "
                "GPU (its CPU verdicts are the CPU table's); a FAIL names its device and gives "
                "the verdict again at matmul precision `highest` (JAX runs float32 dots and "
                "convolutions in TF32 on such GPUs by default, torch's float32 matmuls not).",
                "",
            ]
        if not results and backend == "gpu":
            lines += [
                "Not measured (no device lent): no GPU rows were run (`jax.devices()` at the "
                f"last write: {header['devices']}). On a machine with a GPU the same script "
                "writes the same tables, every path on the GPU (torch on CUDA when torch sees it).",
                "",
            ]
        for result in results:
            if "error" in result and "rows" not in result:
                lines += [
                    f"### {MODELS[result['model']]}",
                    "",
                    f"Did not finish: {result['error']}",
                    "",
                ]
                continue
            lines += render_model(result)
        missing = [MODELS[m] for m in MODEL_ORDER if m not in {r["model"] for r in results}]
        if results and missing:
            lines += [f"Not measured yet on {title}: {'; '.join(missing)}.", ""]
    return "\n".join(lines)


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for pkg in ("torch", "jax", "flax", "onnxruntime", "transformers"):
        with contextlib.suppress(PackageNotFoundError):
            parts.append(f"{pkg} {version(pkg)}")
    return ", ".join(parts)


def _limit_threads(n: int) -> None:
    """Every framework on ``n`` intra-op threads (before jax is imported: XLA reads its flags
    once). On an oversubscribed machine torch's OpenMP barriers wait for descheduled threads,
    which slows a 2-thread batch-1 call 10-30x; one thread each compares the code, not that."""
    import torch

    torch.set_num_threads(n)
    if n == 1:
        flags = "--xla_cpu_multi_thread_eigen=false"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()


def _cpu() -> str:
    """The CPU model and its widest float SIMD: sessions land on different machines, and a
    run's absolute numbers only compare with runs on the same kind."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    simd = next((f for f in ("avx512f", "avx2", "sse4_2") if f in flags), None)
    return f"{model}, {os.cpu_count()} cores" + (f", {simd.upper()}" if simd else "")


def _accelerator(backend: str) -> dict:
    """For a run off the CPU: the device it ran on and the versions it ran with (a lent device
    machine has its own image, so the doc's header versions are not this run's)."""
    if backend == "cpu":
        return {}
    import jax

    return {"device": jax.devices()[0].device_kind, "versions": _versions()}


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def worker(args) -> dict:
    name = args.worker
    if args.threads:
        _limit_threads(args.threads)
    batches = args.batches or DEFAULT_BATCHES[name]
    bench = Bench(name, batches, args.repeat, args.dtypes, args)
    return bench.run()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,bert,cnn,transformer")
    parser.add_argument(
        "--batches",
        type=lambda s: tuple(int(b) for b in s.split(",")),
        default=None,
        help="batch sizes for every model (default per model: "
        + ", ".join(f"{k} {'/'.join(map(str, v))}" for k, v in DEFAULT_BATCHES.items())
        + ")",
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="fresh processes per model; each timing is the median over them (two runs an "
        "hour apart moved the hand-written bf16 timings 1.45-1.75x against each other)",
    )
    parser.add_argument("--compile-models", default=COMPILE_MODELS, help="models to torch.compile")
    parser.add_argument("--bf16-all-batches", action="store_true")
    parser.add_argument("--train-all-batches", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="intra-op threads for torch, onnxruntime and XLA (1: XLA's eigen pool off); "
        "0: each framework's default",
    )
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=["fp32", "bf16"])
    parser.add_argument(
        "--peers", default=PEERS, help="folder with torch2jax / torchax (pip --target)"
    )
    parser.add_argument(
        "--skip",
        type=lambda s: s.split(","),
        default=[],
        help="path groups to leave out: torch,ort,peers,hand,xconv",
    )
    parser.add_argument("--no-compile", action="store_true", help="leave out torch.compile")
    parser.add_argument("--no-train", action="store_true")
    parser.add_argument(
        "--one-layout",
        action="store_true",
        help="to_jax at its default kernel_layout only (leave out the other layout's row)",
    )
    parser.add_argument(
        "--no-infer", action="store_true", help="training steps only (their missing batches)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: batch 1, 2 repeats, fp32, no torch.compile"
    )
    parser.add_argument("--out", type=Path, default=OUT_MD)
    parser.add_argument("--no-write", action="store_true", help="print the table, write nothing")
    parser.add_argument(
        "--render", action="store_true", help="rewrite the doc from its .json store, run nothing"
    )
    parser.add_argument(
        "--drop-path",
        help="with --render: first remove this path's stored rows (a row label no longer "
        "measured, e.g. the old non-default kernel layout)",
    )
    parser.add_argument(
        "--allow-dirty",
        action="store_true",
        help="write the default doc from a tree with uncommitted changes (rows marked so)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv_list = list(argv if argv is not None else sys.argv[1:])
    if args.quick:
        args.batches, args.repeat, args.dtypes, args.no_compile = (1,), 2, ["fp32"], True
    if args.worker:
        # torch.compile's first call compiles from scratch, not from an earlier run's kernels
        # in inductor's on-disk cache.
        with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)
            result = worker(args)
        args.json.write_text(json.dumps(result))
        return 0

    stored_path = args.out.with_suffix(".json")
    if args.render:
        stored = store.load(stored_path)
        if args.drop_path:
            gone = sum(store.drop(stored, b, args.drop_path) for b in list(stored))
            store.save(stored_path, stored)
            print(f"dropped {gone} stored row(s) of {args.drop_path!r}", file=sys.stderr)
        _write(args, stored)
        return 0
    commit = store.commit((args.out, stored_path))  # at the start: the code that runs
    if (
        store.DIRTY in commit
        and not args.no_write
        and args.out.resolve() == OUT_MD.resolve()
        and not args.allow_dirty
    ):
        print(
            f"bench_throughput: the tree has uncommitted changes ({commit}); commit them first "
            f"(rows of {OUT_MD.name} are measured at a commit), or pass --out elsewhere, "
            "--no-write or --allow-dirty",
            file=sys.stderr,
        )
        return 2
    backend = _backend()
    failed = False
    new = []
    for name in args.models.split(","):
        load_before = _load()
        results = []
        for i in range(args.processes):
            if args.processes > 1:
                print(f"[{name}] process {i + 1} of {args.processes}", file=sys.stderr, flush=True)
            results.append(_run_worker(name, argv))
        result = store.combine(results)
        failed = failed or any("error" in r for r in results)
        new.append(result)
        if args.no_write:
            continue
        stamp = {
            "commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_before": load_before,
            "load_after": _load(),
            "cpu": _cpu(),
            **_accelerator(backend),
            "argv": ["--models", name, *_strip_models(argv)],
        }
        # Merged and written after each model, so a stopped run keeps what it measured.
        stored = store.merge(store.load(stored_path), backend, result, stamp)
        store.save(stored_path, stored)
        _write(args, stored)
    if args.no_write:
        print(render({backend: new}, _header()))
    return 1 if failed else 0


def _run_worker(name: str, argv) -> dict:
    """One fresh process measuring ``name``: its result, or ``{"error": ...}``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, *_strip_models(argv), "--worker", name, "--json", str(out)]
        proc = subprocess.run(cmd, check=False)
        if proc.returncode != 0 or not out.exists():
            return {"model": name, "error": f"worker exited with {proc.returncode}"}
        return json.loads(out.read_text())


def _backend() -> str:
    import jax

    return jax.devices()[0].platform


def _header() -> dict:
    import jax

    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.python_version()}",
        "versions": _versions(),
        "devices": ", ".join(str(d) for d in jax.devices()),
    }


def _write(args, stored: dict) -> None:
    sections = {backend: store.results(stored, backend, MODEL_ORDER) for backend in stored}
    args.out.write_text(render(sections, _header()) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


def _strip_models(argv) -> list[str]:
    items = list(argv if argv is not None else sys.argv[1:])
    out, skip = [], False
    for a in items:
        if skip:
            skip = False
            continue
        if a == "--models":
            skip = True
            continue
        if a.startswith("--models="):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    raise SystemExit(main())

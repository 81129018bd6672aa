"""The model zoo: transformers model classes from tiny configs and keras.applications models,
each through every direction xconv offers, written to docs/models.md (the zoo block).

    python benchmarks/zoo.py                       # every row; rewrites the zoo block
    python benchmarks/zoo.py --only t5_encoder,swin --no-write   # these rows; prints them
    python benchmarks/zoo.py --transformers4 /work/tf446         # with the Flax rows
    python benchmarks/zoo.py --transformers4 /work/tf446 --flax-rows   # only those

Rows: the transformers builders of ``tests/models/test_hf_models.py`` (random weights from
``torch.manual_seed(0)``, ``HF_HUB_OFFLINE=1``, default attention implementation) and
``keras.applications`` models (``weights=None``, ``classifier_activation=None``, batch 1 at
the smallest size each accepts, batch norm statistics from a batch holding the input so the
logits keep real magnitude; see :func:`keras_row`), each in a process of its own.

Directions, through the Python API on the in-memory model:

* torch: ``from_torch`` then ``to_jax``, ``to_flax`` (linen, with ``example_inputs``: the
  generated code is checked against ``to_jax`` first) and ``to_torch_source`` (checked against
  ``to_torch``), each compared with the torch module;
* keras: ``from_tf`` then ``to_jax``, ``to_flax`` and ``to_torch``, compared with Keras;
* Flax (the Flax model classes of transformers 4.46.3, run by ``benchmarks/zoo_flax.py`` in
  a process of their own with ``--transformers4 DIR`` / ``$XCONV_ZOO_TRANSFORMERS4`` first on
  its path; without it those rows read "not installed"): ``from_flax`` then ``to_jax``,
  ``to_torch`` and ``to_torch_source`` (checked against ``to_torch``), compared with Flax.

A cell is ``pass`` when every output is within ``RTOL`` of the reference's largest magnitude
(keras rows: by the parity checker's oracle policy against a float64 run of the same Keras
model, :func:`_judge_oracle`), ``FAIL`` (parity) or ``error`` with the first line of the
error; a reference whose largest magnitude is under ``MIN_SCALE`` proves nothing and the cell
reads ``not run``. Failures are grouped by cause above the table with the number of rows each
cause blocks; rows that did not run are counted apart. With ``--peers DIR`` an installed
peer's verdict on the same row is a column of its own (``benchmarks/zoo_peers.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DOC = ROOT / "docs" / "models.md"
BEGIN, END = "<!-- zoo:begin -->", "<!-- zoo:end -->"
STAMP = "Written by `python benchmarks/zoo.py`"
RTOL = 1e-4
#: Whether cells show seconds (off with --no-times: a run outside the benchmark lock).
TIMES = [True]
MIN_SCALE = 1e-3

#: The last torch column: every target of the row at two other input shapes (batch 1 and
#: batch+1, the other symbolic dims shorter and longer), see :func:`other_shapes`.
OTHER_SHAPES = "runs at other shapes"
TORCH_DIRECTIONS = ("torch-to-jax", "torch-to-flax", "torch-to-torch-source", OTHER_SHAPES)
KERAS_DIRECTIONS = ("keras-to-jax", "keras-to-flax", "keras-to-torch")
KERAS_KIND = "keras.applications"
FLAX_DIRECTIONS = ("flax-to-jax", "flax-to-torch", "flax-to-torch-source")
FLAX_KIND = "transformers 4.46.3 Flax"
#: Where transformers 4.46.3 is installed (``pip install --target DIR``); --transformers4.
TRANSFORMERS4_ENV = "XCONV_ZOO_TRANSFORMERS4"
#: Every model of ``keras.applications`` (Keras 3.15); ``tests/models/test_keras_zoo.py``
#: checks this list against the installed package.
KERAS_APPS = (
    "ConvNeXtBase", "ConvNeXtLarge", "ConvNeXtSmall", "ConvNeXtTiny", "ConvNeXtXLarge",
    "DenseNet121", "DenseNet169", "DenseNet201", "EfficientNetB0", "EfficientNetB1",
    "EfficientNetB2", "EfficientNetB3", "EfficientNetB4", "EfficientNetB5", "EfficientNetB6",
    "EfficientNetB7", "EfficientNetV2B0", "EfficientNetV2B1", "EfficientNetV2B2",
    "EfficientNetV2B3", "EfficientNetV2L", "EfficientNetV2M", "EfficientNetV2S",
    "InceptionResNetV2", "InceptionV3", "MobileNet", "MobileNetV2", "MobileNetV3Large",
    "MobileNetV3Small", "NASNetLarge", "NASNetMobile", "ResNet101", "ResNet101V2", "ResNet152",
    "ResNet152V2", "ResNet50", "ResNet50V2", "VGG16", "VGG19", "Xception",
)  # fmt: skip
#: Input side of each keras.applications row: the smallest the model accepts (32 unless set).
KERAS_SIZE = {"InceptionV3": 75, "InceptionResNetV2": 75, "Xception": 71}
#: Rows run under ``--heavy-lock`` (several GiB while converting).
KERAS_HEAVY = {"ConvNeXtXLarge", "ConvNeXtLarge", "EfficientNetV2L", "EfficientNetV2M",
               "NASNetLarge", "EfficientNetB7"}  # fmt: skip
#: Column title of each kind's peer (``--peers``).
PEER_TITLES = {
    "transformers": "peer torch2jax: torch-to-jax",
    "keras.applications": "peer onnx2torch: onnx-to-torch",
}
#: Seconds a keras row's process may run.
KERAS_TIMEOUT = 1200
#: The keras rows' results, merged across runs of ``--only`` (the keras block is rendered
#: from it).
KERAS_JSON = ROOT / "benchmarks" / "zoo_keras.json"
#: Folder of the peers (``--peers``; ``benchmarks/zoo_peers.py``), and the ones found in it.
PEERS_ENV = "XCONV_ZOO_PEERS"
PEERS: list[str] = []
#: More text architectures, built by ``AutoModel.from_config`` from the model type's default
#: config shrunk by :data:`SHRINK` (only the fields a config has are set).
AUTO_TEXT = (
    "gemma", "gemma2", "qwen3", "olmo", "olmo2", "granite", "stablelm", "gpt_neox", "opt",
    "bloom", "falcon", "gpt_neo", "gptj", "codegen", "starcoder2", "xlm-roberta", "mobilebert",
    "deberta-v2", "megatron-bert", "ernie", "camembert", "mpnet", "rembert",
)  # fmt: skip
SHRINK = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 100,
    "max_position_embeddings": 64, "head_dim": 8, "use_cache": False, "n_embd": 32,
    "n_layer": 2, "n_head": 4, "n_positions": 64, "embedding_size": 32, "ffn_dim": 64,
    "word_embed_proj_dim": 32, "rotary_dim": 4, "n_inner": 64, "pad_token_id": 0,
    "bos_token_id": 0, "eos_token_id": 0, "max_seq_len": 64,
}  # fmt: skip


@dataclass(frozen=True)
class Cell:
    verdict: str  # pass | FAIL | error | not run
    rel_err: float | None = None
    seconds: float | None = None
    cause: str | None = None
    #: Judged by the oracle policy (keras rows): the float32 reference's own error against
    #: the float64 run, relative to its largest magnitude (``rel_err`` is then the
    #: candidate's against the float64 run).
    ref_err: float | None = None

    def text(self) -> str:
        parts = [self.verdict]
        if self.verdict == "pass" and self.cause:  # what a passing cell covered
            parts[0] += f" ({self.cause})"
        if self.rel_err is not None:
            parts.append(f"{self.rel_err:.1e}")
        if self.ref_err is not None:
            parts[-1] += f" (ref {self.ref_err:.1e})"
        if self.seconds is not None and TIMES[0]:
            parts.append(f"{self.seconds:.0f} s")
        return ", ".join(parts)


def _numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().cpu().float().numpy()
    return np.asarray(x, dtype=np.float64) if np.asarray(x).dtype.kind in "fc" else np.asarray(x)


def _compare(got, want: list[np.ndarray], oracle: list[np.ndarray] | None = None) -> tuple:
    """``(verdict, rel_err, cause)``, or with ``oracle`` (float64 runs of the reference)
    ``(verdict, rel_err, cause, ref_err)`` judged by :func:`_judge_oracle`."""
    got = list(got) if isinstance(got, tuple | list) else [got]
    if len(got) != len(want):
        return "FAIL", None, f"{len(got)} outputs, expected {len(want)}"
    scale = max(
        (float(np.abs(w).max()) for w in want if w.size and w.dtype.kind in "fc"), default=0
    )
    if scale < MIN_SCALE:
        return "not run", None, f"reference ~0 (largest magnitude {scale:.1e})"
    if oracle is not None:
        return _judge_oracle([_numpy(g) for g in got], want, oracle)
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        g = _numpy(g)
        if g.shape != w.shape:
            return "FAIL", None, f"shape {g.shape} vs {w.shape}"
        worst = max(worst, float(np.abs(g.astype(np.float64) - w).max()) / scale)
    return ("pass" if worst <= RTOL else "FAIL"), worst, None


#: The parity checker's default policy (``xconv.parity``): what a keras row is judged by.
ORACLE_POLICY = "oracle"


def _judge_oracle(got: list[np.ndarray], want: list[np.ndarray], oracle: list[np.ndarray]):
    """Judge ``got`` as the parity checker does (:func:`xconv.parity.metrics.compare`, the
    oracle policy, k=4): each element's error against ``oracle`` (the reference run in
    float64 on the same weights) within k times the float32 reference ``want``'s own error
    per unit of magnitude, plus a floor of a few float32 ulps. A deep float32 net
    accumulates ~1e-4 of its logits (ResNet152) in the reference too; a candidate k times
    worse than the reference still fails. Returns ``(verdict, rel_err, cause, ref_err)``,
    errors relative to the float64 output's largest magnitude."""
    from xconv.parity.metrics import compare
    from xconv.parity.policies import resolve_policy

    policy = resolve_policy(ORACLE_POLICY)
    scale = max((float(np.abs(o).max()) for o in oracle if o.size), default=0.0)
    scale = max(scale, MIN_SCALE)
    worst = ref_worst = 0.0
    failed = []
    for i, (g, w, o) in enumerate(zip(got, want, oracle, strict=True)):
        if g.shape != w.shape:
            return "FAIL", None, f"shape {g.shape} vs {w.shape}", None
        m = compare(f"output {i}", g.astype(w.dtype), w, policy, np.asarray(o, np.float64),
                    logits=False)  # fmt: skip
        worst = max(worst, (m.cand_err or 0.0) / scale)
        ref_worst = max(ref_worst, (m.ref_err or 0.0) / scale)
        if not m.passed:
            failed.append(f"output {i}: {m.mismatches} elements over the bound, worst "
                          f"{m.excess:.1f}x it ({policy.describe()})")  # fmt: skip
    if failed:
        return "FAIL", worst, failed[0], ref_worst
    return "pass", worst, None, ref_worst


def _cell(run: Callable[[], tuple], want: list[np.ndarray], oracle=None) -> Cell:
    start = time.perf_counter()
    try:
        got = run()
    except Exception as e:  # noqa: BLE001 (recorded in the table)
        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return Cell("error", None, time.perf_counter() - start, f"{type(e).__name__}: {text}"[:160])
    verdict, err, cause, *ref = _compare(got, want, oracle)
    return Cell(verdict, err, time.perf_counter() - start, cause, *ref)


def _import(path: Path):
    import importlib.util
    import uuid

    spec = importlib.util.spec_from_file_location(f"zoo_{uuid.uuid4().hex}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _flax_run(model, inputs, where: Path, keep: dict | None = None) -> Callable[[], tuple]:
    import xconv

    def run():
        out = xconv.to_flax(model, where, example_inputs=inputs)
        flax_model, variables = _import(out / "model.py").load(out)
        if keep is not None:
            keep["flax"] = lambda *xs: flax_model.apply(variables, *xs)
        return flax_model.apply(variables, *inputs)

    return run


def other_shapes(model, inputs: tuple[np.ndarray, ...]) -> tuple[list, list[str]]:
    """Two input sets at other shapes than the example's, from the converted IR's symbolic
    dims: ``batch`` 1 with the other symbolic dims shorter (5/8 of the example's), and batch+1
    with them longer (3/2). Each input is cropped or tiled along the resized axes (token ids
    stay in the vocabulary, masks stay masks). Returns ``(sets, resized dim names)``; no sets
    when the conversion kept every dim at the example's size."""
    sizes: dict[str, int] = {}
    for value, x in zip(model.graph.inputs, inputs, strict=True):
        for axis, dim in enumerate(value.shape or ()):
            if not isinstance(dim, int) and getattr(dim, "value", None):
                sizes.setdefault(dim.value, x.shape[axis])
    if not sizes:
        return [], []

    def size(name: str, n: int, small: bool) -> int:
        if name == "batch" or name.startswith("batch"):
            return 1 if small else n + 1
        return max(2, n * 5 // 8) if small else n * 3 // 2

    sets = []
    for small in (True, False):
        want = {name: size(name, n, small) for name, n in sizes.items()}
        arrays = []
        for value, x in zip(model.graph.inputs, inputs, strict=True):
            for axis, dim in enumerate(value.shape or ()):
                if not isinstance(dim, int) and getattr(dim, "value", None) in want:
                    x = np.take(x, np.arange(want[dim.value]) % x.shape[axis], axis=axis)
            arrays.append(np.ascontiguousarray(x))
        sets.append(tuple(arrays))
    return sets, sorted(sizes)


def _other_shapes_cell(model, module, inputs, runners: dict) -> Cell:
    """Every target of the row (to_jax, the generated Flax and torch source) at the two
    :func:`other_shapes` sets against the torch module at the same inputs: ``pass (batch,
    seq)`` names the dims that varied; ``fixed`` when the conversion kept every dim."""
    import torch

    start = time.perf_counter()
    sets, names = other_shapes(model, inputs)
    if not sets:
        return Cell("fixed", None, time.perf_counter() - start, "every dim at the example's")
    worst, shown = 0.0, []
    for arrays in sets:
        try:
            with torch.no_grad():
                out = module(*(torch.from_numpy(a) for a in arrays))
        except Exception as e:  # noqa: BLE001 (the source itself rejects the shape)
            text = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return Cell("error", None, time.perf_counter() - start,
                        f"the torch module rejects {[a.shape for a in arrays]}: {text}"[:160])  # fmt: skip
        outs = out.to_tuple() if hasattr(out, "to_tuple") else out
        outs = outs if isinstance(outs, tuple | list) else (outs,)
        want = [_numpy(t).astype(np.float64) for t in outs if isinstance(t, torch.Tensor)]
        shown.append("x".join(str(d) for d in arrays[0].shape))
        for target, run in runners.items():
            cell = _cell(lambda run=run, arrays=arrays: run(*arrays), want)
            if cell.verdict != "pass":
                cause = f"{target} at {shown[-1]}: {cell.cause or cell.verdict}"
                return Cell(cell.verdict, cell.rel_err, time.perf_counter() - start, cause[:160])
            worst = max(worst, cell.rel_err or 0.0)
    detail = f"{', '.join(names)}: {' and '.join(shown)}"
    return Cell("pass", worst, time.perf_counter() - start, detail)


def _auto_build(name: str):
    """``(module, args)`` of ``AutoModel`` for ``name`` from its shrunk default config."""
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(name)
    for key, value in SHRINK.items():
        if hasattr(cfg, key):
            with contextlib.suppress(AttributeError):  # a derived property (Falcon's head_dim)
                setattr(cfg, key, value)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    return transformers.AutoModel.from_config(cfg), (ids,)


def torch_row(name: str, where: Path) -> tuple[list[Cell], float]:
    import torch

    import xconv
    from tests.models.test_hf_models import _build

    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.manual_seed(0)
    start = time.perf_counter()
    try:
        module, args = _auto_build(name) if name in AUTO_TEXT else _build(name)
        module = module.eval()
        with torch.no_grad():
            out = module(*args)
        outs = out.to_tuple() if hasattr(out, "to_tuple") else out
        want = [_numpy(t).astype(np.float64) for t in outs if isinstance(t, torch.Tensor)]
        model = xconv.from_torch(module, args)
    except Exception as e:  # noqa: BLE001
        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
        cell = Cell("error", None, None, f"import: {type(e).__name__}: {text}"[:160])
        return [cell] * len(TORCH_DIRECTIONS), time.perf_counter() - start
    import_s = time.perf_counter() - start
    inputs = tuple(a.numpy() for a in args)

    keep: dict = {}

    def jax_run():
        fn, params = xconv.to_jax(model)
        keep["to_jax"] = lambda *xs: fn(params, *xs)
        return fn(params, *inputs)

    def source_run():
        source, state = xconv.to_torch_source(model, example_inputs=inputs)
        namespace: dict = {}
        exec(compile(source, "generated", "exec"), namespace)  # noqa: S102
        generated = namespace["Model"]().eval()
        generated.load_state_dict(state)

        def run(*xs):
            with torch.no_grad():
                return generated(*(torch.from_numpy(x) for x in xs))

        keep["torch source"] = run
        return run(*inputs)

    cells = [
        _cell(jax_run, want),
        _cell(_flax_run(model, inputs, where / f"{name}_flax", keep), want),
        _cell(source_run, want),
    ]
    runners = {k: keep[k] for k in ("to_jax", "flax", "torch source") if k in keep}
    cells.append(_other_shapes_cell(model, module, inputs, runners))
    if "torch2jax" in PEERS:
        from benchmarks.zoo_peers import torch2jax_run

        cells.append(_cell(torch2jax_run(module, args), want[:1]))
    return cells, import_s


def float64_twin(build: Callable, net, inputs: tuple[np.ndarray, ...]) -> list[np.ndarray]:
    """The outputs of ``net`` computed in float64: ``build()`` makes the same architecture
    under the ``float64`` dtype policy, ``set_weights`` gives it ``net``'s weights (batch norm
    statistics included), and it runs on ``inputs`` in float64 (inference mode). The parity
    checker's oracle for a keras row. Raises when a layer of the twin does not hold or give
    float64 (it would not be an oracle)."""
    import keras

    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        twin = build()
        twin.set_weights([np.asarray(w, np.float64) if np.asarray(w).dtype.kind == "f"
                          else np.asarray(w) for w in net.get_weights()])  # fmt: skip
        held = {keras.backend.standardize_dtype(w.dtype) for w in twin.weights}
        held = {d for d in held if "float" in d}
        outs = twin(*(np.asarray(a, np.float64) for a in inputs), training=False)
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)
    outs = list(outs) if isinstance(outs, tuple | list) else [outs]
    got = {keras.backend.standardize_dtype(o.dtype) for o in outs} | held
    if got - {"float64"}:
        raise TypeError(f"the float64 twin holds or gives {sorted(got)}")
    return [np.asarray(o, np.float64) for o in outs]


def calibrate_batch_norm(net, batch: np.ndarray) -> None:
    """Set each ``BatchNormalization`` of the Keras model ``net`` to the statistics of
    ``batch``, each channel's variance floored at its layer's mean variance (see
    :func:`keras_row`): an untrained keras.applications model keeps its initial statistics,
    and through them its activations can fade to nothing (MobileNetV2 at alpha 0.35, 64x64:
    features ~1e-10, the softmax constant)."""
    import keras

    norms = [layer for layer in net.layers if isinstance(layer, keras.layers.BatchNormalization)]
    for layer in norms:
        layer.momentum = 0.0
    net(batch, training=True)
    for layer in norms:  # floor: no channel divides by a variance of ~0
        var = np.asarray(layer.moving_variance)
        layer.moving_variance.assign(np.maximum(var, var.mean()))


def keras_row(name: str, where: Path) -> tuple[list[Cell], float]:
    """One keras.applications row, batch 1 at :data:`KERAS_SIZE`.

    Batch norm statistics are first set to those of a batch of 4 holding the input, each
    channel's variance floored at its layer's mean variance: with the initial statistics
    MobileNetV3's logits are ~7e-4 and prove nothing (a tenth of the way to the batch's, the
    earlier rule: ~5e-3); with the batch's unfloored, channels of the 1x1 last stage divide by
    variances of ~0 and amplify float32 rounding (DenseNet121 to_torch 1e-3 of the logits,
    floored 4e-6).

    Cells are judged by the parity checker's oracle policy (:func:`_judge_oracle`) against
    the float64 twin of the same weights (:func:`float64_twin`), not by a fixed tolerance."""
    import keras
    import torch

    import xconv

    keras.utils.set_random_seed(0)
    start = time.perf_counter()
    side = KERAS_SIZE.get(name, 32)
    calib = (np.random.RandomState(0).rand(4, side, side, 3) * 255).astype(np.float32)
    x = calib[:1]
    try:
        net = getattr(keras.applications, name)(
            weights=None, input_shape=(side, side, 3), classifier_activation=None
        )
        calibrate_batch_norm(net, calib)
        want = [np.asarray(net(x, training=False), dtype=np.float32)]
        model = xconv.from_tf(net, (x,))
    except Exception as e:  # noqa: BLE001
        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
        cell = Cell("error", None, None, f"import: {type(e).__name__}: {text}"[:160])
        return [cell] * len(KERAS_DIRECTIONS), time.perf_counter() - start
    import_s = time.perf_counter() - start
    try:
        build = lambda: getattr(keras.applications, name)(  # noqa: E731
            weights=None, input_shape=(side, side, 3), classifier_activation=None
        )
        oracle = float64_twin(build, net, (x,))
    except Exception as e:  # noqa: BLE001
        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
        cell = Cell("error", None, None, f"float64 reference: {type(e).__name__}: {text}"[:160])
        return [cell] * len(KERAS_DIRECTIONS), import_s

    def jax_run():
        fn, params = xconv.to_jax(model)
        return fn(params, x)

    def torch_run():
        module, _ = xconv.to_torch(model)
        with torch.no_grad():
            return module(torch.from_numpy(x))

    cells = [
        _cell(jax_run, want, oracle),
        _cell(_flax_run(model, (x,), where / f"{name}_flax"), want, oracle),
        _cell(torch_run, want, oracle),
    ]
    if "onnx2torch" in PEERS:
        from benchmarks.zoo_peers import onnx2torch_run

        cells.append(_cell(onnx2torch_run(model, (x,), where), want, oracle))
    return cells, import_s


def keras_rows(
    names: list[str],
    heavy_lock: str | None,
    on_row: Callable | None = None,
    timeout: float = KERAS_TIMEOUT,
) -> list[tuple[str, list[Cell], float]]:
    """Each keras row in a process of its own (``--keras-child``), with ``timeout`` seconds;
    the rows of :data:`KERAS_HEAVY` under ``flock heavy_lock`` when given, one row per hold
    (the time waiting for the lock does not count against ``timeout``). A row that runs out
    of time, or whose process is killed (SIGKILL: the kernel's out-of-memory killer on this
    machine), reads "not run" with that reason: it says nothing about the converters."""
    import json
    import subprocess

    out = []
    for name in names:
        cmd = [sys.executable, str(ROOT / "benchmarks" / "zoo.py"), "--keras-child", name]
        lock = heavy_lock if heavy_lock and name in KERAS_HEAVY else None
        try:
            with _held(lock):
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                      timeout=timeout)  # fmt: skip
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if lines:
                got = json.loads(lines[-1])
                cells = [Cell(*c) for c in got["cells"]]
                import_s = got["import_s"]
            elif proc.returncode == -9:
                why = (f"killed (SIGKILL, out of memory?) on this machine "
                       f"({_ram_gib():.0f} GiB RAM, {os.cpu_count()} cores)")  # fmt: skip
                cells, import_s = [Cell("not run", None, None, why)] * 3, 0.0
            else:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                crash = f"process exited {proc.returncode}: {tail}"[:160]
                cells, import_s = [Cell("error", None, None, crash)] * 3, 0.0
        except subprocess.TimeoutExpired:
            why = f"over {timeout:g} s on this machine ({os.cpu_count()} cores)"
            cells = [Cell("not run", None, None, why)] * 3
            import_s = 0.0
        out.append((name, cells, import_s))
        print(name, [c.text() for c in cells], [c.cause for c in cells if c.cause], flush=True)
        if on_row is not None:
            on_row(out[-1])
    return out


@contextlib.contextmanager
def _held(path: str | None):
    """``flock`` on ``path`` (as flock(1) takes it) for the block; nothing when None."""
    if path is None:
        yield
        return
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ram_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def _keras_child(name: str) -> int:
    import json

    from benchmarks.zoo_peers import use

    PEERS[:] = use(os.environ.get(PEERS_ENV))

    with tempfile.TemporaryDirectory() as tmp:
        cells, import_s = keras_row(name, Path(tmp))
    row = {"name": name, "import_s": import_s,
           "cells": [[c.verdict, c.rel_err, c.seconds, c.cause, c.ref_err] for c in cells]}  # fmt: skip
    print(json.dumps(row), flush=True)
    return 0


def rows() -> list[tuple[str, str, Callable]]:
    """``(name, kind, runner)`` for every zoo row, in table order."""
    from tests.models.models_table import MODELS

    out = [(name, "transformers", torch_row) for name, _, _ in MODELS]
    out += [(name, "transformers", torch_row) for name in AUTO_TEXT]
    out += [(name, KERAS_KIND, None) for name in KERAS_APPS]  # keras_rows: a process each
    from benchmarks.zoo_flax import MODELS as FLAX_MODELS

    return out + [(f"flax_{name}", FLAX_KIND, None) for name in FLAX_MODELS]


def flax_rows(names: list[str], transformers4: str | None) -> list[tuple[str, list[Cell], float]]:
    """The Flax rows, run by ``benchmarks/zoo_flax.py`` in a process of their own with
    ``transformers4`` first on its path; without it every row reads not installed."""
    import json
    import subprocess

    missing = (
        f"transformers 4.46.3 not installed (give --transformers4 DIR or ${TRANSFORMERS4_ENV})"
    )
    if not transformers4 or not (Path(transformers4) / "transformers").is_dir():
        cell = Cell("not run", None, None, missing)
        return [(n, [cell] * len(FLAX_DIRECTIONS), 0.0) for n in names]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "zoo_flax.py"), "--transformers4",
           transformers4, "--only", ",".join(n.removeprefix("flax_") for n in names)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    out = []
    for line in proc.stdout:
        got = json.loads(line)
        if "error" in got:
            cell = Cell("not run", None, None, got["error"])
            out = [(n, [cell] * len(FLAX_DIRECTIONS), 0.0) for n in names]
            break
        cells = [Cell(v, e, t, c) for v, e, t, c in got["cells"]]
        out.append((f"flax_{got['name']}", cells, got["import_s"]))
        print(out[-1][0], [c.text() for c in cells], [c.cause for c in cells if c.cause],
              flush=True)  # fmt: skip
    proc.wait()
    done = {n for n, _, _ in out}
    crash = Cell("error", None, None, f"zoo_flax.py exited {proc.returncode} before this row")
    return out + [(n, [crash] * len(FLAX_DIRECTIONS), 0.0) for n in names if n not in done]


def _directions(results) -> list[str]:
    """The direction of every cell of ``results``, in order."""
    by_kind = {"transformers": TORCH_DIRECTIONS, "keras.applications": KERAS_DIRECTIONS,
               FLAX_KIND: FLAX_DIRECTIONS}  # fmt: skip
    return [d for _, kind, _, _ in results for d in by_kind[kind]]


def _cause_key(cause: str) -> str:
    """``cause`` as one group: objects' addresses dropped, and a call's arguments (a peer's
    "Unhandled function call: torch.gather(*(<...>, ...)" names the function that is missing)."""
    key = re.sub(r"<([\w.]+) object at 0x[0-9a-f]+>", r"<\1>", cause)
    return key.split("(*(")[0]


def render(results: list[tuple[str, str, list[Cell], float]]) -> str:
    lines = []
    causes: dict[str, set[str]] = {}
    peer_causes: dict[str, set[str]] = {}
    skipped: dict[str, set[str]] = {}
    width = {"transformers": len(TORCH_DIRECTIONS), "keras.applications": len(KERAS_DIRECTIONS),
             FLAX_KIND: len(FLAX_DIRECTIONS)}  # fmt: skip
    for name, kind, cells, _ in results:  # xconv's cells, then a peer's (--peers)
        for i, cell in enumerate(cells):
            if cell.verdict != "pass" and cell.cause:
                mine = causes if i < width[kind] else peer_causes
                if cell.verdict == "not run" and i < width[kind]:
                    mine = skipped
                mine.setdefault(_cause_key(cell.cause), set()).add(name)
    passed = sum(all(c.verdict == "pass" for c in cells[: width[k]]) for _, k, cells, _ in results)
    # a row none of whose directions ran (its reference does not run, or it ran out of time
    # or memory on this machine) says nothing about the converters: counted apart
    idle = [
        n for n, k, cells, _ in results if all(c.verdict == "not run" for c in cells[: width[k]])
    ]
    gap = f" Not run, not counted: {len(idle)} (reasons below)." if idle else ""
    lines.append(f"{passed} of {len(results) - len(idle)} models pass in every direction.{gap}")
    lines.append("")
    peered = [(k, cells[width[k]]) for _, k, cells, _ in results if len(cells) > width[k]]
    for kind, title in PEER_TITLES.items():
        got = [c for k, c in peered if k == kind]
        if got:
            ok = sum(c.verdict == "pass" for c in got)
            lines.append(f"Column {title}: passes {ok} of the {len(got)} rows it ran on.")
            lines.append("")
    cells = [c for _, k, row, _ in results for c in row[: width[k]]]
    disagree = sum(bool(c.cause and "disagrees with to_" in c.cause) for c in cells)
    checked = sum(d.endswith(("-flax", "-torch-source")) for d in _directions(results))
    lines.append(
        f"Generated source against the IR runtime (`to_flax` / `to_torch_source` with example "
        f"inputs, checked against `to_jax` / `to_torch`): {disagree} disagreements in "
        f"{checked} generated-source cells."
    )
    lines.append("")
    for title, found in (("Failures by cause (models blocked):", causes),
                         ("Not run, by reason (models):", skipped),
                         ("Peer failures by cause (models):", peer_causes)):  # fmt: skip
        if not found:
            continue
        lines.append(title)
        lines.append("")
        for cause, names in sorted(found.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            lines.append(f"- {len(names)}: `{cause}` ({', '.join(sorted(names))})")
        lines.append("")
    for kind, directions in (
        ("transformers", TORCH_DIRECTIONS),
        ("keras.applications", KERAS_DIRECTIONS),
        (FLAX_KIND, FLAX_DIRECTIONS),
    ):
        mine = [r for r in results if r[1] == kind]
        if not mine:
            continue
        n = len(directions)
        if any(len(cells) > n for _, _, cells, _ in mine):
            directions = (*directions, PEER_TITLES[kind])
        lines += [
            f"| {kind} model | " + " | ".join(directions) + " | import s |",
            "| --- | " + " | ".join("---" for _ in directions) + " | ---: |",
        ]
        for name, _, cells, import_s in mine:
            shown = [c.text() for c in cells[:n]]
            if len(directions) > n:
                shown.append(cells[n].text() if len(cells) > n else "-")
            text = " | ".join(shown)
            secs = f"{import_s:.1f}" if TIMES[0] else "-"
            lines.append(f"| {name} | {text} | {secs} |")
        lines.append("")
    return "\n".join(lines)


FLAX_BEGIN, FLAX_END = "<!-- zoo-flax:begin -->", "<!-- zoo-flax:end -->"
KERAS_BEGIN, KERAS_END = "<!-- zoo-keras:begin -->", "<!-- zoo-keras:end -->"
#: Title of the block each kind of row is written to (None: the main zoo block).
BLOCKS = {
    None: (BEGIN, END, "## Zoo"),
    FLAX_KIND: (FLAX_BEGIN, FLAX_END, "## Zoo: Flax models of transformers 4.46.3"),
    KERAS_KIND: (KERAS_BEGIN, KERAS_END, "## Zoo: keras.applications"),
}


def write(text: str, stamp: str, kind: str | None = None) -> None:
    """Replace the block of ``kind`` (the main zoo block: the transformers rows; the Flax rows;
    the keras.applications rows): each is written by the run that ran its rows, so a run of
    one kind alone (a second process, another install) leaves the other tables as they were.
    Writing the keras block drops a keras table left in the main block by an older run."""
    begin, end, title = BLOCKS[kind]
    doc = DOC.read_text()
    block = f"{begin}\n{stamp}\n\n{text.rstrip()}\n{end}"
    if begin in doc:
        doc = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, doc, flags=re.S)
    else:
        doc = doc.rstrip("\n") + f"\n\n{title}\n\n" + block + "\n"
    if kind == KERAS_KIND:
        old = re.compile(r"\| keras\.applications model \|.*?\n(?=\n|" + re.escape(END) + ")",
                         flags=re.S)  # fmt: skip
        main = re.search(re.escape(BEGIN) + ".*?" + re.escape(END), doc, flags=re.S)
        if main and old.search(main.group(0)):
            moved = old.sub("(keras.applications rows: their own block below.)\n", main.group(0))
            doc = doc.replace(main.group(0), moved)
    DOC.write_text(doc)


def _merge_keras(new: list[tuple[str, list[Cell], float]], stamp: dict) -> list:
    """Merge ``new`` keras rows into :data:`KERAS_JSON` (each row keeps the commit, date and
    load it ran at) and return every stored row in :data:`KERAS_APPS` order."""
    import json

    stored = json.loads(KERAS_JSON.read_text()) if KERAS_JSON.exists() else {}
    for name, cells, import_s in new:
        stored[name] = {"import_s": import_s, **stamp,
                        "cells": [[c.verdict, c.rel_err, c.seconds, c.cause, c.ref_err]
                                  for c in cells]}  # fmt: skip
    stored = {n: stored[n] for n in KERAS_APPS if n in stored}
    KERAS_JSON.write_text(json.dumps(stored, indent=1) + "\n")
    return [(n, [Cell(*c) for c in r["cells"]], r["import_s"], r) for n, r in stored.items()]


def _keras_stamp(rows_: list) -> str:
    runs: dict[str, list[float]] = {}
    for _, _, _, r in rows_:
        runs.setdefault(f"`{r['commit']}` ({r['date']})", []).append(r["load"])
    where = "; ".join(
        f"{len(v)} rows at commit {k}, load average {min(v):.1f}-{max(v):.1f}"
        for k, v in runs.items()
    )
    missing = [n for n in KERAS_APPS if n not in {r[0] for r in rows_}]
    gap = f" Not run yet ({len(missing)}): {', '.join(missing)}." if missing else ""
    fixed = [n for n, _, _, r in rows_ if r.get("judge") != ORACLE_POLICY]
    old = (
        f" Judged by the older fixed rule (pass means <= {RTOL:g} of the float32 output's "
        f'largest magnitude, error against the float32 Keras output, no "ref"): '
        f"{len(fixed)} rows ({', '.join(fixed)})."
        if fixed
        else ""
    )
    return (
        f"{STAMP} (`--keras-rows`, or `--only NAME,...`: rows merge into "
        f"`benchmarks/zoo_keras.json`): {where}.{gap} Batch 1, 32 px unless `KERAS_SIZE` says "
        f"otherwise (Inception 75, Xception 71), a process per row. Judged as the parity "
        f"checker judges (`xconv.parity`, oracle policy, k=4, floor 8 ulp): the same Keras "
        f"model is run in float64 (dtype policy `float64`, the float32 model's weights through "
        f"`set_weights`) as ground truth, and each output element passes when its error "
        f"against the float64 run is within 4 times the float32 Keras output's own error per "
        f"unit of magnitude plus 8 float32 ulps, times the element's magnitude plus the "
        f"output's RMS. A deep float32 net's reference is itself ~1e-4 off (ResNet152), so no "
        f"fixed tolerance fits every row; a candidate 4 times worse than the float32 "
        f"reference fails. Errors shown: the candidate's against the float64 run and, as "
        f"\"ref\", the float32 Keras output's own, both relative to the float64 output's "
        f"largest magnitude.{old}"
    )


def _commit() -> str:
    import subprocess

    run = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                         capture_output=True, text=True)  # fmt: skip
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    # the script's own output (the doc, the keras rows' store) is not a code change
    outputs = (str(DOC.relative_to(ROOT)), str(KERAS_JSON.relative_to(ROOT)))
    changed = [ln for ln in run.stdout.splitlines() if ln.strip() and not ln.endswith(outputs)]
    return head + (" plus uncommitted changes" if changed else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated row names")
    parser.add_argument("--no-write", action="store_true", help="print, do not touch the doc")
    parser.add_argument("--flax-rows", action="store_true", help="the Flax rows (their block)")
    parser.add_argument(
        "--no-times", action="store_true", help="verdicts only, no seconds (not a benchmark)"
    )
    parser.add_argument(
        "--transformers4",
        default=os.environ.get(TRANSFORMERS4_ENV),
        help=f"folder holding transformers 4.46.3 for the Flax rows (default ${TRANSFORMERS4_ENV})",
    )
    parser.add_argument("--keras-rows", action="store_true", help="the keras rows (their block)")
    parser.add_argument("--heavy-lock", default=None,
                        help="flock this file around each row of KERAS_HEAVY")  # fmt: skip
    parser.add_argument("--keras-timeout", type=float, default=KERAS_TIMEOUT,
                        help="seconds a keras row may run; past it the row reads not run")  # fmt: skip
    parser.add_argument("--peers", default=os.environ.get(PEERS_ENV),
                        help="folder holding peers (torch2jax, onnx2torch) installed with pip "
                        f"--target: their verdict beside each row (default ${PEERS_ENV})")  # fmt: skip
    parser.add_argument("--keras-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--render-keras", action="store_true",
                        help="rewrite the keras block from benchmarks/zoo_keras.json, run nothing")  # fmt: skip
    opts = parser.parse_args(argv)
    if opts.keras_child:
        return _keras_child(opts.keras_child)
    if opts.render_keras:
        merged = _merge_keras([], {})
        write(render([(n, KERAS_KIND, c, s) for n, c, s, _ in merged]), _keras_stamp(merged),
              kind=KERAS_KIND)  # fmt: skip
        return 0
    TIMES[0] = not opts.no_times
    if opts.peers:
        from benchmarks.zoo_peers import use

        PEERS[:] = use(opts.peers)
        os.environ[PEERS_ENV] = opts.peers  # the keras rows' processes
        print("peers:", PEERS or "none found in " + opts.peers, flush=True)
    commit = _commit()  # at the start: the code that ran, whatever is committed meanwhile
    wanted = {n for n in opts.only.split(",") if n}
    if opts.flax_rows:
        wanted |= {n for n, k, _ in rows() if k == FLAX_KIND}
    if opts.keras_rows:
        wanted |= set(KERAS_APPS)
    results = []
    flax_names = [n for n, k, _ in rows() if k == FLAX_KIND and (not wanted or n in wanted)]
    if flax_names:  # first: transformers 5 is not yet imported in this process either way
        results += [(n, FLAX_KIND, c, s) for n, c, s in flax_rows(flax_names, opts.transformers4)]
    keras_names = [n for n, k, _ in rows() if k == KERAS_KIND and (not wanted or n in wanted)]
    if keras_names:
        date = time.strftime("%Y-%m-%d", time.gmtime())

        def stored(row) -> None:  # each row as it ends: a long run interrupted keeps its rows
            if not opts.no_write:
                _merge_keras([row], {"commit": commit, "date": date, "load": os.getloadavg()[0],
                                     "judge": ORACLE_POLICY})  # fmt: skip

        keras_new = keras_rows(keras_names, opts.heavy_lock, stored, opts.keras_timeout)
        results += [(n, KERAS_KIND, c, s) for n, c, s in keras_new]
    with tempfile.TemporaryDirectory() as tmp:
        for name, kind, runner in rows():
            if wanted and name not in wanted or runner is None:
                continue
            try:
                cells, import_s = runner(name, Path(tmp))
            except Exception:  # noqa: BLE001 (a crash of the harness itself)
                traceback.print_exc()
                continue
            results.append((name, kind, cells, import_s))
            print(name, [c.text() for c in cells], [c.cause for c in cells if c.cause], flush=True)
    date = time.strftime("%Y-%m-%d", time.gmtime())
    for kind in (None, FLAX_KIND, KERAS_KIND):
        mine = [r for r in results if r[1] == kind or kind is None and r[1] == "transformers"]
        if not mine:
            continue
        if kind == KERAS_KIND and not opts.no_write:
            merged = _merge_keras([], {})  # the rows were stored as each ended
            text = render([(n, KERAS_KIND, c, s) for n, c, s, _ in merged])
            print(text)
            write(text, _keras_stamp(merged), kind=KERAS_KIND)
            continue
        text = render(mine)
        print(text)
        if opts.no_write:
            continue
        names = {r[0] for r in mine}
        every = {r[0] for r in rows() if r[1] == (kind or "transformers")}
        scope = f" (rows: {', '.join(sorted(names))})" if names != every else ""
        stamp = (
            f"{STAMP} at commit `{commit}`{scope} ({date}, "
            f"{platform.machine()}, load average {os.getloadavg()[0]:.1f} at the end). Errors "
            f"are relative to the reference's largest magnitude; pass means <= {RTOL:g}."
            + ("" if TIMES[0] else " Times not recorded (run with --no-times).")
            + (
                f" Peer column: {', '.join(PEERS)} from `--peers` (`benchmarks/zoo_peers.py`)."
                if PEERS and kind is None
                else ""
            )  # fmt: skip
        )
        write(text, stamp, kind=kind)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Checkpoints larger than memory: meta trace, streamed shards, layerwise parity, bad input."""

from __future__ import annotations

import json
import os
import re
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from benchmarks.make_checkpoint import make_checkpoint
from xconv.checkpoint import CheckpointOptions, convert_checkpoint, from_checkpoint, write_target
from xconv.cli import main
from xconv.errors import WeightsError
from xconv.weights.shards import CheckpointIndex, ShardWriter, numpy_dtype, write_index
from xconv.weights.stream import LazyWeight, Planned, drop_page_cache, read_flat

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA = "transformers:LlamaForCausalLM"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A float32 Llama (hidden 512, 4 layers, vocab 8000): 92 MB in 6 shards."""
    out = tmp_path_factory.mktemp("ckpt")
    make_checkpoint(out, 2.5e7, dtype="float32", shard_size=20_000_000, layers=4)
    assert len(list(out.glob("model-*.safetensors"))) >= 5
    return out


def _torch_reference(ckpt: Path):
    from safetensors.torch import load_file

    cfg = transformers.LlamaConfig.from_dict(json.loads((ckpt / "config.json").read_text()))
    cfg.use_cache = False
    model = transformers.LlamaForCausalLM(cfg).eval()
    state = {}
    for shard in sorted(ckpt.glob("model-*.safetensors")):
        state.update(load_file(shard))
    model.load_state_dict(state, strict=True)
    return model


@pytest.fixture(scope="module")
def traced(checkpoint):
    result = from_checkpoint(LLAMA, checkpoint, config=checkpoint / "config.json")
    result.reads_after_trace = dict(result.index.log.bytes_read)
    return result


@pytest.fixture(scope="module")
def converted(traced, tmp_path_factory):
    """The flax output; the streaming step runs under tracemalloc (numpy buffers are traced).

    Planning reads no weight data by construction (stand-ins raise if read), so the step that
    touches weight bytes is the one measured."""
    import xconv.weights.stream as stream

    out = tmp_path_factory.mktemp("conv") / "flax"
    peaks = []
    real = stream.stream_targets

    def traced_stream(*args, **kwargs):
        tracemalloc.start()
        try:
            return real(*args, **kwargs)
        finally:
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()

    mp = pytest.MonkeyPatch()
    mp.setattr(stream, "stream_targets", traced_stream)
    try:
        options = CheckpointOptions(parity="none")
        result = write_target(traced, target="flax", out_dir=out, options=options)
    finally:
        mp.undo()
    (peak,) = peaks
    return result, peak


def test_trace_reads_no_weight_bytes(traced):
    lazy = [
        v for v in traced.model.graph.initializers.values() if isinstance(v.const_value, LazyWeight)
    ]
    index = traced.index
    assert len(lazy) == len(index.tensors)  # every checkpoint entry is a lazy reference
    assert traced.reads_after_trace == {}  # headers only
    for v in lazy:
        ref = v.const_value.ref
        assert (v.const_value.location, v.const_value.offset) == (ref.shard.name, ref.offset)
        assert tuple(v.shape) == ref.shape
    # The non-persistent rotary buffer is computed, not expected from the checkpoint.
    inv = [n for n in traced.model.graph.initializers if n.endswith("inv_freq")]
    assert inv and not any(
        isinstance(traced.model.graph.initializers[n].const_value, LazyWeight) for n in inv
    )


def test_streamed_flax_matches_torch(checkpoint, traced, converted):
    result, peak = converted
    out = result.out_dir
    index = CheckpointIndex(checkpoint)
    # Each shard read exactly once, tensor by tensor: bytes read == bytes of its tensors.
    per_shard = {}
    for ref in index.tensors.values():
        per_shard[str(ref.shard)] = per_shard.get(str(ref.shard), 0) + ref.nbytes
    assert result.stream.bytes_read == per_shard
    # Python-side memory (numpy buffers included) held about one tensor, never the checkpoint.
    largest = max(r.nbytes for r in index.tensors.values())
    assert peak < 3 * largest < index.nbytes, (peak, largest, index.nbytes)
    # The generated load() reads the shards and runs a forward pass equal to torch's.
    from xconv.pipeline import _load_generated

    module, variables = _load_generated(out / "model.py").load(out)
    ids = torch.randint(0, 8000, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _torch_reference(checkpoint)(ids).logits.numpy()
    got = module.apply(variables, ids.numpy())
    got = np.asarray(got[0] if isinstance(got, tuple) else got)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # The generated source passes ruff; the nnx module reads the same shards, same numbers.
    from tests.converters.jax.test_flax_emitter import ruff_ok

    ok, msg = ruff_ok(out / "model.py")
    assert ok, msg
    nnx_out = out.parent / "nnx"
    options = CheckpointOptions(api="nnx", parity="none")
    write_target(traced, target="flax", out_dir=nnx_out, options=options)
    nnx_model = _load_generated(nnx_out / "model.py").load(nnx_out)
    got_nnx = nnx_model(ids.numpy())
    np.testing.assert_array_equal(
        np.asarray(got_nnx[0] if isinstance(got_nnx, tuple) else got_nnx), got
    )
    # Dense kernels were transposed on the way, nothing else changed.
    flat = read_flat(out)
    q = index.read("model.layers.0.self_attn.q_proj.weight")
    # The module tree: the decoder layer and its attention are nested submodules.
    key = next(k for k in flat if k.endswith("layers_0/self_attn/q_proj/kernel"))
    np.testing.assert_array_equal(flat[key], q.T)


def test_streamed_onnx_runs_in_onnxruntime(traced, checkpoint, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    options = CheckpointOptions(parity="none")
    result = write_target(traced, target="onnx", out_dir=tmp_path / "onnx", options=options)
    shards = {str(s): s.stat().st_size for s in traced.index.shards}
    assert result.stream.bytes_read == shards  # each shard copied once
    ids = torch.randint(0, 8000, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = _torch_reference(checkpoint)(ids).logits.numpy()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(result.out_dir / "model.onnx"), so)
    (got,) = sess.run(None, {sess.get_inputs()[0].name: ids.numpy()})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_layerwise_parity_passes_every_block(traced, converted, tmp_path):
    from xconv.parity.streamed import check_streamed

    result, _ = converted
    before = dict(traced.index.log.bytes_read)
    report = check_streamed(traced, result.out_dir, result.targets)
    assert report.passed, str(report)
    assert report.checked_weights == len([t for t in result.targets if t.planned is not None])
    # Parity reads each checkpoint tensor once more (one block at a time), never a shard twice.
    again = {k: n - before.get(k, 0) for k, n in traced.index.log.bytes_read.items()}
    assert again == result.stream.bytes_read
    report.to_json(tmp_path / "parity.json")
    names = [b["name"] for b in json.loads((tmp_path / "parity.json").read_text())["blocks"]]
    assert any("layers.3" in n for n in names) and len(names) >= 6


def _wiring(model) -> list[tuple]:
    """Each node as (op, scope metadata, where each input comes from): the producing node's
    position and output index, or an initializer / graph input by name (value names left out:
    the copied layers' internal ``val_N`` names are not torch.onnx's)."""
    graph = model.graph
    position = {id(o): (i, j) for i, n in enumerate(graph) for j, o in enumerate(n.outputs)}

    def source(v):
        if v is None:
            return None
        return position.get(id(v), v.name)

    rows = [(n.op_type, dict(n.metadata_props), [source(v) for v in n.inputs]) for n in graph]
    return [*rows, [source(v) for v in graph.outputs]]


def test_repeated_layers_traced_once_give_what_the_full_trace_gives(
    checkpoint, traced, converted, tmp_path
):
    """The 4 decoder layers are traced as 2 and the second copied (the default): the graph,
    its wiring, scopes, weights, FX program, generated model.py and written shards are those
    of the full trace (its layerwise parity: test_layerwise_parity_passes_every_block)."""
    assert traced.route.startswith("traced model.layers with 2 of 4 entries"), traced.route
    full = from_checkpoint(LLAMA, checkpoint, config=checkpoint / "config.json", repeat=False)
    assert full.route == "full trace"
    assert len(traced.model.graph) == len(full.model.graph)
    assert _wiring(traced.model) == _wiring(full.model)
    assert list(traced.model.graph.initializers) == list(full.model.graph.initializers)
    assert traced.sources == full.sources
    assert dict(traced.model.metadata_props) == dict(full.model.metadata_props)

    # Symbolic by default: torch numbers the input-size reads (``sym_size_int_N``) and the
    # size arithmetic (``add_N``) by its count of every such call while tracing, the ones it
    # removed afterwards included, which the copied layers cannot predict; the same nodes in
    # the same order (model.py and the shards below are byte-identical).
    def fx_names(p):
        return [re.sub(r"_\d+$", "", n.name) for n in p.graph.nodes]

    names = fx_names(traced.program)
    assert names == fx_names(full.program)
    assert any(n.endswith("_weight") and "layers_3" in n for n in names)

    def specs(p):
        return [(s.kind, s.arg.name, s.target) for s in p.graph_signature.input_specs]

    assert specs(traced.program) == specs(full.program)
    result, _ = converted
    out = write_target(
        full, target="flax", out_dir=tmp_path / "full", options=CheckpointOptions(parity="none")
    )
    assert (out.out_dir / "model.py").read_text() == (result.out_dir / "model.py").read_text()
    mine = sorted(p.name for p in result.out_dir.iterdir())
    assert mine == sorted(p.name for p in out.out_dir.iterdir())
    for name in mine:
        assert (out.out_dir / name).read_bytes() == (result.out_dir / name).read_bytes(), name


def _early(traced, stage: Path, guesses=None):
    from xconv.checkpoint import guess_layouts, plan_flax
    from xconv.weights.stream import EarlyStream

    stage.mkdir()
    before = dict(traced.index.log.bytes_read)
    guesses = guesses or guess_layouts(traced.meta.module, traced.index)
    early = EarlyStream(traced.index, guesses, stage).start()
    _, targets = plan_flax(traced)
    report = early.finish(targets)
    read = {k: n - before.get(k, 0) for k, n in traced.index.log.bytes_read.items()}
    return early, report, read


def test_early_stream_writes_the_same_shards_as_the_planned_stream(traced, converted, tmp_path):
    """Streamed on the layout guessed from the module's nn.Linear layers while tracing: the
    same tensors under the same names in the same files as streaming after the plan; each
    shard read once; safetensors itself reads the files (header padded with spaces)."""
    from safetensors.numpy import load_file

    result, _ = converted
    early, report, read = _early(traced, tmp_path / "stage")
    assert report is not None and report.early, early.reason
    assert read == result.stream.bytes_read  # every shard read once
    want = read_flat(result.out_dir)
    got = read_flat(tmp_path / "stage")
    assert got.keys() == want.keys()
    for k, a in want.items():
        assert got[k].dtype == a.dtype and got[k].tobytes() == a.tobytes(), k
    names = sorted(p.name for p in (tmp_path / "stage").iterdir())
    assert names == sorted(p.name for p in result.out_dir.iterdir() if "variables" in p.name)
    for f in (tmp_path / "stage").glob("*.safetensors"):
        assert set(load_file(f)) <= set(want)


def test_early_stream_with_a_wrong_guess_is_redone_not_used(traced, tmp_path):
    """A guess that differs from the emitter's plan (one kernel not transposed, one norm
    transposed twice) is never used: finish() deletes its files and says why."""
    from xconv.checkpoint import guess_layouts

    guesses = guess_layouts(traced.meta.module, traced.index)
    q = "model.layers.0.self_attn.q_proj.weight"
    guesses[q] = Planned(q, guesses[q].shape[::-1], guesses[q].dtype)
    early, report, _ = _early(traced, tmp_path / "stage", guesses)
    assert report is None and q in early.reason
    assert list((tmp_path / "stage").iterdir()) == []
    # A header that outgrows its reserved space is refused as well.
    from xconv.weights.stream import _Part

    (tmp_path / "p").mkdir()
    ref = next(iter(traced.index.tensors.values()))
    dtype = numpy_dtype(ref.dtype)
    part = _Part(tmp_path / "p", [(ref, Planned(ref.name, ref.shape, dtype))])
    part.write(traced.index.read(ref.name))
    part.flush()
    assert not part.set_header([("x" * part.reserve, ref.shape, dtype)])
    assert part.set_header([(ref.name, ref.shape, dtype)])
    part.abort()
    assert list((tmp_path / "p").iterdir()) == []


def test_failed_trace_stops_the_early_stream_and_leaves_nothing(checkpoint, tmp_path):
    import threading

    import xconv.checkpoint as ck

    def fail(program):
        raise ck.ConversionError("translation failed (test)")

    mp = pytest.MonkeyPatch()
    mp.setattr(ck, "_to_ir_and_program", fail)
    try:
        with pytest.raises(ck.ConversionError, match="translation failed"):
            convert_checkpoint(
                LLAMA, checkpoint, config=checkpoint / "config.json", target="flax",
                out_dir=tmp_path / "out", options=CheckpointOptions(parity="none"),
            )  # fmt: skip
    finally:
        mp.undo()
    assert list(tmp_path.iterdir()) == []
    assert not [t for t in threading.enumerate() if t.name == "xconv-early-stream"]
    import psutil  # the early stream's child process was stopped, not left running

    children = psutil.Process().children(recursive=True)
    assert not [c for c in children if "_early_child" in " ".join(c.cmdline())]


def _rewrite(ckpt: Path, dst: Path, edit) -> None:
    """Copy ``ckpt`` to ``dst`` applying ``edit(name, array) -> [(name, array)]`` per tensor."""
    index = CheckpointIndex(ckpt)
    dst.mkdir()
    weight_map = {}
    for shard, refs in index.by_shard().items():
        items = [x for r in refs for x in edit(r.name, index.read(r.name))]
        writer = ShardWriter(dst / shard.name, [(n, a.shape, a.dtype) for n, a in items])
        for n, a in items:
            writer.write(n, a)
            weight_map[n] = shard.name
        writer.close()
    write_index(dst / "model.safetensors.index.json", weight_map, 0)
    (dst / "config.json").write_text((ckpt / "config.json").read_text())


def test_bad_checkpoint_is_one_error_listing_every_problem(checkpoint, tmp_path):
    def edit(name, a):
        if name == "model.layers.1.mlp.up_proj.weight":
            return []  # missing
        if name == "model.layers.2.self_attn.q_proj.weight":
            return [(name, a[:-1])]  # wrong shape
        if name == "model.layers.3.input_layernorm.weight":
            return [(name, a.astype(np.float16))]  # wrong dtype
        if name == "model.norm.weight":
            return [(name, a), ("model.extra.weight", a)]  # unexpected
        return [(name, a)]

    bad = tmp_path / "bad"
    _rewrite(checkpoint, bad, edit)
    shards = sorted(bad.glob("model-*.safetensors"))
    data = shards[-1].read_bytes()
    shards[-1].write_bytes(data[: len(data) - 100])  # truncated
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.down_proj.weight"] = "model-gone.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    with pytest.raises(WeightsError) as err:
        convert_checkpoint(
            LLAMA, bad, config=bad / "config.json", target="flax", out_dir=out,
            options=CheckpointOptions(parity="none"),
        )  # fmt: skip
    text = str(err.value)
    for expected in (
        "missing tensor: model.layers.1.mlp.up_proj.weight",
        "shape mismatch: model.layers.2.self_attn.q_proj.weight",
        "dtype mismatch: model.layers.3.input_layernorm.weight",
        "unexpected tensor: model.extra.weight",
        f"truncated shard {shards[-1].name}",
        "missing shard file",
    ):
        assert expected in text, (expected, text)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_cli_bfloat16_checkpoint_with_layerwise_parity_and_exit_6(tmp_path):
    ckpt = tmp_path / "bf16"
    make_checkpoint(ckpt, 3.2e5, dtype="bfloat16", shard_size=150_000)  # hidden 64, 6 layers
    out = tmp_path / "o"
    args = ["torch-to-flax", "--module", LLAMA, "--config", str(ckpt / "config.json"),
            "--weights", str(ckpt / "model-*.safetensors"), "-o", str(out)]  # fmt: skip
    r = CliRunner().invoke(main, args, env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "layerwise parity" in r.output and "passed" in r.output
    report = json.loads((out / "parity.json").read_text())
    assert report["passed"] and len(report["blocks"]) == 8  # embed, 6 layers, norm + head
    assert report["written_weights_checked"] == len(CheckpointIndex(ckpt).tensors)
    page = (out / "parity.html").read_text()  # the same verdict, one row per block
    assert "parity PASSED" in page and page.count("<tr><td>") == 8
    flat = read_flat(out)
    assert {a.dtype.name for k, a in flat.items() if k.startswith("params/")} == {"bfloat16"}
    bad = tmp_path / "bad"
    _rewrite(ckpt, bad, lambda n, a: [] if n == "lm_head.weight" else [(n, a)])
    args[args.index("--weights") + 1] = str(bad)
    args[-1] = str(tmp_path / "o2")
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 6, r.output
    assert "missing tensor: lm_head.weight" in r.output
    assert not (tmp_path / "o2").exists()


def test_shard_writer_failure_leaves_nothing(tmp_path):
    w = ShardWriter(tmp_path / "a.safetensors", [("x", (2,), np.float32), ("y", (3,), np.float32)])
    w.write("x", np.zeros(2, np.float32))
    with pytest.raises(WeightsError):
        w.close()  # y never written
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_llama_1_5b_streamed_in_bounded_memory(tmp_path):
    """1.5 B bf16 parameters (30 x 2048): the CLI converts with layerwise parity in at most
    the largest shard + 2 GiB of RSS, and the generated load() runs a forward pass.

    The peak is the CLI's own, through a small runner process (``run_measured``): a child
    started straight from this pytest worker would report the worker's earlier peak (6.3 GiB
    in a full ``-m slow`` run)."""
    import sys

    from benchmarks._memory import run_measured

    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, 1.5e9, dtype="bfloat16", shard_size=1_000_000_000)
    out = tmp_path / "flax"
    args = ["torch-to-flax", "--module", LLAMA, "--config", str(ckpt / "config.json"),
            "--weights", str(ckpt / "model.safetensors.index.json"), "-o", str(out)]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(Path(__file__).parents[2]))
    run = run_measured([sys.executable, "-m", "xconv.cli", *args], env=env)
    text = (run.stdout + run.stderr)[-3000:]
    assert run.returncode == 0, text
    largest = CheckpointIndex(ckpt).largest_shard_bytes()
    assert run.peak_gib * 2**30 <= largest + 2 * 2**30, (run.peak_gib, largest / 2**30, text)
    report = json.loads((out / "parity.json").read_text())
    assert report["passed"] and len(report["blocks"]) == 32
    from xconv.pipeline import _load_generated

    module, variables = _load_generated(out / "model.py").load(out)
    logits = module.apply(variables, np.zeros((1, 8), np.int64))
    logits = np.asarray(logits[0] if isinstance(logits, tuple) else logits, np.float32)
    assert logits.shape == (1, 8, 32000) and np.isfinite(logits).all()


_FACTORY = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.norm = nn.LayerNorm(width)
        self.fc2 = nn.Linear(width, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3), persistent=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x)))) * self.scale


def make(config):
    return Net(config["width"])
"""


def test_factory_with_a_dict_config_and_a_computed_buffer(tmp_path):
    """--module as a factory file taking the config dict; a non-persistent buffer computed."""
    (tmp_path / "net.py").write_text(_FACTORY)
    (tmp_path / "config.json").write_text(json.dumps({"width": 16}))
    rng = np.random.default_rng(0)
    state = {
        "fc1.weight": rng.standard_normal((16, 8)), "fc1.bias": rng.standard_normal(16),
        "norm.weight": rng.standard_normal(16), "norm.bias": rng.standard_normal(16),
        "fc2.weight": rng.standard_normal((3, 16)), "fc2.bias": rng.standard_normal(3),
    }  # fmt: skip
    state = {k: v.astype(np.float32) for k, v in state.items()}
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for i, names in enumerate(
        (["fc1.weight", "fc1.bias"], ["norm.weight", "norm.bias", "fc2.weight", "fc2.bias"])
    ):
        w = ShardWriter(
            ckpt / f"part-{i}.safetensors", [(n, state[n].shape, np.float32) for n in names]
        )
        for n in names:
            w.write(n, state[n])
        w.close()
    x = rng.standard_normal((2, 8)).astype(np.float32)
    result = convert_checkpoint(
        f"{tmp_path / 'net.py'}:make", str(ckpt / "part-*.safetensors"), config=tmp_path / "config.json",
        target="flax", out_dir=tmp_path / "out", example_inputs=(x,),
    )  # fmt: skip
    assert result.parity.passed, str(result.parity)
    from xconv.factories import resolve_factory
    from xconv.pipeline import _load_generated

    net = resolve_factory(f"{tmp_path / 'net.py'}:make")({"width": 16}).eval()
    net.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy()
    module, variables = _load_generated(tmp_path / "out" / "model.py").load(tmp_path / "out")
    got = module.apply(variables, x)
    np.testing.assert_allclose(
        np.asarray(got[0] if isinstance(got, tuple) else got), want, rtol=1e-5, atol=1e-6
    )


def test_replayed_transposes_share_one_scratch_buffer_and_stay_exact():
    """The stream's layout copies go through torch into one reused buffer (bfloat16 as int16);
    each result equals numpy's transpose, bit for bit, until the next replay reuses it."""
    from xconv.weights.stream import Scratch

    rng = np.random.default_rng(0)
    bf16 = numpy_dtype("bfloat16")
    scratch = Scratch()
    results = []
    for shape in [(384, 256), (256, 1024), (512, 320)]:  # grows, then fits in the buffer
        bits = rng.integers(-(2**15), 2**15, size=shape, dtype=np.int16)
        array = bits.view(bf16)
        out = Planned("w", shape, bf16).transpose().replay(array, scratch)
        assert out.dtype == bf16 and out.shape == shape[::-1] and out.flags.c_contiguous
        np.testing.assert_array_equal(out.view(np.int16), bits.T)
        results.append(out)
    # The buffer grew for the second; the third is a view of it (and overwrote the second).
    assert not np.shares_memory(results[0], results[1])
    assert np.shares_memory(results[1], results[2])
    fresh = Planned("w", (384, 256), bf16).transpose().replay(np.zeros((384, 256), bf16))
    assert not np.shares_memory(fresh, results[2])


def _direct_io_works(folder: Path) -> bool:
    probe = folder / "o_direct_probe"
    probe.write_bytes(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except (OSError, AttributeError):
        return False
    finally:
        probe.unlink()


def test_child_stream_pipeline_with_direct_io_equals_buffered_bytes(tmp_path):
    """The early stream's pipeline (read ahead with O_DIRECT into reused aligned buffers, the
    transpose written straight into an aligned output buffer, O_DIRECT writes of whole
    blocks on a thread, the unaligned tail carried over and the file cut to its length)
    writes exactly the bytes of the buffered path and of numpy's transposes, for tensors
    whose sizes and offsets are not multiples of 4096 or of each other's item sizes."""
    from xconv.weights.shards import ReadLog
    from xconv.weights.stream import _Part, _stream_parts

    rng = np.random.default_rng(1)
    bf16 = numpy_dtype("bfloat16")
    arrays = {
        "f.w": rng.standard_normal((384, 200)).astype(bf16),  # transposed, then float32
        "a.odd": rng.integers(0, 255, size=(3, 7), dtype=np.uint8),
        "b.w": rng.standard_normal((300, 257)).astype(np.float32),
        "c.w": rng.integers(-(2**15), 2**15, size=(513, 129), dtype=np.int16).view(bf16),
        "d.norm": rng.standard_normal((5,)).astype(np.float32),
        "e.w": rng.integers(-(2**15), 2**15, size=(256, 4096), dtype=np.int16).view(bf16),
    }
    shard = tmp_path / "model-00001-of-00001.safetensors"
    writer = ShardWriter(shard, [(k, v.shape, v.dtype) for k, v in arrays.items()])
    for k, v in arrays.items():
        writer.write(k, v)
    writer.close()
    index = CheckpointIndex(shard)
    transposed = {"b.w", "c.w", "e.w"}
    items = []
    for ref in index.by_shard()[shard]:
        planned = Planned(ref.name, ref.shape, numpy_dtype(ref.dtype))
        if ref.name == "f.w":
            planned = planned.transpose().astype(np.float32)
        items.append((ref, planned.transpose() if ref.name in transposed else planned))
    expect = dict(arrays, **{k: arrays[k].T for k in transposed}, **{"f.w": arrays["f.w"].T})
    expect["f.w"] = expect["f.w"].astype(np.float32)
    want = b"".join(
        np.ascontiguousarray(expect[r.name]).reshape(-1).view(np.uint8).tobytes() for r, _ in items
    )
    direct_ok = _direct_io_works(tmp_path)
    files = {}
    for direct in (True, False):
        drop_page_cache(shard)
        part = _Part(tmp_path, items)
        part.flush()
        stats: dict = {}
        log = ReadLog()
        sizes = _stream_parts(
            [(str(shard), str(part.tmp), part.reserve, items)], log, direct, stats
        )
        data = part.tmp.read_bytes()
        assert sizes == [len(want)] and len(data) == part.reserve + len(want)
        assert data[part.reserve :] == want, f"direct={direct}"
        assert log.bytes_read[str(shard)] == sum(r.nbytes for r, _ in items)
        if direct and direct_ok:  # the tmp folder's file system takes O_DIRECT: it was used
            assert stats["direct_reads"] == 1 and stats["direct_writes"] == 1, stats
        if not direct:
            assert stats["direct_reads"] == 0 and stats["direct_writes"] == 0, stats
        files[direct] = data
        part.abort()
    assert files[True] == files[False]


def test_direct_reader_reports_a_truncated_shard(tmp_path):
    """A shard cut short is a WeightsError naming the tensor, with O_DIRECT reads too."""
    from xconv.weights.shards import ReadLog
    from xconv.weights.stream import _ShardReader

    shard = tmp_path / "model.safetensors"
    arrays = {"a": np.arange(3000, dtype=np.float32), "b": np.arange(5000, dtype=np.float32)}
    writer = ShardWriter(shard, [(k, v.shape, v.dtype) for k, v in arrays.items()])
    for k, v in arrays.items():
        writer.write(k, v)
    writer.close()
    index = CheckpointIndex(shard)
    os.truncate(shard, shard.stat().st_size - 10)
    drop_page_cache(shard)
    reader = _ShardReader(shard, ReadLog())
    try:
        np.testing.assert_array_equal(reader.read(index.tensors["a"]), arrays["a"])
        with pytest.raises(WeightsError, match="truncated shard .*: b is cut short"):
            reader.read(index.tensors["b"])
    finally:
        reader.close()


def test_appender_write_error_is_raised_and_abort_releases_the_file(tmp_path, monkeypatch):
    """A failed write on the writer thread (disk full) is raised to the stream at its next
    tensor; abort() after it closes the file once (no second error hiding the first)."""
    import errno

    from xconv.weights import stream

    path = tmp_path / "part"
    path.write_bytes(b"")
    out = stream._Appender(path, 0)

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(stream.os, "pwrite", full)
    out.put(np.zeros(3000, np.float32))  # 8192 whole bytes go to the writer thread
    with pytest.raises(OSError, match="No space left"):
        out.put(np.zeros(3000, np.float32))
    out.abort()
    assert out.fd == -1
    out.abort()  # a second abort is a no-op

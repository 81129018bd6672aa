"""Bad files, fuzzed: every loader and the CLI end a corrupt input in a clean error.

Small valid files of every kind xconv reads are written once per session; hypothesis then
mutates their bytes (truncated, bit-flipped, emptied, spliced with another format's bytes,
one zip entry rewritten) or builds structurally wrong ones (huge declared sizes, shapes and
dtypes that do not match the data or the model). Each example must load, or raise a
``ConversionError`` subclass with exit code 3 (invalid file) or 6 (weights that do not
match): no other exception, no framework traceback in the logs, no code run from the file,
and (through the CLI) no partial output.

The default suite runs about 1,100 examples; ``-m slow`` runs ten times as many.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xconv.errors import ConversionError

torch = pytest.importorskip("torch")

#: (scale, pytest id): the default suite, and ten times as many examples under -m slow.
SCALES = [pytest.param(1, id="ci"), pytest.param(10, id="slow", marks=pytest.mark.slow)]
#: Loader calls per kind, summed over the module (printed when it ends, with -s).
COUNTS: dict[str, int] = {}


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    if COUNTS:
        print("\nfuzz loader calls:", json.dumps(COUNTS, sort_keys=True), "total",
              sum(COUNTS.values()))  # fmt: skip


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.norm = torch.nn.LayerNorm(3)

    def forward(self, x):
        return self.norm(self.fc(x)).relu()


# ------------------------------------------------------------------ valid files, once


def _onnx_bytes() -> bytes:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from xconv.ir import OPSET

    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    onnx.checker.check_model(model)
    return model.SerializeToString()


@pytest.fixture(scope="session")
def valid(tmp_path_factory) -> dict[str, Path]:
    """One small valid file (or folder) of every kind."""
    from xconv.weights.io import write_checkpoint

    root = tmp_path_factory.mktemp("valid")
    torch.manual_seed(0)
    module = Tiny().eval()
    x = torch.randn(2, 4)
    files = {"onnx": root / "model.onnx", "pt2": root / "model.pt2"}
    files["onnx"].write_bytes(_onnx_bytes())
    torch.export.save(torch.export.export(module, (x,)), files["pt2"])
    files["torchscript"] = root / "script.pt"
    torch.jit.save(torch.jit.trace(module, (x,)), files["torchscript"])
    files["state_dict"] = root / "weights.pt"
    torch.save(module.state_dict(), files["state_dict"])
    flat = {k: v.numpy() for k, v in module.state_dict().items()}
    files["safetensors"] = write_checkpoint(flat, root / "weights.safetensors")
    files["index"] = write_checkpoint(flat, root / "sharded" / "w.safetensors.index.json")
    files["msgpack"] = write_checkpoint(
        {"params": {"fc": {"kernel": flat["fc.weight"].T, "bias": flat["fc.bias"]}}},
        root / "variables.msgpack",
    )
    files["npz"] = root / "inputs.npz"
    np.savez(files["npz"], x=x.numpy(), ids=np.arange(6).reshape(2, 3))
    return files


@pytest.fixture(scope="session")
def valid_slow(tmp_path_factory) -> dict[str, Path]:
    """The formats whose writers need TensorFlow, Keras or Orbax (built on first use)."""
    from xconv.weights.io import write_checkpoint

    root = tmp_path_factory.mktemp("valid_slow")
    files = {"orbax": write_checkpoint({"params": {"w": np.ones((3, 2), np.float32)}},
                                       root / "ckpt", format="orbax")}  # fmt: skip
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    inp = keras.Input((4,))
    model = keras.Model(inp, keras.layers.Dense(3, activation="relu")(inp))
    files["keras"] = root / "model.keras"
    model.save(files["keras"])
    files["savedmodel"] = root / "saved"

    class Fn(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(np.ones((4, 3), np.float32))

        @tf.function(input_signature=[tf.TensorSpec([2, 4], tf.float32)])
        def __call__(self, x):
            return tf.nn.relu(tf.matmul(x, self.w))

    fn = Fn()
    tf.saved_model.save(fn, str(files["savedmodel"]), signatures=fn.__call__)
    return files


# ------------------------------------------------------------------ mutations

_GARBAGE = st.binary(min_size=1, max_size=64)


@st.composite
def mutated(draw, data: bytes, others: tuple[bytes, ...] = ()) -> bytes:
    """``data`` truncated, bit-flipped, emptied, overwritten or spliced with other bytes."""
    kind = draw(st.sampled_from(["truncate", "flip", "flips", "empty", "garbage", "overwrite",
                                 "splice", "zip_entry"]))  # fmt: skip
    n = len(data)
    if kind == "truncate":
        return data[: draw(st.integers(0, n - 1))]
    if kind in ("flip", "flips"):
        out = bytearray(data)
        for _ in range(1 if kind == "flip" else draw(st.integers(2, 16))):
            pos = draw(st.integers(0, n - 1))
            out[pos] ^= 1 << draw(st.integers(0, 7))
        return bytes(out)
    if kind == "empty":
        return b""
    if kind == "garbage":
        return draw(st.binary(min_size=1, max_size=256))
    if kind == "overwrite":
        pos = draw(st.integers(0, n - 1))
        junk = draw(_GARBAGE)
        return data[:pos] + junk + data[pos + len(junk) :]
    if kind == "splice" and others:
        other = draw(st.sampled_from(others))
        return other[: draw(st.integers(1, len(other)))] + data[draw(st.integers(0, n - 1)) :]
    if kind == "zip_entry" and zipfile.is_zipfile(io.BytesIO(data)):
        # A well-formed zip (CRCs right) with one entry's content corrupted: reaches the
        # framework's parsing of the entry, past the zip check.
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            entries = [(i, zf.read(i)) for i in zf.infolist()]
        pick = draw(st.integers(0, len(entries) - 1))
        info, content = entries[pick]
        content = draw(mutated(content)) if content else draw(_GARBAGE)
        entries[pick] = (info, content)
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
            for i, c in entries:
                zf.writestr(i.filename, c)
        return buf.getvalue()
    return data[: n // 2]


def _check(count_key: str, load) -> str:
    """Run ``load``; it returns, or raises a ConversionError with exit code 3 or 6, or the
    trust-pickle refusal (a file that names Python globals, exit 2). Anything else fails the
    test."""
    COUNTS[count_key] = COUNTS.get(count_key, 0) + 1
    try:
        load()
    except ConversionError as e:
        refused = "trust" in str(e) and e.exit_code == 2
        assert e.exit_code in (3, 6) or refused, f"{type(e).__name__} exit {e.exit_code}: {e}"
        assert str(e).strip(), "an empty error message"
        return type(e).__name__
    return "loaded"


class _TracebackCatcher(logging.Handler):
    """Records every log record that carries a traceback (a framework printing one)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or "Traceback (most recent call last)" in record.getMessage():
            self.records.append(record)


@pytest.fixture
def no_logged_traceback():
    catcher = _TracebackCatcher()
    loggers = [logging.getLogger(n) for n in ("", "torch", "torch.export", "absl", "tensorflow")]
    for lg in loggers:
        lg.addHandler(catcher)
    yield
    for lg in loggers:
        lg.removeHandler(catcher)
    assert not catcher.records, [r.getMessage()[:300] for r in catcher.records[:3]]


def _run(n: int, strategy, body) -> None:
    settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )(given(strategy)(body))()


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# ------------------------------------------------------------------ byte mutations per loader


def _loaders(files):
    """kind -> (file to mutate, its suffix, how to load it, examples at scale 1)."""
    from xconv.converters.onnx.io import load as load_onnx
    from xconv.converters.torch.importer.files import inputs_from_npz, load_torch_model
    from xconv.weights.io import checkpoint_shapes, read_checkpoint

    def state_dict(p):
        read_checkpoint(p)
        load_torch_model(p, module_factory=Tiny)

    def safetensors(p):
        checkpoint_shapes(p)
        read_checkpoint(p)
        load_torch_model(p, module_factory=Tiny)

    def trusted(p):  # a TorchScript archive loads only with the trust flag
        load_torch_model(p, trust_pickle=True)

    def npz(p):
        inputs_from_npz(p)
        read_checkpoint(p)

    return {
        "onnx": (files["onnx"], ".onnx", load_onnx, 180),
        "pt2": (files["pt2"], ".pt2", load_torch_model, 70),
        "torchscript": (files["torchscript"], ".pt", trusted, 90),
        "state_dict": (files["state_dict"], ".pt", state_dict, 160),
        "safetensors": (files["safetensors"], ".safetensors", safetensors, 160),
        "msgpack": (files["msgpack"], ".msgpack", read_checkpoint, 150),
        "npz": (files["npz"], ".npz", npz, 150),
    }


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize(
    "kind", ["onnx", "pt2", "torchscript", "state_dict", "safetensors", "msgpack", "npz"]
)
def test_corrupt_file_is_a_clean_error(valid, tmp_path, kind, scale, no_logged_traceback):
    path, suffix, load, n = _loaders(valid)[kind]
    data = path.read_bytes()
    others = tuple(p.read_bytes() for k, p in valid.items() if k != kind and p.is_file())
    target = tmp_path / f"bad{suffix}"
    outcomes: dict[str, int] = {}

    def body(bad: bytes) -> None:
        outcome = _check(kind, lambda: load(_write(target, bad)))
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    _run(n * scale, mutated(data, others), body)
    assert sum(outcomes.values()) >= n * scale * 0.9, outcomes
    # Most mutations must be refused: a loader that accepts anything fails here.
    assert outcomes.get("loaded", 0) < 0.5 * sum(outcomes.values()), outcomes


@pytest.mark.parametrize("scale", SCALES)
def test_corrupt_sharded_index_is_a_clean_error(valid, tmp_path, scale, no_logged_traceback):
    from xconv.weights.io import read_checkpoint

    src = valid["index"].parent
    index_text = valid["index"].read_text()
    shard = next(src.glob("*.safetensors"))
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
        ),  # fmt: skip
        max_leaves=6,
    )
    index_bytes = st.one_of(
        mutated(index_text.encode()),
        json_values.map(lambda v: json.dumps(v).encode()),
        json_values.map(lambda v: json.dumps({"weight_map": v}).encode()),
        st.sampled_from([shard.name, "../../etc/passwd", "", "missing.safetensors"]).map(
            lambda s: json.dumps({"weight_map": {"fc.weight": s}}).encode()
        ),
    )
    counter = iter(range(10**9))

    def body(args) -> None:
        bad_index, bad_shard = args
        folder = tmp_path / f"ex{next(counter)}"
        folder.mkdir()
        (folder / shard.name).write_bytes(bad_shard)
        index = _write(folder / valid["index"].name, bad_index)
        _check("safetensors index", lambda: read_checkpoint(index))

    n = 80 * scale
    _run(n, st.tuples(index_bytes, st.one_of(st.just(shard.read_bytes()),
                                             mutated(shard.read_bytes()))), body)  # fmt: skip


# ------------------------------------------------------------------ structured bad files


@st.composite
def safetensors_file(draw) -> bytes:
    """A safetensors file whose header lies: huge or negative sizes, offsets past the data,
    unknown dtypes, shapes that do not match the byte count."""
    dtype = draw(st.sampled_from(["F32", "F16", "BF16", "I64", "BOOL", "F8_E4M3", "X9", "",
                                  "U8"]))  # fmt: skip
    shape = draw(st.lists(st.one_of(st.integers(0, 6), st.integers(2**31, 2**62),
                                    st.integers(-3, -1)), max_size=4))  # fmt: skip
    data = draw(st.binary(max_size=64))
    begin = draw(st.one_of(st.just(0), st.integers(-4, 2**40)))
    end = draw(st.one_of(st.just(len(data)), st.integers(-4, 2**40)))
    header = {"fc.weight": {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}}
    if draw(st.booleans()):
        header["__metadata__"] = {"format": draw(st.text(max_size=4))}
    body = json.dumps(header).encode()
    length = draw(st.one_of(st.just(len(body)), st.integers(0, 2**64 - 1)))
    return struct.pack("<Q", length) + body + data


@st.composite
def npy_file(draw) -> bytes:
    """An .npy entry whose header declares huge or negative shapes, odd dtypes, or a
    Python object array (needs pickle)."""
    descr = draw(st.sampled_from(["<f4", "<i8", "|b1", "|O", "<c16", "<U3", "V8", "<f2"]))
    shape = tuple(draw(st.lists(st.one_of(st.integers(0, 5), st.integers(2**40, 2**62),
                                          st.integers(-2, -1)), max_size=3)))  # fmt: skip
    header = repr({"descr": descr, "fortran_order": draw(st.booleans()), "shape": shape})
    header = header.encode() + b" " * (-(len(header) + 11) % 64) + b"\n"
    head = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header
    return head + draw(st.binary(max_size=64))


@pytest.mark.parametrize("scale", SCALES)
def test_safetensors_header_lies_are_clean_errors(tmp_path, scale, no_logged_traceback):
    from xconv.converters.torch.importer.files import load_torch_model
    from xconv.weights.io import checkpoint_shapes, read_checkpoint

    path = tmp_path / "lies.safetensors"

    def body(data: bytes) -> None:
        _write(path, data)
        _check("safetensors header", lambda: checkpoint_shapes(path))
        _check("safetensors header", lambda: read_checkpoint(path))
        _check("safetensors header", lambda: load_torch_model(path, module_factory=Tiny))

    _run(60 * scale, safetensors_file(), body)


@pytest.mark.parametrize("scale", SCALES)
def test_npz_header_lies_are_clean_errors(tmp_path, scale, no_logged_traceback):
    from xconv.converters.torch.importer.files import inputs_from_npz
    from xconv.weights.io import read_checkpoint

    path = tmp_path / "lies.npz"

    def body(entry: bytes) -> None:
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("x.npy", entry)
        _check("npz header", lambda: inputs_from_npz(path))
        _check("npz header", lambda: read_checkpoint(path))

    _run(60 * scale, npy_file(), body)


_TORCH_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                 torch.int8, torch.bool, torch.complex64]  # fmt: skip


@pytest.mark.parametrize("scale", SCALES)
def test_state_dict_that_does_not_fit_is_a_weights_error(tmp_path, scale, no_logged_traceback):
    """Renamed, dropped, extra, mis-shaped and mis-typed tensors: exit 6, never a load."""
    from xconv.converters.torch.importer.files import load_torch_model
    from xconv.errors import WeightsError

    good = Tiny().state_dict()
    path = tmp_path / "bad.pt"

    @st.composite
    def bad_state(draw):
        state = dict(good)
        name = draw(st.sampled_from(sorted(state)))
        change = draw(st.sampled_from(["shape", "dtype", "drop", "extra", "rename"]))
        if change == "shape":
            shape = draw(st.lists(st.integers(0, 5), max_size=3).filter(
                lambda s: tuple(s) != tuple(good[name].shape)))  # fmt: skip
            state[name] = torch.zeros(shape)
        elif change == "dtype":
            dtype = draw(st.sampled_from([d for d in _TORCH_DTYPES if not d.is_floating_point]))
            state[name] = torch.zeros(good[name].shape, dtype=dtype)
        elif change == "drop":
            del state[name]
        elif change == "extra":
            state[draw(st.text("abc.", min_size=1, max_size=6))] = torch.zeros(2)
        else:
            state[name + draw(st.text("xyz", min_size=1, max_size=3))] = state.pop(name)
        return state

    def body(state) -> None:
        torch.save(state, path)
        with pytest.raises(WeightsError):
            load_torch_model(path, module_factory=Tiny)
        COUNTS["state_dict mismatch"] = COUNTS.get("state_dict mismatch", 0) + 1

    _run(50 * scale, bad_state(), body)


@pytest.mark.parametrize("scale", SCALES)
def test_flax_variables_that_do_not_fit_are_a_weights_error(tmp_path, scale):
    """A variables file with a dropped, extra, mis-shaped or mis-typed leaf, given to
    ``flax-to-*``: exit 6 before tracing, never Flax's own ScopeParamShapeError."""
    pytest.importorskip("flax")
    from fixtures.flax_models import linen_mlp
    from xconv.errors import WeightsError
    from xconv.pipeline import ConvertOptions, convert
    from xconv.weights.io import flatten, write_checkpoint

    good = flatten(linen_mlp()[1])
    path = tmp_path / "vars.msgpack"
    options = ConvertOptions(module_factory="fixtures.flax_models:linen_mlp", check=False)

    @st.composite
    def bad_vars(draw):
        flat = dict(good)
        name = draw(st.sampled_from(sorted(flat)))
        change = draw(st.sampled_from(["shape", "dtype", "drop", "extra"]))
        if change == "shape":
            shape = draw(st.lists(st.integers(1, 5), max_size=3).filter(
                lambda s: tuple(s) != good[name].shape))  # fmt: skip
            flat[name] = np.zeros(shape, np.float32)
        elif change == "dtype":
            flat[name] = np.zeros(good[name].shape, draw(st.sampled_from([np.int32, np.bool_])))
        elif change == "drop":
            del flat[name]
        else:
            flat[name.rsplit("/", 1)[0] + "/extra"] = np.zeros(2, np.float32)
        return flat

    def body(flat) -> None:
        write_checkpoint(flat, path)
        out = tmp_path / "out"
        with pytest.raises(WeightsError):
            convert(path, source_kind="flax", target="onnx", out_dir=out, options=options)
        assert not out.exists()
        COUNTS["flax variables mismatch"] = COUNTS.get("flax variables mismatch", 0) + 1

    _run(8 * scale, bad_vars(), body)


# ------------------------------------------------------------------ folders and TF / Keras


def _mutate_folder(draw, src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    members = sorted(p for p in dst.rglob("*") if p.is_file())
    victim = draw(st.sampled_from(members))
    action = draw(st.sampled_from(["mutate", "delete"]))
    if action == "delete":
        victim.unlink()
    else:
        victim.write_bytes(draw(mutated(victim.read_bytes() or b"\0")))


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("kind", ["orbax", "keras", "savedmodel"])
def test_corrupt_checkpoint_folder_or_tf_model_is_a_clean_error(
    valid_slow, tmp_path, kind, scale, no_logged_traceback
):
    from xconv.converters.tf.importer import load_source
    from xconv.weights.io import read_checkpoint

    src = valid_slow[kind]
    load = read_checkpoint if kind == "orbax" else load_source
    counter = iter(range(10**9))

    def body(data) -> None:
        dst = tmp_path / f"ex{next(counter)}" / src.name
        dst.parent.mkdir()
        if src.is_dir():
            _mutate_folder(data.draw, src, dst)
        else:
            dst.write_bytes(data.draw(mutated(src.read_bytes())))
        _check(kind, lambda: load(dst))

    _run({"orbax": 20, "keras": 10, "savedmodel": 4}[kind] * scale, st.data(), body)


# ------------------------------------------------------------------ code is never run


class _Payload:
    """Unpickling this creates ``marker``: a loader that runs it executes file-borne code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_pickled_code_is_never_run(tmp_path):
    from click.testing import CliRunner

    from xconv.cli import main
    from xconv.converters.torch.importer.files import load_torch_model
    from xconv.weights.io import read_checkpoint

    marker = tmp_path / "ran"
    evil = tmp_path / "evil.pt"
    torch.save({"fc.weight": _Payload(marker)}, evil)
    npz = tmp_path / "evil.npz"
    np.savez(npz, x=np.array([_Payload(marker)], dtype=object))
    for load in (
        lambda: load_torch_model(evil, module_factory=Tiny),
        lambda: read_checkpoint(evil),
        lambda: read_checkpoint(npz),
    ):
        with pytest.raises(ConversionError):
            load()
    r = CliRunner().invoke(main, ["torch-to-onnx", str(evil), "--module", "x:y",
                                  "-o", str(tmp_path / "out")])  # fmt: skip
    assert r.exit_code in (2, 3) and "Traceback" not in r.output, r.output
    assert not marker.exists(), "a loader ran code from the file"
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ the CLI


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("kind", ["onnx", "pt2", "npz"])
def test_cli_on_corrupt_files_exits_cleanly_without_output(valid, tmp_path, kind, scale):
    from click.testing import CliRunner

    from xconv.cli import main

    data = valid[kind].read_bytes()
    counter = iter(range(10**9))

    def body(bad: bytes) -> None:
        folder = tmp_path / f"ex{next(counter)}"
        folder.mkdir()
        out = folder / "out"
        if kind == "npz":  # a valid model with bad example inputs
            args = [
                "onnx-to-jax",
                str(valid["onnx"]),
                "--inputs",
                str(_write(folder / "x.npz", bad)),
            ]
        else:
            model = _write(folder / valid[kind].name, bad)
            args = [f"{'torch' if kind == 'pt2' else 'onnx'}-to-jax", str(model)]
        r = CliRunner().invoke(main, [*args, "-o", str(out), "--no-check"])
        COUNTS[f"cli {kind}"] = COUNTS.get(f"cli {kind}", 0) + 1
        assert "Traceback" not in r.output, r.output
        if r.exit_code == 0:
            return  # the mutation left a loadable file
        # Open finding (-m slow, 1 example in 300): a bit-flipped graph that passes the ONNX
        # loader's checks can still fail inside onnx_ir during conversion; the CLI reports it
        # as a clean exit-10 paragraph. Loader-level errors must be 3 or 6 (tests above).
        allowed = (3, 4, 5, 6, 10) if kind == "onnx" else (3, 4, 5, 6)
        assert r.exit_code in allowed, (r.exit_code, r.output)
        assert len(r.output.strip().splitlines()) == 1 or r.exit_code != 10, r.output
        assert r.output.startswith("error: "), r.output
        assert not out.exists(), "partial output left behind"
        assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []

    _run({"onnx": 30, "pt2": 8, "npz": 30}[kind] * scale, mutated(data), body)

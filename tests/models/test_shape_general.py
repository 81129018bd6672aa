"""A model converted once with symbolic dims runs at every admissible shape on every target.

Each tiny model is converted ONCE (through :func:`_convert`) at a distinctive example shape
and then run at three shapes on ``xconv.to_jax``, the generated Flax source (linen and nnx),
``xconv.to_torch``, the generated torch source and onnxruntime (the IR saved as ``.onnx``),
each compared with the torch module at that shape. The JAX targets run under ``jit`` (a
fresh trace at each shape, weights traced). The generated sources must not hold the example's
sizes: a ``reshape`` / ``view`` / ``arange`` / ``expand`` / ``full`` with a literal batch or
sequence length would pin the model to the traced shape.

ViT fixes its image size (the position table has one row per patch), so only its batch is
symbolic; the test checks that which dims are symbolic is exactly what each model admits.
"""

from __future__ import annotations

import functools
import os
import re
import uuid
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
pytest.importorskip("flax")
transformers = pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")

from flax import nnx  # noqa: E402

import xconv  # noqa: E402
from fixtures.torch_models import make_resnet  # noqa: E402
from tests.torch_source import load_generated  # noqa: E402
from xconv.pipeline import _load_generated  # noqa: E402

_T = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
      "intermediate_size": 64}  # fmt: skip

# The first shape of each list is the example the model is converted at: batch 5 and
# sequence 7 (image 56) are sizes nothing else in the tiny configs has, so a literal one in
# the generated source is the trace's shape leaking.
TEXT_SHAPES = [(5, 7), (1, 4), (3, 12)]
IMAGE_SHAPES = [(5, 3, 56, 56), (1, 3, 32, 32), (2, 3, 40, 48)]
VIT_SHAPES = [(5, 3, 32, 32), (1, 3, 32, 32), (3, 3, 32, 32)]

#: name -> (shapes, which dims of the input are symbolic after conversion)
MODELS = {
    "bert": (TEXT_SHAPES, (0, 1)),
    "gpt2": (TEXT_SHAPES, (0, 1)),
    "llama": (TEXT_SHAPES, (0, 1)),
    "vit": (VIT_SHAPES, (0,)),  # the image size is fixed by the position embeddings
    "cnn": (IMAGE_SHAPES, (0, 2, 3)),
}
TARGETS = ["jax", "flax_linen", "flax_nnx", "torch", "torch_source", "onnxruntime"]


class _Outputs(torch.nn.Module):
    """``forward(x)`` -> the tensors of a Hugging Face output (keyword ``name``)."""

    def __init__(self, inner, name: str) -> None:
        super().__init__()
        self.inner, self.name = inner, name

    def forward(self, x):
        out = self.inner(**{self.name: x})
        return tuple(t for t in out.to_tuple() if isinstance(t, torch.Tensor))


def _build(name: str) -> torch.nn.Module:
    tf = transformers
    torch.manual_seed(0)
    if name == "bert":
        model = tf.BertModel(tf.BertConfig(vocab_size=100, max_position_embeddings=64, **_T))
        return _Outputs(model, "input_ids").eval()
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=4, n_positions=64,
                            use_cache=False, bos_token_id=0, eos_token_id=0)  # fmt: skip
        return _Outputs(tf.GPT2Model(cfg), "input_ids").eval()
    if name == "llama":
        cfg = tf.LlamaConfig(vocab_size=100, num_key_value_heads=2, max_position_embeddings=64,
                             use_cache=False, **_T)  # fmt: skip
        return _Outputs(tf.LlamaForCausalLM(cfg), "input_ids").eval()
    if name == "vit":
        model = tf.ViTModel(tf.ViTConfig(image_size=32, patch_size=8, **_T))
        return _Outputs(model, "pixel_values").eval()
    if name == "cnn":
        return make_resnet()[0].eval()
    raise ValueError(name)


def _input(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if len(shape) == 2:
        return torch.randint(0, 100, shape, generator=gen)
    return torch.randn(*shape, generator=gen)


def _convert(module: torch.nn.Module, example: torch.Tensor):
    """The one conversion, as a new user writes it: no argument but the example (symbolic
    by default: every dim torch.export keeps dynamic)."""
    return xconv.from_torch(module, (example,))


@functools.cache
def _converted(name: str):
    os.environ["HF_HUB_OFFLINE"] = "1"
    module = _build(name)
    shapes, _ = MODELS[name]
    model = _convert(module, _input(name, shapes[0], seed=0))
    return module, model


@pytest.fixture(scope="module")
def where(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shape_general")


@functools.cache
def _flax_dir(name: str, api: str, where: str) -> Path:
    return xconv.to_flax(_converted(name)[1], Path(where) / f"{name}_{api}", api=api)


@functools.cache
def _torch_source(name: str, where: str):
    return load_generated(_converted(name)[1], Path(where))


def _runner(name: str, target: str, where: Path):
    """``run(x: np.ndarray) -> list[np.ndarray]`` for ``target``, built once."""
    model = _converted(name)[1]
    # JAX targets run under jit with their weights traced, as one deploys them: each shape
    # is a fresh trace, so a size read from the example would show.
    if target == "jax":
        fn, params = xconv.to_jax(model)
        jitted = jax.jit(fn)
        return lambda x: jitted(params, x)
    if target == "flax_linen":
        out = _flax_dir(name, "linen", str(where))
        module, variables = _load_generated(out / "model.py").load(out)
        apply = jax.jit(module.apply)
        return lambda x: apply(variables, x)
    if target == "flax_nnx":
        out = _flax_dir(name, "nnx", str(where))
        module = _load_generated(out / "model.py").load(out)
        call = nnx.jit(lambda m, x: m(x))
        return lambda x: call(module, x)
    if target in ("torch", "torch_source"):
        if target == "torch":
            built = xconv.to_torch(model)
            module = built[0] if isinstance(built, tuple) else built
        else:
            module = _torch_source(name, str(where))[0]
        module.eval()

        def run(x):
            with torch.no_grad():
                return module(torch.from_numpy(x))

        return run
    path = xconv.save(model, where / f"{name}_{uuid.uuid4().hex[:6]}.onnx")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = sess.get_inputs()[0].name
    return lambda x: sess.run(None, {feed: x})


def _arrays(out) -> list[np.ndarray]:
    out = out if isinstance(out, tuple | list) else (out,)
    return [np.asarray(o.detach() if isinstance(o, torch.Tensor) else o) for o in out]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_symbolic_dims_are_the_admissible_ones(name):
    model = _converted(name)[1]
    _, symbolic = MODELS[name]
    (value,) = model.graph.inputs
    got = tuple(i for i, d in enumerate(value.shape) if not isinstance(d, int))
    assert got == symbolic, value.shape
    assert all(isinstance(d, ir.SymbolicDim) for i, d in enumerate(value.shape) if i in got)
    # named by role: batch, seq (token ids), height and width (an image)
    roles = {1: "seq"} if value.dtype.is_integer() else {2: "height", 3: "width"}
    assert [value.shape[i].value for i in got] == [roles.get(i, "batch") for i in got]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_runs_at_every_shape(name, target, where):
    module, _ = _converted(name)
    shapes, _ = MODELS[name]
    run = _runner(name, target, where)
    for seed, shape in enumerate(shapes, start=1):
        x = _input(name, shape, seed)
        with torch.no_grad():
            want = _arrays(module(x))
        got = _arrays(run(x.numpy()))
        assert len(got) == len(want), (shape, target)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape, (shape, target)
            scale = float(np.abs(w).max()) or 1.0
            err = float(np.abs(g.astype(np.float64) - w).max())
            assert err <= 1e-4 * scale, (shape, target, err, scale)


# A call that fixes a shape: a literal batch or sequence length in its arguments pins the
# model to the traced shape.
_SHAPING = re.compile(
    r"\b(reshape|view|arange|expand|broadcast_to|full|zeros|ones|empty|tile|repeat|"
    r"new_zeros|new_ones|new_full|unflatten)\(([^()]*(?:\([^()]*\)[^()]*)*)\)"
)


def _example_sizes(name: str) -> set[int]:
    shapes, symbolic = MODELS[name]
    sizes = {shapes[0][i] for i in symbolic}
    if name in ("bert", "gpt2", "llama"):  # flattened batch * sequence rows
        sizes.add(shapes[0][0] * shapes[0][1])
    return sizes


def _leaks(source: str, sizes: set[int]) -> list[str]:
    found = []
    for line in source.splitlines():
        for match in _SHAPING.finditer(line):
            numbers = {int(n) for n in re.findall(r"(?<![\w.])\d+(?![\w.])", match.group(2))}
            if numbers & sizes:
                found.append(line.strip())
    return found


def test_leak_check_sees_a_literal_size():
    sizes = {5, 7}
    assert _leaks("        h = x.reshape(5, 7, 32)", sizes) == ["h = x.reshape(5, 7, 32)"]
    assert _leaks("    p = jnp.arange(0, 7, dtype=jnp.int64)", sizes)
    assert _leaks("    m = jnp.broadcast_to(m, (x.shape[0], 1, 7, 7))", sizes)
    assert not _leaks("        h = x.reshape(*x.shape[:2], -1, 8)", sizes)
    assert not _leaks("        h = x.reshape(x.shape[0], 17, 32)", sizes)


@pytest.mark.parametrize("source", ["flax_linen", "flax_nnx", "torch_source"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_no_example_shape_in_generated_source(name, source, where):
    if source == "torch_source":
        text = _torch_source(name, str(where))[1]
    else:
        text = (_flax_dir(name, source.split("_")[1], str(where)) / "model.py").read_text()
    assert _leaks(text, _example_sizes(name)) == []


#: What each model's generated linen source reads its sizes as (``flax/source/sizes.py``).
SIZE_FORMS = {
    "bert": ["[:, :x.shape[1]]", "jnp.broadcast_to(h_1, (x.shape[0], x.shape[1]))"],
    "gpt2": ["np.arange(x.shape[1], dtype=np.int64)"],
    "vit": ["(x.shape[0], 1, 32))"],
}


@pytest.mark.parametrize("name", sorted(SIZE_FORMS))
def test_sizes_are_python_expressions_in_generated_flax(name, where):
    """No numpy plumbing for sizes: the slice, broadcast and range read ``x.shape[i]``
    (these sources also run at every shape above, under jit)."""
    text = (_flax_dir(name, "linen", str(where)) / "model.py").read_text()
    text = text.split("\ndef load(")[0]
    for form in SIZE_FORMS[name]:
        assert form in text, (name, form)
    for plumbing in (r"(?<![\w.])np\.squeeze\(", r"(?<![\w.])np\.concatenate\(", r"\b_slice\(",
                     "broadcast_shapes", r"\+ 0\b"):  # fmt: skip
        assert not re.search(plumbing, text), (name, plumbing)

"""Flax models from outside packages, converted to torch as a new user would.

Each model comes from a package on the index (``flaxmodels``, ``jax-models``, ``vitax``,
``mamba2-jax``), built
at a small size with random weights (nothing downloads), every float weight nudged so zero-
initialised heads and layer scales cannot hide a wrong mapping, and run in eval mode. It goes
through ``xconv.from_flax`` and both torch routes: ``xconv.to_torch`` (runtime module) and
``xconv.to_torch_source`` (readable ``nn.Module`` source, executed, state_dict loaded strictly).
Both must reproduce the Flax outputs. One model also goes through the CLI
(``xconv flax-to-torch VARS --module pkg.mod:factory``). A package that is not installed skips.
The six slowest models (20-90 s each) run under ``-m slow``.

Eval mode: ``flaxmodels`` modules take ``train=True`` by default and ``jax_models`` modules take
``deterministic`` at call time, so the call is passed to ``from_flax`` as ``method``, a callable
``(module, *inputs)`` (linen's ``apply(method=...)`` accepts one).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import xconv  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5


def _images(size: int, batch: int = 2) -> np.ndarray:
    return np.random.default_rng(0).random((batch, size, size, 3), dtype=np.float32)


def _nudged(variables: Any) -> Any:
    """Every float leaf plus ``0.05 * N(0, 1)`` (variances by ``|noise|``, so they stay > 0)."""
    rng = np.random.default_rng(7)  # numpy: one jax.random call per leaf shape compiles
    leaves, tree = jax.tree_util.tree_flatten_with_path(variables)
    out = []
    for path, leaf in leaves:
        leaf = np.asarray(leaf)
        if leaf.dtype.kind != "f":
            out.append(leaf)
            continue
        noise = (0.05 * rng.standard_normal(leaf.shape)).astype(leaf.dtype)
        out.append(leaf + (np.abs(noise) if "var" in jax.tree_util.keystr(path) else noise))
    return jax.tree_util.tree_unflatten(tree, out)


def _eval_train(module, x):
    return module(x, train=False)


def _eval_deterministic(module, x):
    return module(x, deterministic=True)


# --- the models -----------------------------------------------------------------------------
# Each builder returns (module, variables or None for nnx, inputs, method, layer markers): the
# markers are strings the generated torch source must contain (real layers, not loose ops).


def _flaxmodels_resnet18():
    fm = pytest.importorskip("flaxmodels")
    module = fm.ResNet18(output="logits", pretrained=None, num_classes=10)
    x = _images(32)
    variables = _nudged(module.init(jax.random.PRNGKey(0), x, train=False))
    # flaxmodels writes its own BatchNorm module (a copy of Flax's, not nn.BatchNorm): it is
    # emitted as its body, one generated class, not as torch's BatchNorm2d.
    return module, variables, (x,), _eval_train, ("nn.Conv2d(", "class BatchNorm(", "nn.Linear(")


def _flaxmodels_vgg16():
    fm = pytest.importorskip("flaxmodels")
    # include_head=True needs 224x224 images; the convolutional trunk runs at any size.
    module = fm.VGG16(output="logits", pretrained=None, include_head=False)
    x = _images(32)
    variables = _nudged(module.init(jax.random.PRNGKey(0), x, train=False))
    # VGG builds its convs in a helper method (``self._conv_block``): the name stack holds
    # ``VGG/VGG._conv_block/conv1_1`` and the importer still finds the module ``conv1_1``.
    return module, variables, (x,), _eval_train, ("nn.Conv2d(",)


def _jax_models(name: str):
    pytest.importorskip("jax_models")
    from jax_models.models import (
        cait,
        conv_mixer,
        convnext,
        mlp_mixer,
        mpvit,
        patchconvnet,
        poolformer,
        pvit,
        segformer,
        swin_transformer,
        van,
    )

    builders = {
        "mlp_mixer": lambda: mlp_mixer.MLPMixer(
            patch_size=8,
            num_mixers_layers=2,
            hidden_size=32,
            channels_dim=64,
            tokens_dim=16,
            attach_head=True,
            num_classes=10,
        ),  # fmt: skip
        "conv_mixer": lambda: conv_mixer.ConvMixer(
            features=16, patch_size=4, num_mixer_layers=2, filter_size=3, num_classes=10
        ),
        "poolformer_s12": lambda: poolformer.S12(attach_head=True, num_classes=10),
        "cait": lambda: cait.CaiT(
            patch_size=8, embed_dim=32, depth=2, num_heads=4, depth_token_only=1, num_classes=10
        ),
        "mpvit": lambda: mpvit.MPViT(
            channels_list=(8, 16, 24, 32), num_layers_list=(1, 1, 1, 1), num_classes=10
        ),
        "patchconvnet": lambda: patchconvnet.PatchConvNet(depth=2, dim=32, num_classes=10),
        # These compute Python floats from `jnp.linspace` in __call__ (drop-path rates): the
        # importer retraces them with constant-only operations evaluated eagerly.
        "convnext": lambda: convnext.ConvNeXt(
            depths=(1, 1, 1, 1), dims=(8, 16, 32, 64), num_classes=10
        ),
        "van": lambda: van.VAN(embed_dims=(8, 16, 32, 64), depths=(1, 1, 1, 1), num_classes=10),
        "pvit": lambda: pvit.PyramidViT(
            embed_dims=(8, 16, 32, 64), depths=(1, 1, 1, 1), num_classes=10
        ),
        "segformer": lambda: segformer.SegFormer(
            emb_dims=(8, 16, 32, 64),
            num_heads=(1, 2, 4, 8),
            depths=(1, 1, 1, 1),
            drop_path=0.0,
            decoder_emb=16,
            attach_head=True,
            num_classes=5,
        ),
        "swin": lambda: swin_transformer.SwinTransformer(
            patch_size=4,
            emb_dim=16,
            depths=(2, 2),
            num_heads=(2, 4),
            window_size=4,
            drop_path=0.0,
            num_classes=10,
        ),
    }
    markers = {
        "mlp_mixer": ("nn.Conv2d(", "nn.LayerNorm(", "nn.Linear("),
        "conv_mixer": ("nn.Conv2d(", "BatchNorm2d("),
        "poolformer_s12": ("nn.Conv2d(", "nn.LayerNorm("),
        "cait": ("nn.Conv2d(", "nn.LayerNorm(", "nn.Linear("),
        "mpvit": ("nn.Conv2d(", "BatchNorm2d(", "nn.Linear("),
        "patchconvnet": ("nn.Conv2d(", "nn.Linear("),
        "convnext": ("nn.Conv2d(", "nn.LayerNorm(", "nn.Linear("),
        "van": ("nn.Conv2d(", "BatchNorm2d("),
        "pvit": ("nn.Conv2d(", "nn.LayerNorm(", "nn.Linear("),
        "segformer": ("nn.Conv2d(", "nn.LayerNorm("),
        "swin": ("nn.LayerNorm(", "nn.Linear("),
    }
    module = builders[name]()
    x = _images(64 if name in ("mpvit", "convnext", "van", "pvit", "segformer") else 32)
    variables = _nudged(module.init(jax.random.PRNGKey(0), x, deterministic=True))
    return module, variables, (x,), _eval_deterministic, markers[name]


def _vitax_module():
    """vitax's ``VisionTransformer`` (nnx).

    ``import vitax`` fails with transformers 5 (its ``__init__`` imports the removed
    ``FlaxViTForImageClassification``); ``vitax/models/vit.py`` needs only jax and flax, so it is
    loaded from its file.
    """
    spec = importlib.util.find_spec("vitax")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vitax is not installed")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "models" / "vit.py"
    file_spec = importlib.util.spec_from_file_location("_xconv_test_vitax_vit", path)
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    return module


def _vitax_vit(fsdp: bool):
    from flax import nnx

    vit = _vitax_module()
    kwargs = dict(num_classes=10, img_size=32, patch_size=8, num_layers=2, num_heads=4,
                  mlp_dim=64, hidden_size=32, dropout_rate=0.1, fsdp=fsdp)  # fmt: skip
    if fsdp:  # weights annotated with a 'data' mesh axis: flax needs a mesh to create them
        mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        with jax.set_mesh(mesh):
            model = vit.VisionTransformer(**kwargs, rngs=nnx.Rngs(0))
    else:
        model = vit.VisionTransformer(**kwargs, rngs=nnx.Rngs(0))
    model.eval()
    return model, None, (_images(32),), None, ("nn.Conv2d(", "nn.LayerNorm(", "nn.Linear(")


def _mamba2(kind: str):
    """mamba2-jax (nnx), tiny: the causal LM's logits, or the time-series forecaster.

    The package opens its own ``jax.named_scope`` in every module (``mamba2_forecaster/...``);
    the importer skips name-stack segments that are not module paths.
    """
    mj = pytest.importorskip("mamba2_jax")
    from flax import nnx

    if kind == "forecaster":
        model = mj.create_random_forecaster(input_dim=3, d_model=32, n_layers=2, output_dim=1,
                                            forecast_horizon=4, d_state=8, headdim=8,
                                            chunk_size=8)  # fmt: skip
        x = np.random.default_rng(0).standard_normal((2, 16, 3)).astype(np.float32)
    else:
        cfg = mj.Mamba2Config(vocab_size=100, hidden_size=32, state_size=8, head_dim=8,
                              chunk_size=8, num_hidden_layers=2)  # fmt: skip

        class LogitsOnly(nnx.Module):  # the LM returns {"logits", "loss": None, "cache": None}
            def __init__(self, lm):
                self.lm = lm

            def __call__(self, ids):
                return self.lm(ids)["logits"]

        model = LogitsOnly(mj.create_random_model(cfg, seed=0))
        x = np.random.default_rng(1).integers(0, 100, (2, 16)).astype(np.int32)
    model.eval()
    return model, None, (x,), None, ("nn.Linear(",)


CASES: dict[str, Callable[[], tuple]] = {
    "flaxmodels.ResNet18": _flaxmodels_resnet18,
    "flaxmodels.VGG16": _flaxmodels_vgg16,
    **{
        f"jax_models.{n}": (lambda n=n: _jax_models(n))
        for n in (
            *("mlp_mixer", "conv_mixer", "poolformer_s12", "cait", "mpvit", "patchconvnet"),
            *("convnext", "van", "pvit", "segformer", "swin"),
        )
    },
    "vitax.VisionTransformer": lambda: _vitax_vit(fsdp=False),
    "vitax.VisionTransformer(fsdp)": lambda: _vitax_vit(fsdp=True),
    "mamba2_jax.Mamba2ForCausalLM": lambda: _mamba2("lm"),
    "mamba2_jax.Mamba2Forecaster": lambda: _mamba2("forecaster"),
}


def _reference(module, variables, inputs, method) -> list[np.ndarray]:
    # nnx modules hold their state; linen ones are applied to their variables.
    out = module(*inputs) if variables is None else module.apply(variables, *inputs, method=method)
    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(out)]


def _torch_outputs(module, inputs) -> list[np.ndarray]:
    with torch.no_grad():
        out = module(*(torch.from_numpy(np.asarray(x)) for x in inputs))
    out = out if isinstance(out, tuple | list) else (out,)
    return [o.detach().numpy() for o in out]


def _assert_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    """float32 agreement; ``atol`` scales with the output's magnitude (VGG's reaches ~1e3)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        scale = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL * scale)


def _convert(module, variables, inputs, method, *, dynamic_batch: bool = True):
    kwargs = {} if method is None else {"method": method}
    return xconv.from_flax(module, variables, inputs, dynamic_batch=dynamic_batch, **kwargs)


#: Cases that take 20-90 s each on two cores: ``-m slow`` (PoolFormer goes through the CLI test
#: in the default run).
SLOW_CASES = {
    f"jax_models.{n}" for n in ("poolformer_s12", "mpvit", "convnext", "van", "pvit", "swin")
}


@pytest.mark.filterwarnings("ignore:xconv. converting with a symbolic batch dimension")
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES else n for n in CASES]
)
def test_outside_flax_model_to_torch(name):
    module, variables, inputs, method, markers = CASES[name]()
    want = _reference(module, variables, inputs, method)
    assert any(np.abs(w).max() > 1e-3 for w in want), "reference output is trivially zero"
    model = _convert(module, variables, inputs, method)

    runtime, _ = xconv.to_torch(model)
    _assert_close(_torch_outputs(runtime, inputs), want)

    source, state = xconv.to_torch_source(model)
    for marker in markers:
        assert marker in source, f"{marker!r} missing from the generated source"
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<{name}>", "exec"), namespace)
    generated = namespace["Model"]()
    generated.load_state_dict(state)  # strict: every weight has its place
    generated.eval()
    _assert_close(_torch_outputs(generated, inputs), want)


# --- the CLI route --------------------------------------------------------------------------


def poolformer_s12_factory():
    """``--module`` factory: jax_models' PoolFormer-S12 (eval mode) and its example input."""
    from jax_models.models import poolformer

    return poolformer.S12(attach_head=True, num_classes=10, deterministic=True), (_images(32),)


@pytest.mark.filterwarnings("ignore:xconv. converting with a symbolic batch dimension")
def test_outside_flax_model_through_the_cli(tmp_path):
    pytest.importorskip("jax_models")
    from click.testing import CliRunner
    from flax import serialization

    from xconv.cli import main
    from xconv.pipeline import _load_generated

    module, (x,) = poolformer_s12_factory()
    variables = _nudged(module.init(jax.random.PRNGKey(0), x))
    path = tmp_path / "poolformer.msgpack"
    path.write_bytes(serialization.msgpack_serialize(variables))
    out = tmp_path / "out"
    factory = f"{__name__}:poolformer_s12_factory"
    r = CliRunner().invoke(main, ["flax-to-torch", str(path), "--module", factory, "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "parity.json").read_text())["passed"] is True
    generated = _load_generated(out / "model.py").load(out)
    generated.eval()
    _assert_close(_torch_outputs(generated, (x,)), [np.asarray(module.apply(variables, x))])

"""Generated Flax runs under ``jax.jit``, with its variables traced, and matches torch.

A model whose folded constants are too large to inline stores them in the ``constants``
collection; under ``jit`` with the variables passed as arguments those are traced arrays,
so no op may compute on them with numpy. BERT-base's attention-mask ``Expand`` of a
``(1, 1, seq, 1)`` table did (``TracerArrayConversionError`` in bench_throughput's BERT row).
"""

from __future__ import annotations

import importlib.util
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
pytest.importorskip("flax")
transformers = pytest.importorskip("transformers")

import xconv  # noqa: E402

SEQ = 80  # > INLINE_LIMIT (64): the mask table is a stored constant, not a literal
_T = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
      "intermediate_size": 64}  # fmt: skip


class _Hidden(torch.nn.Module):
    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids):
        return self.inner(input_ids=input_ids).last_hidden_state


def _build(name: str) -> torch.nn.Module:
    tf = transformers
    torch.manual_seed(0)
    if name == "bert":
        cfg = tf.BertConfig(vocab_size=100, max_position_embeddings=128, **_T)
        return _Hidden(tf.BertModel(cfg, add_pooling_layer=False)).eval()
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=128)
        return _Hidden(tf.GPT2Model(cfg)).eval()
    if name == "llama":
        cfg = tf.LlamaConfig(
            vocab_size=100, num_key_value_heads=2, max_position_embeddings=128, **_T
        )
        return _Hidden(tf.LlamaModel(cfg)).eval()
    raise ValueError(name)


def _import(path):
    spec = importlib.util.spec_from_file_location(f"jit_gen_{uuid.uuid4().hex}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# bert is the regression (~20 s loaded); gpt2 and llama (causal masks, rotary tables) are slow
@pytest.mark.parametrize(
    "name", ["bert", *(pytest.param(n, marks=pytest.mark.slow) for n in ("gpt2", "llama"))]
)
def test_generated_flax_runs_under_jit(tmp_path, name):
    module = _build(name)
    ids = torch.randint(0, 100, (2, SEQ), generator=torch.Generator().manual_seed(1))
    model = xconv.from_torch(module, ids, dynamic_batch=True)
    out = xconv.to_flax(model, tmp_path / "flax")
    flax_module, variables = _import(out / "model.py").load(out)
    apply = jax.jit(lambda v, x: flax_module.apply(v, x))
    with torch.no_grad():
        want = module(ids[:1]).numpy()
    got = apply(variables, ids[:1].numpy())  # batch 1: not the traced batch size 2
    got = got[0] if isinstance(got, tuple | list) else got
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    # and a training step: gradients through the traced parameters
    params = variables["params"]
    rest = {k: v for k, v in variables.items() if k != "params"}

    def loss(p, x):
        y = flax_module.apply({"params": p, **rest}, x)
        y = y[0] if isinstance(y, tuple | list) else y
        return (y**2).mean()

    grads = jax.jit(jax.grad(loss))(params, ids[:1].numpy())
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree_util.tree_leaves(grads))

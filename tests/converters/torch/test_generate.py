"""Causal LMs converted with ``generate=True`` decode with a cache, token for token like torch.

Tiny Llama (GQA, RoPE), GPT-2 (learned positions, tied embeddings) and Mistral (a sliding
window longer than the cache) are built offline from configs, converted with
``xconv.from_torch(model, generate=True)`` and written by ``xconv.to_flax``. Through the
generated model.py:

* ``generate`` gives torch's ``generate(do_sample=False)`` tokens for 24 steps at two batch
  and prompt sizes;
* each cached step (prefill, then one token at a time) gives torch's full-forward logits at
  those positions, through the JAX runtime and the generated module, at two cache lengths;
* a left-padded batch (``attention_mask``) gives torch's tokens, and other tokens without
  the mask;
* a planted fault (one layer-1 weight scaled by 1.01) changes the logits past the tolerance;
* every decoder family of the transformers zoo (``tests/decoder_zoo.py``: OPT, Falcon and
  Mixtral by default, the other 15 under ``-m slow``) gives torch's greedy tokens for 20 steps.

CI runs it on the newest transformers and on 5.23.0 (``.ci/run``).
"""

from __future__ import annotations

import importlib.util
import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
transformers = pytest.importorskip("transformers")

import xconv  # noqa: E402
from tests.decoder_zoo import FAST, SLOW, tiny_decoder  # noqa: E402
from tests.generated_lint import ruff_findings  # noqa: E402
from xconv.errors import ConversionError  # noqa: E402

TF = transformers.__version__
_SIZES = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip


def _model(family: str):
    tf = transformers
    if family == "gpt2":
        config = tf.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                               bos_token_id=1, eos_token_id=2)  # fmt: skip
        cls = tf.GPT2LMHeadModel
    elif family == "mistral":
        config, cls = tf.MistralConfig(**_SIZES, sliding_window=48), tf.MistralForCausalLM
    else:
        config, cls = tf.LlamaConfig(**_SIZES), tf.LlamaForCausalLM
    torch.manual_seed(0)
    return cls(config).eval()


def _load(out):
    spec = importlib.util.spec_from_file_location(f"generated_{out.name}", out / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=["llama", "gpt2", "mistral"])
def converted(request, tmp_path_factory):
    model = _model(request.param)
    ir_model = xconv.from_torch(model, generate=True)
    out = tmp_path_factory.mktemp(request.param)
    xconv.to_flax(ir_model, out)
    return request.param, model, ir_model, _load(out), out


@pytest.mark.parametrize("batch,prompt", [(1, 5), (3, 9)])
def test_greedy_tokens_equal_torch_generate(converted, batch, prompt):
    family, model, _, generated, out = converted
    ids = torch.randint(3, 96, (batch, prompt), generator=torch.Generator().manual_seed(prompt))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=0).numpy()  # fmt: skip
    module, variables = generated.load(out)
    got = np.asarray(generated.generate(module, variables, ids.numpy(), 24, eos_token_id=None))
    assert got.shape == want.shape == (batch, prompt + 24)
    assert (got == want).all(), (
        f"{family} on transformers {TF}: first differing step "
        f"{int(np.argmax((got != want).any(0))) - prompt}"
    )


def _left_padded(batch, prompt, vocab, seed):
    """Prompts of different lengths in one batch: row ``r`` left-padded by ``2 * r`` slots."""
    ids = torch.randint(3, vocab, (batch, prompt), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, : 2 * row] = 0
    return ids.masked_fill(mask == 0, 0), mask


def test_left_padded_prompts_equal_torch_generate(converted):
    """``attention_mask`` marks each row's padding: positions count the unmasked slots and no
    token attends to padding, as in torch's generate; without it the padded rows differ."""
    family, model, _, generated, out = converted
    ids, mask = _left_padded(3, 9, 96, seed=5)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=0).numpy()  # fmt: skip
    module, variables = generated.load(out)
    got = np.asarray(generated.generate(module, variables, ids.numpy(), 24,
                                        attention_mask=mask.numpy(), eos_token_id=None))  # fmt: skip
    assert (got == want).all(), (
        f"{family} on transformers {TF}: rows differing {np.nonzero((got != want).any(1))[0]}"
    )
    unmasked = np.asarray(generated.generate(module, variables, ids.numpy(), 24, eos_token_id=None))
    assert (unmasked[0] == want[0]).all() and (unmasked[1:] != want[1:]).any(), family
    with pytest.raises(ValueError, match="attention_mask must be"):
        generated.generate(module, variables, ids.numpy(), 2, attention_mask=mask[:, 1:].numpy())


def test_generated_model_lints_clean(converted):
    out = converted[-1]
    source = (out / "model.py").read_text()
    assert "def generate(" in source and "_scatter_elements" not in source  # slice writes
    assert ruff_findings(out / "model.py", line_length=100) == ""


def test_every_layer_is_one_class(converted):
    """Layer 0's cache is also read by the mask (its length), outside the layer: the layer's
    class still reuses the cache's name for its write, as layer 1's does, so both layers are
    one generated class (they were ``LlamaDecoderLayer`` and ``LlamaDecoderLayer_1``)."""
    family, *_, out = converted
    source = (out / "model.py").read_text()
    classes = re.findall(r"^class (\w+)\(", source, re.M)
    assert not [c for c in classes if re.search(r"_\d+$", c)], (family, classes)


def test_cached_steps_match_the_full_forward(converted):
    family, model, ir_model, generated, out = converted
    spec = json.loads(ir_model.metadata_props["xconv.generate"])
    assert len(spec["layers"]) == 2
    fn, params = xconv.to_jax(ir_model)
    module, variables = generated.load(out)
    for batch, prompt, length in [(2, 5, 12), (3, 8, 20)]:
        ids = torch.randint(3, 96, (batch, prompt + 3), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = model(ids).logits.numpy()
        cache = generated.init_cache(batch, length)
        flat = [np.asarray(t) for layer in cache for t in layer]
        ones = np.ones((batch, length), np.int64)  # the step's attention_mask: no padding
        runtime = fn(params, ids[:, :prompt].numpy(), np.arange(prompt), ones, *flat)
        logits, cache = generated.decode(module, variables, ids[:, :prompt].numpy(),
                                         np.arange(prompt), cache)  # fmt: skip
        errors = [np.abs(np.asarray(logits) - want[:, :prompt]).max(),
                  np.abs(np.asarray(runtime[0]) - want[:, :prompt]).max()]  # fmt: skip
        flat = runtime[1:]
        for t in range(prompt, prompt + 3):
            step = ids[:, t : t + 1].numpy()
            logits, cache = generated.decode(module, variables, step, np.array([t]), cache)
            runtime = fn(params, step, np.array([t]), ones, *flat)
            flat = runtime[1:]
            errors += [np.abs(np.asarray(logits)[:, 0] - want[:, t]).max(),
                       np.abs(np.asarray(runtime[0])[:, 0] - want[:, t]).max()]  # fmt: skip
        assert max(errors) < 1e-4, f"{family} on transformers {TF}, cache {length}: {errors}"


def test_a_wrong_weight_is_caught(converted):
    family, model, _, generated, out = converted
    module, variables = generated.load(out)
    leaves = jax.tree_util.tree_flatten_with_path(variables)[0]
    path, leaf = next((p, v) for p, v in leaves if "1" in jax.tree_util.keystr(p) and v.ndim == 2)
    wrong = jax.tree_util.tree_map_with_path(lambda p, v: v * 1.01 if p == path else v, variables)
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits.numpy()
    logits, _ = generated.decode(module, wrong, ids.numpy(), np.arange(6),
                                 generated.init_cache(2, 8))  # fmt: skip
    assert np.abs(np.asarray(logits) - want).max() > 1e-4, f"{family}: {path} scaled unnoticed"


def test_refusals_name_the_reason(tmp_path):
    with pytest.raises(ConversionError, match="causal LM"):
        xconv.from_torch(torch.nn.Linear(3, 3), generate=True)
    model = _model("llama")
    with pytest.raises(ConversionError, match="static=True"):
        xconv.from_torch(model, generate=True, static=True)
    ir_model = xconv.from_torch(model, generate=True)
    xconv.to_flax(ir_model, tmp_path / "linen")
    generated = _load(tmp_path / "linen")
    module, variables = generated.load(tmp_path / "linen")
    with pytest.raises(ValueError, match="64 positions"):
        generated.generate(module, variables, np.ones((1, 60), np.int64), 8)
    with pytest.raises(ValueError, match="rng"):
        generated.generate(module, variables, np.ones((1, 4), np.int64), 2, temperature=0.7)
    sampled = generated.generate(module, variables, np.ones((2, 4), np.int64), 6, temperature=0.7,
                                 top_k=10, top_p=0.9, rng=jax.random.key(0))  # fmt: skip
    assert sampled.shape == (2, 10) and int(sampled.max()) < 96


#: Families the fixture above does not already convert.
_ZOO = [pytest.param(f, id=f"{f}-tf{TF}") for f in FAST if f not in ("llama", "gpt2")] + [
    pytest.param(f, id=f"{f}-tf{TF}", marks=pytest.mark.slow) for f in SLOW if f != "mistral"
]


@pytest.mark.parametrize("family", _ZOO)
def test_zoo_decoders_generate_like_torch(family, tmp_path):
    cls, config = tiny_decoder(family)
    torch.manual_seed(0)
    model = cls(config).eval()
    xconv.to_flax(xconv.from_torch(model, generate=True), tmp_path)
    generated = _load(tmp_path)
    module, variables = generated.load(tmp_path)
    ids = torch.randint(3, config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None,
                              pad_token_id=0, use_cache=True).numpy()  # fmt: skip
    got = np.asarray(generated.generate(module, variables, ids.numpy(), 20, eos_token_id=None))
    assert (got == want).all(), (
        f"{family} on transformers {TF}: first differing step "
        f"{int(np.argmax((got != want).any(0))) - 5}"
    )
    # The same program with the second row left-padded by 2 slots.
    ids, mask = _left_padded(2, 5, config.vocab_size, seed=2)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                              eos_token_id=None, pad_token_id=0, use_cache=True).numpy()  # fmt: skip
    got = np.asarray(generated.generate(module, variables, ids.numpy(), 20,
                                        attention_mask=mask.numpy(), eos_token_id=None))  # fmt: skip
    assert (got == want).all(), f"{family} left-padded on transformers {TF}"


def test_nnx_model_generates_like_linen(converted, tmp_path):
    """api="nnx": the module holds its variables; ``generate(model, input_ids, ...)``."""
    family, model, ir_model, generated, out = converted
    xconv.to_flax(ir_model, tmp_path, api="nnx")
    nnx_generated = _load(tmp_path)
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=0).numpy()  # fmt: skip
    got = nnx_generated.generate(nnx_generated.load(tmp_path), ids.numpy(), 12, eos_token_id=None)
    assert (np.asarray(got) == want).all(), f"{family} nnx on transformers {TF}"

"""Zoo rows for the Flax model classes of transformers 4.46.3 (the last release with Flax
implementations), run in their own process so that transformers 4 never meets the
transformers 5 of the torch rows.

    python benchmarks/zoo_flax.py --transformers4 /work/tf446 [--only bert,gpt2]

prints one JSON line per row: ``{"name", "cells": [[verdict, rel_err, seconds, cause], ...],
"import_s"}``. ``benchmarks/zoo.py`` runs it and writes the rows into docs/models.md.

Each model is built from a tiny config with random parameters (``seed=0``; every float
parameter then gets Gaussian noise of scale ``NOISE`` so zero-initialised biases and unit
norm scales are exercised too), and its linen module ``model.module`` with variables
``{"params": model.params}`` goes through ``xconv.from_flax`` and then ``to_jax``,
``to_torch`` and ``to_torch_source`` (with example inputs: the source is checked against
``to_torch`` first), each compared with the Flax module's own outputs.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION = "4.46.3"
DIRECTIONS = ("flax-to-jax", "flax-to-torch", "flax-to-torch-source")
NOISE = 0.05

_TEXT = dict(
    vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=64, max_position_embeddings=64,
)  # fmt: skip
_SEQ2SEQ = dict(
    vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
    max_position_embeddings=64, pad_token_id=1, decoder_start_token_id=2,
)  # fmt: skip
_T5 = dict(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
           num_heads=4)  # fmt: skip
_VISION = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=32,
               num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)  # fmt: skip

#: name -> (model class, config class, config kwargs, input kind)
MODELS: dict[str, tuple[str, str, dict, str]] = {
    "bert": ("FlaxBertModel", "BertConfig", _TEXT, "text"),
    "roberta": ("FlaxRobertaModel", "RobertaConfig", _TEXT, "text"),
    "roberta_prelayernorm": ("FlaxRobertaPreLayerNormModel", "RobertaPreLayerNormConfig",
                             _TEXT, "text"),
    "xlm_roberta": ("FlaxXLMRobertaModel", "XLMRobertaConfig", _TEXT, "text"),
    "electra": ("FlaxElectraModel", "ElectraConfig", {**_TEXT, "embedding_size": 16}, "text"),
    "albert": ("FlaxAlbertModel", "AlbertConfig", {**_TEXT, "embedding_size": 16}, "text"),
    "distilbert": ("FlaxDistilBertModel", "DistilBertConfig",
                   dict(vocab_size=100, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                        max_position_embeddings=64), "text"),
    "roformer": ("FlaxRoFormerModel", "RoFormerConfig", {**_TEXT, "embedding_size": 32}, "text"),
    "big_bird": ("FlaxBigBirdModel", "BigBirdConfig",
                 {**_TEXT, "attention_type": "original_full"}, "text"),
    "gpt2": ("FlaxGPT2Model", "GPT2Config",
             dict(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64), "text"),
    "gpt_neo": ("FlaxGPTNeoModel", "GPTNeoConfig",
                dict(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4,
                     attention_types=[[["global", "local"], 1]], window_size=4,
                     max_position_embeddings=64), "text"),
    "gptj": ("FlaxGPTJModel", "GPTJConfig",
             dict(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                  rotary_dim=4), "text"),
    "opt": ("FlaxOPTModel", "OPTConfig",
            dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32), "text"),
    "bloom": ("FlaxBloomModel", "BloomConfig",
              dict(vocab_size=100, hidden_size=32, n_layer=2, n_head=4), "text"),
    "xglm": ("FlaxXGLMModel", "XGLMConfig",
             dict(vocab_size=100, d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
                  max_position_embeddings=64), "text"),
    "llama": ("FlaxLlamaModel", "LlamaConfig", {**_TEXT, "num_key_value_heads": 2}, "text"),
    "mistral": ("FlaxMistralModel", "MistralConfig",
                {**_TEXT, "num_key_value_heads": 2, "sliding_window": 4}, "text"),
    "gemma": ("FlaxGemmaModel", "GemmaConfig",
              {**_TEXT, "num_key_value_heads": 2, "head_dim": 8}, "text"),
    "clip_text": ("FlaxCLIPTextModel", "CLIPTextConfig", _TEXT, "text"),
    "t5_encoder": ("FlaxT5EncoderModel", "T5Config", _T5, "text"),
    "mt5_encoder": ("FlaxMT5EncoderModel", "MT5Config", _T5, "text"),
    "t5": ("FlaxT5Model", "T5Config", _T5, "seq2seq"),
    "longt5": ("FlaxLongT5Model", "LongT5Config", {**_T5, "encoder_attention_type": "local",
                                                    "local_radius": 4}, "seq2seq"),
    "bart": ("FlaxBartModel", "BartConfig", _SEQ2SEQ, "seq2seq"),
    "mbart": ("FlaxMBartModel", "MBartConfig", _SEQ2SEQ, "seq2seq"),
    "marian": ("FlaxMarianModel", "MarianConfig", _SEQ2SEQ, "seq2seq"),
    "pegasus": ("FlaxPegasusModel", "PegasusConfig", _SEQ2SEQ, "seq2seq"),
    "blenderbot": ("FlaxBlenderbotModel", "BlenderbotConfig", _SEQ2SEQ, "seq2seq"),
    "blenderbot_small": ("FlaxBlenderbotSmallModel", "BlenderbotSmallConfig", _SEQ2SEQ,
                         "seq2seq"),
    "vit": ("FlaxViTModel", "ViTConfig", _VISION, "image"),
    "beit": ("FlaxBeitModel", "BeitConfig", {**_VISION, "use_mask_token": False}, "image"),
    "dinov2": ("FlaxDinov2Model", "Dinov2Config", _VISION, "image"),
    "clip_vision": ("FlaxCLIPVisionModel", "CLIPVisionConfig", _VISION, "image"),
    "resnet": ("FlaxResNetModel", "ResNetConfig",
               dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                    layer_type="basic"), "image"),
    "regnet": ("FlaxRegNetModel", "RegNetConfig",
               dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8),
               "image"),
    "wav2vec2": ("FlaxWav2Vec2Model", "Wav2Vec2Config",
                 dict(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16),
                      conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=16,
                      num_conv_pos_embedding_groups=4, do_stable_layer_norm=True,
                      feat_extract_norm="layer"), "audio"),
    "whisper": ("FlaxWhisperModel", "WhisperConfig",
                dict(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2,
                     encoder_attention_heads=4, decoder_attention_heads=4,
                     encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
                     max_source_positions=8, max_target_positions=16, pad_token_id=1,
                     decoder_start_token_id=2, begin_suppress_tokens=None,
                     suppress_tokens=None), "speech"),
}  # fmt: skip


def _inputs(kind: str):
    import numpy as np

    rs = np.random.RandomState(1)
    if kind == "image":
        return (rs.rand(2, 32, 32, 3).astype(np.float32),)  # the linen modules take NHWC
    if kind == "audio":
        return (rs.randn(2, 400).astype(np.float32),)
    if kind == "speech":
        return (rs.randn(2, 16, 16).astype(np.float32), rs.randint(0, 100, (2, 4)).astype("i4"))
    ids = rs.randint(3, 100, (2, 8)).astype("i4")
    return (ids, ids[:, :4].copy()) if kind == "seq2seq" else (ids,)


def _call(module):
    """``fn(module, *inputs)`` calling the linen module with the arguments the model's
    ``__call__`` wrapper would have built (masks of ones, positions 0..n-1, eval mode)."""
    import jax.numpy as jnp

    params = [n for n in inspect.signature(type(module).__call__).parameters if n != "self"]

    def fn(m, x, decoder=None):
        kw = {params[0]: x}
        batch_seq = x.shape[:2]
        for name in params[1:]:
            if name == "attention_mask" and x.dtype.kind == "i":
                kw[name] = jnp.ones(batch_seq, "i4")
            elif name == "token_type_ids":
                kw[name] = jnp.zeros(batch_seq, "i4")
            elif name == "position_ids":
                kw[name] = jnp.broadcast_to(jnp.arange(batch_seq[1])[None], batch_seq)
            elif name == "decoder_input_ids" and decoder is not None:
                kw[name] = decoder
            elif name == "decoder_attention_mask" and decoder is not None:
                kw[name] = jnp.ones(decoder.shape, "i4")
            elif name == "decoder_position_ids" and decoder is not None:
                kw[name] = jnp.broadcast_to(jnp.arange(decoder.shape[1])[None], decoder.shape)
            elif name == "head_mask":
                kw[name] = None
            elif name == "deterministic":
                kw[name] = True
            elif name == "train" or name == "return_dict":
                kw[name] = False
        out = m(**kw)
        return tuple(o for o in _leaves(out))

    return fn


def _leaves(out):
    import jax

    return [o for o in jax.tree_util.tree_leaves(out) if hasattr(o, "shape")]


def _jax_compat() -> None:
    """``jnp.clip(x, a_min=, a_max=)``: transformers 4.46.3's T5 and LongT5 call the keywords
    jax has since removed (``min=`` / ``max=`` now); a user running that code today needs the
    same one-line shim."""
    import jax.numpy as jnp

    real = jnp.clip
    if getattr(real, "_zoo_compat", False):
        return

    def clip(x, min=None, max=None, *, a_min=None, a_max=None, **kw):  # noqa: A002
        return real(x, a_min if min is None else min, a_max if max is None else max, **kw)

    clip._zoo_compat = True
    jnp.clip = clip


class _Splittable:
    """An array with the ``.split(n, axis=)`` method jax arrays had (``jnp.split``)."""

    def __init__(self, a) -> None:
        self.a, self.shape = a, a.shape

    def split(self, n, axis=-1):
        import jax.numpy as jnp

        return jnp.split(self.a, n, axis=axis)


def _roformer_compat() -> None:
    """transformers 4.46.3's Flax RoFormer calls ``sinusoidal_pos.split(2, axis=-1)``, a
    method jax arrays no longer have (jax 0.10: "'ArrayImpl' object has no attribute
    'split'"); its rotary embedding is given an array that has it, the rest of the library's
    code runs as it is."""
    try:
        from transformers.models.roformer import modeling_flax_roformer as m
    except ImportError:
        return
    cls = m.FlaxRoFormerSelfAttention
    real = cls.apply_rotary_position_embeddings
    if getattr(real, "_zoo_compat", False):
        return

    def rotary(sinusoidal_pos, *layers):
        return real(_Splittable(sinusoidal_pos), *layers)

    rotary._zoo_compat = True
    cls.apply_rotary_position_embeddings = staticmethod(rotary)


def build(name: str):
    """``(module, variables, call, inputs)`` for row ``name``."""
    import jax
    import numpy as np
    import transformers

    _jax_compat()
    _roformer_compat()
    cls_name, cfg_name, kwargs, kind = MODELS[name]
    cfg = getattr(transformers, cfg_name)(**kwargs)
    model = getattr(transformers, cls_name)(cfg, seed=0)
    params = model.params
    variables = dict(params) if "batch_stats" in params else {"params": params}
    rng = np.random.RandomState(0)

    def noisy(path, leaf):
        keys = [getattr(p, "key", "") for p in path]
        if "batch_stats" in keys or not np.issubdtype(np.asarray(leaf).dtype, np.floating):
            return leaf
        return leaf + NOISE * rng.standard_normal(np.shape(leaf)).astype(np.asarray(leaf).dtype)

    variables = jax.tree_util.tree_map_with_path(noisy, variables)
    return model.module, variables, _call(model.module), _inputs(kind)


def row(name: str) -> dict:
    import numpy as np
    import torch

    import xconv
    from benchmarks.zoo import Cell, _cell

    start = time.perf_counter()
    try:
        module, variables, call, inputs = build(name)
        want = [
            np.asarray(o, dtype=np.float64) for o in module.apply(variables, *inputs, method=call)
        ]
    except Exception as e:  # noqa: BLE001 (the library's own code does not run here)
        import jax

        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
        cause = f"reference: transformers {VERSION} on jax {jax.__version__}: {text}"
        cells = [Cell("not run", None, None, cause[:160])] * len(DIRECTIONS)
        return _dump(name, cells, time.perf_counter() - start)
    try:
        model = xconv.from_flax(module, variables, inputs, method=call)
    except Exception as e:  # noqa: BLE001 (recorded in the table)
        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
        cells = [Cell("error", None, None, f"import: {type(e).__name__}: {text}"[:160])] * 3
        return _dump(name, cells, time.perf_counter() - start)
    import_s = time.perf_counter() - start
    targs = tuple(torch.from_numpy(np.asarray(x)) for x in inputs)

    def jax_run():
        fn, params = xconv.to_jax(model)
        return fn(params, *inputs)

    def torch_run():
        tm, _ = xconv.to_torch(model)
        with torch.no_grad():
            return tm(*targs)

    def source_run():
        source, state = xconv.to_torch_source(model, example_inputs=inputs)
        namespace: dict = {}
        exec(compile(source, "generated", "exec"), namespace)  # noqa: S102
        generated = namespace["Model"]().eval()
        generated.load_state_dict(state)
        with torch.no_grad():
            return generated(*targs)

    cells = [_cell(jax_run, want), _cell(torch_run, want), _cell(source_run, want)]
    return _dump(name, cells, import_s)


def _dump(name, cells, import_s) -> dict:
    return {
        "name": name,
        "cells": [[c.verdict, c.rel_err, c.seconds, c.cause] for c in cells],
        "import_s": import_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transformers4", required=True, help="folder holding transformers 4.46.3")
    p.add_argument("--only", default="", help="comma-separated row names")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(args.transformers4).resolve()))
    sys.path.insert(1, str(ROOT))
    import transformers

    if transformers.__version__ != VERSION:
        print(json.dumps({"error": f"transformers {VERSION} not installed "
                                   f"(found {transformers.__version__})"}))  # fmt: skip
        return 0
    wanted = {n for n in args.only.split(",") if n}
    for name in MODELS:
        if wanted and name not in wanted:
            continue
        print(json.dumps(row(name)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

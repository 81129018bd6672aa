"""Flax source templates for the classical ML ops: ai.onnx.ml LabelEncoder,
ArrayFeatureExtractor, Binarizer, TreeEnsemble and the default-domain TfIdfVectorizer, written
with the helpers shared with the torch source (``expressions_ml``). Numbers stay jax arrays
(compare-and-select lookups, vectorised tree steps: jittable); strings are numpy object
arrays, as the string ops hold them. Importing this module registers them in
``templates.registry``.
"""

from __future__ import annotations

from xconv.converters import expressions_ml as exml
from xconv.converters.flax.source.templates import OpCall, array_literal, registry
from xconv.converters.ops.ml import ML

registry.helpers.update(exml.HELPERS)
registry.helpers.update(exml.JAX_HELPERS)

_JAX = exml.Framework(literal=array_literal, from_numpy="jnp.asarray")


@registry.builtin("LabelEncoder", domain=ML, attrs=exml.LABEL_ENCODER_ATTRS)
def _label_encoder(c: OpCall) -> str:
    return exml.label_encoder_call(c, _JAX)


@registry.builtin("ArrayFeatureExtractor", domain=ML)
def _array_feature_extractor(c: OpCall) -> str:
    """X[..., Y]; a 1-D X gives one row (as onnxruntime does). String X stays numpy."""
    x, y = c.args
    xp = "np" if exml.is_strings_input(c) else "jnp"
    if c.need_rank(0) == 1:
        return f"{xp}.reshape({xp}.take({x}, {xp}.ravel({y})), (1, -1))"
    return f"{xp}.take({x}, {xp}.ravel({y}), axis=-1)"


@registry.builtin("Binarizer", domain=ML, attrs={"threshold": 0.0})
def _binarizer(c: OpCall) -> str:
    return f"({c.args[0]} > {exml.binarizer_threshold(c)}).astype({c.dtype()})"


@registry.builtin("TreeEnsemble", domain=ML, since=5, attrs=exml.TREE_ENSEMBLE_ATTRS)
def _tree_ensemble(c: OpCall) -> str:
    return exml.tree_ensemble_call(c, _JAX)


@registry.builtin("TfIdfVectorizer", since=9, attrs=exml.TFIDF_ATTRS)
def _tfidf_vectorizer(c: OpCall) -> str:
    return exml.tfidf_vectorizer_call(c, _JAX)

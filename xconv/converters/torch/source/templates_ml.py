"""PyTorch source templates for the classical ML ops: ai.onnx.ml LabelEncoder,
ArrayFeatureExtractor, Binarizer, TreeEnsemble and the default-domain TfIdfVectorizer, written
with the helpers shared with the Flax source (``expressions_ml``). Numbers stay tensors
(compare-and-select lookups, vectorised tree steps); strings are numpy object arrays, as the
string ops hold them. Importing this module registers them in ``templates.registry``.
"""

from __future__ import annotations

from xconv.converters import expressions_ml as exml
from xconv.converters.ops.ml import ML
from xconv.converters.torch.source.templates import OpCall, registry, tensor_literal

registry.helpers.update(exml.HELPERS)
registry.helpers.update(exml.TORCH_HELPERS)

_TORCH = exml.Framework(literal=tensor_literal, from_numpy="torch.from_numpy")


@registry.builtin("LabelEncoder", domain=ML, attrs=exml.LABEL_ENCODER_ATTRS)
def _label_encoder(c: OpCall) -> str:
    return exml.label_encoder_call(c, _TORCH)


@registry.builtin("ArrayFeatureExtractor", domain=ML)
def _array_feature_extractor(c: OpCall) -> str:
    """X[..., Y]; a 1-D X gives one row (as onnxruntime does). String X stays numpy."""
    x, y = c.args
    index = f"np.asarray({y}).reshape(-1)" if exml.is_strings_input(c) else f"{y}.reshape(-1)"
    if c.need_rank(0) == 1:
        return f"{x}[{index}].reshape(1, -1)"
    return f"{x}[..., {index}]"


@registry.builtin("Binarizer", domain=ML, attrs={"threshold": 0.0})
def _binarizer(c: OpCall) -> str:
    return f"({c.args[0]} > {exml.binarizer_threshold(c)}).to({c.dtype()})"


@registry.builtin("TreeEnsemble", domain=ML, since=5, attrs=exml.TREE_ENSEMBLE_ATTRS)
def _tree_ensemble(c: OpCall) -> str:
    return exml.tree_ensemble_call(c, _TORCH)


@registry.builtin("TfIdfVectorizer", since=9, attrs=exml.TFIDF_ATTRS)
def _tfidf_vectorizer(c: OpCall) -> str:
    return exml.tfidf_vectorizer_call(c, _TORCH)

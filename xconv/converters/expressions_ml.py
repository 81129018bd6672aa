"""The classical ML ops (ai.onnx.ml LabelEncoder, ArrayFeatureExtractor, Binarizer,
TreeEnsemble and the default-domain TfIdfVectorizer) as both source emitters write them:
the helper text and the calls of those helpers, computed as ``ops/ml`` computes them for the
runtimes. The attributes are read when writing (lookup tables, flat tree tables and n-gram
tables are built then, with the runtime's own parsers, and written as constants), so the
written helpers take only valid ones.

Numeric data stays in the framework and traceable (compare-and-select lookups, a fixed
number of vectorised tree steps); string data runs on numpy object arrays of ``str``, as the
string ops do (``expressions_strings``). The numeric helpers differ per framework
(:data:`JAX_HELPERS`, :data:`TORCH_HELPERS`); the numpy ones are shared (:data:`HELPERS`).
Each emitter's ``templates_ml`` passes its literal writer (:class:`Framework`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.converters.codegen import TemplateCall, scalar_literal
from xconv.converters.ops import ml
from xconv.converters.registry import REQUIRED

LABEL_ENCODER_ATTRS = dict(ml._LABEL_ENCODER_ATTRS)

TREE_ENSEMBLE_ATTRS = {
    "aggregate_function": 1,
    "leaf_targetids": REQUIRED,
    "leaf_weights": REQUIRED,
    "membership_values": None,
    "n_targets": None,
    "nodes_falseleafs": REQUIRED,
    "nodes_falsenodeids": REQUIRED,
    "nodes_featureids": REQUIRED,
    "nodes_hitrates": None,
    "nodes_missing_value_tracks_true": None,
    "nodes_modes": REQUIRED,
    "nodes_splits": REQUIRED,
    "nodes_trueleafs": REQUIRED,
    "nodes_truenodeids": REQUIRED,
    "post_transform": 0,
    "tree_roots": REQUIRED,
}

TFIDF_ATTRS = {
    "max_gram_length": REQUIRED,
    "max_skip_count": REQUIRED,
    "min_gram_length": REQUIRED,
    "mode": REQUIRED,
    "ngram_counts": REQUIRED,
    "ngram_indexes": REQUIRED,
    "pool_int64s": None,
    "pool_strings": None,
    "weights": None,
}

# --------------------------------------------------------------------------- numpy helpers

LOOKUP_STRINGS = '''
def _lookup_strings(x, table, default, dtype=object):
    """ONNX LabelEncoder through a dict: each element of x (a string or a number) replaced
    by its value in ``table`` (a NaN key matching NaN), ``default`` where absent."""
    x = np.asarray(x)
    items = x.reshape(-1).tolist()
    if x.dtype.kind == "S":
        items = [e.decode("utf-8") for e in items]
    nan_value = next((v for k, v in table.items() if k != k), default)
    out = [nan_value if e != e else table.get(e, default) for e in items]
    return np.array(out, dtype=dtype).reshape(x.shape)
'''

TOKEN_IDS = '''
def _token_ids(x, vocabulary):
    """Each string of x as its id in ``vocabulary``, -1 where absent (int64)."""
    x = np.asarray(x)
    items = [e.decode("utf-8") if isinstance(e, bytes) else e for e in x.reshape(-1).tolist()]
    return np.array([vocabulary.get(e, -1) for e in items], dtype=np.int64).reshape(x.shape)
'''

#: registry.helpers name -> text, the same in both emitters.
HELPERS = {"lookup_strings": LOOKUP_STRINGS, "token_ids": TOKEN_IDS}

# ------------------------------------------------------------------- per-framework helpers

_LOOKUP_DOC = '''"""ONNX LabelEncoder on numbers: each element of x replaced by the value of the
    first key it equals (a NaN key matching NaN), ``default`` where none does."""'''

_TREE_DOC = '''"""ONNX TreeEnsemble of x [N, F] -> [N, n_targets]. The trees are flat node tables:
    internal nodes 0..n-1, then a padding row n; a child p >= n is leaf p - n. Every tree
    steps down ``depth`` times at once (a row at a leaf stays there), each node testing its
    feature by its mode (<=, <, >=, >, ==, !=, member of ``members``; NaN goes to the true
    branch where ``missing_true``). The reached leaves' weights are summed, averaged, or
    their min / max taken per target, then post-transformed."""'''

_TFIDF_DOC = '''"""ONNX TfIdfVectorizer of x ([C] or [B, C] ids) -> float32 [width] or [B, width].
    ``ngrams`` holds per n-gram length counted (length, grams [n, length], their output
    columns); each gram is counted in each row, unigrams once and longer grams at every
    distance 1..max_skip + 1 between their items. IDF mode counts presence only; IDF and
    TFIDF scale by ``weights``."""'''

JAX_HELPERS = {
    "lookup": f"""
def _lookup(x, keys, values, default):
    {_LOOKUP_DOC}
    keys = jnp.asarray(keys, x.dtype)
    hit = (x[..., None] == keys) | (jnp.isnan(x)[..., None] & jnp.isnan(keys))
    picked = jnp.take(values, jnp.argmax(hit, axis=-1))
    return jnp.where(jnp.any(hit, axis=-1), picked, default)
""",
    "tree_ensemble": f"""
def _tree_ensemble(
    x,
    roots,
    features,
    modes,
    splits,
    true_child,
    false_child,
    leaf_weights,
    leaf_targets,
    depth,
    n_targets,
    members=None,
    missing_true=None,
    aggregate="SUM",
    post_transform="NONE",
):
    {_TREE_DOC}
    n = len(features) - 1
    splits = jnp.asarray(splits, x.dtype)
    pos = jnp.broadcast_to(roots, (x.shape[0], len(roots)))
    for _ in range(depth):
        node = jnp.minimum(pos, n)  # a leaf reads the padding row
        value = jnp.take_along_axis(x, jnp.take(features, node), axis=1)  # [N, trees]
        split = jnp.take(splits, node)
        if members is None:
            member = jnp.zeros_like(value, dtype=bool)
        else:
            member = jnp.take(jnp.asarray(members, x.dtype), node, axis=0)
            member = jnp.any(value[..., None] == member, axis=-1)
        tests = [value <= split, value < split, value >= split, value > split]
        tests = jnp.stack([*tests, value == split, value != split, member], axis=-1)
        mode = jnp.take(modes, node)
        outcome = jnp.take_along_axis(tests, mode[..., None], axis=-1)[..., 0]
        if missing_true is not None:
            outcome = outcome | (jnp.take(missing_true, node) & jnp.isnan(value))
        child = jnp.where(outcome, jnp.take(true_child, node), jnp.take(false_child, node))
        pos = jnp.where(pos < n, child, pos)
    leaf = pos - n
    weight = jnp.take(jnp.asarray(leaf_weights, x.dtype), leaf)[..., None]  # [N, trees, 1]
    onehot = jnp.take(leaf_targets, leaf)[..., None] == jnp.arange(n_targets)
    if aggregate in ("SUM", "AVERAGE"):
        y = jnp.sum(jnp.where(onehot, weight, 0.0), axis=1)
        y = y / len(roots) if aggregate == "AVERAGE" else y
    elif aggregate == "MIN":
        y = jnp.min(jnp.where(onehot, weight, float(jnp.finfo(x.dtype).max)), axis=1)
    else:
        y = jnp.max(jnp.where(onehot, weight, float(jnp.finfo(x.dtype).min)), axis=1)
    y = y.astype(x.dtype)
    if post_transform == "SOFTMAX":
        e = jnp.exp(y - jnp.max(y, axis=-1, keepdims=True))
        return e / jnp.sum(e, axis=-1, keepdims=True)
    if post_transform == "LOGISTIC":
        return 1 / (1 + jnp.exp(-y))
    if post_transform == "SOFTMAX_ZERO":
        e = jnp.where(y != 0, jnp.exp(y - jnp.max(y, axis=-1, keepdims=True)), 0.0)
        total = jnp.sum(e, axis=-1, keepdims=True)
        return e / jnp.maximum(total, float(jnp.finfo(y.dtype).tiny))
    if post_transform == "PROBIT":
        return jax.scipy.special.erfinv(2 * y - 1) * math.sqrt(2.0)
    return y
""",
    "tfidf_vectorizer": f"""
def _tfidf_vectorizer(x, ngrams, width, max_skip=0, mode="TF", weights=None):
    {_TFIDF_DOC}
    rows = jnp.reshape(x, (1, -1)) if x.ndim < 2 else x
    counts = jnp.zeros((rows.shape[0], width), jnp.float32)
    for size, grams, columns in ngrams:
        for distance in range(1, (max_skip + 1 if size > 1 else 1) + 1):
            span = rows.shape[1] - distance * (size - 1)
            if span <= 0:
                continue
            index = np.arange(span)[:, None] + distance * np.arange(size)
            windows = jnp.take(rows, index, axis=1)  # [B, span, size]
            hit = jnp.all(windows[:, :, None, :] == grams, axis=-1)  # [B, span, grams]
            counts = counts.at[:, columns].add(jnp.sum(hit, axis=1, dtype=jnp.float32))
    if mode == "IDF":
        counts = (counts > 0).astype(jnp.float32)
    if mode != "TF" and weights is not None:
        counts = counts * weights
    return counts[0] if x.ndim < 2 else counts
""",
}

TORCH_HELPERS = {
    "lookup": f"""
def _lookup(x, keys, values, default):
    {_LOOKUP_DOC}
    keys = keys.to(x.dtype)
    hit = (x[..., None] == keys) | (torch.isnan(x)[..., None] & torch.isnan(keys))
    picked = values[hit.to(torch.uint8).argmax(dim=-1)]
    return torch.where(hit.any(dim=-1), picked, torch.tensor(default, dtype=values.dtype))
""",
    "tree_ensemble": f"""
def _tree_ensemble(
    x,
    roots,
    features,
    modes,
    splits,
    true_child,
    false_child,
    leaf_weights,
    leaf_targets,
    depth,
    n_targets,
    members=None,
    missing_true=None,
    aggregate="SUM",
    post_transform="NONE",
):
    {_TREE_DOC}
    n = len(features) - 1
    splits = splits.to(x.dtype)
    pos = roots.expand(x.shape[0], len(roots))
    for _ in range(depth):
        node = pos.clamp(max=n)  # a leaf reads the padding row
        value = torch.gather(x, 1, features[node])  # [N, trees]
        split = splits[node]
        if members is None:
            member = torch.zeros_like(value, dtype=torch.bool)
        else:
            member = (value[..., None] == members.to(x.dtype)[node]).any(dim=-1)
        tests = [value <= split, value < split, value >= split, value > split]
        tests = torch.stack([*tests, value == split, value != split, member], dim=-1)
        outcome = torch.gather(tests, -1, modes[node][..., None])[..., 0]
        if missing_true is not None:
            outcome = outcome | (missing_true[node] & torch.isnan(value))
        child = torch.where(outcome, true_child[node], false_child[node])
        pos = torch.where(pos < n, child, pos)
    leaf = pos - n
    weight = leaf_weights.to(x.dtype)[leaf][..., None]  # [N, trees, 1]
    onehot = leaf_targets[leaf][..., None] == torch.arange(n_targets)
    if aggregate in ("SUM", "AVERAGE"):
        y = torch.where(onehot, weight, 0.0).sum(dim=1)
        y = y / len(roots) if aggregate == "AVERAGE" else y
    elif aggregate == "MIN":
        y = torch.where(onehot, weight, torch.finfo(x.dtype).max).amin(dim=1)
    else:
        y = torch.where(onehot, weight, torch.finfo(x.dtype).min).amax(dim=1)
    y = y.to(x.dtype)
    if post_transform == "SOFTMAX":
        e = torch.exp(y - y.amax(dim=-1, keepdim=True))
        return e / e.sum(dim=-1, keepdim=True)
    if post_transform == "LOGISTIC":
        return 1 / (1 + torch.exp(-y))
    if post_transform == "SOFTMAX_ZERO":
        e = torch.where(y != 0, torch.exp(y - y.amax(dim=-1, keepdim=True)), 0.0)
        return e / e.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(y.dtype).tiny)
    if post_transform == "PROBIT":
        return torch.erfinv(2 * y - 1) * math.sqrt(2.0)
    return y
""",
    "tfidf_vectorizer": f"""
def _tfidf_vectorizer(x, ngrams, width, max_skip=0, mode="TF", weights=None):
    {_TFIDF_DOC}
    rows = x.reshape(1, -1) if x.ndim < 2 else x
    counts = torch.zeros(rows.shape[0], width, dtype=torch.float32)
    for size, grams, columns in ngrams:
        for distance in range(1, (max_skip + 1 if size > 1 else 1) + 1):
            span = rows.shape[1] - distance * (size - 1)
            if span <= 0:
                continue
            index = torch.arange(span)[:, None] + distance * torch.arange(size)
            windows = rows[:, index]  # [B, span, size]
            hit = (windows[:, :, None, :] == grams).all(dim=-1)  # [B, span, grams]
            counts = counts.index_add(1, columns, hit.sum(dim=1, dtype=torch.float32))
    if mode == "IDF":
        counts = (counts > 0).float()
    if mode != "TF" and weights is not None:
        counts = counts * weights
    return counts[0] if x.ndim < 2 else counts
""",
}


# ------------------------------------------------------------------------------ call builders


@dataclass(frozen=True)
class Framework:
    """What a call builder needs of an emitter: its constant literal, how a numpy result
    becomes its array, and its numpy-dtype spelling."""

    #: numpy array -> source literal (``np.asarray(...)`` for Flax, ``torch.tensor(...)``).
    literal: Callable[[np.ndarray], str]
    #: wraps a numpy-valued expression: ``jnp.asarray`` / ``torch.from_numpy``.
    from_numpy: str


def _refusals(c: TemplateCall) -> SimpleNamespace:
    """The ``ctx`` the runtime's attribute parsers raise through: ``error`` is ``c.fail``."""
    return SimpleNamespace(error=c.fail)


def is_strings_input(c: TemplateCall, i: int = 0) -> bool:
    """Whether the node's input ``i`` is a string tensor (numpy in both sources)."""
    return c.node.inputs[i] is not None and c.node.inputs[i].dtype == ir.DataType.STRING


def _str(s: str) -> str:
    """A string literal in double quotes (JSON's escapes are Python's)."""
    return json.dumps(s, ensure_ascii=False)


def _key(v: Any) -> str:
    """A dict key as exact Python source (a float32 key's full double spelling, as the
    lookup compares it)."""
    if isinstance(v, str):
        return _str(v)
    if isinstance(v, float | np.floating):
        f = float(v)
        return 'float("nan")' if math.isnan(f) else scalar_literal(f) if math.isinf(f) else repr(f)
    return repr(int(v))


def _value(v: Any) -> str:
    return _str(v) if isinstance(v, str) else scalar_literal(v)


def _np_dtype(dtype: np.dtype) -> str:
    return f"np.{np.dtype(dtype).name}"


def label_encoder_call(c: TemplateCall, fw: Framework) -> str:
    """``_lookup(x, keys, values, default)`` (numbers: compare and select, traceable) or
    ``_lookup_strings(x, {key: value}, default)`` (strings in or out), with the tables the
    runtime reads from the attributes (``ops.ml.encoder_table``; LabelEncoder-1's
    ``classes_strings`` as strings <-> their index)."""
    a, strings_in = c.attrs, is_strings_input(c)
    if a["classes_strings"] is not None:
        classes = ml._text(a["classes_strings"])
        index = np.arange(len(classes), dtype=np.int64)
        if strings_in:
            keys, values, default = classes, index, a["default_int64"]
        else:
            keys, values, default = index, classes, ml._text([a["default_string"]])[0]
    else:
        keys, values, default = ml.encoder_table(_refusals(c), a)
    x = c.args[0]
    if strings_in or keys.dtype == object or values.dtype == object:
        c.helpers.add("lookup_strings")
        pairs = zip(keys.tolist(), values.tolist(), strict=True)
        table = "{" + ", ".join(f"{_key(k)}: {_value(v)}" for k, v in pairs) + "}"
        if values.dtype == object:
            return f"_lookup_strings({x}, {table}, {_value(default)})"
        default = _value(values.dtype.type(default))
        call = f"_lookup_strings({x}, {table}, {default}, {_np_dtype(values.dtype)})"
        return f"{fw.from_numpy}({call})"
    c.helpers.add("lookup")
    default = scalar_literal(values.dtype.type(default))
    return f"_lookup({x}, {fw.literal(keys)}, {fw.literal(values)}, {default})"


def binarizer_threshold(c: TemplateCall) -> str:
    """Binarizer's threshold as X's dtype compares with it: its float32 spelling for a
    float32 X, else the exact double the runtime compares a float64 X with."""
    t = float(c.attrs["threshold"])
    dtype = c.node.inputs[0].dtype
    if dtype == ir.DataType.FLOAT or not math.isfinite(t):
        return scalar_literal(t)
    return repr(t)


def tree_ensemble_call(c: TemplateCall, fw: Framework) -> str:
    """``_tree_ensemble(x, ...)`` over the runtime's flat tables of the trees
    (``ops.ml.Forest``); aggregate_function / post_transform out of range are refused."""
    a = c.attrs
    function, transform = a["aggregate_function"], a["post_transform"]
    if not 0 <= function < len(ml._AGGREGATES):
        raise c.fail(
            f"aggregate_function must be 0..3 ({', '.join(ml._AGGREGATES)}), got {function}"
        )
    if not 0 <= transform < len(ml._POST_TRANSFORMS):
        raise c.fail(
            f"post_transform must be 0..4 ({', '.join(ml._POST_TRANSFORMS)}), got {transform}"
        )
    if c.rank(0) not in (None, 2):
        raise c.fail(f"X must have shape [N, F], got {list(c.shapes[0])}")
    forest = ml.Forest(_refusals(c), a)
    args = [
        c.args[0],
        f"roots={fw.literal(forest.starts)}",
        f"features={fw.literal(forest.features)}",
        f"modes={fw.literal(forest.modes)}",
        f"splits={fw.literal(forest.splits)}",
        f"true_child={fw.literal(forest.true_child)}",
        f"false_child={fw.literal(forest.false_child)}",
        f"leaf_weights={fw.literal(forest.weights)}",
        f"leaf_targets={fw.literal(forest.targets)}",
        f"depth={forest.depth}",
        f"n_targets={forest.n_targets}",
    ]
    if (forest.modes == ml._MEMBER).any():
        args.append(f"members={fw.literal(forest.members)}")
    if forest.tracks.any():
        args.append(f"missing_true={fw.literal(forest.tracks)}")
    if function != 1:
        args.append(f'aggregate="{ml._AGGREGATES[function]}"')
    if transform != 0:
        args.append(f'post_transform="{ml._POST_TRANSFORMS[transform]}"')
    c.helpers.add("tree_ensemble")
    return f"_tree_ensemble({', '.join(args)})"


def tfidf_vectorizer_call(c: TemplateCall, fw: Framework) -> str:
    """``_tfidf_vectorizer(ids, ngrams, width, ...)`` over the runtime's n-gram tables
    (``ops.ml.ngram_tables``); a string input becomes pool ids through ``_token_ids``."""
    a = c.attrs
    mode = a["mode"]
    if mode not in ("TF", "IDF", "TFIDF"):
        raise c.fail(f"mode must be TF, IDF or TFIDF, got {mode!r}")
    if (a["pool_int64s"] is None) == (a["pool_strings"] is None):
        raise c.fail("exactly one of pool_int64s and pool_strings is required")
    if c.rank(0) is not None and c.rank(0) > 2:
        raise c.fail(f"X must have shape [C] or [B, C], got {list(c.shapes[0])}")
    x = c.args[0]
    if a["pool_strings"] is not None:
        if not is_strings_input(c):
            raise c.fail("pool_strings needs a string input (pool_int64s an integer one)")
        vocab: dict[str, int] = {}
        pool = np.array([vocab.setdefault(s, len(vocab)) for s in ml._text(a["pool_strings"])])
        c.helpers.add("token_ids")
        table = "{" + ", ".join(f"{_str(s)}: {i}" for s, i in vocab.items()) + "}"
        x = f"{fw.from_numpy}(_token_ids({x}, {table}))"
    else:
        pool = np.asarray(a["pool_int64s"], dtype=np.int64)
    tables = ml.ngram_tables(_refusals(c), pool, a)
    width = int(max(a["ngram_indexes"])) + 1
    ngrams = ", ".join(
        f"({size}, {fw.literal(grams.astype(np.int64))}, {fw.literal(columns)})"
        for size, grams, columns in tables
    )
    args = [x, f"[{ngrams}]", str(width)]
    if a["max_skip_count"]:
        args.append(f"max_skip={int(a['max_skip_count'])}")
    if mode != "TF":
        args.append(f'mode="{mode}"')
    weights = a["weights"]
    if mode != "TF" and weights is not None and len(weights):
        weights = np.asarray(weights, np.float32)
        if len(weights) < width:
            raise c.fail(f"weights has {len(weights)} entries for {width} outputs")
        args.append(f"weights={fw.literal(weights[:width])}")
    c.helpers.add("tfidf_vectorizer")
    return f"_tfidf_vectorizer({', '.join(args)})"

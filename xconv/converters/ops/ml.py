"""Classical ML ops written once against an array namespace ``xp``: ai.onnx.ml LabelEncoder,
ArrayFeatureExtractor, Binarizer, TreeEnsemble and the default-domain TfIdfVectorizer.

Numeric data runs in the backend's namespace and stays traceable: lookups are
compare-and-select, trees are evaluated by a fixed number of vectorised steps (the depth of
the deepest tree). String data runs on numpy object arrays in every backend (no backend has
string tensors); a numeric result of a string input comes back as the backend's array.
Attributes are parsed on numpy once per node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from xconv.converters.ops.arrays import astype, is_static

ML = "ai.onnx.ml"

_LEQ, _LT, _GTE, _GT, _EQ, _NEQ, _MEMBER = range(7)
_AGGREGATES = ("AVERAGE", "SUM", "MIN", "MAX")
_POST_TRANSFORMS = ("NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO", "PROBIT")


class MlKernel(Protocol):
    """What a backend provides for the ML ops."""

    def run(self, fn: Callable[..., Any], *arrays: Any) -> Any:
        """``fn(xp, *arrays)`` in the namespace this backend picks for ``arrays`` (numpy when
        every one is static or one is a string array)."""

    def fuse(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn(xp, *arrays)`` as one compiled computation where the backend compiles (many
        small ops dispatched eagerly would dominate a tree walk or an n-gram count)."""

    def constant(self, a: np.ndarray, like: Any = None) -> Any:
        """numpy ``a`` as a value the backend computes with next to ``like``."""

    def arange(self, xp: Any, n: int, like: Any) -> Any: ...

    def repeat(self, xp: Any, step: Callable[[Any], Any], init: Any, n: int) -> Any:
        """``step`` applied ``n`` times to ``init`` (a loop the backend may keep rolled)."""

    def finfo(self, xp: Any, dtype: Any) -> Any:
        """``finfo`` of a floating-point dtype of ``xp``."""

    def erfinv(self, xp: Any, x: Any) -> Any: ...


def is_strings(x: Any) -> bool:
    return isinstance(x, np.ndarray) and x.dtype.kind in "OUS"


def _text(values: Any) -> np.ndarray:
    """Strings (ONNX gives bytes) as a numpy object array of ``str``."""
    return np.array(
        [v.decode() if isinstance(v, bytes) else v for v in np.asarray(values).tolist()],
        dtype=object,
    ).reshape(np.shape(values))


def _on_backend(k: MlKernel, a: Any, like: Any) -> Any:
    """A static input as the backend's value next to ``like``; run-time values unchanged."""
    return k.constant(np.asarray(a), like) if is_static(a) else a


# ------------------------------------------------------------------------------ LabelEncoder


def lookup_strings(x: np.ndarray, keys: np.ndarray, values: np.ndarray, default, out_dtype):
    """Each element of numpy ``x`` through keys -> values, ``default`` where absent."""
    if keys.dtype.kind == "f":
        table = {float(k): v for k, v in zip(keys.tolist(), values.tolist(), strict=True)}
        nan_value = next((v for k, v in table.items() if np.isnan(k)), default)

        def get(e):
            return nan_value if np.isnan(e) else table.get(float(e), default)
    else:
        table = dict(zip(keys.tolist(), values.tolist(), strict=True))

        def get(e):
            return table.get(e, default)

    out = np.vectorize(get, otypes=[object])(x) if x.size else np.empty(x.shape, object)
    return out if out_dtype == np.dtype(object) else out.astype(out_dtype)


def lookup(k: MlKernel, xp: Any, x: Any, keys: np.ndarray, values: np.ndarray, default) -> Any:
    """Each element of numeric ``x`` through numeric keys -> values (compare and select)."""
    table = astype(xp, k.constant(keys, x), x.dtype)
    hit = x[..., None] == table
    if keys.dtype.kind == "f":
        hit = hit | (xp.isnan(x)[..., None] & xp.isnan(table))
    picked = xp.take(k.constant(values, x), xp.argmax(hit, axis=-1), axis=0)
    fallback = k.constant(np.asarray(default, values.dtype), x)
    return xp.where(xp.max(hit, axis=-1), picked, fallback)


_LABEL_ENCODER_ATTRS = {
    "classes_strings": None,
    "default_float": -0.0,
    "default_int64": -1,
    "default_string": "_Unused",
    "default_tensor": None,
    "keys_floats": None,
    "keys_int64s": None,
    "keys_strings": None,
    "keys_tensor": None,
    "values_floats": None,
    "values_int64s": None,
    "values_strings": None,
    "values_tensor": None,
}


def encoder_table(ctx, a: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, Any]:
    """LabelEncoder's keys, values (in the output dtype) and the default for unknown keys."""
    keys = next(
        (
            _text(v) if name == "keys_strings" else np.array(v)  # a writable copy
            for name in ("keys_tensor", "keys_floats", "keys_int64s", "keys_strings")
            if (v := a[name]) is not None
        ),
        None,
    )
    if keys is None:
        raise ctx.error(
            "LabelEncoder needs one of keys_floats, keys_int64s, keys_strings, keys_tensor"
        )
    if a["values_tensor"] is not None:
        values = np.array(a["values_tensor"]).reshape(-1)
        if a["default_tensor"] is not None:
            default = np.asarray(a["default_tensor"]).reshape(-1)[0]
        else:
            default = "_Unused" if values.dtype.kind in "OUS" else values.dtype.type(-1)
            if values.dtype.kind == "f":
                default = -0.0
    elif a["values_floats"] is not None:
        values, default = np.asarray(a["values_floats"], np.float32), a["default_float"]
    elif a["values_int64s"] is not None:
        values, default = np.asarray(a["values_int64s"], np.int64), a["default_int64"]
    elif a["values_strings"] is not None:
        values, default = np.asarray(a["values_strings"], object), a["default_string"]
    else:
        raise ctx.error(
            "LabelEncoder needs one of values_floats, values_int64s, values_strings, values_tensor"
        )
    keys = keys.reshape(-1)
    if len(keys) != len(values):
        raise ctx.error(f"LabelEncoder has {len(keys)} keys but {len(values)} values")
    if keys.dtype.kind in "OUS":
        keys = _text(keys)
    if values.dtype.kind in "OUS":
        values = _text(values)
        default = _text(np.asarray([default]))[0]
    return keys, values, default


# ------------------------------------------------------------------------------ TreeEnsemble


def _tree_depth(root: int, true_ids, false_ids, true_leaf, false_leaf) -> int:
    """Number of internal nodes on the longest root-to-leaf path (iteratively)."""
    depth, stack = 0, [(root, 1)]
    while stack:
        node, d = stack.pop()
        depth = max(depth, d)
        for child, leaf in ((true_ids[node], true_leaf[node]), (false_ids[node], false_leaf[node])):
            if not leaf:
                stack.append((child, d + 1))
    return depth


def _membership_table(ctx, modes: np.ndarray, membership_values) -> np.ndarray:
    """Set-membership nodes' member values (``[nodes, width]``, NaN-padded), read from the
    NaN-separated ``membership_values`` in node order."""
    n_nodes = len(modes)
    members = np.full((n_nodes, 1), np.nan)
    if not (modes == _MEMBER).any():
        return members
    if membership_values is None:
        raise ctx.error("set-membership nodes (mode 6) need the membership_values attribute")
    groups, current = [], []
    for v in np.asarray(membership_values, dtype=np.float64).reshape(-1):
        if np.isnan(v):
            groups.append(current)
            current = []
        else:
            current.append(v)
    member_nodes = np.flatnonzero(modes == _MEMBER)
    if len(groups) < len(member_nodes):
        raise ctx.error(
            f"membership_values has {len(groups)} NaN-terminated groups for "
            f"{len(member_nodes)} set-membership nodes"
        )
    width = max((len(g) for g in groups), default=1) or 1
    members = np.full((n_nodes, width), np.nan)
    for node, group in zip(member_nodes, groups, strict=False):
        members[node, : len(group)] = group
    return members


class Forest:
    """A TreeEnsemble's trees as flat tables: internal nodes 0..n-1, then a padding row n
    that leaves point at; a tree's position ``p >= n`` is its leaf ``p - n``."""

    def __init__(self, ctx, a: dict[str, Any]):
        modes = np.asarray(a["nodes_modes"]).astype(np.int64).reshape(-1)
        n = len(modes)
        true_ids = np.asarray(a["nodes_truenodeids"], dtype=np.int64).reshape(-1)
        false_ids = np.asarray(a["nodes_falsenodeids"], dtype=np.int64).reshape(-1)
        true_leaf = np.asarray(a["nodes_trueleafs"], dtype=bool).reshape(-1)
        false_leaf = np.asarray(a["nodes_falseleafs"], dtype=bool).reshape(-1)
        features = np.asarray(a["nodes_featureids"], dtype=np.int64).reshape(-1)
        splits = np.asarray(a["nodes_splits"], dtype=np.float64).reshape(-1)
        tracks = a["nodes_missing_value_tracks_true"]
        tracks = np.zeros(n, bool) if tracks is None else np.asarray(tracks, bool).reshape(-1)
        sizes = [len(v) for v in (true_ids, false_ids, true_leaf, false_leaf, features, splits)]
        if any(s != n for s in (*sizes, len(tracks))):
            raise ctx.error(f"the nodes_* attributes must all have {n} entries (nodes_modes')")
        self.weights = np.asarray(a["leaf_weights"], dtype=np.float64).reshape(-1)
        self.targets = np.asarray(a["leaf_targetids"], dtype=np.int64).reshape(-1)
        if len(self.targets) != len(self.weights):
            raise ctx.error(
                f"{len(self.targets)} leaf_targetids but {len(self.weights)} leaf_weights"
            )
        n_targets = a["n_targets"]
        self.n_targets = (
            int(n_targets)
            if n_targets is not None
            else (int(self.targets.max()) + 1 if self.targets.size else 1)
        )
        members = _membership_table(ctx, modes, a["membership_values"])

        def padded(values, fill):
            return np.concatenate([values, np.full((1, *values.shape[1:]), fill, values.dtype)])

        self.n_nodes = n
        self.features, self.modes = padded(features, 0), padded(modes, _LEQ)
        self.splits, self.tracks = padded(splits, 0.0), padded(tracks, False)
        self.members = padded(members, np.nan)
        self.true_child = padded(np.where(true_leaf, true_ids + n, true_ids), 0)
        self.false_child = padded(np.where(false_leaf, false_ids + n, false_ids), 0)
        # A degenerate root (both branches the same leaf) starts at that leaf.
        starts, self.depth = [], 0
        for r in np.asarray(a["tree_roots"], dtype=np.int64).reshape(-1):
            if true_leaf[r] and false_leaf[r] and true_ids[r] == false_ids[r]:
                starts.append(true_ids[r] + n)
            else:
                starts.append(r)
                self.depth = max(
                    self.depth, _tree_depth(r, true_ids, false_ids, true_leaf, false_leaf)
                )
        self.starts = np.asarray(starts, dtype=np.int64)

    def leaves(self, k: MlKernel, xp: Any, x: Any) -> Any:
        """``[N, trees]``: the leaf each row of ``x`` reaches in each tree."""
        c = lambda a: k.constant(a, x)  # noqa: E731
        feat, modes, tracks = c(self.features), c(self.modes), c(self.tracks)
        true_child, false_child = c(self.true_child), c(self.false_child)
        splits = astype(xp, c(self.splits), x.dtype)
        members = astype(xp, c(self.members), x.dtype)
        n = self.n_nodes

        def step(pos):
            internal = pos < n
            node = xp.where(internal, pos, n)
            value = xp.take_along_axis(x, xp.take(feat, node), axis=1)  # [N, trees]
            split, mode = xp.take(splits, node), xp.take(modes, node)
            member = xp.max(value[..., None] == xp.take(members, node, axis=0), axis=-1)
            outcome = member
            tests = (
                value <= split,
                value < split,
                value >= split,
                value > split,
                value == split,
                value != split,
            )
            for m in range(_NEQ, _LEQ - 1, -1):
                outcome = xp.where(mode == m, tests[m], outcome)
            outcome = outcome | (xp.take(tracks, node) & xp.isnan(value))
            nxt = xp.where(outcome, xp.take(true_child, node), xp.take(false_child, node))
            return xp.where(internal, nxt, pos)

        start = xp.broadcast_to(c(self.starts), (x.shape[0], len(self.starts)))
        return k.repeat(xp, step, start, self.depth) - n

    def aggregate(self, k: MlKernel, xp: Any, leaf: Any, function: int, like: Any) -> Any:
        """``[N, n_targets]``: the reached leaves' weights per target."""
        w = xp.take(astype(xp, k.constant(self.weights, like), like.dtype), leaf)[..., None]
        targets = xp.take(k.constant(self.targets, like), leaf)
        onehot = targets[..., None] == k.arange(xp, self.n_targets, like)  # [N, trees, K]
        if function in (0, 1):
            out = xp.sum(xp.where(onehot, w, 0.0), axis=1)
            return out / len(self.starts) if function == 0 else out
        info = k.finfo(xp, like.dtype)
        if function == 2:
            return xp.min(xp.where(onehot, w, float(info.max)), axis=1)
        return xp.max(xp.where(onehot, w, float(info.min)), axis=1)


def post_transform(k: MlKernel, xp: Any, y: Any, kind: int) -> Any:
    """NONE, SOFTMAX, LOGISTIC, SOFTMAX_ZERO (over the non-zero entries only) or PROBIT."""
    if kind == 1:
        e = xp.exp(y - xp.max(y, axis=-1, keepdims=True))
        return e / xp.sum(e, axis=-1, keepdims=True)
    if kind == 2:
        return 1 / (1 + xp.exp(-y))
    if kind == 3:
        e = xp.where(y != 0, xp.exp(y - xp.max(y, axis=-1, keepdims=True)), 0.0)
        return e / xp.maximum(xp.sum(e, axis=-1, keepdims=True), float(k.finfo(xp, y.dtype).tiny))
    if kind == 4:
        return k.erfinv(xp, 2 * y - 1) * float(np.sqrt(2.0))
    return y


# --------------------------------------------------------------------------- TfIdfVectorizer


def ngram_tables(ctx, pool: np.ndarray, a: dict[str, Any]):
    """The pool's n-grams of the lengths counted: ``(size, grams [n, size], columns [n])``."""
    counts, indexes = list(a["ngram_counts"]), np.asarray(a["ngram_indexes"], np.int64)
    bounds = [*counts, len(pool)]
    tables, gram_id = [], 0
    for size, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True), start=1):
        n_grams = max(hi - lo, 0) // size
        columns = indexes[gram_id : gram_id + n_grams]
        gram_id += n_grams
        if len(columns) < n_grams:
            raise ctx.error(f"ngram_indexes has {len(indexes)} entries, the pool more n-grams")
        if n_grams and a["min_gram_length"] <= size <= a["max_gram_length"]:
            tables.append((size, pool[lo : lo + n_grams * size].reshape(n_grams, size), columns))
    return tables


def count_ngrams(k: MlKernel, xp: Any, rows: Any, tables, max_skip: int, width: int) -> Any:
    """``[B, width]`` float32 n-gram counts of ``rows`` ([B, C] pool ids)."""
    counts = k.constant(np.zeros((rows.shape[0], width), np.float32), rows)
    for size, grams, columns in tables:
        grams = astype(xp, k.constant(grams, rows), rows.dtype)
        per_gram = None
        # Unigrams are counted once; longer grams once per skip distance.
        for dist in range(1, (max_skip + 1 if size > 1 else 1) + 1):
            span = rows.shape[1] - dist * (size - 1)
            if span <= 0:
                continue
            index = np.arange(span)[:, None] + dist * np.arange(size)[None, :]
            windows = xp.take(rows, index, axis=1)  # [B, span, size]
            hit = xp.min(windows[:, :, None, :] == grams, axis=-1)  # [B, span, grams]
            found = xp.sum(astype(xp, hit, xp.float32), axis=1)
            per_gram = found if per_gram is None else per_gram + found
        if per_gram is not None:
            scatter = np.zeros((len(grams), width), np.float32)
            scatter[np.arange(len(grams)), columns] = 1.0
            counts = counts + xp.matmul(per_gram, k.constant(scatter, rows))
    return counts


# ------------------------------------------------------------------------------ registration


def register_ml_ops(builtin: Callable[..., Any], k: MlKernel, required: Any) -> None:
    """Register the ML ops with a backend registry's ``builtin`` and kernel ``k``."""

    @builtin("LabelEncoder", domain=ML, since=1, attrs=_LABEL_ENCODER_ATTRS)
    def label_encoder(ctx, x, **a):
        """LabelEncoder(X) -> Y: each key replaced by its value, unknown keys by the default."""
        if a["classes_strings"] is not None:  # LabelEncoder-1: strings <-> their index
            classes = _text(a["classes_strings"])
            index = np.arange(len(classes), dtype=np.int64)
            if is_strings(x):
                keys, values, default = classes, index, a["default_int64"]
            else:
                keys, values, default = index, classes, _text([a["default_string"]])[0]
        else:
            keys, values, default = encoder_table(ctx, a)
        if is_strings(x) or keys.dtype == object or values.dtype == object:
            x = _text(x) if is_strings(x) else ctx.static(x, "X")
            return k.run(lambda xp, x: lookup_strings(x, keys, values, default, values.dtype), x)
        return k.run(lambda xp, x: lookup(k, xp, x, keys, values, default), x)

    @builtin("ArrayFeatureExtractor", domain=ML, since=1)
    def array_feature_extractor(ctx, x, indices):
        """ArrayFeatureExtractor(X, Y) -> X[..., Y] (a 1-D X gives one row, as onnxruntime
        does)."""

        def extract(xp, x, indices):
            flat = xp.reshape(_on_backend(k, indices, x), (-1,))
            out = xp.take(x, flat, axis=x.ndim - 1)
            return xp.reshape(out, (1, -1)) if x.ndim == 1 else out

        if is_strings(x):
            return extract(np, x, ctx.static(indices, "Y"))
        return k.run(extract, x, indices)

    @builtin("Binarizer", domain=ML, since=1, attrs={"threshold": 0.0})
    def binarizer(ctx, x, *, threshold):
        """Binarizer(X) -> 1 where X > threshold, else 0, in X's dtype."""
        return k.run(lambda xp, x: astype(xp, x > threshold, x.dtype), x)

    @builtin(
        "TreeEnsemble",
        domain=ML,
        since=5,
        attrs={
            "aggregate_function": 1,
            "leaf_targetids": required,
            "leaf_weights": required,
            "membership_values": None,
            "n_targets": None,
            "nodes_falseleafs": required,
            "nodes_falsenodeids": required,
            "nodes_featureids": required,
            "nodes_hitrates": None,
            "nodes_missing_value_tracks_true": None,
            "nodes_modes": required,
            "nodes_splits": required,
            "nodes_trueleafs": required,
            "nodes_truenodeids": required,
            "post_transform": 0,
            "tree_roots": required,
        },
    )
    def tree_ensemble(ctx, x, **a):
        """TreeEnsemble(X [N, F]) -> Y [N, n_targets]: aggregated leaf weights of every tree."""
        function, transform = a["aggregate_function"], a["post_transform"]
        if not 0 <= function < len(_AGGREGATES):
            raise ctx.error(
                f"aggregate_function must be 0..3 ({', '.join(_AGGREGATES)}), got {function}"
            )
        if not 0 <= transform < len(_POST_TRANSFORMS):
            raise ctx.error(
                f"post_transform must be 0..4 ({', '.join(_POST_TRANSFORMS)}), got {transform}"
            )
        if len(np.shape(x)) != 2:
            raise ctx.error(f"X must have shape [N, F], got {tuple(np.shape(x))}")
        forest = Forest(ctx, a)

        def evaluate(xp, x):
            out = forest.aggregate(k, xp, forest.leaves(k, xp, x), function, x)
            return post_transform(k, xp, astype(xp, out, x.dtype), transform)

        return k.run(k.fuse(evaluate), x)

    @builtin(
        "TfIdfVectorizer",
        since=9,
        attrs={
            "max_gram_length": required,
            "max_skip_count": required,
            "min_gram_length": required,
            "mode": required,
            "ngram_counts": required,
            "ngram_indexes": required,
            "pool_int64s": None,
            "pool_strings": None,
            "weights": None,
        },
    )
    def tfidf_vectorizer(ctx, x, **a):
        """TfIdfVectorizer(X [C] or [B, C]) -> n-gram counts (TF), presence weights (IDF) or
        both (TFIDF)."""
        mode = a["mode"]
        if mode not in ("TF", "IDF", "TFIDF"):
            raise ctx.error(f"mode must be TF, IDF or TFIDF, got {mode!r}")
        if (a["pool_int64s"] is None) == (a["pool_strings"] is None):
            raise ctx.error("exactly one of pool_int64s and pool_strings is required")
        if len(np.shape(x)) > 2:
            raise ctx.error(f"X must have shape [C] or [B, C], got {tuple(np.shape(x))}")
        if a["pool_strings"] is not None:
            if not is_strings(x):
                raise ctx.error("pool_strings needs a string input (pool_int64s an integer one)")
            vocab: dict[str, int] = {}
            pool = np.array([vocab.setdefault(s, len(vocab)) for s in _text(a["pool_strings"])])
            x = np.vectorize(lambda s: vocab.get(s, -1), otypes=[np.int64])(_text(x))
        else:
            pool = np.asarray(a["pool_int64s"], dtype=np.int64)
        tables = ngram_tables(ctx, pool, a)
        width = int(max(a["ngram_indexes"])) + 1
        weights = a["weights"]
        if weights is not None and len(weights):
            weights = np.asarray(weights, np.float32)
            if len(weights) < width:
                raise ctx.error(f"weights has {len(weights)} entries for {width} outputs")
            weights = weights[:width]
        else:
            weights = None  # empty weights count as absent, as in the reference

        def vectorize(xp, x):
            rows = xp.reshape(x, (1, -1)) if x.ndim < 2 else x
            counts = count_ngrams(k, xp, rows, tables, a["max_skip_count"], width)
            if mode == "IDF":
                counts = astype(xp, counts > 0, xp.float32)
            if mode != "TF" and weights is not None:
                counts = counts * k.constant(weights, x)
            return counts[0] if x.ndim < 2 else counts

        return k.run(k.fuse(vectorize), x)

"""Classical ML ops: ai.onnx.ml LabelEncoder, TreeEnsemble, ArrayFeatureExtractor, Binarizer,
and the default-domain TfIdfVectorizer.

Numeric data runs in JAX (jittable: lookups are compare-and-select, trees are evaluated
by a fixed number of vectorised steps); string data runs on numpy object arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from xconv.converters.jax.registry import REQUIRED, builtin

ML = "ai.onnx.ml"


def _is_strings(x) -> bool:
    return isinstance(x, np.ndarray) and x.dtype.kind in "OUS"


# ------------------------------------------------------------------------------ LabelEncoder


def _lookup(x, keys: np.ndarray, values: np.ndarray, default, out_dtype):
    """Map each element of x through keys -> values, default where absent."""
    if _is_strings(x) or keys.dtype.kind in "OUS" or values.dtype.kind in "OUS":
        x = np.asarray(x)
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
    xj = jnp.asarray(x)
    kj = jnp.asarray(keys).astype(xj.dtype)
    hit = xj[..., None] == kj
    if jnp.issubdtype(xj.dtype, jnp.floating):
        hit = hit | (jnp.isnan(xj)[..., None] & jnp.isnan(kj))
    found = hit.any(-1)
    index = jnp.argmax(hit, axis=-1)
    picked = jnp.asarray(values)[index]
    return jnp.where(found, picked, jnp.asarray(default, dtype=picked.dtype)).astype(out_dtype)


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


def _encoder_values(
    ctx, values_tensor, values_floats, values_int64s, values_strings,
    default_tensor, default_float, default_int64, default_string,
):  # fmt: skip
    """LabelEncoder's values, the default for unknown keys, and the output dtype."""
    if values_tensor is not None:
        values = np.asarray(values_tensor)
        if default_tensor is not None:
            default = np.asarray(default_tensor).reshape(-1)[0]
        elif values.dtype.kind in "OUS":
            default = "_Unused"
        elif values.dtype.kind == "f":
            default = -0.0
        else:
            default = -1
        out_dtype = np.dtype(object) if values.dtype.kind in "OUS" else values.dtype
    elif values_floats is not None:
        values, default, out_dtype = (
            np.asarray(values_floats, np.float32),
            default_float,
            np.dtype(np.float32),
        )
    elif values_int64s is not None:
        values, default, out_dtype = (
            np.asarray(values_int64s, np.int64),
            default_int64,
            np.dtype(np.int64),
        )
    elif values_strings is not None:
        values, default, out_dtype = (
            np.array(values_strings, dtype=object),
            default_string,
            np.dtype(object),
        )
    else:
        raise ctx.error(
            "LabelEncoder needs one of values_floats, values_int64s, values_strings, values_tensor"
        )
    return values, default, out_dtype


@builtin("LabelEncoder", domain=ML, since=1, attrs=_LABEL_ENCODER_ATTRS)
def label_encoder(
    ctx,
    x,
    *,
    classes_strings,
    default_float,
    default_int64,
    default_string,
    default_tensor,
    keys_floats,
    keys_int64s,
    keys_strings,
    keys_tensor,
    values_floats,
    values_int64s,
    values_strings,
    values_tensor,
):
    """LabelEncoder(X) -> Y: each key replaced by its value, unknown keys by the default."""
    if classes_strings is not None:  # LabelEncoder-1: strings <-> their index
        classes = np.array(classes_strings, dtype=object)
        index = np.arange(len(classes), dtype=np.int64)
        if _is_strings(x):
            return _lookup(x, classes, index, default_int64, np.dtype(np.int64))
        return _lookup(x, index, classes, default_string, np.dtype(object))
    keys = next(
        (
            np.asarray(k)
            for k in (keys_tensor, keys_floats, keys_int64s, keys_strings)
            if k is not None
        ),
        None,
    )
    if keys is None:
        raise ctx.error(
            "LabelEncoder needs one of keys_floats, keys_int64s, keys_strings, keys_tensor"
        )
    if keys_strings is not None:
        keys = np.array(keys_strings, dtype=object)
    values, default, out_dtype = _encoder_values(
        ctx, values_tensor, values_floats, values_int64s, values_strings,
        default_tensor, default_float, default_int64, default_string,
    )  # fmt: skip
    if len(keys) != len(values):
        raise ctx.error(f"{len(keys)} keys but {len(values)} values")
    if values.dtype.kind in "OUS":
        values = np.array(
            [v.decode() if isinstance(v, bytes) else v for v in values.tolist()], object
        )
    if keys.dtype.kind in "OUS":
        keys = np.array([k.decode() if isinstance(k, bytes) else k for k in keys.tolist()], object)
    if isinstance(default, bytes):
        default = default.decode()
    return _lookup(x, keys, values, default, out_dtype)


# ---------------------------------------------------------------------- ArrayFeatureExtractor


@builtin("ArrayFeatureExtractor", domain=ML, since=1)
def array_feature_extractor(ctx, x, indices):
    """ArrayFeatureExtractor(X, Y) -> X[..., Y] (a 1-D X gives one row, as onnxruntime does)."""
    mod = np if _is_strings(x) else jnp
    flat = mod.reshape(mod.asarray(indices), (-1,))
    out = mod.take(mod.asarray(x), flat, axis=-1)
    if np.ndim(x) == 1:
        out = out.reshape(1, -1)
    return out


@builtin("Binarizer", domain=ML, since=1, attrs={"threshold": 0.0})
def binarizer(ctx, x, *, threshold):
    """Binarizer(X) -> 1 where X > threshold, else 0, in X's dtype."""
    x = jnp.asarray(x)
    return (x > threshold).astype(x.dtype)


# ------------------------------------------------------------------------------ TreeEnsemble

_LEQ, _LT, _GTE, _GT, _EQ, _NEQ, _MEMBER = range(7)


def _tree_depth(root: int, is_leaf: bool, true_ids, false_ids, true_leaf, false_leaf) -> int:
    """Number of internal nodes on the longest root-to-leaf path (iteratively)."""
    if is_leaf:
        return 0
    depth, stack = 0, [(root, 1)]
    while stack:
        node, d = stack.pop()
        depth = max(depth, d)
        for child, leaf in ((true_ids[node], true_leaf[node]), (false_ids[node], false_leaf[node])):
            if not leaf:
                stack.append((child, d + 1))
    return depth


@builtin(
    "TreeEnsemble",
    domain=ML,
    since=5,
    attrs={
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
    },
)
def tree_ensemble(
    ctx,
    x,
    *,
    aggregate_function,
    leaf_targetids,
    leaf_weights,
    membership_values,
    n_targets,
    nodes_falseleafs,
    nodes_falsenodeids,
    nodes_featureids,
    nodes_hitrates,
    nodes_missing_value_tracks_true,
    nodes_modes,
    nodes_splits,
    nodes_trueleafs,
    nodes_truenodeids,
    post_transform,
    tree_roots,
):
    """TreeEnsemble(X [N, F]) -> Y [N, n_targets]: aggregated leaf weights of every tree."""
    x = jnp.asarray(x)
    modes = np.asarray(nodes_modes).astype(np.int64).reshape(-1)
    n_nodes = len(modes)
    splits = np.asarray(nodes_splits).reshape(-1)
    features = np.asarray(nodes_featureids, dtype=np.int64)
    true_ids = np.asarray(nodes_truenodeids, dtype=np.int64)
    false_ids = np.asarray(nodes_falsenodeids, dtype=np.int64)
    true_leaf = np.asarray(nodes_trueleafs, dtype=bool)
    false_leaf = np.asarray(nodes_falseleafs, dtype=bool)
    weights = np.asarray(leaf_weights).reshape(-1)
    targets = np.asarray(leaf_targetids, dtype=np.int64)
    tracks = (
        np.zeros(n_nodes, bool)
        if nodes_missing_value_tracks_true is None
        else np.asarray(nodes_missing_value_tracks_true, dtype=bool)
    )
    if n_targets is None:
        n_targets = int(targets.max()) + 1 if targets.size else 1
    members = _membership_table(ctx, modes, membership_values)
    # Children in one index space: internal nodes 0..n-1, leaves n..n+L-1.
    true_child = np.where(true_leaf, true_ids + n_nodes, true_ids)
    false_child = np.where(false_leaf, false_ids + n_nodes, false_ids)
    roots = np.asarray(tree_roots, dtype=np.int64)
    start, depth = _tree_starts(roots, n_nodes, true_ids, false_ids, true_leaf, false_leaf)

    dtype = x.dtype
    pad = lambda a, fill: jnp.asarray(np.concatenate([a, np.full(1, fill, a.dtype)]))  # noqa: E731
    j_feat, j_mode = pad(features, 0), pad(modes, _LEQ)
    j_split = pad(splits.astype(np.float64), 0).astype(dtype)
    j_true = pad(true_child.astype(np.int32), 0)
    j_false = pad(false_child.astype(np.int32), 0)
    j_tracks = pad(tracks, False)
    j_members = jnp.asarray(np.concatenate([members, np.full((1, members.shape[1]), np.nan)]))
    j_members = j_members.astype(dtype)

    def evaluate(x):
        def step(idx, _):
            internal = idx < n_nodes
            node = jnp.where(internal, idx, n_nodes)  # the padding row for leaves
            value = jnp.take_along_axis(x, j_feat[node], axis=1)  # [N, T]
            split, mode = j_split[node], j_mode[node]
            member = (value[..., None] == j_members[node]).any(-1)
            outcome = _split_outcome(mode, value, split, member)
            outcome = outcome | (j_tracks[node] & jnp.isnan(value))
            nxt = jnp.where(outcome, j_true[node], j_false[node])
            return jnp.where(internal, nxt, idx), None

        idx0 = jnp.broadcast_to(start, (x.shape[0], len(roots)))
        idx, _ = jax.lax.scan(step, idx0, None, length=depth)
        leaf = idx - n_nodes
        w = jnp.asarray(weights).astype(dtype)[leaf]  # [N, T]
        onehot = jnp.asarray(targets)[leaf][..., None] == jnp.arange(n_targets)  # [N, T, K]
        out = _aggregate(ctx, aggregate_function, onehot, w, len(roots), dtype)
        return _post_transform(ctx, out.astype(dtype), post_transform)

    # One compiled computation instead of many eagerly dispatched small ops.
    return jax.jit(evaluate)(x)


def _membership_table(ctx, modes: np.ndarray, membership_values) -> np.ndarray:
    """Set-membership nodes: their member values, NaN-separated, in node order
    (``[nodes, width]``, NaN-padded)."""
    n_nodes = len(modes)
    members = np.full((n_nodes, 1), np.nan)
    if (modes == _MEMBER).any():
        if membership_values is None:
            raise ctx.error("set-membership nodes need the membership_values attribute")
        groups, current = [], []
        for v in np.asarray(membership_values, dtype=np.float64).reshape(-1):
            if np.isnan(v):
                groups.append(current)
                current = []
            else:
                current.append(v)
        member_nodes = np.flatnonzero(modes == _MEMBER)
        if len(groups) < len(member_nodes):
            raise ctx.error("membership_values has fewer groups than set-membership nodes")
        width = max((len(g) for g in groups), default=1) or 1
        members = np.full((n_nodes, width), np.nan)
        for node, group in zip(member_nodes, groups, strict=False):
            members[node, : len(group)] = group
    return members


def _tree_starts(roots, n_nodes, true_ids, false_ids, true_leaf, false_leaf):
    """Each tree's starting index (a degenerate root, both branches the same leaf, starts at
    that leaf) and the deepest tree's depth."""
    start = []
    depth = 0
    for r in roots:
        degenerate = true_leaf[r] and false_leaf[r] and true_ids[r] == false_ids[r]
        start.append(true_ids[r] + n_nodes if degenerate else r)
        depth = max(depth, _tree_depth(r, degenerate, true_ids, false_ids, true_leaf, false_leaf))
    return jnp.asarray(np.asarray(start, dtype=np.int32)), depth


def _split_outcome(mode, value, split, member):
    """A node's test by its mode (BRANCH_LEQ .. BRANCH_NEQ, else set membership)."""
    return jnp.select(
        [mode == _LEQ, mode == _LT, mode == _GTE, mode == _GT, mode == _EQ, mode == _NEQ],
        [
            value <= split,
            value < split,
            value >= split,
            value > split,
            value == split,
            value != split,
        ],
        member,
    )


def _aggregate(ctx, aggregate_function: int, onehot, w, n_trees: int, dtype):
    """The trees' leaf weights per target: AVERAGE, SUM, MIN or MAX (0..3)."""
    if aggregate_function in (0, 1):
        out = jnp.where(onehot, w[..., None], 0).sum(1)
        if aggregate_function == 0:
            out = out / n_trees
    elif aggregate_function == 2:
        out = jnp.where(onehot, w[..., None], jnp.finfo(dtype).max).min(1)
    elif aggregate_function == 3:
        out = jnp.where(onehot, w[..., None], jnp.finfo(dtype).min).max(1)
    else:
        raise ctx.error(
            f"aggregate_function must be 0..3 (AVERAGE, SUM, MIN, MAX), got {aggregate_function}"
        )
    return out


def _post_transform(ctx, y, kind: int):
    if kind == 0:
        return y
    if kind == 1:
        return jax.nn.softmax(y, axis=-1)
    if kind == 2:
        return jax.nn.sigmoid(y)
    if kind == 3:  # softmax over the non-zero entries only
        e = jnp.where(y != 0, jnp.exp(y - y.max(-1, keepdims=True)), 0)
        return e / jnp.maximum(e.sum(-1, keepdims=True), jnp.finfo(y.dtype).tiny)
    if kind == 4:
        return jnp.sqrt(2.0).astype(y.dtype) * jax.scipy.special.erfinv(2 * y - 1)
    raise ctx.error(f"post_transform must be 0..4, got {kind}")


# --------------------------------------------------------------------------- TfIdfVectorizer


@builtin(
    "TfIdfVectorizer",
    since=9,
    attrs={
        "max_gram_length": REQUIRED,
        "max_skip_count": REQUIRED,
        "min_gram_length": REQUIRED,
        "mode": REQUIRED,
        "ngram_counts": REQUIRED,
        "ngram_indexes": REQUIRED,
        "pool_int64s": None,
        "pool_strings": None,
        "weights": None,
    },
)
def tfidf_vectorizer(
    ctx,
    x,
    *,
    max_gram_length,
    max_skip_count,
    min_gram_length,
    mode,
    ngram_counts,
    ngram_indexes,
    pool_int64s,
    pool_strings,
    weights,
):
    """TfIdfVectorizer(X [C] or [B, C]) -> n-gram counts (TF), presence weights (IDF) or both."""
    if mode not in ("TF", "IDF", "TFIDF"):
        raise ctx.error(f"mode must be TF, IDF or TFIDF, got {mode!r}")
    if (pool_int64s is None) == (pool_strings is None):
        raise ctx.error("exactly one of pool_int64s and pool_strings is required")
    if pool_strings is not None:
        vocab: dict[str, int] = {}
        pool = np.array([vocab.setdefault(s, len(vocab)) for s in pool_strings], np.int64)
        if not _is_strings(x):
            raise ctx.error("pool_strings needs a string input")
        x = np.vectorize(lambda s: vocab.get(s, -1), otypes=[np.int64])(x)
    else:
        pool = np.asarray(pool_int64s, dtype=np.int64)
    x = jnp.asarray(x)
    if x.ndim > 2:
        raise ctx.error(f"X must have shape [C] or [B, C], got {x.shape}")
    rows = x.reshape(1, -1) if x.ndim < 2 else x
    out_size = max(ngram_indexes) + 1

    def count(rows):
        counts = jnp.zeros((rows.shape[0], out_size), jnp.float32)
        # Enumerate the pool's n-grams: ngram_counts[i] is where the (i+1)-grams start.
        gram_id = 0
        bounds = [*ngram_counts, len(pool)]
        for size, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True), start=1):
            n_grams = max(hi - lo, 0) // size
            grams = pool[lo : lo + n_grams * size].reshape(n_grams, size)
            columns = np.asarray(ngram_indexes[gram_id : gram_id + n_grams], dtype=np.int64)
            gram_id += n_grams
            if not n_grams or not min_gram_length <= size <= max_gram_length:
                continue
            per_gram = jnp.zeros((rows.shape[0], n_grams), jnp.float32)
            # Unigrams are counted once; longer grams once per skip distance.
            for dist in range(1, (max_skip_count + 1 if size > 1 else 1) + 1):
                span = rows.shape[1] - dist * (size - 1)
                if span <= 0:
                    continue
                index = np.arange(span)[:, None] + dist * np.arange(size)[None, :]
                windows = rows[:, index]  # [rows, span, size]
                hit = (windows[:, :, None, :] == jnp.asarray(grams, rows.dtype)).all(-1)
                per_gram = per_gram + hit.sum(1).astype(jnp.float32)
            scatter = np.zeros((n_grams, out_size), np.float32)
            scatter[np.arange(n_grams), columns] = 1.0
            counts = counts + per_gram @ jnp.asarray(scatter)
        return counts

    # One compiled computation instead of dozens of eagerly dispatched small ops.
    counts = jax.jit(count)(rows)
    w = None if weights is None else jnp.asarray(weights, jnp.float32)
    if mode == "TF":
        out = counts
    elif mode == "IDF":
        out = jnp.where(counts > 0, 1.0 if w is None else w, 0.0).astype(jnp.float32)
    else:
        out = counts if w is None else counts * w
    return out[0] if x.ndim < 2 else out

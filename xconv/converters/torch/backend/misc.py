"""PyTorch handlers: NonMaxSuppression and the string ops (StringConcat, StringNormalizer,
StringSplit, RegexFullMatch).

NonMaxSuppression's output length depends on the data, so it runs on concrete values with
numpy. torch has no string tensors: strings are numpy object arrays, and the string ops
compute with numpy, returning torch tensors for their numeric outputs.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from xconv.converters.torch.backend.registry import builtin


def _corners(boxes: np.ndarray, center_point_box: int) -> np.ndarray:
    """Boxes as [x_min, y_min, x_max, y_max] from either ONNX box format."""
    if center_point_box:
        cx, cy, w, h = (boxes[..., i] for i in range(4))
        return np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=-1)
    y1, x1, y2, x2 = (boxes[..., i] for i in range(4))
    return np.stack(
        [np.minimum(x1, x2), np.minimum(y1, y2), np.maximum(x1, x2), np.maximum(y1, y2)],
        axis=-1,
    )


def _iou_exceeds(box: np.ndarray, others: np.ndarray, threshold: float) -> np.ndarray:
    ix = np.minimum(box[2], others[:, 2]) - np.maximum(box[0], others[:, 0])
    iy = np.minimum(box[3], others[:, 3]) - np.maximum(box[1], others[:, 1])
    inter = np.where((ix > 0) & (iy > 0), ix * iy, 0.0)
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (others[:, 2] - others[:, 0]) * (others[:, 3] - others[:, 1])
    union = area + areas - inter
    valid = (inter > 0) & (area > 0) & (areas > 0) & (union > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = np.where(valid, inter / np.where(union > 0, union, 1), 0.0)
    return valid & (iou > threshold)


@builtin("NonMaxSuppression", since=10, attrs={"center_point_box": 0})
def non_max_suppression(
    ctx,
    boxes,
    scores,
    max_output_boxes_per_class=None,
    iou_threshold=None,
    score_threshold=None,
    *,
    center_point_box,
):
    """NonMaxSuppression(boxes, scores, max_boxes?, iou?, score?) -> [n, 3] int64 indices.

    The number of selected boxes depends on the data, so every input must be concrete.
    """
    boxes = ctx.static(boxes, "boxes").astype(np.float64)
    scores = ctx.static(scores, "scores").astype(np.float64)
    max_out = 0
    if max_output_boxes_per_class is not None:
        m = ctx.static(max_output_boxes_per_class, "max_output_boxes_per_class").reshape(-1)
        max_out = max(int(m[0]), 0) if m.size else 0
    iou = 0.0
    if iou_threshold is not None and np.size(ctx.static(iou_threshold, "iou_threshold")):
        iou = float(ctx.static(iou_threshold, "iou_threshold").reshape(-1)[0])
    score_min = None
    if score_threshold is not None and np.size(ctx.static(score_threshold, "score_threshold")):
        score_min = float(ctx.static(score_threshold, "score_threshold").reshape(-1)[0])
    corners = _corners(boxes, center_point_box)
    selected = []
    for b in range(scores.shape[0]):
        for c in range(scores.shape[1]):
            s = scores[b, c]
            candidates = np.arange(s.shape[0])
            if score_min is not None:
                candidates = candidates[s[candidates] > score_min]
            # Highest score first; ties keep the lower box index first (stable sort).
            order = candidates[np.argsort(-s[candidates], kind="stable")]
            kept: list[int] = []
            for idx in order:
                if len(kept) >= max_out:
                    break
                if kept and _iou_exceeds(corners[b, idx], corners[b, kept], iou).any():
                    continue
                kept.append(int(idx))
                selected.append((b, c, int(idx)))
    return torch.from_numpy(np.array(selected, dtype=np.int64).reshape(-1, 3))


# ---------------------------------------------------------------- strings


def _strings(ctx, x, what: str = "X") -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.dtype.kind not in "OUS":
        raise ctx.error(
            f"{what} must be a numpy string array (torch has no strings), got "
            f"{getattr(x, 'dtype', type(x).__name__)}"
        )
    if x.dtype.kind == "S":
        return np.vectorize(lambda b: b.decode("utf-8"), otypes=[object])(x)
    return x.astype(object)


@builtin("StringConcat", since=20)
def string_concat(ctx, x, y):
    """StringConcat(X, Y) -> X + Y elementwise, with broadcasting."""
    x, y = _strings(ctx, x, "X"), _strings(ctx, y, "Y")
    return np.char.add(x.astype(np.str_), y.astype(np.str_)).astype(object)


@builtin(
    "StringNormalizer",
    since=10,
    attrs={"case_change_action": "NONE", "is_case_sensitive": 0, "locale": "", "stopwords": None},
)
def string_normalizer(ctx, x, *, case_change_action, is_case_sensitive, locale, stopwords):
    """StringNormalizer(X [C] or [1, C]) -> X without stop words, case changed."""
    x = _strings(ctx, x)
    if x.ndim not in (1, 2) or (x.ndim == 2 and x.shape[0] != 1):
        raise ctx.error(f"X must have shape [C] or [1, C], got {x.shape}")
    if case_change_action not in ("NONE", "LOWER", "UPPER"):
        raise ctx.error(
            f"case_change_action must be NONE, LOWER or UPPER, got {case_change_action!r}"
        )
    words = [str(w) for w in x.reshape(-1)]
    if stopwords:
        if is_case_sensitive:
            stops = set(stopwords)
            words = [w for w in words if w not in stops]
        else:
            stops = {s.lower() for s in stopwords}
            words = [w for w in words if w.lower() not in stops]
    if case_change_action == "LOWER":
        words = [w.lower() for w in words]
    elif case_change_action == "UPPER":
        words = [w.upper() for w in words]
    if not words:
        words = [""]
    out = np.array(words, dtype=object)
    return out.reshape(1, -1) if x.ndim == 2 else out


@builtin("StringSplit", since=20, attrs={"delimiter": "", "maxsplit": None})
def string_split(ctx, x, *, delimiter, maxsplit):
    """StringSplit(X) -> (Y: substrings padded with "" to the longest split, Z: counts)."""
    x = _strings(ctx, x)
    sep = delimiter or None
    limit = -1 if maxsplit is None else int(maxsplit)
    parts = [str(s).split(sep, limit) for s in x.reshape(-1)]
    counts = np.array([len(p) for p in parts], dtype=np.int64).reshape(x.shape)
    width = max((len(p) for p in parts), default=0)
    y = np.array([p + [""] * (width - len(p)) for p in parts], dtype=object)
    return y.reshape(*x.shape, width), torch.from_numpy(counts)


@builtin("RegexFullMatch", since=20, attrs={"pattern": None})
def regex_full_match(ctx, x, *, pattern):
    """RegexFullMatch(X) -> bool: whether each string fully matches ``pattern`` (re2 syntax)."""
    x = _strings(ctx, x)
    if pattern is None:
        raise ctx.error("the pattern attribute is required")
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise ctx.error(f"invalid regular expression {pattern!r}: {e}") from e
    match = np.vectorize(lambda s: regex.fullmatch(str(s)) is not None, otypes=[np.bool_])
    return torch.from_numpy(np.asarray(match(x), dtype=np.bool_))

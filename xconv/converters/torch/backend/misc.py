"""PyTorch handlers: NonMaxSuppression and the string ops (StringConcat, StringNormalizer,
StringSplit, RegexFullMatch).

NonMaxSuppression's output length depends on the data, so it runs on concrete values with
numpy. torch has no string tensors: strings are numpy object arrays, and the string ops
compute with numpy, returning torch tensors for their numeric outputs.
"""

from __future__ import annotations

import numpy as np
import torch

from xconv.converters.common import nms, strings
from xconv.converters.torch.backend.registry import builtin


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

    def static(value, what):
        return None if value is None else ctx.static(value, what)

    selected = nms.non_max_suppression(
        ctx.static(boxes, "boxes"),
        ctx.static(scores, "scores"),
        static(max_output_boxes_per_class, "max_output_boxes_per_class"),
        static(iou_threshold, "iou_threshold"),
        static(score_threshold, "score_threshold"),
        center_point_box,
    )
    return torch.from_numpy(selected)


# ---------------------------------------------------------------- strings


def _strings(ctx, x, what: str = "X") -> np.ndarray:
    return strings.as_strings(x, what, ctx.error, "torch")


@builtin("StringConcat", since=20)
def string_concat(ctx, x, y):
    """StringConcat(X, Y) -> X + Y elementwise, with broadcasting."""
    return strings.string_concat(_strings(ctx, x, "X"), _strings(ctx, y, "Y"))


@builtin(
    "StringNormalizer",
    since=10,
    attrs={"case_change_action": "NONE", "is_case_sensitive": 0, "locale": "", "stopwords": None},
)
def string_normalizer(ctx, x, *, case_change_action, is_case_sensitive, locale, stopwords):
    """StringNormalizer(X [C] or [1, C]) -> X without stop words, case changed."""
    return strings.string_normalizer(
        _strings(ctx, x),
        ctx.error,
        case_change_action=case_change_action,
        is_case_sensitive=is_case_sensitive,
        stopwords=stopwords,
    )


@builtin("StringSplit", since=20, attrs={"delimiter": "", "maxsplit": None})
def string_split(ctx, x, *, delimiter, maxsplit):
    """StringSplit(X) -> (Y: substrings padded with "" to the longest split, Z: counts)."""
    y, counts = strings.string_split(_strings(ctx, x), delimiter=delimiter, maxsplit=maxsplit)
    return y, torch.from_numpy(counts)


@builtin("RegexFullMatch", since=20, attrs={"pattern": None})
def regex_full_match(ctx, x, *, pattern):
    """RegexFullMatch(X) -> bool: whether each string fully matches ``pattern`` (re2 syntax)."""
    return torch.from_numpy(strings.regex_full_match(_strings(ctx, x), ctx.error, pattern=pattern))

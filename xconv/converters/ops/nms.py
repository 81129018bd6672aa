"""NonMaxSuppression on numpy: its output length depends on the data, so both backends
run it on concrete values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np


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


def non_max_suppression(
    boxes: np.ndarray,
    scores: np.ndarray,
    max_output_boxes_per_class: np.ndarray | None,
    iou_threshold: np.ndarray | None,
    score_threshold: np.ndarray | None,
    center_point_box: int,
) -> np.ndarray:
    """NonMaxSuppression -> [n, 3] int64 (batch, class, box) indices.

    Each optional input is None when absent; an empty one counts as absent.
    """
    boxes = np.asarray(boxes).astype(np.float64)
    scores = np.asarray(scores).astype(np.float64)
    max_out = 0
    if max_output_boxes_per_class is not None:
        m = np.asarray(max_output_boxes_per_class).reshape(-1)
        max_out = max(int(m[0]), 0) if m.size else 0
    iou = 0.0
    if iou_threshold is not None and np.size(iou_threshold):
        iou = float(np.asarray(iou_threshold).reshape(-1)[0])
    score_min = None
    if score_threshold is not None and np.size(score_threshold):
        score_min = float(np.asarray(score_threshold).reshape(-1)[0])
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
    return np.array(selected, dtype=np.int64).reshape(-1, 3)


def register_nms(builtin: Callable[..., Any], to_backend: Callable[[np.ndarray], Any]) -> None:
    """Register NonMaxSuppression with a backend registry's ``builtin``; ``to_backend`` turns
    the numpy indices into the backend's array."""

    @builtin("NonMaxSuppression", since=10, attrs={"center_point_box": 0})
    def nms_handler(
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
            # An empty optional input counts as absent and need not be concrete.
            if value is None or not math.prod(np.shape(value)):
                return None
            return ctx.static(value, what)

        max_out = max_output_boxes_per_class
        if max_out is not None:
            max_out = ctx.static(max_out, "max_output_boxes_per_class")
        selected = non_max_suppression(
            ctx.static(boxes, "boxes"),
            ctx.static(scores, "scores"),
            max_out,
            static(iou_threshold, "iou_threshold"),
            static(score_threshold, "score_threshold"),
            center_point_box,
        )
        return to_backend(selected)

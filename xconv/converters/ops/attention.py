"""Attribute checks of the attention ops shared by the backends."""

from __future__ import annotations

from collections.abc import Callable

Fail = Callable[[str], Exception]

LINEAR_ATTENTION_RULES = ("linear", "gated", "delta", "gated_delta")


def linear_attention_rule(
    update_rule: str,
    q_num_heads: int,
    kv_num_heads: int,
    *,
    has_decay: bool,
    has_beta: bool,
    fail: Fail,
) -> tuple[bool, bool]:
    """Check LinearAttention's attributes and inputs; return (gating, delta) of the rule."""
    if update_rule not in LINEAR_ATTENTION_RULES:
        raise fail(f"update_rule {update_rule!r} is not one of {list(LINEAR_ATTENTION_RULES)}")
    if q_num_heads <= 0 or kv_num_heads <= 0 or q_num_heads % kv_num_heads:
        raise fail(
            f"q_num_heads ({q_num_heads}) must be a positive multiple of kv_num_heads "
            f"({kv_num_heads})"
        )
    gating = update_rule in ("gated", "gated_delta")
    delta = update_rule in ("delta", "gated_delta")
    if gating != has_decay:
        raise fail(f"update_rule {update_rule!r} {'needs' if gating else 'forbids'} decay")
    if delta != has_beta:
        raise fail(f"update_rule {update_rule!r} {'needs' if delta else 'forbids'} beta")
    return gating, delta

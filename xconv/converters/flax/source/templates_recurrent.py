"""Flax source templates: LinearAttention and CausalConvWithState."""

from __future__ import annotations

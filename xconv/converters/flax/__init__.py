"""flax."""

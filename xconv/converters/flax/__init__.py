"""Flax / JAX frontend: linen and nnx modules and plain JAX functions -> the shared IR.

``from_flax`` and ``from_jax`` live in :mod:`xconv.converters.flax.importer` (imported
lazily: this package imports no framework).
"""

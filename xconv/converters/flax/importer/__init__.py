"""Flax / JAX importer: linen and nnx modules and plain JAX functions -> the shared IR.

``from_flax`` and ``from_jax`` live in :mod:`xconv.converters.flax.importer.trace.trace`; the jaxpr
primitives in ``primitives``, ``math``, ``indexing``, ``control``; layer recognition in ``layers``.
Importing this package imports no framework.
"""

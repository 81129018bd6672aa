"""Flax: ``importer/`` (Flax modules and JAX functions -> IR, ``xconv.from_flax`` /
``xconv.from_jax``) and ``source/`` (IR -> Flax linen / nnx source, ``xconv.to_flax``);
``source_names`` is what both share (the source names a generated module records).
Importing this package imports no framework."""

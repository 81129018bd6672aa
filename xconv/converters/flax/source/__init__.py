"""Flax source emitter: the IR as readable Flax linen / nnx source (``xconv.to_flax``).

``emitter`` walks the graph, ``templates`` holds one template per op, ``classes`` and
``render`` rebuild the source module tree. Plain Python: importing it imports no framework.
"""

"""Flax source templates for ONNX's RNN, GRU and LSTM: a call
(:func:`~xconv.converters.expressions.recurrent_call`) of the generated ``_rnn`` / ``_gru`` /
``_lstm`` (``helpers``). Importing this module registers them in ``templates.registry``.
"""

from __future__ import annotations

from xconv.converters import expressions as ex
from xconv.converters.flax.source.templates import registry
from xconv.converters.ops.rnn import COMMON_ATTRS

_RNN_ATTRS = COMMON_ATTRS

registry.builtin("RNN", attrs=_RNN_ATTRS)(ex.recurrent_call)
registry.builtin("GRU", attrs={**_RNN_ATTRS, "linear_before_reset": 0})(ex.recurrent_call)
registry.builtin("LSTM", attrs={**_RNN_ATTRS, "input_forget": 0})(ex.recurrent_call)

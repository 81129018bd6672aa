"""Framework-free ONNX semantics shared by the JAX and PyTorch backends.

Everything here computes with numpy (and reads onnx_ir values) only, so each piece of ONNX
semantics is written once. Functions that can reject their input take ``fail``: a callable
that turns a message into the exception to raise (a backend passes its ``ctx.error``).
"""

#: The op families every runtime implements, one handler module each (``<runtime>/<family>.py``;
#: a family written once here has a module of the same name holding the runtime's kernel).
RUNTIME_FAMILIES = (
    "elementwise",
    "math",
    "nn",
    "rnn",
    "linalg",
    "reduce",
    "attention",
    "shape",
    "indexing",
    "control",
    "sequence",
    "random",
    "misc",
    "signal",
    "ml",
)

"""Framework-free ONNX semantics shared by the JAX and PyTorch backends.

Everything here computes with numpy (and reads onnx_ir values) only, so each piece of ONNX
semantics is written once. Functions that can reject their input take ``fail``: a callable
that turns a message into the exception to raise (a backend passes its ``ctx.error``).
"""

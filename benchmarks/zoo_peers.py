"""The peers' verdicts beside the zoo's rows (``benchmarks/zoo.py --peers DIR``).

A peer is run on the same model and inputs as the row and compared with the same reference
(``zoo._compare``), when it is installed in ``DIR`` (``pip install --target DIR``, kept out of
the project's environment; CI does not install them and the default suite does not use them):

* transformers rows: torch2jax (PyPI ``torch2jax==0.1.0``, ``t2j``), torch to JAX. ``t2j`` of
  a module returns one tensor, so the peer runs the model's first output (the last hidden state
  or the logits) and is compared with the reference's first output. ``t2j`` sets every buffer
  from the state dict it is given, which lacks non-persistent buffers (BERT's position ids):
  the peer runs on a copy whose buffers are all persistent.
* keras.applications rows: onnx2torch (PyPI ``onnx2torch==1.5.15``), ONNX to torch, on the
  ONNX that ``xconv.save`` writes of the row's imported model, taken to opset :data:`OPSET`
  (tf2onnx alone does not export every keras.applications model: ``PartitionedCall`` of
  ConvNeXt, issue 16). onnx2torch
  imports ``torchvision`` for its NMS and RoiAlign converters only; without it a stand-in
  module that raises on use is put on the path (no keras.applications model uses either op).

Install (tried on this machine, torch 2.13 / jax 0.10, neither changes /work/venv)::

    pip install --target DIR --no-deps torch2jax==0.1.0 onnx2torch==1.5.15
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import sys
import types
from collections.abc import Callable
from pathlib import Path

#: onnx2torch 1.5.15 converts opsets up to 17 (``Constant`` of opset 23 is "not implemented"):
#: the ONNX is first taken down to it with ``onnx.version_converter``, as a user would (where
#: onnx has no adapter, e.g. Pad, onnx2torch is given the file as written).
OPSET = 17


def use(folder: str | None) -> list[str]:
    """Put ``folder`` first on ``sys.path``; the names of the peers importable from it."""
    if not folder:
        return []
    if folder not in sys.path:
        sys.path.insert(0, folder)
    found = []
    try:
        import torch2jax  # noqa: F401

        found.append("torch2jax")
    except ImportError:
        pass
    stand_in = importlib.util.find_spec("torchvision") is None
    if stand_in:  # only while onnx2torch imports: transformers looks for torchvision's spec
        sys.modules["torchvision"] = _torchvision_stand_in()
        sys.modules["torchvision.ops"] = sys.modules["torchvision"].ops
    try:
        import onnx2torch  # noqa: F401

        found.append("onnx2torch")
    except ImportError:
        pass
    finally:
        if stand_in:
            del sys.modules["torchvision"], sys.modules["torchvision.ops"]
    return found


def _torchvision_stand_in() -> types.ModuleType:
    def missing(*args, **kwargs):
        raise NotImplementedError("torchvision is not installed (onnx2torch's NMS/RoiAlign)")

    ops = types.ModuleType("torchvision.ops")
    ops.nms = ops.roi_align = ops.box_convert = missing
    tv = types.ModuleType("torchvision")
    tv.ops = ops
    return tv


def torch2jax_run(module, args: tuple) -> Callable[[], object]:
    """torch2jax's ``t2j`` of ``module``'s first output, on ``args``."""

    def run():
        import jax.numpy as jnp
        import torch
        from torch2jax import t2j

        class First(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, *a):
                out = self.inner(*a)
                out = out.to_tuple() if hasattr(out, "to_tuple") else out
                return out[0] if isinstance(out, tuple | list) else out

        wrapped = First(copy.deepcopy(module)).eval()
        for sub in wrapped.modules():  # t2j sets every buffer from state_dict, which lacks
            sub._non_persistent_buffers_set.clear()  # the non-persistent ones (position ids)
        state = {k: t2j(v.detach()) for k, v in wrapped.state_dict().items()}
        return t2j(wrapped)(*(jnp.asarray(a.numpy()) for a in args), state_dict=state)

    return run


def onnx2torch_run(model, inputs: tuple, where: Path) -> Callable[[], object]:
    """onnx2torch's module of the ONNX ``xconv.save`` writes of ``model``, on ``inputs``."""

    def run():
        import onnx
        import onnx.version_converter
        import onnx2torch
        import torch

        import xconv

        proto = onnx.load(str(xconv.save(model, where / "peer.onnx")))
        if max(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")) > OPSET:
            # no adapter down to OPSET (Pad): onnx2torch gets the file as written
            with contextlib.suppress(RuntimeError):
                proto = onnx.version_converter.convert_version(proto, OPSET)
        module = onnx2torch.convert(proto).eval()
        with torch.no_grad():
            return module(*(torch.from_numpy(x) for x in inputs))

    return run

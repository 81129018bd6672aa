"""Write a converted model as a self-contained PyTorch package directory.

``write_torch(model, out_dir)`` creates ``out_dir/model.py`` (``class Model(nn.Module)`` and
``load(out_dir)``) and the weights: ``weights.safetensors`` when safetensors is importable,
else ``weights.pt`` (read back with ``weights_only=True``). The directory is written to a
temporary sibling first and renamed into place, so a failed run leaves nothing half-written.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import onnx_ir as ir

from xconv.converters.codegen import write_dir_atomic
from xconv.converters.torch.source.emitter import to_torch_source


def _has_safetensors() -> bool:
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        return False
    return True


def write_torch(model: ir.Model, out_dir: str | os.PathLike) -> Path:
    """Write ``out_dir/model.py`` and its weights for ``model``.

    Args:
        model: The IR model (not modified).
        out_dir: Directory to create (replaced atomically when it exists).

    Returns:
        ``out_dir`` as a Path.

    Raises:
        UnsupportedOpError: ops without a template, all listed, before writing anything.
    """
    import torch

    source, state = to_torch_source(model)
    state = {k: v.contiguous() for k, v in sorted(state.items())}
    files = {"model.py": source.encode()}
    buf = io.BytesIO()
    if _has_safetensors():
        from safetensors.torch import save

        files["weights.safetensors"] = save(state)
        fmt = "safetensors"
    else:
        torch.save(state, buf)
        files["weights.pt"] = buf.getvalue()
        fmt = "pt"
    meta = {"format": 1, "weights": fmt}
    files["xconv.json"] = json.dumps(meta, sort_keys=True).encode()
    return write_dir_atomic(out_dir, files)

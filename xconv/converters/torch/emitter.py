"""IR -> PyTorch: a runnable module (``to_torch``) and readable source (``to_torch_source``)."""

from __future__ import annotations

from xconv.converters.torch.runtime.interpreter import to_torch

__all__ = ["to_torch", "to_torch_source"]


def to_torch_source(model, *args, **kwargs):
    """Readable ``nn.Module`` source and its state_dict (see ``source_emitter``)."""
    from xconv.converters.torch.source.emitter import to_torch_source as impl

    return impl(model, *args, **kwargs)

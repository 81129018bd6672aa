"""PyTorch source emitter: the IR as readable ``nn.Module`` source (``xconv.to_torch_source``,
``emitter``, one template per op in ``templates``, the module tree in ``tree``) and the written
package folder (``write``). Importing this package does not import torch."""

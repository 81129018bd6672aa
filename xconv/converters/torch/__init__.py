"""PyTorch: ``importer/`` (torch.export -> IR), ``runtime/`` (IR -> ``nn.Module``, ``xconv.to_torch``),
``source/`` (IR -> readable torch source); ``emitter`` gives both targets one entry point.
Importing this package does not import torch; its modules do."""

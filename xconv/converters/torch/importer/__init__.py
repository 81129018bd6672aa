"""PyTorch importer: ``from_torch`` (``trace``), layer recognition (``layers``), model files
(``files``), the meta-device route (``meta``). Importing this package does not import torch."""

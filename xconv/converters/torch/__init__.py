"""PyTorch frontend: ``from_torch`` (importer.py), layer recognition (layers.py), model files
(files.py). Importing this package does not import torch; its modules do."""

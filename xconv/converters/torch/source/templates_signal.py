"""PyTorch source templates: DFT, STFT and MelWeightMatrix."""

from __future__ import annotations

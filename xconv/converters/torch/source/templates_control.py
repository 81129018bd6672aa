"""PyTorch source templates: the control-flow ops If, Loop and Scan."""

from __future__ import annotations

"""The tiny model of the training-checkpoint tests: Linear, BatchNorm1d, ReLU, Linear."""

from __future__ import annotations

import torch


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 12)
        self.bn = torch.nn.BatchNorm1d(12)
        self.fc2 = torch.nn.Linear(12, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def make_tiny():
    torch.manual_seed(0)
    return Tiny()

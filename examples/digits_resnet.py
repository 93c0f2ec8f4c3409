"""A small residual CNN for the 8x8 handwritten digits, written as PyTorch users write one: the skip connection
is what a layer list cannot say. GroupNorm, not BatchNorm: federated devices share parameters only, and
batch-norm running statistics would be each device's own (edgefed refuses modules whose buffers change).

    edgefed run examples/digits-torch.toml
"""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm1 = nn.GroupNorm(4, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(4, channels)

    def forward(self, x):
        h = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(x + self.norm2(self.conv2(h)))


class DigitsResNet(nn.Module):
    def __init__(self, in_channels: int, n_classes: int, width: int = 16):
        super().__init__()
        self.stem = nn.Conv2d(in_channels, width, 3, padding=1)
        self.block = Block(width)
        self.head = nn.Linear(width, n_classes)

    def forward(self, x):
        h = self.block(torch.relu(self.stem(x)))
        return self.head(h.mean(dim=(2, 3)))


def factory(input_shape, n_classes):
    return DigitsResNet(input_shape[0], n_classes)

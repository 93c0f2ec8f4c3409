"""A PyTorch module as a Flower user already has it: the CNN of Flower's PyTorch quickstart (the CIFAR-10 net of
PyTorch's 60-minute tutorial), unchanged, plus the one function edgefed calls to build it.

    edgefed run examples/cifar10-torch.toml --set data.path=PATH/cifar-10-batches-py

edgefed calls `factory(input_shape, n_classes)` with the data's sample shape, channels first ((3, 32, 32) for
CIFAR-10), and trains the module's parameters itself: no optimizer, data loader or training loop here.
"""

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def factory(input_shape, n_classes):
    """Flower's Net as it is: it takes 3x32x32 images and 10 classes, and says so otherwise."""
    if tuple(input_shape) != (3, 32, 32) or n_classes != 10:
        raise ValueError(f"Net takes 3x32x32 images of 10 classes, not {tuple(input_shape)} of {n_classes}")
    return Net()

"""Modules written as a PyTorch user writes them, for tests/test_torch.py (imported by edgefed from this file)."""

import random

import numpy as np
import torch
from torch import nn


class Residual(nn.Module):
    """A skip connection a layer list cannot say, with dropout (its masks: the device's stream)."""

    def __init__(self, features: int, n_classes: int):
        super().__init__()
        self.inp = nn.Linear(features, 12)
        self.block = nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12))
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(12, n_classes)

    def forward(self, x):
        h = torch.relu(self.inp(torch.flatten(x, 1)))
        return self.out(self.drop(h + self.block(h)))


def residual(input_shape, n_classes):
    features = 1
    for s in input_shape:
        features *= s
    return Residual(features, n_classes)


def linear(input_shape, n_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), n_classes))


def batchnorm(input_shape, n_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], 8), nn.BatchNorm1d(8), nn.Linear(8, n_classes))


def wrong_width(input_shape, n_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], n_classes + 1))


def broken(input_shape, n_classes):
    raise ValueError("no such layer size")


class Counting(nn.Module):
    def __init__(self, features, n_classes):
        super().__init__()
        self.lin = nn.Linear(features, n_classes)
        self.steps = nn.Parameter(torch.zeros(1, dtype=torch.int64), requires_grad=False)

    def forward(self, x):
        return self.lin(torch.flatten(x, 1))


def integer_parameter(input_shape, n_classes):
    return Counting(input_shape[0], n_classes)


class _Linear(nn.Module):
    def __init__(self, features, n_classes):
        super().__init__()
        self.lin = nn.Linear(features, n_classes)


class TupleOutput(_Linear):
    def forward(self, x):
        out = self.lin(torch.flatten(x, 1))
        return out, out


class Detached(_Linear):
    def forward(self, x):
        return self.lin(torch.flatten(x, 1)).detach()


class NoisyAlways(_Linear):
    def forward(self, x):
        return self.lin(torch.flatten(x, 1)) + torch.randn(x.shape[0], 1)


class Clamping(_Linear):
    def forward(self, x):
        self.lin.weight.data = self.lin.weight.data.clamp(-0.1, 0.1)  # a copy, not in place
        return self.lin(torch.flatten(x, 1))


class NoisyOnLargeBatches(_Linear):
    def forward(self, x):
        out = self.lin(torch.flatten(x, 1))
        return out + torch.randn_like(out) if self.training and x.shape[0] > 2 else out


class NumpyNoiseInEvaluation(_Linear):
    def forward(self, x):
        out = self.lin(torch.flatten(x, 1))
        return out if self.training else out + float(np.random.normal(scale=1e-3))


class PythonNoiseInTraining(_Linear):
    def forward(self, x):
        out = self.lin(torch.flatten(x, 1))
        return out * random.uniform(0.9, 1.1) if self.training else out


class NumpyNoiseOnLargeBatches(_Linear):
    def forward(self, x):
        out = self.lin(torch.flatten(x, 1))
        return out + float(np.random.rand()) if x.shape[0] > 2 else out


def numpy_noise_in_evaluation(input_shape, n_classes):
    return NumpyNoiseInEvaluation(input_shape[0], n_classes)


def python_noise_in_training(input_shape, n_classes):
    return PythonNoiseInTraining(input_shape[0], n_classes)


def numpy_noise_on_large_batches(input_shape, n_classes):
    return NumpyNoiseOnLargeBatches(input_shape[0], n_classes)


def tuple_output(input_shape, n_classes):
    return TupleOutput(input_shape[0], n_classes)


def detached(input_shape, n_classes):
    return Detached(input_shape[0], n_classes)


def noisy_always(input_shape, n_classes):
    return NoisyAlways(input_shape[0], n_classes)


def clamping(input_shape, n_classes):
    return Clamping(input_shape[0], n_classes)


def noisy_on_large_batches(input_shape, n_classes):
    return NoisyOnLargeBatches(input_shape[0], n_classes)


def frozen_first_layer(input_shape, n_classes):
    module = nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], 8), nn.Tanh(), nn.Linear(8, n_classes))
    module[1].requires_grad_(False)
    return module

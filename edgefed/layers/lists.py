"""A model config's layer list: the built-in models as named lists, the one entry from a model config to its list (model_layers), and what a model's
first layers say of its samples (spatial dimensions, token ids, the shape they take)."""

from __future__ import annotations

import math

import numpy as np

from edgefed.layers.types import ACTIVATIONS, TYPES
from edgefed.problems.text import ALL_LETTERS

CHARS = len(ALL_LETTERS)  # LEAF Shakespeare's vocabulary


def builtin_layers(kind: str, sample_shape: tuple, n_classes: int, hidden=(200, 200)) -> tuple[dict, ...]:
    """The built-in models as layer lists: logistic regression, McMahan et al.'s 2NN (hidden widths) and CNN
    (two 5x5 "same" convolutions of 32 and 64 channels, each with ReLU and 2x2 max pooling, a 512-unit ReLU
    layer, the softmax output), and their character LSTM (an 8-dimensional embedding of 80 characters, two
    LSTM layers of 256 units, the next character's softmax: 819,920 parameters for 80 classes)."""
    if kind == "charlstm":
        return ({"type": "embedding", "num": CHARS, "dim": 8},
                {"type": "lstm", "hidden": 256, "layers": 2, "output": "last"}, {"type": "dense", "out": n_classes})
    head = [{"type": "flatten"}]
    if kind == "logreg":
        return tuple(head + [{"type": "dense", "out": n_classes}])
    if kind == "mlp":
        body = []
        for width in hidden:
            body += [{"type": "dense", "out": int(width)}, {"type": "relu"}]
        return tuple(head + body + [{"type": "dense", "out": n_classes}])
    side = math.isqrt(int(np.prod(sample_shape)))
    first = [{"type": "reshape", "shape": [1, side, side]}] if len(sample_shape) == 1 else []
    conv = {"kernel": 5, "stride": 1, "padding": "same"}
    return tuple(first + [
        {"type": "conv2d", "out": 32, **conv}, {"type": "relu"}, {"type": "maxpool2d", "size": 2, "stride": 2},
        {"type": "conv2d", "out": 64, **conv}, {"type": "relu"}, {"type": "maxpool2d", "size": 2, "stride": 2},
        {"type": "flatten"}, {"type": "dense", "out": 512}, {"type": "relu"}, {"type": "dense", "out": n_classes}])


def first_spatial(model) -> int:
    """The dimensions (2 or 1) of a [model] table's first spatial layer, 0 if it flattens first: what says
    whether a 2-D sample is an image (H, W) or a sequence (C, L)."""
    if model.kind == "cnn":
        return 2
    for layer in model.layers if model.kind == "sequential" else ():
        dims = TYPES[layer["type"]].spatial
        if dims:
            return dims
        if layer["type"] not in ("dropout", *ACTIVATIONS):
            break
    return 0


def token_ids(model) -> int | None:
    """The vocabulary of a [model] table's first layer when it is an embedding (its samples are token ids),
    else None."""
    layers = builtin_layers("charlstm", (), 0) if model.kind == "charlstm" else (
        model.layers if model.kind == "sequential" else ())
    return first_vocabulary(layers)


def first_vocabulary(layers) -> int | None:
    """The vocabulary of a layer list's first layer when it is an embedding (its samples are token ids),
    else None."""
    return layers[0]["num"] if layers and layers[0]["type"] == "embedding" else None


def input_shape_for(sample_shape: tuple, layers) -> tuple:
    """The shape the first layers see: a sample stored as (H, W) is one channel for a 2-D layer, a vector
    one channel for a 1-D layer (the first spatial layer, before any reshape or flatten)."""
    for layer in layers:
        kind = layer["type"]
        dims = TYPES[kind].spatial
        if dims:
            return (1, *sample_shape) if len(sample_shape) == dims else tuple(sample_shape)
        if kind not in ("dropout", *ACTIVATIONS):
            break
    return tuple(sample_shape)


def model_layers(model, sample_shape: tuple, n_classes: int) -> tuple[dict, ...]:
    """The one entry from a [model] table to its layer list: a built-in model's named list, or its own."""
    if model.kind == "sequential":
        return tuple(model.layers)  # (checked with the config: check_layers)
    return builtin_layers(model.kind, sample_shape, n_classes, model.hidden)

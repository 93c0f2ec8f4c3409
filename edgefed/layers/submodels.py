"""Width-scaled submodels (HeteroFL, Diao et al. 2021; FjORD's ordered dropout, Horvath et al. 2021): the layer
list a width trains, and where each of its parameters sits in the whole model's flat vector.

A width w keeps the first ceil(w * out) units of every hidden dense layer and the first ceil(w * out) channels of
every hidden convolution (never the input, never the output layer), and the matching input slice of the layer
after it: exactly the leading slice of each of the whole model's PyTorch tensors. A GroupNorm keeps its channels
per group (the width's channels must hold whole groups). Layer types whose parameters cannot be sliced that way
(embeddings, recurrent layers) are refused in one line, as is a list with no hidden layer to slice.
"""

from __future__ import annotations

import math

import numpy as np

from edgefed.errors import ConfigError
from edgefed.layers.network import Network
from edgefed.layers.pytorch import state_dict, whole_from_state

SCALED = ("dense", "conv1d", "conv2d")  # the types whose `out` a width scales
UNSLICEABLE = ("embedding", "lstm", "gru")


def narrowed(layers, width: float, key: str = "model.layers") -> tuple[dict, ...]:
    """The layer list of width `width`: every hidden dense or convolution's `out` scaled up to ceil(width * out),
    the output layer (the last with an `out`) whole."""
    if not 0.0 < width <= 1.0:
        raise ConfigError(f"config: submodel.widths holds {width}; a width is a fraction in (0, 1]")
    for i, layer in enumerate(layers):
        if layer["type"] in UNSLICEABLE:
            raise ConfigError(f"config: {key}[{i}] ({layer['type']}) cannot be narrowed to a width; submodels slice "
                              "dense, convolution and groupnorm layers only")
    scaled = [i for i, layer in enumerate(layers) if layer["type"] in SCALED]
    if len(scaled) < 2:
        raise ConfigError(f"config: submodel is set, but {key} has no hidden dense or convolution layer to narrow "
                          "(its only one is the output); give the model a hidden layer, or remove [submodel]")
    output = scaled[-1]
    out, channels, whole_channels = [], None, None
    for i, layer in enumerate(layers):
        kind = layer["type"]
        layer = dict(layer)
        if kind in SCALED and i != output:
            channels, whole_channels = math.ceil(width * layer["out"]), layer["out"]
            layer["out"] = channels
        elif kind == "groupnorm" and channels is not None:
            per_group = whole_channels // layer["groups"]
            if channels % per_group:
                raise ConfigError(f"config: {key}[{i}] (groupnorm) has {per_group} channels a group, but width "
                                  f"{width} keeps {channels} channels of its input; choose widths that keep whole "
                                  "groups")
            layer["groups"] = channels // per_group
        elif kind == "reshape" and channels is not None:
            raise ConfigError(f"config: {key}[{i}] (reshape) follows a narrowed layer, whose width changes the shape "
                              "it reshapes; submodels need flatten there")
        out.append(layer)
    return tuple(out)


def slice_positions(whole: Network, part: Network) -> np.ndarray:
    """(part.n_params,) int64: the position in the whole model's flat vector of each parameter of the width's
    network, found by slicing the whole model's PyTorch tensors (of their own positions) to the part's shapes."""
    positions = state_dict(whole, np.arange(whole.n_params, dtype=np.float64))
    sliced = {}
    for t in part.tensors:
        name = f"{t.layer}.{t.name}"
        sliced[name] = positions[name][tuple(slice(0, n) for n in t.torch_shape)]
    return whole_from_state(part, sliced, "a width's slice", np.float64).astype(np.int64)

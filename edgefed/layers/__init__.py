"""The layer library: every layer type in one registry, and a layer list walked once into a program for
kernels/network.py (JAX stax's shape inference, Caffe's Reshape-before-Forward). A package of roles:
`types` (each type's settings, plan and PyTorch text side by side, the registry `TYPES`), `lists` (a model
config's layer list: the built-in models as named lists, what its first layers say of the samples),
`network` (the walk, `build`, the planned `Network`, initial values, the program's prefix and rest), and
`pytorch` (state_dict in and out, the equivalent nn.Sequential as text).

A layer list is what `[model] layers` holds: tables with a `type` and its settings, applied in order with
PyTorch's semantics (channels-first samples, cross-correlation, pooling that floors, `flatten` in C, H, W
order). Inside the kernels a map is channels-last, so a dense layer after `flatten` holds its weight rows
in (H, W, C) order and a convolution its weights as (kh, kw, c_in, c_out): `state_dict` converts both to
PyTorch's shapes and order, so exported weights load into the equivalent `torch.nn.Sequential` (one child
per layer, parameters named "<index>.weight" and "<index>.bias").

Each type declares its settings (with defaults), what input it takes, and how it plans its operation:
output shape, parameters (their initialisation and their PyTorch shape), and the sizes of its workspaces.
"""

from edgefed.layers.lists import (CHARS, builtin_layers, first_spatial, first_vocabulary, input_shape_for, model_layers,
                                  token_ids)
from edgefed.layers.network import (EVAL_BYTES, EVAL_CHUNK, Network, Tensor, build, channels_last, feature_prefix,
                                    initial_params, rest_program)
from edgefed.layers.pytorch import TORCH_WRAPPERS, check_state, state_dict, torch_text, whole_from_state
from edgefed.layers.types import ACTIVATIONS, EXAMPLES, INITS, LOSSES, REQUIRED, TYPES, LayerType, check_layers

__all__ = ["ACTIVATIONS", "CHARS", "EVAL_BYTES", "EVAL_CHUNK", "EXAMPLES", "INITS", "LOSSES", "REQUIRED", "TORCH_WRAPPERS",
           "TYPES", "LayerType", "Network", "Tensor", "build", "builtin_layers", "channels_last", "check_layers",
           "check_state", "feature_prefix", "first_spatial", "first_vocabulary", "initial_params", "input_shape_for", "model_layers",
           "rest_program", "state_dict", "token_ids", "torch_text", "whole_from_state"]

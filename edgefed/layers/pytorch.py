"""PyTorch in and out: a network's parameters as the equivalent nn.Sequential's state_dict, a state_dict checked
and taken in, and that nn.Sequential as Python text (`edgefed export --weights`)."""

from __future__ import annotations

import numpy as np

from edgefed.errors import ConfigError
from edgefed.layers.network import Network
from edgefed.layers.types import TYPES

TORCH_WRAPPERS = {  # classes the printed module defines before its nn.Sequential, when it uses them
    "lstm": '''class LSTM(nn.LSTM):
    """nn.LSTM over (N, L, F) batches from zero states, returning the top layer's last state (N, H) (last=True)
    or every step's (N, L, H)."""

    def __init__(self, *args, last=True, **kwargs):
        super().__init__(*args, batch_first=True, **kwargs)
        self.last = last

    def forward(self, x):
        out, _ = super().forward(x)
        return out[:, -1] if self.last else out
''',
}
TORCH_WRAPPERS["gru"] = TORCH_WRAPPERS["lstm"].replace("LSTM", "GRU")


def state_dict(network: Network, flat: np.ndarray) -> dict[str, np.ndarray]:
    """The parameters as the equivalent nn.Sequential's state_dict: "<index>.weight" / "<index>.bias" in
    PyTorch's shapes and order."""
    return {f"{t.layer}.{t.name}": t.to_torch(flat) for t in network.tensors}


def check_state(weights: dict, expected: dict, source: str, fix: str) -> None:
    """A state_dict against what a model holds, expected: name -> (shape, whose it is, e.g. "the model's layer
    4 (dense)", whether it is floating point). The first tensor missing, of another shape, not finite, or not
    the model's stops it: a ConfigError naming it and what the model wants, then `fix`."""
    if not weights:
        wanted = ", ".join(f"{name} {shape}" for name, (shape, _, _) in list(expected.items())[:4])
        raise ConfigError(f"{source} holds no tensors; the model needs {len(expected)} ({wanted}"
                          f"{', ...' if len(expected) > 4 else ''}); {fix}")
    for name, (shape, whose, floating) in expected.items():
        if name not in weights:
            raise ConfigError(f"{source} has no tensor {name!r}, which {whose} needs with shape {shape}; {fix}")
        value = np.asarray(weights[name])
        if value.shape != shape:
            raise ConfigError(f"{source}: tensor {name!r} has shape {value.shape}, but {whose} needs {shape}; {fix}")
        if floating and (not np.issubdtype(value.dtype, np.floating) or not np.isfinite(value).all()):
            what = "NaN or infinite values" if np.issubdtype(value.dtype, np.floating) else f"{value.dtype} values"
            raise ConfigError(f"{source}: tensor {name!r} holds {what}; give finite floating-point weights")
    extra = [name for name in weights if name not in expected]
    if extra:
        names = ", ".join(list(expected)[:6]) + (", ..." if len(expected) > 6 else "")
        raise ConfigError(f"{source} has the tensor {extra[0]!r}, which the model does not (its tensors: {names}); "
                          f"{fix}")


def whole_from_state(network: Network, weights: dict, source: str, dtype) -> np.ndarray:
    """The whole parameter vector from a state_dict (state_dict's names and PyTorch's shapes), checked first
    (check_state)."""
    check_state(weights, {f"{t.layer}.{t.name}": (tuple(t.torch_shape),
                                                  f"the model's layer {t.layer} ({network.layers[t.layer]['type']})",
                                                  True) for t in network.tensors},
                source, "give the weights of the same layers (edgefed export --weights writes them)")
    whole = np.zeros(network.n_params, dtype)
    for t in network.tensors:
        whole[t.offset:t.offset + t.size] = t.from_torch(np.asarray(weights[f"{t.layer}.{t.name}"]))
    return whole


def torch_text(network: Network) -> str:
    """The equivalent torch.nn.Sequential, as Python: what `edgefed export --weights` prints (self-contained:
    the classes it needs, nn.LSTM and nn.GRU keeping the last step or the sequence, come first)."""
    shape, parts = network.input_shape, []
    for layer, out_shape in zip(network.layers, network.output_shapes):
        parts.append(TYPES[layer["type"]].torch(layer, shape, out_shape))
        shape = out_shape
    used = dict.fromkeys(layer["type"] for layer in network.layers if layer["type"] in TORCH_WRAPPERS)
    preamble = "".join(TORCH_WRAPPERS[kind] + "\n\n" for kind in used)
    return preamble + "nn.Sequential(\n" + "".join(f"    {p},\n" for p in parts) + ")"

"""The layer library: every layer type in one registry, and a layer list walked once into a program for
kernels/network.py (JAX stax's shape inference, Caffe's Reshape-before-Forward).

A layer list is what `[model] layers` holds: tables with a `type` and its settings, applied in order with
PyTorch's semantics (channels-first samples, cross-correlation, pooling that floors, `flatten` in C, H, W
order). Inside the kernels a map is channels-last, so a dense layer after `flatten` holds its weight rows
in (H, W, C) order and a convolution its weights as (kh, kw, c_in, c_out): `state_dict` converts both to
PyTorch's shapes and order, so exported weights load into the equivalent `torch.nn.Sequential` (one child
per layer, parameters named "<index>.weight" and "<index>.bias").

Each type declares its settings (with defaults), what input it takes, and how it plans its operation:
output shape, parameters (their initialisation and their PyTorch shape), and the sizes of its workspaces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from edgefed.errors import ConfigError, ResourceError
from edgefed.kernels import program as ops
from edgefed.kernels.conv import AVG, MAX, MAX_RELU
from edgefed.kernels.dense import BLOCK_BYTES, FUSED_WEIGHTS
from edgefed.kernels.fma import TILE_BYTES
from edgefed.kernels.pointwise import LEAKY_RELU, RELU, SIGMOID, TANH
from edgefed.kernels.sequence import pack_values, work_values
from edgefed.memory import size_text
from edgefed.problems.text import ALL_LETTERS

LOSSES = ("cross_entropy", "mse")
INITS = ("pytorch", "glorot", "zeros")
REQUIRED = object()


def _int(minimum: int):
    def check(value, where):
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ConfigError(f"{where} = {value!r} must be an integer >= {minimum}")
        return value
    return check


def _rate(value, where):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ConfigError(f"{where} = {value!r} must be a number in [0, 1) (the share of values dropped)")
    return float(value)


def _number(value, where):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where} = {value!r} must be a finite number")
    return float(value)


def _padding(value, where):
    if value in ("same", "valid"):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ConfigError(f'{where} = {value!r} must be "same", "valid" or an integer >= 0')


def _one_of(*options):
    def check(value, where):
        if value not in options:
            raise ConfigError(f"{where} = {value!r} must be one of {', '.join(map(repr, options))}")
        return value
    return check


def _shape(value, where):
    if (not isinstance(value, (list, tuple)) or not 1 <= len(value) <= 3
            or not all(isinstance(v, int) and not isinstance(v, bool) and (v >= 1 or v == -1) for v in value)
            or value.count(-1) > 1):
        raise ConfigError(f"{where} = {value!r} must be a list of 1 to 3 sizes (one of them may be -1), "
                          "e.g. [1, 28, 28]")
    return list(value)


@dataclass(frozen=True)
class LayerType:
    settings: dict  # name -> (default or REQUIRED, check(value, where) -> value)
    torch: object  # torch(layer, input shape, output shape): its PyTorch module as Python (`edgefed export`)
    plan: object  # plan(walk, layer, index, where): its operation, output, parameters and workspaces (below)
    spatial: int = 0  # the input's dimensions a spatial layer works on (2: (C, H, W), 1: (C, L)); 0: not spatial
    parametric: bool = False  # it has parameters (which `trainable = false` freezes)


ACTIVATIONS = {"relu": RELU, "leaky_relu": LEAKY_RELU, "tanh": TANH, "sigmoid": SIGMOID}


def check_layers(layers, key: str = "model.layers") -> tuple[dict, ...]:
    """Each layer's type and settings checked and its defaults filled in; shapes are checked by `build`."""
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ConfigError(f'config: {key} must be a non-empty list of layers, e.g. [{{type = "dense", out = 10}}]')
    out = []
    for i, layer in enumerate(layers):
        where = f"config: {key}[{i}]"
        if not isinstance(layer, dict):
            raise ConfigError(f'{where} must be a table like {{type = "dense", out = 10}}')
        kind = layer.get("type")
        if kind is None:
            raise ConfigError(f'{where} has no type; give one, e.g. {{type = "dense", out = 10}} (types: '
                              f"{', '.join(TYPES)})")
        if not isinstance(kind, str) or kind not in TYPES:
            import difflib

            hint = difflib.get_close_matches(str(kind), list(TYPES), n=1)
            fix = f"did you mean {hint[0]!r}?" if hint else f"choose one of {', '.join(TYPES)}"
            raise ConfigError(f"{where}.type = {kind!r} is not a layer type; {fix}")
        spec = TYPES[kind]
        unknown = [k for k in layer if k not in ("type", "trainable") and k not in spec.settings]
        if unknown:
            known = ", ".join(spec.settings) or "none"
            raise ConfigError(f"{where} ({kind}): unknown setting {unknown[0]!r}; {kind} takes: {known}")
        checked = {"type": kind}
        for name, (default, check) in spec.settings.items():
            if name in layer:
                checked[name] = check(layer[name], f"{where}.{name}")
            elif default is REQUIRED:
                raise ConfigError(f"{where} ({kind}) needs {name!r}, e.g. {_example(kind)}")
            elif default is not None:
                checked[name] = default
        if "trainable" in layer:
            if not spec.parametric:
                raise ConfigError(f"{where} ({kind}): trainable applies to layers with parameters (dense, conv, "
                                  "groupnorm, embedding, lstm, gru); remove it here")
            if not isinstance(layer["trainable"], bool):
                raise ConfigError(f"{where}.trainable = {layer['trainable']!r} must be true or false")
            if not layer["trainable"]:
                checked["trainable"] = False  # (true is the default and is not kept: profile keys stay as they were)
        out.append(checked)
    parametric = [layer for layer in out if TYPES[layer["type"]].parametric]
    if parametric and not any(layer.get("trainable", True) for layer in parametric):
        raise ConfigError(f"config: {key}: every layer with parameters has trainable = false, so nothing would "
                          "train; let at least one train")
    return tuple(out)


EXAMPLES = {  # a layer of each type with its required settings, as a message shows it (tests check each)
    "dense": '{type = "dense", out = 10}', "conv2d": '{type = "conv2d", out = 32, kernel = 5}',
    "conv1d": '{type = "conv1d", out = 32, kernel = 5}', "reshape": '{type = "reshape", shape = [1, 28, 28]}',
    "groupnorm": '{type = "groupnorm", groups = 8}', "embedding": '{type = "embedding", num = 80, dim = 8}',
    "lstm": '{type = "lstm", hidden = 256}', "gru": '{type = "gru", hidden = 256}',
    **{pool: f'{{type = "{pool}", size = 2}}' for pool in ("maxpool2d", "avgpool2d", "maxpool1d", "avgpool1d")}}


def _example(kind: str) -> str:
    return EXAMPLES.get(kind, f'{{type = "{kind}"}}')


# ------------------------------------------------------------------------------------------------- layouts
def channels_last(shape: tuple) -> np.ndarray | None:
    """Where each value of a (C, H, W) or (C, L) map stored channels-last sits in PyTorch's order (None: the
    same order, a vector or one channel)."""
    if len(shape) < 2 or shape[0] == 1:
        return None
    c, rest = shape[0], int(np.prod(shape[1:]))
    return (np.arange(c)[None, :] * rest + np.arange(rest)[:, None]).reshape(-1).astype(np.int64)


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor: where it lives in the flat vector, its shape there, and PyTorch's."""

    layer: int
    name: str  # "weight" or "bias" (a recurrent layer: PyTorch's names, "weight_ih_l0", ...)
    offset: int
    shape: tuple  # as stored
    torch_shape: tuple
    fans: tuple  # (fan_in, fan_out) of its layer, for the initialisations
    kind: str  # "dense", "conv", "norm", "embedding" or "recurrent"
    order: np.ndarray | None = None  # dense: the PyTorch input index of each stored weight row
    hidden: int = 0  # recurrent: H, whose 1/sqrt(H) bounds PyTorch's initialisation

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def to_torch(self, flat: np.ndarray) -> np.ndarray:
        w = flat[self.offset:self.offset + self.size].reshape(self.shape)
        if self.kind == "embedding" or len(self.shape) == 1:  # (biases, norms: 1-D)
            return w.copy()
        if self.kind in ("dense", "recurrent"):  # stored (in, out): PyTorch's (out, in) transposed
            out = np.empty(self.torch_shape, w.dtype)
            out[:, self.order if self.order is not None else slice(None)] = w.T
            return out
        if len(self.torch_shape) == 3:  # conv1d: stored (1, k, c_in, c_out)
            return np.ascontiguousarray(w[0].transpose(2, 1, 0))
        return np.ascontiguousarray(w.transpose(3, 2, 0, 1))

    def from_torch(self, value: np.ndarray) -> np.ndarray:
        """to_torch's inverse: PyTorch's tensor as this one's stored values, flat."""
        if self.kind == "embedding" or len(self.shape) == 1:
            return value.reshape(-1)
        if self.kind in ("dense", "recurrent"):
            return (value[:, self.order] if self.order is not None else value).T.reshape(-1)
        if len(self.torch_shape) == 3:
            return value.transpose(2, 1, 0).reshape(-1)
        return value.transpose(2, 3, 1, 0).reshape(-1)


@dataclass
class Network:
    """A layer list planned for one input shape: the program and everything sized from it."""

    layers: tuple
    input_shape: tuple
    out_width: int
    prog: np.ndarray
    slopes: np.ndarray
    perms: np.ndarray
    dim: int  # every parameter, the frozen ones (the last dim - trainable of the vector) included
    tensors: tuple
    per_sample: int  # activation values per sample
    aux_per_sample: int
    cols: int  # scratch sizes, in values
    wt: int
    narrow: int  # the transposed gradient of narrow dense layers (gt)
    pads: int
    tr_per_sample: int
    fused_out: int  # the widest dense layer that steps its weights in its backward pass
    output_shapes: tuple = field(default_factory=tuple)  # each layer's output shape (PyTorch's)
    itemsize: int = 4  # of the model dtype
    trainable: int = 0  # the parameters that train: the vector's first

    @property
    def frozen(self) -> int:
        return self.dim - self.trainable

    @property
    def eval_chunk(self) -> int:
        """The samples evaluated at a time: EVAL_CHUNK, fewer where a sample's activations are large (a
        recurrent layer keeps every step's states), so that a chunk's stay within EVAL_BYTES."""
        return int(max(1, min(EVAL_CHUNK, EVAL_BYTES // (self.per_sample * self.itemsize))))

    def workspace_bytes(self, rows: int, per_sample: int | None = None) -> int:
        """What one model of this network holds (models.Sequential's buffers): the gradient, activations and
        their deltas for minibatches of `rows` samples (and evaluation chunks), the scratch, and the
        program's permutations. per_sample: the activations a sample of the program it runs keeps (fewer
        when a frozen prefix's outputs are the samples)."""
        item, per_sample = self.itemsize, self.per_sample if per_sample is None else per_sample
        acts = max(rows, self.eval_chunk + 1) * (per_sample * item + self.aux_per_sample * 4)
        deltas = rows * (per_sample + self.tr_per_sample) * item
        scratch = self.cols + self.wt + self.narrow + self.gblock + self.pads
        return self.dim * item + acts + deltas + scratch * item + 8 * self.perms.size

    @property
    def gblock(self) -> int:
        """Values of the gradient block a fused dense layer steps at a time (at least one row of its weights)."""
        return max(BLOCK_BYTES // self.itemsize, self.fused_out)

    def signature(self) -> str:
        """The layer list and input as one line: what a board profile's speed entry is keyed by."""
        parts = []
        for layer in self.layers:
            settings = ",".join(f"{k}={_text(v)}" for k, v in layer.items() if k != "type")
            parts.append(f"{layer['type']}({settings})" if settings else layer["type"])
        return "x".join(map(str, self.input_shape)) + ": " + " ".join(parts)


def _text(value) -> str:
    return "x".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


EVAL_CHUNK = 64  # the samples a model evaluates at a time (its activations hold one more row, of scratch)
EVAL_BYTES = 16 << 20  # ... at most, unless one sample's activations are more


class _Walk:
    """The state of one walk over a layer list: the current tensor and the program so far."""

    def __init__(self, input_shape: tuple, itemsize: int, memory=None):
        self.shape, self.order, self.itemsize = input_shape, None, itemsize
        self.memory = memory  # (bytes, what sets them) or None
        self.where, self.fix = "config: model.layers", ""  # the layer being planned, and how to make it smaller
        self.region = 0  # where the current tensor starts in a sample's activations
        self.next_region = 0
        self.ops, self.slopes, self.perms = [], [], []
        self.n_perm = 0
        self.dim = 0
        self.aux = 0
        self.tensors = []
        self.cols = self.wt = self.narrow = self.pads = self.tr = self.fused_out = 0
        self.trainable = True  # the layer being planned trains
        self.maps = False  # the current tensor is a convolution's or pooling's map, (C, H, W) or (C, L)
        self.sequence = False  # ... a sequence (L, F) an embedding or a recurrent layer made
        self.before = None  # (its name, its settings) of the layer planned last, for a message's fix
        self.op(ops.INPUT, int(np.prod(input_shape)))  # the samples gathered into the first activations

    def check_memory(self, out_size: int = 0) -> None:
        """Refuse the layer being planned when what the model holds so far, at the least (its parameters and
        their gradient, one sample's activations, the scratch, and the layout of a new output of out_size
        values), exceeds the memory: before anything of that size is allocated, the planning included."""
        if self.memory is None:
            return
        values = 2 * self.dim + self.next_region + out_size + self.aux + self.cols + self.pads + self.wt
        need = values * self.itemsize + 8 * (self.n_perm + out_size)
        if need > self.memory[0]:
            raise ResourceError(
                f"{self.where} makes the model need at least {size_text(need)} of memory ({self.dim:,} parameters, "
                f"{self.next_region + out_size:,} values per sample), more than {self.memory[1]}, "
                f"{size_text(self.memory[0])}; {self.fix}")

    def op(self, kind: int, out_size: int, **fields) -> np.ndarray:
        self.check_memory(out_size)
        row = np.zeros(ops.WIDTH, np.int64)
        row[ops.F_TYPE] = kind
        row[ops.F_IN], row[ops.F_NIN] = self.region, int(np.prod(self.shape))
        row[ops.F_OUT], row[ops.F_NOUT] = self.next_region, out_size
        for name, value in fields.items():
            row[getattr(ops, "F_" + name)] = value
        self.ops.append(row)
        self.slopes.append(0.0)
        self.region = self.next_region
        self.next_region += out_size
        return row

    def params(self, row, layer: int, tensors) -> None:
        row[ops.F_PARAM] = self.dim
        row[ops.F_FROZEN] = int(not self.trainable)
        for name, shape, torch_shape, fans, kind, order, *hidden in tensors:
            self.tensors.append(Tensor(layer, name, self.dim, shape, torch_shape, fans, kind, order, *hidden))
            self.dim += int(np.prod(shape))
        row[ops.F_NPARAM] = self.dim - row[ops.F_PARAM]
        self.check_memory()

    def permute(self, order_out: np.ndarray | None) -> None:
        """A permutation op from the current internal order to order_out (same values, same shape)."""
        n = int(np.prod(self.shape))
        inverse = np.arange(n) if self.order is None else np.argsort(self.order)
        index = inverse if order_out is None else inverse[order_out]
        if np.array_equal(index, np.arange(n)):
            self.order = order_out
            return
        if len(self.ops) == 1 and self.region == 0:  # still the input: gather it in that order instead
            self._input_order(order_out)
            return
        self.op(ops.PERMUTE, n, PERM=self.n_perm)
        self.perms.append(index.astype(np.int64))
        self.n_perm += n
        self.order = order_out

    def _input_order(self, order_out) -> None:
        row = self.ops[0]
        row[ops.F_MODE] = 0 if order_out is None else 1
        row[ops.F_PERM] = self.n_perm
        if order_out is not None:
            self.perms.append(order_out.astype(np.int64))
            self.n_perm += order_out.size
        self.order = order_out

    def channels_last(self) -> None:
        self.permute(channels_last(self.shape))


def _spatial(walk, dims: int, where: str) -> tuple:
    """(C, H, W) of a spatial layer's input (H = 1 for a 1-D map)."""
    shape = walk.shape
    want = "(C, H, W)" if dims == 2 else "(C, L)"
    _not_a_sequence(walk, where, want)
    walk.maps = True
    if len(shape) != dims + 1:
        raise ConfigError(f"{where} takes {want} maps, got {_show(shape)}; "
                          + ("add a reshape before it" if len(shape) == 1 else "check the layer types"))
    return (shape[0], 1, shape[1]) if dims == 1 else shape


def _not_a_sequence(walk, where: str, takes: str) -> None:
    if walk.sequence:
        raise ConfigError(f"{where} takes {takes} maps, but its input {_show(walk.shape)} is a sequence (steps, "
                          "features) from an embedding or recurrent layer; follow it with a recurrent layer, or "
                          "with flatten and a dense layer")


def _show(shape: tuple) -> str:
    return str(tuple(shape))


def _pads(padding, k: int, s: int, where: str) -> tuple[int, int]:
    if padding == "same":
        if s != 1:
            raise ConfigError(f'{where}: padding = "same" needs stride = 1 (as in PyTorch); '
                              "give the padding as an integer")
        return (k - 1) // 2, k - 1 - (k - 1) // 2  # PyTorch's: the odd one out at the end
    p = 0 if padding == "valid" else padding
    return p, p


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


# ------------------------------------------------------------------------------------ each type's plan
# plan(walk, layer, index, where): the operation a layer adds to the walk's program (if any), its output
# shape and layout, its parameters and the workspaces it needs; errors name the layer (where) and the fix.

def _plan_flatten(walk, layer, i, where):
    walk.shape = (int(np.prod(walk.shape)),)  # no operation: the values stay where they are (order kept)
    walk.maps = walk.sequence = False


def _plan_reshape(walk, layer, i, where):
    target = list(layer["shape"])
    n = int(np.prod(walk.shape))
    if -1 in target:
        known = int(np.prod([t for t in target if t != -1]))
        if n % known:
            raise ConfigError(f"{where}: shape = {list(layer['shape'])} does not divide the {n} values of its input "
                              f"{_show(walk.shape)}")
        target[target.index(-1)] = n // known
    if int(np.prod(target)) != n:
        raise ConfigError(f"{where}: shape = {list(layer['shape'])} holds {int(np.prod(target))} values but its "
                          f"input {_show(walk.shape)} has {n}")
    walk.permute(channels_last(tuple(target)))  # the same values in PyTorch's order, read as the new shape
    walk.shape = tuple(target)
    walk.maps = walk.sequence = False


def _plan_dense(walk, layer, i, where):
    if len(walk.shape) != 1:
        raise ConfigError(f'{where} takes a flat input, got {_show(walk.shape)}; put {{type = "flatten"}} before it')
    din, dout = walk.shape[0], layer["out"]
    stepped = din * dout >= FUSED_WEIGHTS and walk.trainable  # (a frozen layer takes no step)
    row = walk.op(ops.DENSE_STEPPED if stepped else ops.DENSE, dout, C=din, CO=dout)
    walk.params(row, i, [("weight", (din, dout), (dout, din), (din, dout), "dense", walk.order),
                         ("bias", (dout,), (dout,), (din, dout), "dense", None)])
    walk.shape, walk.order = (dout,), None
    if dout * walk.itemsize < TILE_BYTES:
        walk.narrow = max(walk.narrow, din * dout)
    if stepped:
        walk.tr = max(walk.tr, din + dout)
        walk.fused_out = max(walk.fused_out, dout)


def _plan_conv(walk, layer, i, where):
    kind = layer["type"]
    dims = TYPES[kind].spatial
    C, H, W = _spatial(walk, dims, where)
    walk.channels_last()
    k, s, co = layer["kernel"], layer["stride"], layer["out"]
    kh = k if dims == 2 else 1
    pt, pb = _pads(layer["padding"], k, s, where) if dims == 2 else (0, 0)
    pl, pr = _pads(layer["padding"], k, s, where)
    HP, WP = H + pt + pb, W + pl + pr
    if HP < kh or WP < k:
        raise ConfigError(f"{where}: kernel = {k} is larger than its (padded) input {_show(walk.shape)}; use a "
                          "smaller kernel or padding")
    HO, WO = (HP - kh) // (s if dims == 2 else 1) + 1, (WP - k) // s + 1
    row = walk.op(ops.CONV, HO * WO * co, C=C, H=H, W=W, CO=co, HO=HO, WO=WO, KH=kh, KW=k, SH=s if dims == 2 else 1,
                  SW=s, PT=pt, PL=pl, HP=HP, WP=WP, PAD=walk.pads)
    if HP != H or WP != W:
        walk.pads += HP * WP * C
    torch_shape = (co, C, k, k) if dims == 2 else (co, C, k)
    fans = (kh * k * C, kh * k * co)
    walk.params(row, i, [("weight", (kh, k, C, co), torch_shape, fans, "conv", None),
                         ("bias", (co,), (co,), fans, "conv", None)])
    walk.cols = max(walk.cols, HO * WO * kh * k * C)
    walk.shape = (co, HO, WO) if dims == 2 else (co, WO)
    walk.order = channels_last(walk.shape)


def _plan_pool(walk, layer, i, where):
    kind = layer["type"]
    dims = TYPES[kind].spatial
    C, H, W = _spatial(walk, dims, where)
    walk.channels_last()
    size = layer["size"]
    stride = layer.get("stride", size)
    kh, sh = (size, stride) if dims == 2 else (1, 1)
    if H < kh or W < size:
        raise ConfigError(f"{where}: size = {size} is larger than its input {_show(walk.shape)}; use a smaller size "
                          "or fewer pooling layers")
    HO, WO = (H - kh) // sh + 1, (W - size) // stride + 1
    pool = AVG if kind.startswith("avg") else MAX
    if pool == MAX and _fused_relu(walk):  # ReLU then max pooling: max, then ReLU on a quarter of the values
        walk.ops[-1][ops.F_MODE] = 0
        pool = MAX_RELU
    walk.op(ops.POOL, HO * WO * C, C=C, H=H, W=W, CO=C, HO=HO, WO=WO, KH=kh, KW=size, SH=sh, SW=stride, MODE=pool,
            AUX=walk.aux)
    walk.aux += HO * WO * C  # a max's winners (a mean's room unused: every view must fit)
    walk.shape = (C, HO, WO) if dims == 2 else (C, WO)
    walk.order = channels_last(walk.shape)


def _plan_global_pool(walk, layer, i, where):
    _not_a_sequence(walk, where, "(C, H, W) or (C, L)")
    if len(walk.shape) not in (2, 3):
        raise ConfigError(f"{where} takes (C, H, W) or (C, L) maps, got {_show(walk.shape)}")
    walk.channels_last()
    C, P = walk.shape[0], int(np.prod(walk.shape[1:]))
    walk.op(ops.GLOBAL_POOL, C, C=C, H=1, W=P, CO=C)
    walk.shape, walk.order = (C,), None


def _plan_activation(walk, layer, i, where):
    if layer["type"] == "relu" and _fusable(walk):
        walk.ops[-1][ops.F_MODE] = 1  # the dense layer or convolution applies it (and its derivative)
        return
    walk.op(ops.ACTIVATION, int(np.prod(walk.shape)), MODE=ACTIVATIONS[layer["type"]])
    walk.slopes[-1] = layer.get("slope", 0.0)


def _plan_dropout(walk, layer, i, where):
    n = int(np.prod(walk.shape))
    walk.op(ops.DROPOUT, n, AUX=walk.aux)
    walk.slopes[-1] = layer["rate"]
    walk.aux += n


def _plan_groupnorm(walk, layer, i, where):
    _not_a_sequence(walk, where, "(C, H, W) or (C, L)")
    C = walk.shape[0]
    if C % layer["groups"]:
        raise ConfigError(f"{where}: groups = {layer['groups']} does not divide its {C} channels")
    if len(walk.shape) == 1:
        walk.permute(None)
    else:
        walk.channels_last()
    P = int(np.prod(walk.shape[1:]))
    row = walk.op(ops.GROUPNORM, int(np.prod(walk.shape)), C=C, H=1, W=P, CO=C, MODE=layer["groups"])
    walk.params(row, i, [("weight", (C,), (C,), (C, C), "norm", None), ("bias", (C,), (C,), (C, C), "norm", None)])


def _plan_embedding(walk, layer, i, where):
    if len(walk.ops) != 1 or len(walk.shape) != 1:
        raise ConfigError(f"{where} takes token ids, a sample of shape (L,), so it must be the first layer; got "
                          f"{_show(walk.shape)}" + ("" if len(walk.ops) == 1 else " from the layers before it"))
    V, D, L = layer["num"], layer["dim"], walk.shape[0]
    pad = layer.get("padding_idx")
    if pad is not None and pad >= V:
        raise ConfigError(f"{where}: padding_idx = {pad} must be below num = {V}")
    if walk.itemsize == 4 and V > 1 << 24:
        raise ConfigError(f"{where}: num = {V} is more ids than float32 holds exactly (2**24); use model.dtype = "
                          '"float64" or a smaller vocabulary')
    row = walk.op(ops.EMBEDDING, L * D, C=V, CO=D, W=L, MODE=0 if pad is None else pad + 1)
    walk.params(row, i, [("weight", (V, D), (V, D), (V, D), "embedding", None)])
    walk.shape, walk.order, walk.sequence = (L, D), None, True


def _plan_recurrent(walk, layer, i, where):
    kind = layer["type"]
    if walk.maps or len(walk.shape) != 2:
        got = "maps" if walk.maps or len(walk.shape) > 2 else "a flat input"
        name, before = walk.before or (None, {})
        if before.get("type") in ("lstm", "gru"):  # its output = "last" gave one vector, not the sequence
            fix = f'set output = "all" on {name} ({before["type"]}), so that it hands this layer its whole sequence'
        elif len(walk.shape) == 1:
            fix = "put an embedding before it (token ids), or give samples of shape (N, L, F)"
        else:
            fix = ("a recurrent layer takes a sequence: an embedding's, another recurrent layer's with output = "
                   '"all", or samples of shape (N, L, F)')
        raise ConfigError(f"{where} takes (L, F) sequences, got {got} {_show(walk.shape)}; {fix}")
    walk.permute(None)
    (L, F0), H, K = walk.shape, layer["hidden"], layer["layers"]
    gates = 4 if kind == "lstm" else 3
    every = layer["output"] == "all"
    row = walk.op(ops.LSTM if kind == "lstm" else ops.GRU, L * H if every else H, C=F0, CO=H, W=L, H=K,
                  MODE=int(every))
    tensors = []
    for k in range(K):
        F = F0 if k == 0 else H
        tensors += [(f"weight_ih_l{k}", (F, gates * H), (gates * H, F), (F, gates * H), "recurrent", None, H),
                    (f"weight_hh_l{k}", (H, gates * H), (gates * H, H), (H, gates * H), "recurrent", None, H),
                    (f"bias_ih_l{k}", (gates * H,), (gates * H,), (H, gates * H), "recurrent", None, H),
                    (f"bias_hh_l{k}", (gates * H,), (gates * H,), (H, gates * H), "recurrent", None, H)]
    walk.params(row, i, tensors)
    work = work_values(kind == "lstm", L, F0, H, K, walk.itemsize)
    walk.check_memory(work)
    row[ops.F_WORK] = walk.next_region  # after its output: the states, cells and gates its backward pass reads
    walk.next_region += work
    walk.wt = max(walk.wt, gates * H * max(F0, H))
    walk.cols = max(walk.cols, pack_values(kind == "lstm", F0, H, walk.itemsize))
    walk.shape, walk.order, walk.maps, walk.sequence = ((L, H) if every else (H,)), None, False, every


def _torch_recurrent(layer, shape, out):
    cls = "LSTM" if layer["type"] == "lstm" else "GRU"
    return f"{cls}({shape[1]}, {layer['hidden']}, num_layers={layer['layers']}, last={layer['output'] == 'last'})"


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


# each type's PyTorch module, as Python text: torch(layer, input shape, output shape)
def _torch_conv(layer, shape, out):
    pad = layer["padding"]
    pad = f"'{pad}'" if isinstance(pad, str) else pad
    return (f"nn.Conv{layer['type'][-2:]}({shape[0]}, {layer['out']}, {layer['kernel']}, stride={layer['stride']}, "
            f"padding={pad})")


def _torch_pool(layer, shape, out):
    kind = layer["type"]
    return f"nn.{kind[:3].capitalize()}Pool{kind[-2:]}({layer['size']}, stride={layer.get('stride', layer['size'])})"


def _torch_reshape(layer, shape, out):
    inner = f"nn.Unflatten(1, {tuple(out)})"
    return inner if len(shape) == 1 else f"nn.Sequential(nn.Flatten(), {inner})"


def _fixed(text):
    return lambda layer, shape, out: text


_CONV = {"out": (REQUIRED, _int(1)), "kernel": (REQUIRED, _int(1)), "stride": (1, _int(1)), "padding": ("same", _padding)}
_POOL = {"size": (REQUIRED, _int(1)), "stride": (None, _int(1))}
_RECURRENT = {"hidden": (REQUIRED, _int(1)), "layers": (1, _int(1)), "output": ("last", _one_of("last", "all"))}
TYPES = {
    "dense": LayerType({"out": (REQUIRED, _int(1))}, lambda l, i, o: f"nn.Linear({i[0]}, {l['out']})", _plan_dense,
                       parametric=True),
    "conv2d": LayerType(_CONV, _torch_conv, _plan_conv, 2, True),
    "conv1d": LayerType(_CONV, _torch_conv, _plan_conv, 1, True),
    "maxpool2d": LayerType(_POOL, _torch_pool, _plan_pool, 2),
    "avgpool2d": LayerType(_POOL, _torch_pool, _plan_pool, 2),
    "maxpool1d": LayerType(_POOL, _torch_pool, _plan_pool, 1),
    "avgpool1d": LayerType(_POOL, _torch_pool, _plan_pool, 1),
    "global_avgpool": LayerType({}, lambda l, i, o: f"nn.Sequential(nn.AdaptiveAvgPool{len(i) - 1}d(1), nn.Flatten())",
                                _plan_global_pool),
    "flatten": LayerType({}, _fixed("nn.Flatten()"), _plan_flatten),
    "reshape": LayerType({"shape": (REQUIRED, _shape)}, _torch_reshape, _plan_reshape),
    "relu": LayerType({}, _fixed("nn.ReLU()"), _plan_activation),
    "leaky_relu": LayerType({"slope": (0.01, _number)}, lambda l, i, o: f"nn.LeakyReLU({l['slope']})", _plan_activation),
    "tanh": LayerType({}, _fixed("nn.Tanh()"), _plan_activation),
    "sigmoid": LayerType({}, _fixed("nn.Sigmoid()"), _plan_activation),
    "dropout": LayerType({"rate": (0.5, _rate)}, lambda l, i, o: f"nn.Dropout({l['rate']})", _plan_dropout),
    "groupnorm": LayerType({"groups": (REQUIRED, _int(1))}, lambda l, i, o: f"nn.GroupNorm({l['groups']}, {i[0]})",
                           _plan_groupnorm, parametric=True),
    "embedding": LayerType({"num": (REQUIRED, _int(1)), "dim": (REQUIRED, _int(1)), "padding_idx": (None, _int(0))},
                           lambda l, i, o: f"nn.Embedding({l['num']}, {l['dim']}"
                                           + (f", padding_idx={l['padding_idx']})" if "padding_idx" in l else ")"),
                           _plan_embedding, parametric=True),
    "lstm": LayerType(_RECURRENT, _torch_recurrent, _plan_recurrent, parametric=True),
    "gru": LayerType(_RECURRENT, _torch_recurrent, _plan_recurrent, parametric=True),
}
def build(layers, sample_shape: tuple, out_width: int, dtype, outputs_what: str = "classes",
          name: str = "model.layers", memory: tuple[int, str] | None = None, rows: int = 1) -> Network:
    """Plan a checked layer list (check_layers) for samples of sample_shape; the last width must be out_width
    (the classes, or the targets' width). Errors name the layer (name[index]) and the fix. memory: (bytes,
    what sets them) a model of it may take, for minibatches of `rows` samples: a list that needs more is
    refused (ResourceError) at the layer that makes it, before anything of its size is allocated."""
    itemsize = np.dtype(dtype).itemsize
    shape = input_shape_for(tuple(int(s) for s in sample_shape), layers)
    walk = _Walk(shape, itemsize, memory)
    shapes = []
    for i, layer in enumerate(layers):
        kind = layer["type"]
        walk.where = f"config: {name}[{i}] ({kind})"
        sizes = [k for k in ("out", "kernel", "padding", "size") if k in TYPES[kind].settings]
        walk.fix = f"make the layer smaller ({', '.join(sizes)})" if sizes else "make the layers before it smaller"
        walk.trainable = layer.get("trainable", True)
        TYPES[kind].plan(walk, layer, i, walk.where)
        walk.check_memory()
        walk.before = (f"{name}[{i}]", layer)
        shapes.append(walk.shape)
    if len(walk.shape) != 1:
        raise ConfigError(f"config: {name} ends with {_show(walk.shape)} maps; end with "
                          f'{{type = "flatten"}} and a dense layer of {out_width} outputs')
    walk.permute(None)
    if walk.shape[0] != out_width:
        raise ConfigError(f"config: {name} ends with {walk.shape[0]} outputs but the data has {out_width} "
                          f"{outputs_what}; give the last layer out = {out_width}")
    if walk.dim == 0:
        raise ConfigError(f"config: {name} has no layer with parameters; add a dense or conv layer")
    prog = np.stack(walk.ops)
    tensors, trainable = _trainable_first(prog, walk.tensors)
    _mark_input_gradients(prog)
    conv_wt = 0  # each convolution packs its W^T once per step and keeps it through its samples: its own room
    for row in prog:  # (a view of it is made even where unused); a dense layer's, packed and used at once, shares it
        if row[ops.F_GRAD_IN] and row[ops.F_TYPE] in (ops.DENSE, ops.DENSE_STEPPED):
            walk.wt = max(walk.wt, row[ops.F_NIN] * row[ops.F_NOUT])
        elif row[ops.F_TYPE] == ops.CONV:
            row[ops.F_WT] = conv_wt
            conv_wt += row[ops.F_KH] * row[ops.F_KW] * row[ops.F_C] * row[ops.F_CO]
    walk.wt = max(walk.wt, conv_wt)
    network = Network(tuple(layers), shape, out_width, prog, np.asarray(walk.slopes, np.float64),
                      np.concatenate(walk.perms) if walk.perms else np.zeros(0, np.int64), walk.dim,
                      tensors, walk.next_region, walk.aux, walk.cols, walk.wt, walk.narrow, walk.pads,
                      walk.tr, walk.fused_out, tuple(shapes), itemsize, trainable)
    need = network.workspace_bytes(rows) + network.dim * (8 + itemsize)  # and x_0, drawn in float64
    if memory is not None and need > memory[0]:
        raise ResourceError(f"config: {name}: a model of these layers needs about {size_text(need)} of memory "
                            f"({network.dim:,} parameters, {network.per_sample:,} values per sample, minibatches of "
                            f"{rows}), more than {memory[1]}, {size_text(memory[0])}; make the layers smaller, or "
                            "the minibatches (train.batch_size)")
    return network


def _fusable(walk: _Walk) -> bool:
    """A ReLU right after a dense layer or convolution (whose output is the current tensor) fuses into it."""
    last = walk.ops[-1]
    return (last[ops.F_TYPE] in (ops.DENSE, ops.DENSE_STEPPED, ops.CONV) and last[ops.F_MODE] == 0
            and last[ops.F_OUT] == walk.region)


def _fused_relu(walk: _Walk) -> bool:
    """The current tensor is a convolution's output with its ReLU fused in (and read by nothing else)."""
    last = walk.ops[-1]
    return last[ops.F_TYPE] == ops.CONV and last[ops.F_MODE] == 1 and last[ops.F_OUT] == walk.region


def _trainable_first(prog: np.ndarray, tensors) -> tuple[tuple, int]:
    """Move the frozen layers' parameters after every trainable one (each group in layer order), so that the
    trainable ones are the vector's first: x, what travels. Without frozen layers nothing moves. Returns the
    tensors at their new offsets and how many parameters train."""
    moved, at, trainable = {}, 0, 0
    for frozen in (0, 1):
        if frozen:
            trainable = at
        for row in prog[1:]:
            if row[ops.F_NPARAM] > 0 and row[ops.F_FROZEN] == frozen:
                moved[int(row[ops.F_PARAM])] = at
                row[ops.F_PARAM] = at
                at += int(row[ops.F_NPARAM])
    out, start = [], None
    for t in tensors:  # a layer's tensors are consecutive, from its row's old F_PARAM
        if t.offset in moved:
            start, base = t.offset, moved[t.offset]
        out.append(replace(t, offset=base + t.offset - start))
    return tuple(out), trainable


def _mark_input_gradients(prog: np.ndarray) -> None:
    """An operation needs its input's gradient only when some operation before it has parameters that train."""
    seen = False
    for row in prog[1:]:
        row[ops.F_GRAD_IN] = int(seen)
        seen = seen or (row[ops.F_NPARAM] > 0 and not row[ops.F_FROZEN])


# ---------------------------------------------------------------------------------------- initialisation
def initial_params(network: Network, init: str, g: np.random.Generator, dtype) -> np.ndarray:
    """The parameters drawn from g (the run's (seed, INIT) stream) tensor by tensor, in float64, then cast:
    "pytorch": PyTorch's defaults for the same layers (weights and biases U(+-1/sqrt(fan_in)), GroupNorm 1
    and 0); "glorot": Glorot-uniform weights U(+-sqrt(6 / (fan_in + fan_out))) and zero biases (the
    TensorFlow default McMahan et al.'s models used); "zeros": everything zero (logistic regression)."""
    params = np.zeros(network.dim)
    for t in network.tensors:
        part = params[t.offset:t.offset + t.size]
        if t.kind == "norm":
            part[:] = 1.0 if t.name == "weight" else 0.0
        elif t.kind == "embedding" and init == "pytorch":
            part[:] = g.standard_normal(t.size)
        elif init == "pytorch":
            bound = 1.0 / math.sqrt(t.hidden or t.fans[0])
            part[:] = g.uniform(-bound, bound, t.size)
        elif init == "glorot" and t.name.startswith("weight"):
            limit = math.sqrt(6.0 / (t.fans[0] + t.fans[1]))
            part[:] = g.uniform(-limit, limit, t.size)
        pad = network.layers[t.layer].get("padding_idx") if t.kind == "embedding" else None
        if pad is not None:  # an embedding's padding_idx row starts at zero, as nn.Embedding's
            part.reshape(t.shape)[pad] = 0
    return params.astype(dtype)


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
    whole = np.zeros(network.dim, dtype)
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


# ------------------------------------------------------------------------------------- the built-in models
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

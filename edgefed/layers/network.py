"""A layer list walked once into a program (`build`): the walk's state, the planned `Network` (its program,
tensors, workspaces), the parameters' initial values, and the program's frozen prefix and the rest after it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from edgefed.errors import ConfigError, ResourceError
from edgefed.kernels import program as ops
from edgefed.kernels.dense import BLOCK_BYTES
from edgefed.kernels.program import DROPOUT, F_FROZEN, F_IN, F_MODE, F_NIN, F_NOUT, F_NPARAM, F_OUT, F_TYPE, F_WORK
from edgefed.layers.lists import input_shape_for
from edgefed.layers.types import TYPES, _show, channels_last
from edgefed.memory import size_text

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


@dataclass(frozen=True)
class Workspace:
    """The sizes, in values of the model dtype, of the scratch the network kernel takes beside the parameters,
    activations and deltas (kernels/network.py's tr, cols, wt, gt, gblock and pads)."""

    transposed_per_sample: int  # tr: a stepped dense layer's input and deltas, transposed, per sample
    columns: int  # cols: a convolution's unfolded input (im2col), or a recurrent layer's packed weights
    weights_t: int  # wt: transposed weights (a dense layer's, each convolution's, a recurrent layer's gates)
    narrow_grad: int  # gt: the transposed gradient of narrow dense layers
    grad_block: int  # gblock: the gradient block a fused dense layer steps at a time (at least one row)
    padded: int  # pads: the zero-padded inputs of the padded convolutions

    @property
    def scratch(self) -> tuple[int, int, int, int, int]:
        """cols, wt, gt, gblock, pads: the kernel's scratch vectors, in its arguments' order."""
        return self.columns, self.weights_t, self.narrow_grad, self.grad_block, self.padded


@dataclass
class Network:
    """A layer list planned for one input shape: the program and everything sized from it."""

    layers: tuple
    input_shape: tuple
    out_width: int
    prog: np.ndarray
    slopes: np.ndarray
    perms: np.ndarray
    n_params: int  # every parameter, the frozen ones (the last n_params - trainable of the vector) included
    tensors: tuple
    per_sample: int  # activation values per sample
    aux_per_sample: int
    workspace: Workspace
    output_shapes: tuple = field(default_factory=tuple)  # each layer's output shape (PyTorch's)
    itemsize: int = 4  # of the model dtype
    trainable: int = 0  # the parameters that train: the vector's first

    @property
    def frozen(self) -> int:
        return self.n_params - self.trainable

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
        deltas = rows * (per_sample + self.workspace.transposed_per_sample) * item
        return self.n_params * item + acts + deltas + sum(self.workspace.scratch) * item + 8 * self.perms.size

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
        self.n_params = 0
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
        values = 2 * self.n_params + self.next_region + out_size + self.aux + self.cols + self.pads + self.wt
        need = values * self.itemsize + 8 * (self.n_perm + out_size)
        if need > self.memory[0]:
            raise ResourceError(
                f"{self.where} makes the model need at least {size_text(need)} of memory ({self.n_params:,} parameters, "
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
        row[ops.F_PARAM] = self.n_params
        row[ops.F_FROZEN] = int(not self.trainable)
        for name, shape, torch_shape, fans, kind, order, *hidden in tensors:
            self.tensors.append(Tensor(layer, name, self.n_params, shape, torch_shape, fans, kind, order, *hidden))
            self.n_params += int(np.prod(shape))
        row[ops.F_NPARAM] = self.n_params - row[ops.F_PARAM]
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
    if walk.n_params == 0:
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
                      np.concatenate(walk.perms) if walk.perms else np.zeros(0, np.int64), walk.n_params,
                      tensors, walk.next_region, walk.aux,
                      Workspace(walk.tr, walk.cols, walk.wt, walk.narrow, max(BLOCK_BYTES // itemsize, walk.fused_out),
                                walk.pads),
                      tuple(shapes), itemsize, trainable)
    need = network.workspace_bytes(rows) + network.n_params * (8 + itemsize)  # and x_0, drawn in float64
    if memory is not None and need > memory[0]:
        raise ResourceError(f"config: {name}: a model of these layers needs about {size_text(need)} of memory "
                            f"({network.n_params:,} parameters, {network.per_sample:,} values per sample, minibatches of "
                            f"{rows}), more than {memory[1]}, {size_text(memory[0])}; make the layers smaller, or "
                            "the minibatches (train.batch_size)")
    return network


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


def initial_params(network: Network, init: str, g: np.random.Generator, dtype) -> np.ndarray:
    """The parameters drawn from g (the run's (seed, INIT) stream) tensor by tensor, in float64, then cast:
    "pytorch": PyTorch's defaults for the same layers (weights and biases U(+-1/sqrt(fan_in)), GroupNorm 1
    and 0); "glorot": Glorot-uniform weights U(+-sqrt(6 / (fan_in + fan_out))) and zero biases (the
    TensorFlow default McMahan et al.'s models used); "zeros": everything zero (logistic regression)."""
    params = np.zeros(network.n_params)
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


def feature_prefix(prog: np.ndarray) -> int:
    """The last operation of the frozen, deterministic prefix whose outputs can stand for the samples: the
    operations before the first trainable one or the first dropout (whose draws change every step), when one
    of them has (frozen) parameters; 0 when there is none."""
    last, frozen = 0, False
    for i in range(1, prog.shape[0]):
        row = prog[i]
        if (row[F_NPARAM] > 0 and not row[F_FROZEN]) or row[F_TYPE] == DROPOUT:
            break
        frozen = frozen or row[F_NPARAM] > 0
        last = i
    return last if frozen and last < prog.shape[0] - 1 else 0


def rest_program(prog: np.ndarray, slopes: np.ndarray, prefix: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The program after a prefix, and where its activations start in the whole program's: its input row
    gathers the prefix's outputs (features, in the activations' own layout), and the operations after it run
    as in the whole program, their regions moved down by that start (the prefix's regions are not kept)."""
    base = int(prog[prefix, F_OUT])
    rest = prog[prefix + 1:].copy()
    rest[:, F_IN] -= base
    rest[:, F_OUT] -= base
    rest[:, F_WORK] = np.where(rest[:, F_WORK] > 0, rest[:, F_WORK] - base, 0)  # (a recurrent layer's)
    head = prog[:1].copy()
    head[0, F_OUT], head[0, F_NOUT], head[0, F_NIN] = 0, prog[prefix, F_NOUT], prog[prefix, F_NOUT]
    head[0, F_MODE] = 0  # (no permutation)
    return np.ascontiguousarray(np.vstack([head, rest])), np.concatenate([slopes[:1], slopes[prefix + 1:]]), base

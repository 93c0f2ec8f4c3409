"""The layer types: each type's settings (with defaults and checks), its plan (the operation it adds to a
walk's program, its output shape and layout, its parameters and workspaces) and its PyTorch module as text,
side by side; `TYPES` is the registry every other part reads, `check_layers` a list's settings."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from edgefed.errors import ConfigError
from edgefed.kernels import program as ops
from edgefed.kernels.conv import AVG, MAX, MAX_RELU
from edgefed.kernels.dense import FUSED_WEIGHTS
from edgefed.kernels.fma import TILE_BYTES
from edgefed.kernels.pointwise import LEAKY_RELU, RELU, SIGMOID, TANH
from edgefed.kernels.sequence import pack_values, work_values

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


# ------------------------------------------------------------------ layouts, and what a plan reads of them
def channels_last(shape: tuple) -> np.ndarray | None:
    """Where each value of a (C, H, W) or (C, L) map stored channels-last sits in PyTorch's order (None: the
    same order, a vector or one channel)."""
    if len(shape) < 2 or shape[0] == 1:
        return None
    c, rest = shape[0], int(np.prod(shape[1:]))
    return (np.arange(c)[None, :] * rest + np.arange(rest)[:, None]).reshape(-1).astype(np.int64)


def _fusable(walk) -> bool:
    """A ReLU right after a dense layer or convolution (whose output is the current tensor) fuses into it."""
    last = walk.ops[-1]
    return (last[ops.F_TYPE] in (ops.DENSE, ops.DENSE_STEPPED, ops.CONV) and last[ops.F_MODE] == 0
            and last[ops.F_OUT] == walk.region)


def _fused_relu(walk) -> bool:
    """The current tensor is a convolution's output with its ReLU fused in (and read by nothing else)."""
    last = walk.ops[-1]
    return last[ops.F_TYPE] == ops.CONV and last[ops.F_MODE] == 1 and last[ops.F_OUT] == walk.region


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

"""The models of a run's submodel widths ([submodel], docs/design.md 2.23): the layer list each width trains, built
beside the whole model, where its parameters sit in the whole vector, and FjORD's ordered dropout over them.

A width's model is a model like any other (the same kernels, compiled once per operation, at the smaller
shapes' cost); a device of width w takes x's slice at `positions[w]`, trains it there and reports the change of
that slice alone.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from edgefed.errors import ConfigError
from edgefed.layers.submodels import narrowed, slice_positions
from edgefed.memory import memory_limit
from edgefed.models import build_model
from edgefed.rng import Purpose, generator

HETEROFL, FJORD = "heterofl", "fjord"


class WidthModels:
    """Each width's model and its positions in the whole vector (and, for FjORD, in every wider width's)."""

    def __init__(self, method: str, models: dict, positions: dict, inner: dict | None = None):
        """inner: where width u's parameters sit inside width w's vector (u <= w), FjORD's; None: found here."""
        self.method, self.models, self.positions = method, models, positions
        self.widths = tuple(sorted(models))
        if inner is None and method == FJORD:  # slices nest: u's positions in the whole vector are among w's
            inner = {(u, w): np.searchsorted(positions[w], positions[u]) for w in self.widths for u in self.widths
                     if u <= w}
            for (u, w), at in inner.items():
                assert (positions[w][at] == positions[u]).all(), "a narrower slice is not inside a wider one"
        self.inner = inner

    def clone(self) -> "WidthModels":
        """The same widths with workspaces of their own (a lane's)."""
        return WidthModels(self.method, {w: m.clone() for w, m in self.models.items()}, self.positions, self.inner)

    def n_params(self, width: float) -> int:
        return int(self.positions[width].size)

    def trainer(self, width: float, draws: np.ndarray | None = None):
        """What trains a device of this width: the width's model (HeteroFL), or ordered dropout up to it
        (FjORD: draws, each step's width as an index into `widths`)."""
        if self.method == HETEROFL:
            return self.models[width]
        return OrderedDropout(self, width, draws)

    def step_draws(self, width: float, rng: np.random.Generator, n_steps: int) -> np.ndarray | None:
        """FjORD: each of n_steps local steps' width, uniform over the widths up to the device's (indices into
        `widths`), from the device's own stream; None under HeteroFL."""
        if self.method != FJORD:
            return None
        return rng.integers(0, self.widths.index(width) + 1, size=max(int(n_steps), 0))


class OrderedDropout:
    """FjORD's local steps (Horvath et al. 2021): the device holds its widest slice, and each step trains the
    leading slice of the width drawn for it (the units past that width dropped), in place. A run of steps that
    drew one width is one call of that width's kernel."""

    def __init__(self, models: WidthModels, width: float, draws: np.ndarray):
        self.models, self.width, self.draws, self.done = models, width, draws, 0
        self.top = models.models[width]

    def local_steps(self, params, data, run, n_steps: int, batch_size, lr: float, terms: tuple | None = None) -> int:
        widths, taken, sliced = self.models.widths, 0, {}
        n_steps = min(int(n_steps), self.draws.size - self.done)
        while taken < n_steps:
            u = int(self.draws[self.done])
            same = 1
            while taken + same < n_steps and self.draws[self.done + same] == u:
                same += 1
            width = widths[u]
            if width == self.width:
                steps = self.top.local_steps(params, data, run, same, batch_size, lr, terms)
            else:
                at = self.models.inner[(width, self.width)]
                if width not in sliced:  # the terms' vectors (FedProx's anchor) cut to the width, once a call
                    sliced[width] = None if terms is None else tuple(
                        t[at] if t.shape[0] == params.shape[0] and i < 2 else t for i, t in enumerate(terms))
                part = params[at]
                steps = self.models.models[width].local_steps(part, data, run, same, batch_size, lr, sliced[width])
                params[at] = part
            taken += steps
            self.done += steps
            if steps < same:
                break
        return taken


def width_models(cfg, problem, whole) -> WidthModels | None:
    """The models of [submodel]'s widths for the run's model `whole` on its problem, sized like it for this
    process (None: [submodel] is not set); a layer list that cannot be narrowed is refused in one line."""
    s = cfg.submodel
    if not s.enabled:
        return None
    if not hasattr(whole, "network"):
        raise ConfigError(f"config: [submodel] slices a layer list; model.kind = {cfg.model.kind!r} has none")
    network = whole.network
    if network.frozen or whole.prefix_end:
        raise ConfigError("config: [submodel] narrows every hidden layer, but model.layers freezes some (frozen = "
                          "true); a submodel trains all it keeps: unfreeze them or remove [submodel]")
    layers = tuple(network.layers)
    models, positions = {}, {}
    for width in s.widths:
        table = dataclasses.replace(cfg.model, kind="sequential", layers=narrowed(layers, width))
        part = build_model(table, problem, generator(cfg.seed, Purpose.INIT), memory_limit(), cfg.train.batch_size)
        models[width], positions[width] = part, slice_positions(network, part.network)
    return WidthModels(s.method, models, positions)

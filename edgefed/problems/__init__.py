"""Federated problems: per-device data that is a pure function of (seed, device_id).

A problem knows every device's training-sample count n_k cheaply (the weights need them everywhere), but
builds a device's samples only when `device(k)` is called, so an MPI rank builds only its own devices.
"""

from __future__ import annotations

import numpy as np

from edgefed.errors import reading
from edgefed.problems.data import ClassificationData, QuadraticData

__all__ = ["ClassificationData", "QuadraticData", "build_problem"]


def build_problem(data, seed: int, dtype: str, loss: str = "cross_entropy", spatial: int = 0, tokens: int | None = None,
                  builtin: str | None = None, convert: bool = True, shard=None):
    """The problem a validated [data] table describes (a quadratic file, or a dataset file, is opened and
    checked here); loss: the model's, which says whether a file's y are labels or float targets; spatial: the
    dimensions of the model's first spatial layer (how a dataset file's 2-D samples are normalized); tokens:
    the vocabulary of the model's first layer when it is an embedding (the samples are token ids); builtin: the
    built-in model (charlstm) that embedding is part of, None for a layer list (what a message says to change);
    convert: whether a LEAF folder may be converted here (leaf.cached), not only read from its converted copy;
    shard: this device rank's shard of the data (shard.py), read instead of data.path."""
    with reading(str(shard) if shard is not None else data.path or f"[data] kind = {data.kind!r}"):
        return _built(data, seed, np.dtype(dtype), loss, spatial, (tokens, builtin), convert, shard)


def _built(data, seed: int, dtype, loss: str, spatial: int, tokens: tuple, convert: bool, shard):
    if data.kind == "arrays":
        from edgefed.problems.arrays import arrays_problem

        return arrays_problem(data, seed, dtype, loss, spatial, *tokens, shard=shard)
    if data.kind == "leaf":
        from edgefed.problems.leaf import leaf_problem

        return leaf_problem(data, seed, dtype, loss, spatial, *tokens, convert=convert, shard=shard)
    if data.kind in ("cifar10", "cifar100"):
        from edgefed.problems.cifar import cifar_problem

        return cifar_problem(data, seed, dtype, loss, spatial, *tokens)
    if data.kind == "synthetic":
        from edgefed.problems.synthetic import SyntheticProblem

        return SyntheticProblem(data, seed, dtype)
    if data.kind in ("mnist", "emnist"):
        from edgefed.problems.images import ImageProblem

        return ImageProblem(data, seed, dtype)
    from edgefed.problems.quadratic import QuadraticProblem

    return QuadraticProblem.from_config(data, seed, dtype)

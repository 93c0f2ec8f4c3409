"""Federated problems: per-device data that is a pure function of (seed, device_id).

A problem knows every device's training-sample count n_k cheaply (the weights need them everywhere), but
builds a device's samples only when `device(k)` is called, so an MPI rank builds only its own devices.
"""

from __future__ import annotations

import numpy as np

from edgefed.problems.data import ClassificationData, QuadraticData

__all__ = ["ClassificationData", "QuadraticData", "build_problem"]


def build_problem(data, seed: int, dtype: str):
    """The problem a validated [data] table describes (a quadratic file is opened and checked here)."""
    dtype = np.dtype(dtype)
    if data.kind == "synthetic":
        from edgefed.problems.synthetic import SyntheticProblem

        return SyntheticProblem(data, seed, dtype)
    if data.kind in ("mnist", "emnist"):
        from edgefed.problems.images import ImageProblem

        return ImageProblem(data, seed, dtype)
    from edgefed.problems.quadratic import QuadraticProblem

    return QuadraticProblem.from_config(data, seed, dtype)

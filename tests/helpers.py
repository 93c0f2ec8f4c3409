"""Helpers shared by the test modules."""

from fractions import Fraction

import numpy as np
import pytest

from edgefed.orchestration import run as runs
from edgefed.orchestration.resume import resolve_config
from edgefed.layers import first_spatial
from edgefed.problems import build_problem
from edgefed.runlog import measured, read_run


def fma_exact(a, b, c, dtype=None):
    """IEEE 754 fma elementwise, independently of any CPU: a * b + c in exact rational arithmetic, rounded
    once to the nearest value of dtype (ties to even). The reference for edgefed's kernels' fmas."""
    dtype = np.dtype(dtype or np.result_type(a, b, c))
    a, b, c = np.broadcast_arrays(*(np.asarray(v, dtype) for v in (a, b, c)))
    out = np.empty(a.shape, dtype)
    for i in np.ndindex(a.shape):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        near = dtype.type(float(exact))  # within one step of the answer (float() rounds to float64 first)
        steps = (near, np.nextafter(near, dtype.type(np.inf)), np.nextafter(near, dtype.type(-np.inf)))
        out[i] = min(steps, key=lambda v: (abs(Fraction(float(v)) - exact), int(v.view(f"u{dtype.itemsize}")) & 1))
    return out


def problem_of(cfg):
    """The problem a config describes, as every process builds it."""
    return build_problem(cfg.data, cfg.seed, cfg.model.dtype, cfg.model.loss, first_spatial(cfg.model))


def compared(log: dict) -> dict:
    """Every dataset two runs of one config must write byte for byte: all but the measured ones and the
    undo area (scratch space whose rows past its count hold whatever an earlier round left there)."""
    skip = measured(log["attrs"])
    return {k: v for k, v in log.items() if k != "attrs" and k not in skip and not k.startswith("state/undo/")}


def assert_same_logs(a: dict, b: dict) -> None:
    assert compared(a).keys() == compared(b).keys()
    for name, value in compared(a).items():
        assert value.tobytes() == b[name].tobytes(), name


def run_until(cfg, path, stop_round: int):
    """Run cfg into path, stopped by Ctrl-C after stop_round; returns the log's resume point."""

    def stop(summary):
        if summary.round_idx == stop_round:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runs.run(cfg, path, on_round=stop)
    _, point = resolve_config(None, [], str(path))
    assert point.rounds_done == stop_round
    return point


def interrupted_then_resumed(cfg, tmp_path, stop_round: int):
    """Run cfg whole, and again stopped by Ctrl-C after stop_round and resumed; returns both logs."""
    whole, part = tmp_path / "whole.h5", tmp_path / "part.h5"
    runs.run(cfg, whole)
    point = run_until(cfg, part, stop_round)
    runs.run(cfg, part, resume_point=point)
    return read_run(whole), read_run(part)


def logreg_model(features, classes, dtype):
    """The built-in logistic regression (a layer list) for vectors of `features` values."""
    from edgefed.models import Sequential

    return Sequential.builtin("logreg", (features,), classes, dtype)


def mlp_model(sizes, dtype, seed=0):
    """The built-in MLP of these layer widths (input, hidden..., classes)."""
    from edgefed.models import Sequential

    return Sequential.builtin("mlp", (sizes[0],), sizes[-1], dtype, seed, tuple(sizes[1:-1]))


def cnn_model(pixels, classes, dtype, seed=0):
    """McMahan et al.'s CNN for square one-channel images of `pixels` values."""
    from math import isqrt

    from edgefed.models import Sequential

    side = isqrt(pixels)
    return Sequential.builtin("cnn", (1, side, side), classes, dtype, seed)

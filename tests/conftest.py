import numpy as np
import pytest

from edgefed import config as config_mod
from edgefed.orchestration import run as runs
from edgefed.runlog import read_run


@pytest.fixture
def quad_file(tmp_path):
    """Write a quadratic problem file; returns its path."""

    def write(A, b, n=None, x0=None, name="quad.npz"):
        arrays = {"A": np.asarray(A), "b": np.asarray(b)}
        if n is not None:
            arrays["n"] = np.asarray(n)
        if x0 is not None:
            arrays["x0"] = np.asarray(x0)
        path = tmp_path / name
        np.savez(path, **arrays)
        return path

    return write


@pytest.fixture
def run_experiment(tmp_path):
    """Run a config (dict of overrides on the default) in-process; returns the run log as a dict."""
    counter = iter(range(10**6))

    def go(overrides: dict, name=None):
        cfg = config_with(overrides)
        path = tmp_path / (name or f"run{next(counter)}.h5")
        runs.run(cfg, path)
        return read_run(path)

    return go


def config_with(overrides: dict):
    """The default config with these `table.key: value` overrides (None: leave the default)."""
    raw = {}
    for key, value in overrides.items():
        if value is not None:
            config_mod.set_key(raw, key, value)
    return config_mod.config_from_dict(raw)

import numpy as np
import pytest

from edgefed import config as config_mod
from edgefed import experiment
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
        items = [f"{k}={_toml(v)}" for k, v in overrides.items() if v is not None]
        cfg = config_mod.load_config(None, items)
        path = tmp_path / (name or f"run{next(counter)}.h5")
        experiment.run(cfg, path)
        return read_run(path)

    return go


def _toml(v):
    if isinstance(v, list) and v and isinstance(v[0], dict):
        return "[" + ", ".join("{" + ", ".join(f"{k} = {_toml(x)}" for k, x in item.items()) + "}" for item in v) + "]"
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v)

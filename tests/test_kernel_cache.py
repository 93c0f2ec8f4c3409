"""What a cold start compiles: a model its own kernels only (its operations' forward and backward, the loss
and the step, through the network's table of addresses), an unknown operation never reaching the kernel, a
run saying so before it compiles, `edgefed warmup --config` leaving a run nothing to compile, and a warmed
checkout copied to another path (a board image) compiling nothing."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from edgefed import layers as layer_lib
from edgefed.kernels import ops
from edgefed.kernels.program import CONV, DENSE, DENSE_STEPPED, POOL

PACKAGE = Path(__file__).resolve().parents[1] / "edgefed"


def codes_of(layers, shape, classes=10):
    return set(layer_lib.build(layer_lib.check_layers(layers), shape, classes, np.float32).prog[1:, 0].tolist())


def test_a_program_names_exactly_its_operations_and_an_unknown_one_never_reaches_the_kernel():
    assert codes_of([{"type": "flatten"}, {"type": "dense", "out": 10}], (60,)) == {DENSE}
    cnn = layer_lib.builtin_layers("cnn", (1, 28, 28), 10)
    assert codes_of(cnn, (1, 28, 28)) == {CONV, POOL, DENSE, DENSE_STEPPED}  # fc1: 3136 x 512, stepped
    items = ops.kernels_of([DENSE])
    assert items == [(ops.FORWARD, DENSE), (ops.BACKWARD, DENSE), (ops.OBJECTIVE, ops.LOSS), (ops.OBJECTIVE, ops.STEP)]
    assert ops.kernel_names(items) == ["dense", "loss", "SGD step"]
    for bad in ([99], [DENSE, 42], []):
        with pytest.raises(ValueError, match="have no kernel"):
            ops.tables(bad, np.float32)


_LOADED = """
import json, sys
import numpy as np
from edgefed.kernels import ops, network
from edgefed.models import Sequential, warm_model
from edgefed.problems import ClassificationData
model = Sequential.builtin("logreg", (12,), 3, np.float32)
X = np.random.default_rng(0).random((30, 12), dtype=np.float32)
y = np.arange(30) % 3
warm_model(model, ClassificationData(X, y, X[:5], y[:5]), 10)
table = model._ops
print(json.dumps({"compiled": sorted(f"{r}:{s}" for r, s, _ in ops._addresses),
                  "table": [[int(r), int(s)] for r, s in zip(*np.nonzero(table))],
                  "loaded": sorted({f.py_func.__name__ for pair in ops.OPERATIONS.values() for f in pair
                                    if f.overloads})}))
"""


def test_a_logistic_regression_loads_its_own_kernels_and_no_convolution():
    done = subprocess.run([sys.executable, "-c", _LOADED], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    mine = {f"{r}:{s}" for r, s in ops.kernels_of([DENSE])}
    assert set(seen["compiled"]) == mine  # the dense forward and backward, the loss and the step: nothing else
    assert {f"{r}:{s}" for r, s in seen["table"]} == mine  # the table's other slots are empty, never called
    assert seen["loaded"] == ["dense_backward_op", "dense_forward_op"]


def _edgefed(root: Path, *args):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}  # the cache beside the sources
    return subprocess.run([sys.executable, "-m", "edgefed", *args], cwd=root, capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(root)}, timeout=600)


def test_warmup_of_a_config_leaves_nothing_to_compile_and_a_copied_checkout_keeps_its_cache(tmp_path):
    """A checkout whose package is copied, kernel cache (its __pycache__ folders) and all, to another path
    compiles nothing there: a board image carries its compiled kernels."""
    first = tmp_path / "a"
    shutil.copytree(PACKAGE, first / "edgefed", ignore=shutil.ignore_patterns("__pycache__"))  # an empty cache
    (first / "tiny.toml").write_text('rounds = 1\n[data]\nclients = 2\n[model]\nkind = "sequential"\nlayers = '
                                     '[{type = "flatten"}, {type = "dense", out = 10}]\n[train]\nclients_per_round = 2\n'
                                     'local_steps = 2\n')
    warm = _edgefed(first, "warmup", "--config", "tiny.toml")
    assert warm.returncode == 0, warm.stderr
    lines = warm.stdout.splitlines()
    assert lines[0] == ("compiling network, dense, loss, SGD step (float32) into this machine's kernel cache: only "
                        "this once, every later run loads them (`edgefed warmup` compiles them ahead)")
    assert lines[-1].startswith("warmup tiny.toml: compiled ")
    run = _edgefed(first, "run", "tiny.toml", "--out", "r.h5", "--quiet")
    assert run.returncode == 0 and "compil" not in run.stdout, run.stdout + run.stderr
    second = tmp_path / "b"
    shutil.copytree(first, second)
    again = _edgefed(second, "run", "tiny.toml", "--out", "r2.h5", "--quiet")
    assert again.returncode == 0 and "compil" not in again.stdout, again.stdout + again.stderr
    for log in (first / "r.h5", second / "r2.h5"):
        with h5py.File(log) as f:
            assert f.attrs["warmup_compiled"].tolist() == [0]


def test_the_compile_notice_estimates_the_wait_from_the_boards_profile():
    from edgefed.config import load_config
    from edgefed.orchestration import run as runs

    said = []
    model = type("M", (), {"kind": "logreg"})()
    for profile, eta in ((None, ""), ("pi4b", "; about 9 s on a Raspberry Pi 4 Model B (its profile)"),
                         ("pi-zero-2w", "; about 31 s on a Raspberry Pi Zero 2 W (its profile)")):
        cfg = load_config(None, [] if profile is None else [f'device.profile="{profile}"'])
        runs.compile_notice(cfg, model, said.append)(["network", "dense", "loss", "SGD step"], np.float32)
        assert said[-1] == ("compiling network, dense, loss, SGD step (float32) into this machine's kernel cache: "
                            f"only this once, every later run loads them (`edgefed warmup` compiles them ahead){eta}")

"""Weights out: `edgefed export --weights` writes the equivalent torch.nn.Sequential's state_dict, which gives the
log's own predictions in a NumPy forward pass (and in PyTorch, where it is installed)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgefed.runlog import read_run
from naive import network_forward

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "data" / "digits.npz"
LAYERS = [{"type": "conv2d", "out": 4, "kernel": 3}, {"type": "relu"}, {"type": "maxpool2d", "size": 2},
          {"type": "flatten"}, {"type": "dense", "out": 10}]


def cli(*args):
    return subprocess.run([sys.executable, "-m", "edgefed", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("digits")
    log = folder / "d.h5"
    sets = ["data.kind=\"arrays\"", f"data.path=\"{DIGITS}\"", "data.clients=4", "data.normalize=\"standard\"",
            "model.kind=\"sequential\"", f"model.layers={_toml(LAYERS)}", "train.clients_per_round=2",
            "train.local_steps=5", "train.lr_local=0.2", "rounds=3", "log.every=2"]
    done = cli("run", "--out", str(log), "--quiet", *[a for s in sets for a in ("--set", s)])
    assert done.returncode == 0, done.stderr
    return folder, log


def _toml(layers) -> str:
    return "[" + ", ".join("{" + ", ".join(f"{k} = {v!r}".replace("'", '"') for k, v in l.items()) + "}"
                           for l in layers) + "]"


def test_exported_weights_give_the_logs_test_accuracy_in_a_numpy_forward_pass(digits_run):
    folder, log = digits_run
    done = cli("export", str(log), "--weights", str(folder / "w.npz"))
    assert done.returncode == 0, done.stderr
    assert "nn.Conv2d(1, 4, 3, stride=1, padding='same')" in done.stdout and "nn.Linear(64, 10)" in done.stdout
    assert "its inputs: (N, 1, 8, 8), normalized as the run's: (x - shift) / scale, shift [" in done.stdout
    weights = dict(np.load(folder / "w.npz"))
    assert {k: v.shape for k, v in weights.items()} == {"0.weight": (4, 1, 3, 3), "0.bias": (4,),
                                                        "4.weight": (10, 64), "4.bias": (10,)}
    d = np.load(DIGITS)
    x = d["x_train"].astype(np.float64)
    attrs = read_run(log)["attrs"]  # the normalization the run applied, kept for this: the training set's
    np.testing.assert_allclose(attrs["input_shift"], [x.mean()], rtol=1e-12)
    np.testing.assert_allclose(attrs["input_scale"], [x.std()], rtol=1e-12)
    xt = ((d["x_test"] - attrs["input_shift"][0]) / attrs["input_scale"][0]).astype(np.float32).astype(np.float64)
    z, _ = network_forward(LAYERS, {k: v.astype(np.float64) for k, v in weights.items()}, xt)
    accuracy = float((z.argmax(axis=1) == d["y_test"]).mean())
    assert accuracy == pytest.approx(read_run(log)["metrics/test_accuracy"][-1], abs=1e-12)
    assert accuracy > 0.3  # a trained model, not an untouched one


def test_exported_weights_load_into_pytorch(digits_run):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch): the NumPy test above "
                                                "checks the same weights")
    folder, log = digits_run
    assert cli("export", str(log), "--weights", str(folder / "t.npz"), "--round", "2").returncode == 0
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding="same"), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                torch.nn.Flatten(), torch.nn.Linear(64, 10))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in np.load(folder / "t.npz").items()})
    x = torch.from_numpy(np.random.default_rng(0).normal(size=(5, 1, 8, 8)).astype(np.float32))
    ours, _ = network_forward(LAYERS, {k: v.astype(np.float64) for k, v in np.load(folder / "t.npz").items()},
                              x.numpy().astype(np.float64))
    np.testing.assert_allclose(model(x).detach().numpy(), ours, rtol=1e-4, atol=1e-5)


def test_export_refusals_are_one_line(digits_run, tmp_path):
    folder, log = digits_run
    bad = cli("export", str(log), "--weights", str(tmp_path / "w.npz"), "--round", "1")
    assert bad.returncode == 2 and bad.stderr.strip() == (
        f"edgefed: error: --round 1: {log} stores the model of rounds 0, 2, 3 (the last 3); pick one of them")
    bad = cli("export", str(log))
    assert bad.returncode == 2 and "export needs --csv FOLDER or --weights OUT.npz" in bad.stderr
    assert not (tmp_path / "w.npz").exists()

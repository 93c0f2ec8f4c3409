"""Fine-tuning: a run starts from weights (an exported .npz, a run log, a PyTorch state_dict), layers with
`trainable = false` stay as they came and never travel, and a frozen prefix's outputs are computed once per
device: the same bytes as running the whole network each step, in the simulator and under mpiexec."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgefed import layers as layer_lib
from edgefed.cli import main
from edgefed.config import load_config
from edgefed.errors import ConfigError
from edgefed.models import Sequential
from edgefed.orchestration import run as runs
from edgefed.orchestration.profiling import prefix_samples_per_second, speed_entry
from edgefed.problems import ClassificationData
from edgefed.rng import Purpose, kernel_state
from edgefed.runlog import read_run
from edgefed.runtime.mpi.comm import local_mpiexec, outside_world_env

from helpers import assert_same_logs, run_until

DIGITS = Path(__file__).resolve().parents[1] / "examples" / "data" / "digits.npz"
CONV = '{type = "conv2d", out = 4, kernel = 3%s}'
NET = [CONV, '{type = "relu"}', '{type = "maxpool2d", size = 2}', '{type = "flatten"}', '{type = "dense", out = 12%s}',
       '{type = "relu"}', '{type = "dense", out = 10}']
FROZEN = ", trainable = false"


def config_file(tmp_path, name, frozen=(), extra="", rounds=3):
    """A small CNN on the digits (8 devices, 4 a round), its layers i in `frozen` not trainable."""
    layers = ", ".join(layer % (FROZEN if i in frozen else "") if "%s" in layer else layer
                       for i, layer in enumerate(NET))
    path = tmp_path / f"{name}.toml"
    path.write_text(f'seed = 1\nrounds = {rounds}\n[data]\nkind = "arrays"\npath = "{DIGITS}"\nclients = 8\n'
                    f'normalize = "standard"\n[model]\nkind = "sequential"\nlayers = [{layers}]\n{extra}\n'
                    '[train]\nclients_per_round = 4\nlocal_steps = 3\nbatch_size = 8\nlr_local = 0.1\n')
    return path


def run(tmp_path, name, **kw):
    path = tmp_path / f"{name}.h5"
    path.unlink(missing_ok=True)
    runs.run(load_config(config_file(tmp_path, name, **kw)), path)
    return read_run(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Run A, trained from the seed, and its last round exported."""
    folder = tmp_path_factory.mktemp("finetune")
    a = run(folder, "a")
    assert main(["export", str(folder / "a.h5"), "--weights", str(folder / "a.npz")]) == 0
    return folder, a


# -- the layer list -------------------------------------------------------------------------------------------
def small(layers, cache=True, dtype=np.float64):
    network = layer_lib.build(layer_lib.check_layers(layers), (1, 6, 6), 3, dtype)
    return Sequential.seeded(network, dtype, 2, cache_features=cache)


LAYERS = [{"type": "conv2d", "out": 3, "kernel": 3, "trainable": False}, {"type": "relu"}, {"type": "flatten"},
          {"type": "dense", "out": 5}, {"type": "tanh"}, {"type": "dense", "out": 4, "trainable": False},
          {"type": "relu"}, {"type": "dense", "out": 3}]


def renamed(model, whole_model, params):
    """model's x and frozen tensors as whole_model's vector (all of it trainable), through the state_dict."""
    return layer_lib.whole_from_state(whole_model.network, model.state_dict(params), "test", whole_model.dtype)


def test_frozen_tensors_come_last_take_no_step_and_the_rest_steps_on_the_whole_networks_gradient():
    """A frozen convolution first (cached: the dense layers train on its outputs) and a frozen dense layer
    between trainable ones (whose input gradient still flows through it): every step equals plain SGD on the
    trainable coordinates of the all-trainable network's gradient, the frozen ones unchanged."""
    model = small(LAYERS)
    whole_model = small([{k: v for k, v in layer.items() if k != "trainable"} for layer in LAYERS])
    assert model.n_trainable == 6 * 6 * 3 * 5 + 5 + 4 * 3 + 3 and model.network.frozen == 27 + 3 + 20 + 4
    assert model.prefix_end == 1 and model.n_features == 6 * 6 * 3  # the convolution (its ReLU fused in)
    g = np.random.default_rng(0)
    X, y = g.normal(size=(12, 36)), g.integers(0, 3, 12)
    data = ClassificationData(model.features(X), y, model.features(X[:4]), y[:4])
    x = model.initial_params()
    frozen = model.frozen_values.copy()
    trainable = np.concatenate([_tensor_span(whole_model, t) for t in ("3.weight", "3.bias", "7.weight", "7.bias")])
    expected = renamed(model, whole_model, x)
    grad = np.zeros(whole_model.n_trainable)
    for _ in range(3):  # full-batch steps: x <- x - lr grad, on the trainable coordinates only
        whole_model.loss_grad(expected, ClassificationData(X, y, X[:0], y[:0]), grad)
        expected[trainable] -= 0.2 * grad[trainable]
    model.local_steps(x, data, model.begin(data, kernel_state(0, Purpose.LOCAL, 1, 0)), 3, None, 0.2)
    np.testing.assert_allclose(renamed(model, whole_model, x), expected, rtol=1e-12, atol=1e-14)
    assert np.array_equal(model.frozen_values, frozen)


def _tensor_span(model, name):
    t = next(t for t in model.network.tensors if f"{t.layer}.{t.name}" == name)
    return np.arange(t.offset, t.offset + t.size)


def test_the_feature_cache_changes_no_bit_of_a_step():
    cached, whole = small(LAYERS, dtype=np.float32), small(LAYERS, cache=False, dtype=np.float32)
    g = np.random.default_rng(1)
    X, y = g.normal(size=(20, 36)).astype(np.float32), g.integers(0, 3, 20)
    raw = ClassificationData(X, y, X[:5].copy(), y[:5].copy())
    feats = ClassificationData(cached.features(X), y, cached.features(X[:5]), y[:5])
    xs = []
    for model, data in ((cached, feats), (whole, raw)):
        x = model.initial_params()
        model.local_steps(x, data, model.begin(data, kernel_state(3, Purpose.LOCAL, 1, 0)), 4, 6, 0.1)
        xs.append((x, model.loss_correct(x, data.X_test, data.y_test)))
    assert xs[0][0].tobytes() == xs[1][0].tobytes() and xs[0][1] == xs[1][1]
    # the cached model keeps none of the prefix's activations before its outputs (here the 36 input values)
    assert whole.memory_bytes(6) - cached.memory_bytes(6) == (max(6, cached.network.eval_chunk + 1) + 6) * 36 * 4


@pytest.mark.parametrize("layers, message", [
    ([{"type": "relu", "trainable": False}, {"type": "dense", "out": 3}], "trainable applies to layers with parameters"),
    ([{"type": "dense", "out": 3, "trainable": 0}], "must be true or false"),
    ([{"type": "flatten"}, {"type": "dense", "out": 3, "trainable": False}], "nothing would train"),
])
def test_trainable_mistakes_are_one_line(layers, message):
    with pytest.raises(ConfigError, match=message):
        layer_lib.check_layers(layers)


def test_a_profile_entry_of_a_frozen_prefix_model_times_its_prefix_too():
    model = small(LAYERS, dtype=np.float32)
    entry = speed_entry(model, 8, 100.0, prefix_samples_per_second(model))
    assert entry["params"] == 6 * 6 * 3 * 5 + 5 + 4 * 3 + 3  # the trainable ones: what a step's time scales with
    assert entry["prefix_samples_per_s"] > 0 and "trainable=False" in entry["layers"]
    assert small(LAYERS, cache=False).prefix_end == 0  # (profiling then times no prefix)


# -- runs ------------------------------------------------------------------------------------------------------
def test_a_run_starts_where_an_exported_run_or_its_log_ended(trained):
    folder, a = trained
    last = a["trajectory/x"][-1]
    for source, extra in (("a.npz", ""), ("a.h5", ""), ("a.h5", "weights_round = 1")):
        b = run(folder, "b", extra=f'weights = "{folder / source}"\n{extra}', rounds=1)
        want = a["trajectory/x"][1] if extra else last
        assert b["trajectory/x"][0].tobytes() == want.tobytes(), (source, extra)
        assert b["metrics/test_accuracy"][0] == (a["metrics/test_accuracy"][1] if extra else a["metrics/test_accuracy"][-1])


def test_frozen_convolutions_never_travel_and_stay_as_loaded(trained):
    """Started from A with the convolution frozen: x is the dense layers' (fewer bytes up and down), the frozen
    tensors are stored once and equal A's, and the export holds them beside the trained rest."""
    folder, a = trained
    b = run(folder, "frozen", frozen=(0,), extra=f'weights = "{folder / "a.npz"}"')
    dim = b["trajectory/x"].shape[1]
    assert dim == 64 * 12 + 12 + 12 * 10 + 10 and b["model/frozen"].size == 4 * 9 + 4
    selected = b["participation/selected"]
    assert set(b["participation/bytes_up"][selected].tolist()) == {4 * dim}
    assert main(["export", str(folder / "frozen.h5"), "--weights", str(folder / "frozen.npz")]) == 0
    before, after = np.load(folder / "a.npz"), np.load(folder / "frozen.npz")
    assert sorted(before.files) == sorted(after.files)
    assert all(np.array_equal(before[k], after[k]) for k in ("0.weight", "0.bias"))
    assert not np.array_equal(before["4.weight"], after["4.weight"])


def test_the_feature_cache_writes_the_whole_networks_bytes(trained):
    folder, _ = trained
    extra = f'weights = "{folder / "a.npz"}"'
    cached = run(folder, "cached", frozen=(0,), extra=extra)
    whole = run(folder, "whole", frozen=(0,), extra=extra + "\ncache_features = false")
    assert_same_logs(cached, whole)


def test_a_frozen_layer_after_a_trainable_one_still_passes_gradients_back(trained):
    folder, a = trained
    b = run(folder, "late", frozen=(4,), extra=f'weights = "{folder / "a.npz"}"')
    assert b["trajectory/x"].shape[1] == 4 * 9 + 4 + 10 * 12 + 10 and b["model/frozen"].size == 64 * 12 + 12
    conv = b["trajectory/x"][:, :40]
    assert not np.array_equal(conv[0], conv[-1])  # the convolution below the frozen layer trains


def test_a_fine_tuning_run_resumes_to_the_same_bytes_when_its_weights_file_moved_or_changed(trained, tmp_path):
    """The log holds x_0 and the frozen tensors: a resume takes them from there, whatever the weights file
    is now, and says when it is gone or no longer the run's."""
    folder, _ = trained
    weights = tmp_path / "w.npz"
    cfg = load_config(config_file(tmp_path, "resume", frozen=(0,), extra=f'weights = "{weights}"'))
    whole = tmp_path / "whole.h5"
    for case in ("same", "gone", "changed"):
        weights.write_bytes((folder / "a.npz").read_bytes())
        if not whole.exists():
            runs.run(cfg, whole)
        part = tmp_path / f"{case}.h5"
        point = run_until(cfg, part, 1)
        if case == "gone":
            weights.unlink()
        elif case == "changed":
            np.savez(weights, **{k: v + 1 for k, v in np.load(folder / "a.npz").items()})
        said = []
        runs.run(cfg, part, resume_point=point, on_info=said.append)
        assert_same_logs(read_run(whole), read_run(part))
        warnings = [line for line in said if line.startswith("warning: model.weights")]
        assert len(warnings) == (case != "same"), said
        assert case == "same" or ("is gone" if case == "gone" else "is not the file the run started from") in warnings[0]


@pytest.mark.parametrize("change, message", [
    (lambda w: w.pop("4.bias"), re.escape("has no tensor '4.bias', which the model's layer 4 (dense) needs with shape (12,)")),
    (lambda w: w.update({"9.weight": np.zeros(3, np.float32)}), "has the tensor '9.weight', which the model does not"),
    (lambda w: w.update({"0.weight": np.zeros((4, 1, 5, 5), np.float32)}),
     r"tensor '0.weight' has shape \(4, 1, 5, 5\), but the model's layer 0 \(conv2d\) needs \(4, 1, 3, 3\)"),
])
def test_weights_that_do_not_fit_are_one_line_and_nothing_is_written(trained, tmp_path, capsys, change, message):
    folder, _ = trained
    weights = dict(np.load(folder / "a.npz"))
    change(weights)
    np.savez(tmp_path / "w.npz", **weights)
    out = tmp_path / "out.h5"
    code = main(["run", str(config_file(tmp_path, "bad", extra=f'weights = "{tmp_path / "w.npz"}"')), "--out", str(out),
                 "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert re.search(message, err), err
    assert not out.exists()


def test_weights_files_of_the_wrong_kind_are_one_line(trained, tmp_path, capsys):
    folder, _ = trained
    (tmp_path / "notes.txt").write_text("not weights")
    np.savez(tmp_path / "empty.npz")
    for weights, extra, message in ((tmp_path / "none.npz", "", "does not exist"),
                                    (tmp_path / "empty.npz", "", re.escape("holds no tensors; the model needs 6 "
                                                                           "(0.weight (4, 1, 3, 3), 0.bias (4,),")),
                                    (tmp_path / "notes.txt", "", "is neither an .npz, a run log nor a PyTorch"),
                                    (folder / "a.npz", "weights_round = 1", "picks a round of a run log"),
                                    (folder / "a.h5", "weights_round = 7", "config: model.weights_round = 7: .* stores the model of rounds")):
        code = main(["run", str(config_file(tmp_path, "bad", extra=f'weights = "{weights}"\n{extra}')), "--out",
                     str(tmp_path / "out.h5"), "--quiet"])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, err
        assert re.search(message, err), err


def test_a_pytorch_state_dict_starts_a_run(trained, tmp_path):
    torch = pytest.importorskip("torch", reason="the torch extra is not installed: pip install 'edgefed[torch]'")
    folder, a = trained
    torch.save({k: torch.from_numpy(v) for k, v in np.load(folder / "a.npz").items()}, tmp_path / "a.pt")
    b = run(tmp_path, "b", extra=f'weights = "{tmp_path / "a.pt"}"', rounds=1)
    assert b["trajectory/x"][0].tobytes() == a["trajectory/x"][-1].tobytes()


MPIEXEC = local_mpiexec()


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install 'edgefed[mpi]'")
def test_a_frozen_prefix_run_under_mpiexec_writes_the_simulators_bytes(trained):
    folder, _ = trained
    path = config_file(folder, "mpi", frozen=(0,), extra=f'weights = "{folder / "a.npz"}"')
    sim = run(folder, "mpi", frozen=(0,), extra=f'weights = "{folder / "a.npz"}"')
    done = subprocess.run([MPIEXEC, "-n", "3", sys.executable, "-m", "edgefed", "run", str(path), "--out",
                           str(folder / "mpi-3.h5"), "--quiet"], capture_output=True, text=True, timeout=300,
                          env=outside_world_env())
    assert done.returncode == 0, done.stderr
    assert_same_logs(sim, read_run(folder / "mpi-3.h5"))


def test_the_privacy_clip_and_noise_see_only_the_trainable_parameters(trained, tmp_path):
    """One device, one round: with noise off, x_1 - x_0 is the device's update clipped to C over the trainable
    coordinates (a NumPy replay from the same round without privacy)."""
    pytest.importorskip("dp_accounting", reason="dp-accounting is not installed: pip install 'edgefed[privacy]'")
    folder, _ = trained
    weights = f'weights = "{folder / "a.npz"}"'

    def round_of(name, privacy):
        path = config_file(tmp_path, name, frozen=(0,), extra=weights, rounds=1)
        path.write_text(path.read_text().replace("clients_per_round = 4", "clients_per_round = 1") + privacy)
        runs.run(load_config(path), tmp_path / f"{name}.h5")
        return read_run(tmp_path / f"{name}.h5")

    plain = round_of("plain", "")
    delta = plain["trajectory/x"][1].astype(np.float64) - plain["trajectory/x"][0]
    clip = 0.25 * np.linalg.norm(delta)
    clipped = round_of("clipped", f'[privacy]\nmechanism = "central"\nclip = {clip}\nnoise_multiplier = 0.0\n')
    assert clipped["participation/clipped"][0].any()
    step = clipped["trajectory/x"][1].astype(np.float64) - clipped["trajectory/x"][0]
    np.testing.assert_allclose(step, delta * clip / np.linalg.norm(delta), rtol=1e-4, atol=1e-7)

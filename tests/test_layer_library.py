"""The layer library against tests/naive.py's NumPy network in PyTorch's semantics and finite differences: every
layer type forward and backward, float32 and float64, odd shapes; random deep stacks; a step with the fused
large dense layer; dropout's masks; exported weights; the built-in models against their former kernels."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from edgefed import layers as layer_lib
from edgefed.errors import ConfigError
from edgefed.kernels.sgd import step_terms
from edgefed.models import Sequential
from edgefed.problems import ClassificationData
from edgefed.rng import Purpose, kernel_state
from naive import Xoshiro, network_forward, network_loss_grad

DATA = Path(__file__).parent / "data"


def conv(out, kernel, **kw):
    return {"type": "conv2d", "out": out, "kernel": kernel, **kw}


CASES = {  # name: (sample shape, layers without the classifier head)
    "dense": ((7,), [{"type": "dense", "out": 5}, {"type": "tanh"}]),
    "conv2d same, ReLU fused": ((2, 6, 5), [conv(3, 3), {"type": "relu"}, {"type": "flatten"}]),
    "conv2d valid, stride 2, one channel": ((1, 7, 7), [conv(2, 3, stride=2, padding="valid"), {"type": "flatten"}]),
    "conv2d even kernel same, then integer padding": ((2, 5, 4), [conv(2, 4), conv(3, 2, padding=1),
                                                                 {"type": "flatten"}]),
    "conv2d on (H, W) samples": ((6, 6), [conv(2, 3), {"type": "sigmoid"}, {"type": "flatten"}]),
    "conv1d": ((3, 11), [{"type": "conv1d", "out": 4, "kernel": 3}, {"type": "leaky_relu", "slope": 0.1},
                         {"type": "conv1d", "out": 2, "kernel": 2, "stride": 2, "padding": "valid"},
                         {"type": "flatten"}]),
    "maxpool2d after ReLU (fused), overlapping maxpool": ((2, 7, 7), [conv(3, 3), {"type": "relu"},
                                                                     {"type": "maxpool2d", "size": 2},
                                                                     {"type": "maxpool2d", "size": 2, "stride": 1},
                                                                     {"type": "flatten"}]),
    "avgpool2d, odd map floored": ((2, 7, 5), [conv(2, 3), {"type": "avgpool2d", "size": 2}, {"type": "relu"},
                                              {"type": "flatten"}]),
    "maxpool1d and avgpool1d": ((2, 13), [{"type": "conv1d", "out": 3, "kernel": 3}, {"type": "maxpool1d", "size": 2},
                                          {"type": "avgpool1d", "size": 3, "stride": 2}, {"type": "flatten"}]),
    "global_avgpool": ((3, 4, 5), [conv(4, 3), {"type": "tanh"}, {"type": "global_avgpool"}]),
    "reshape of a flat sample, and after a dense layer": ((12,), [{"type": "reshape", "shape": [3, 2, 2]}, conv(2, 2),
                                                                 {"type": "flatten"}, {"type": "dense", "out": 12},
                                                                 {"type": "reshape", "shape": [2, -1]},
                                                                 {"type": "conv1d", "out": 2, "kernel": 3},
                                                                 {"type": "flatten"}]),
    "groupnorm on maps and on vectors": ((4, 3, 3), [conv(4, 3), {"type": "groupnorm", "groups": 2},
                                                     {"type": "relu"}, {"type": "flatten"},
                                                     {"type": "dense", "out": 6}, {"type": "groupnorm", "groups": 3}]),
    "dropout (evaluation: the identity)": ((5,), [{"type": "dense", "out": 6}, {"type": "dropout", "rate": 0.3}]),
}
N_CLASSES = 3


def model_for(shape, layers, dtype, loss="cross_entropy", width=N_CLASSES):
    checked = layer_lib.check_layers(list(layers) + [{"type": "dense", "out": width}])
    network = layer_lib.build(checked, shape, width, dtype)
    return Sequential.seeded(network, dtype, 3, "pytorch", loss=loss)


def samples(model, n, seed=0, loss="cross_entropy"):
    g = np.random.default_rng(seed)
    X = g.normal(size=(n, model.n_features)).astype(model.dtype)
    y = g.integers(0, model.n_outputs, n) if loss == "cross_entropy" else g.normal(size=(n, model.n_outputs)).astype(model.dtype)
    return ClassificationData(X, y, X[:4].copy(), y[:4].copy())


def naive(model, params, X, y, loss="cross_entropy", masks=None):
    """(loss, state_dict gradients, outputs) of the NumPy reference on the model's exported weights."""
    sd = {k: v.astype(np.float64) for k, v in model.state_dict(params).items()}
    x = X.astype(np.float64).reshape(X.shape[0], *model.network.input_shape)
    value, grads = network_loss_grad(model.network.layers, sd, x, y, loss, masks)
    return value, grads, network_forward(model.network.layers, sd, x, masks)[0]


def assert_float64_matches_naive(model, data, loss_rel=1e-10):
    """A float64 model's outputs, loss and every gradient against the NumPy reference, at x_0."""
    x = model.initial_params()
    grad = np.zeros(model.n_trainable)
    loss = model.loss_grad(x, data, grad)
    ref_loss, ref_grads, ref_outputs = naive(model, x, data.X_train, data.y_train)
    np.testing.assert_allclose(model.outputs(x, data.X_train), ref_outputs, rtol=1e-10, atol=1e-12)
    assert loss == pytest.approx(ref_loss, rel=loss_rel)
    ours = model.state_dict(grad)
    assert ours.keys() == ref_grads.keys()
    for name, value in ref_grads.items():
        np.testing.assert_allclose(ours[name], value, rtol=1e-9, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 2e-4)])
@pytest.mark.parametrize("case", list(CASES))
def test_every_layer_type_forward_and_backward_against_numpy(case, dtype, tol):
    shape, layers = CASES[case]
    model = model_for(shape, layers, dtype)
    data = samples(model, 9)
    x = model.initial_params()
    outputs = model.outputs(x, data.X_train)
    grad = np.zeros(model.n_trainable, dtype)
    loss = model.loss_grad(x, data, grad)
    ref_loss, ref_grads, ref_outputs = naive(model, x, data.X_train, data.y_train)
    scale = max(1.0, np.abs(ref_outputs).max())
    np.testing.assert_allclose(outputs, ref_outputs, rtol=tol, atol=tol * scale)
    assert loss == pytest.approx(ref_loss, rel=tol, abs=tol)
    ours = model.state_dict(grad)
    assert ours.keys() == ref_grads.keys()
    for name, value in ref_grads.items():
        np.testing.assert_allclose(ours[name], value, rtol=tol, atol=tol * max(1.0, np.abs(value).max()), err_msg=name)


@pytest.mark.parametrize("case", ["conv1d", "maxpool2d after ReLU (fused), overlapping maxpool",
                                  "groupnorm on maps and on vectors", "reshape of a flat sample, and after a dense layer"])
def test_gradients_match_finite_differences(case):
    shape, layers = CASES[case]
    model = model_for(shape, layers, np.float64)
    data = samples(model, 5, seed=1)
    x = model.initial_params()
    grad = np.zeros(model.n_trainable)
    model.loss_grad(x, data, grad)
    g = np.random.default_rng(2)
    for j in g.choice(model.n_trainable, 10, replace=False):
        e = np.zeros(model.n_trainable)
        e[j] = 1e-6
        fd = (model.train_loss(x + e, data) - model.train_loss(x - e, data)) / 2e-6
        assert fd == pytest.approx(grad[j], abs=1e-7), j


def test_batch_of_one_and_a_minibatch_step_as_the_reference_draws_it():
    shape, layers = CASES["maxpool2d after ReLU (fused), overlapping maxpool"]
    model = model_for(shape, layers, np.float64)
    data = samples(model, 11, seed=4)
    x0 = model.initial_params()
    for batch in (1, 4):
        state = kernel_state(9, Purpose.LOCAL, 2, 1)
        rows = Xoshiro(state.copy()).batch(list(range(11)), batch)
        _, grads, _ = naive(model, x0, data.X_train[rows], data.y_train[rows])
        x = x0.copy()
        model.local_steps(x, data, model.begin(data, state), 1, batch, 0.1)
        stepped = model.state_dict(x)
        for name, value in model.state_dict(x0).items():
            np.testing.assert_allclose(stepped[name], value - 0.1 * grads[name], rtol=1e-10, atol=1e-12, err_msg=name)


def test_mse_loss_and_regression_outputs():
    model = model_for((4,), [{"type": "dense", "out": 5}, {"type": "sigmoid"}], np.float64, "mse", width=2)
    data = samples(model, 7, loss="mse")
    x = model.initial_params()
    grad = np.zeros(model.n_trainable)
    loss = model.loss_grad(x, data, grad)
    ref_loss, ref_grads, ref_outputs = naive(model, x, data.X_train, data.y_train, "mse")
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    np.testing.assert_allclose(model.outputs(x, data.X_train), ref_outputs, rtol=1e-12)
    for name, value in ref_grads.items():
        np.testing.assert_allclose(model.state_dict(grad)[name], value, rtol=1e-10, atol=1e-13)
    assert not model.has_accuracy and model.loss_correct(x, data.X_test, data.y_test)[1] == 0


def test_dropout_masks_come_from_the_devices_stream_and_scale_the_kept_values():
    rate = 0.4
    model = model_for((5,), [{"type": "dense", "out": 8}, {"type": "dropout", "rate": rate}], np.float64)
    data = samples(model, 6)
    x = model.initial_params()
    state = kernel_state(2, Purpose.LOCAL, 1, 0)
    grad = np.zeros(model.n_trainable)
    model.oracle_grad(x, data, model.begin(data, state.copy()), 6, grad)  # the whole batch: no minibatch draw
    ref = Xoshiro(state.copy())  # one draw per value, sample by sample
    masks = {1: np.array([[ref.uniform() >= rate for _ in range(8)] for _ in range(6)], np.float64)}
    _, ref_grads, _ = naive(model, x, data.X_train, data.y_train, masks=masks)
    for name, value in ref_grads.items():
        np.testing.assert_allclose(model.state_dict(grad)[name], value, rtol=1e-10, atol=1e-13, err_msg=name)
    assert 0 < masks[1].mean() < 1


@pytest.mark.parametrize("seed", range(4))
def test_random_deep_stacks_against_numpy(seed):
    """Stacks of 6-9 random layers (types, sizes, strides and paddings drawn from a seeded stream)."""
    g = np.random.default_rng(100 + seed)
    shape = (int(g.integers(1, 4)), int(g.integers(6, 10)), int(g.integers(6, 10)))
    layers, current = [], shape
    for _ in range(int(g.integers(3, 6))):
        pick = g.choice(["conv", "pool", "act", "norm"])
        if pick == "conv":
            k = int(g.integers(1, 4))
            pad = [g.choice(["same", "valid"]), int(g.integers(0, 2))][int(g.integers(0, 2))]
            layer = conv(int(g.integers(1, 5)), k, padding=pad if k <= min(current[1:]) else "same")
        elif pick == "pool" and min(current[1:]) >= 2:
            layer = {"type": str(g.choice(["maxpool2d", "avgpool2d"])), "size": 2, "stride": int(g.integers(1, 3))}
        elif pick == "norm":
            layer = {"type": "groupnorm", "groups": 1}
        else:
            layer = {"type": str(g.choice(["relu", "tanh", "sigmoid", "leaky_relu"]))}
        trial = layer_lib.build(layer_lib.check_layers(layers + [layer, {"type": "flatten"},
                                                                 {"type": "dense", "out": N_CLASSES}]),
                                shape, N_CLASSES, np.float64)
        layers.append(layer)
        current = trial.output_shapes[len(layers) - 1]
    layers += [{"type": "flatten"}, {"type": "dense", "out": 7}, {"type": "relu"}]
    model = model_for(shape, layers, np.float64)
    assert_float64_matches_naive(model, samples(model, 6, seed=seed))


def test_a_large_dense_layer_steps_its_weights_in_the_backward_pass_with_the_algorithms_terms():
    """512 x 512 weights reach the fused backward-and-step path; the step must equal x - lr (g + mu (x - a) + c)."""
    model = model_for((512,), [{"type": "dense", "out": 512}, {"type": "relu"}], np.float64)
    data = samples(model, 8)
    g = np.random.default_rng(5)
    x0 = model.initial_params()
    anchor, correction = x0 + 0.01 * g.normal(size=model.n_trainable), 0.001 * g.normal(size=model.n_trainable)
    grad = np.zeros(model.n_trainable)
    model.loss_grad(x0, data, grad)
    x = x0.copy()
    model.local_steps(x, data, model.begin(data, kernel_state(1, Purpose.LOCAL, 1, 0)), 1, None, 0.05,
                      step_terms(np.float64, correction, anchor, 0.3))
    np.testing.assert_allclose(x, x0 - 0.05 * (grad + 0.3 * (x0 - anchor) + correction), rtol=1e-12, atol=1e-15)


def test_the_built_in_models_compute_their_former_kernels_bits():
    """tests/data holds the outputs of the hand-written logreg/2NN/CNN kernels this library replaced, on fixed
    inputs: local steps (with and without an algorithm's terms, minibatch and full), one oracle gradient, the
    full gradient and evaluation. Every one is equal to the bit, but logistic regression's full gradient,
    which the former kernel summed per sample before scaling (within a float32 ulp or two here)."""
    hashes = json.loads((DATA / "previous_builtin_hashes.json").read_text())
    arrays = np.load(DATA / "previous_builtin_outputs.npz")
    shapes = {"logreg": ((6,), 4, 0, ()), "mlp": ((12,), 3, 1, (7, 5)), "cnn": ((1, 8, 8), 3, 2, ())}
    for kind, (shape, classes, seed, hidden) in shapes.items():
        for dtype in (np.float32, np.float64):
            model = Sequential.builtin(kind, shape, classes, dtype, seed, hidden or (200, 200))
            for name, value in _outputs(model, dtype, int(np.prod(shape)), classes).items():
                key = f"{kind}/{np.dtype(dtype).name}/{name}"
                if kind == "logreg" and name == "loss_grad":
                    np.testing.assert_allclose(value, arrays[key], rtol=0, atol=5e-8)
                    continue
                assert hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest() == hashes[key], key


def _outputs(model, dtype, features, classes):
    """The calls tests/data's outputs were recorded with (the same inputs, the same order)."""
    g = np.random.Generator(np.random.PCG64(123))
    X = g.normal(size=(23, features)).astype(dtype)
    y = g.integers(0, classes, 23).astype(np.int64)
    data = ClassificationData(X, y, X[:7].copy(), y[:7].copy())
    out = {"init": model.initial_params()}
    x0 = out["init"] if out["init"].any() else (
        0.1 * np.random.Generator(np.random.PCG64(5)).normal(size=model.n_trainable)).astype(dtype)
    runs = {"steps": (3, 5, None), "full_steps": (2, None, None)}
    h = np.random.Generator(np.random.PCG64(9))
    runs["steps_terms"] = (3, 5, step_terms(dtype, h.normal(size=model.n_trainable).astype(dtype),
                                            h.normal(size=model.n_trainable).astype(dtype), 0.3))
    for name in ("steps", "steps_terms", "full_steps"):
        steps, batch, terms = runs[name]
        x = x0.copy()
        model.local_steps(x, data, model.begin(data, kernel_state(3, Purpose.LOCAL, 1, 2)), steps, batch, 0.1, terms)
        out[name] = x
    grad = np.zeros(model.n_trainable, dtype)
    model.oracle_grad(x0, data, model.begin(data, kernel_state(4, Purpose.LOCAL, 1, 2)), 5, grad)
    out["oracle"] = grad.copy()
    out["loss_grad_loss"] = np.array(model.loss_grad(x0, data, grad))
    out["loss_grad"] = grad.copy()
    out["eval"] = np.array(model.loss_correct(x0, data.X_test, data.y_test))
    out["x0"] = x0
    return out


def test_the_built_in_models_are_named_layer_lists():
    cnn = layer_lib.builtin_layers("cnn", (1, 28, 28), 10)
    assert [layer["type"] for layer in cnn] == ["conv2d", "relu", "maxpool2d", "conv2d", "relu", "maxpool2d",
                                                "flatten", "dense", "relu", "dense"]
    assert Sequential.builtin("cnn", (1, 28, 28), 10, np.float32).n_trainable == 1_663_370  # McMahan et al.'s count
    assert Sequential.builtin("mlp", (1, 28, 28), 10, np.float32).n_trainable == 199_210
    assert Sequential.builtin("logreg", (60,), 10, np.float32).n_trainable == 610
    assert [layer["type"] for layer in layer_lib.builtin_layers("cnn", (784,), 10)][0] == "reshape"  # LEAF's flat images


@pytest.mark.parametrize("layers,message", [
    ([{"type": "Conv2d", "out": 3}], "model.layers[0].type = 'Conv2d' is not a layer type; did you mean 'conv2d'?"),
    ([{"type": "dense", "out": 3, "units": 4}], "model.layers[0] (dense): unknown setting 'units'; dense takes: out"),
    ([{"type": "conv2d", "out": 3}], "model.layers[0] (conv2d) needs 'kernel'"),
    ([{"type": "dropout", "rate": 1.0}], "model.layers[0].rate = 1.0 must be a number in [0, 1)"),
    ([{"type": "conv2d", "out": 2, "kernel": 9, "padding": "valid"}, {"type": "flatten"}, {"type": "dense", "out": 3}],
     "model.layers[0] (conv2d): kernel = 9 is larger than its (padded) input (1, 5, 5)"),
    ([{"type": "dense", "out": 3}], "model.layers[0] (dense) takes a flat input, got (1, 5, 5); put {type = \"flatten\"}"),
    ([{"type": "flatten"}, {"type": "dense", "out": 4}], "model.layers ends with 4 outputs but the data has 3 classes"),
    ([{"type": "conv2d", "out": 3, "kernel": 3, "stride": 2}], 'padding = "same" needs stride = 1'),
    ([{"type": "conv2d", "out": 3, "kernel": 3}, {"type": "groupnorm", "groups": 2}], "groups = 2 does not divide its 3"),
    ([{"type": "reshape", "shape": [2, 13]}], "shape = [2, 13] holds 26 values but its input (1, 5, 5) has 25"),
    ([{"type": "conv2d", "out": 3, "kernel": 3}], "model.layers ends with (3, 5, 5) maps"),
])
def test_bad_layer_lists_name_the_layer_and_the_fix(layers, message):
    with pytest.raises(ConfigError) as err:
        layer_lib.build(layer_lib.check_layers(layers), (1, 5, 5), N_CLASSES, np.float32)
    assert message in str(err.value)


def test_the_built_in_models_errors_name_them_and_labels_out_of_range_are_refused():
    with pytest.raises(ConfigError, match=r'config: model.kind = "cnn", layers\[2\] \(maxpool2d\): size = 2 is larger '
                                          r"than its input \(32, 1, 3\)"):
        Sequential.builtin("cnn", (1, 1, 3), 3, np.float32)
    model = model_for((4,), [], np.float64)
    data = samples(model, 5)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\); row 2 has 7"):
        model.loss_correct(model.initial_params(), data.X_train, np.array([0, 1, 7, 2, 1]))


def test_a_new_layer_list_compiles_nothing_once_the_library_is_compiled(tmp_path):
    """The library's one entry per dtype serves every list: a model never run before loads what the first
    one compiled (or found in the cache) and compiles nothing."""
    from conftest import config_with
    from edgefed.orchestration import run as runs
    from edgefed.runlog import read_run

    common = {"rounds": 1, "data.clients": 3, "train.clients_per_round": 2, "train.local_steps": 2}
    runs.run(config_with(common), tmp_path / "a.h5")  # the built-in logistic regression
    layers = [{"type": "dense", "out": 7}, {"type": "leaky_relu", "slope": 0.3}, {"type": "dropout", "rate": 0.2},
              {"type": "reshape", "shape": [7, 1]}, {"type": "conv1d", "out": 3, "kernel": 1},
              {"type": "groupnorm", "groups": 3}, {"type": "global_avgpool"}, {"type": "dense", "out": 10}]
    runs.run(config_with({**common, "model.kind": "sequential", "model.layers": layers}), tmp_path / "b.h5")
    assert read_run(tmp_path / "b.h5")["attrs"]["warmup_compiled"].tolist() == [0]

"""Width-scaled submodels: a width's layer list, where its parameters sit in the whole model's vector (the leading
slice of each of the whole model's PyTorch tensors), and a width's loss and gradients against the NumPy reference
network and PyTorch on those sliced tensors, in float64."""

import numpy as np
import pytest

from edgefed import layers as layer_lib
from edgefed.errors import ConfigError
from edgefed.layers.submodels import narrowed, slice_positions
from edgefed.models import Sequential
from edgefed.problems import ClassificationData
from edgefed.algorithms.base import DELTA_X, RoundReports, ServerState
from edgefed import hwprofile
from edgefed.algorithms.fedavg import FedAvg
from edgefed.analysis.figures import participation
from edgefed.analysis.logs import Run
from edgefed.cli import main
from edgefed.config import load_config
from edgefed.participation.schemes import SCHEMES
from edgefed.participation.submodels import Submodels, level_coefficients, server_update
from edgefed.orchestration import run as runs
from edgefed.rng import Purpose, generator
from edgefed.runlog import read_run
from edgefed.width_models import width_models
from conftest import config_with
from helpers import assert_same_logs, interrupted_then_resumed, problem_of
from naive import network_loss_grad

CNN = ((2, 8, 8), [{"type": "conv2d", "out": 8, "kernel": 3}, {"type": "groupnorm", "groups": 4}, {"type": "relu"},
                   {"type": "maxpool2d", "size": 2}, {"type": "conv2d", "out": 4, "kernel": 3}, {"type": "relu"},
                   {"type": "flatten"}, {"type": "dense", "out": 7}, {"type": "tanh"}, {"type": "dense", "out": 3}])
MLP = ((5,), [{"type": "dense", "out": 8}, {"type": "relu"}, {"type": "dense", "out": 6}, {"type": "sigmoid"},
              {"type": "dense", "out": 3}])


def networks(case, width):
    shape, layers = case
    whole = layer_lib.build(layer_lib.check_layers(layers), shape, 3, np.float64)
    part = layer_lib.build(layer_lib.check_layers(list(narrowed(layer_lib.check_layers(layers), width))), shape, 3,
                           np.float64)
    return whole, part


def test_a_width_narrows_every_hidden_layer_and_keeps_the_input_and_the_output():
    layers = layer_lib.check_layers(CNN[1])
    half = narrowed(layers, 0.5)
    assert [layer.get("out") for layer in half if "out" in layer] == [4, 2, 4, 3]  # ceil(w * out); the output whole
    assert half[1]["groups"] == 2  # 2 channels a group, as in the whole model
    whole, part = networks(MLP, 0.25)
    assert part.input_shape == whole.input_shape and part.output_shapes[-1] == whole.output_shapes[-1]
    assert [t.torch_shape for t in part.tensors if t.name == "weight"] == [(2, 5), (2, 2), (3, 2)]


@pytest.mark.parametrize("layers,width,message", [
    (MLP[1], 0.0, r"submodel.widths holds 0.0; a width is a fraction in \(0, 1\]"),
    (MLP[1], 1.5, r"submodel.widths holds 1.5"),
    ([{"type": "dense", "out": 3}], 0.5, r"has no hidden dense or convolution layer to narrow"),
    ([{"type": "embedding", "num": 5, "dim": 4}, {"type": "lstm", "hidden": 4}, {"type": "dense", "out": 3}], 0.5,
     r"model.layers\[0\] \(embedding\) cannot be narrowed"),
    ([{"type": "dense", "out": 8}, {"type": "reshape", "shape": [2, 4]}, {"type": "flatten"}, {"type": "dense", "out": 3}],
     0.5, r"model.layers\[1\] \(reshape\) follows a narrowed layer"),
    (CNN[1], 0.3, r"model.layers\[1\] \(groupnorm\) has 2 channels a group, but width 0.3 keeps 3"),
])
def test_what_cannot_be_narrowed_is_refused_in_one_line_naming_the_layer(layers, width, message):
    with pytest.raises(ConfigError, match=message):
        narrowed(layer_lib.check_layers(layers), width)


@pytest.mark.parametrize("case", [MLP, CNN], ids=["mlp", "cnn"])
@pytest.mark.parametrize("width", [0.5, 1.0])
def test_a_widths_parameters_are_the_leading_slices_of_the_whole_models_tensors(case, width):
    whole, part = networks(case, width)
    positions = slice_positions(whole, part)
    assert positions.size == part.n_params and np.unique(positions).size == positions.size
    values = np.random.default_rng(0).normal(size=whole.n_params)
    full = layer_lib.state_dict(whole, values)
    for name, tensor in layer_lib.state_dict(part, values[positions]).items():
        np.testing.assert_array_equal(tensor, full[name][tuple(slice(0, n) for n in tensor.shape)], err_msg=name)
    if width == 1.0:
        assert positions.tolist() == list(range(whole.n_params))


@pytest.mark.parametrize("case", [MLP, CNN], ids=["mlp", "cnn"])
def test_a_widths_loss_and_gradients_are_those_of_the_sliced_tensors(case):
    """The width's model at the whole model's sliced values against the NumPy reference network on the sliced
    state_dict (float64, 1e-10), and against PyTorch where it is installed."""
    whole, part = networks(case, 0.5)
    positions = slice_positions(whole, part)
    g = np.random.default_rng(1)
    x = g.normal(size=whole.n_params) * 0.3
    model = Sequential.seeded(part, np.float64, 3, "pytorch")
    X = g.normal(size=(6, model.n_features))
    y = g.integers(0, 3, 6)
    data = ClassificationData(X, y, X[:2].copy(), y[:2].copy())
    grad = np.zeros(part.n_params)
    loss = model.loss_grad(x[positions], data, grad)
    full = layer_lib.state_dict(whole, x)
    sliced = {name: full[name][tuple(slice(0, n) for n in t.torch_shape)]
              for name, t in ((f"{t.layer}.{t.name}", t) for t in part.tensors)}
    ref_loss, ref_grads = network_loss_grad(part.layers, sliced, X.reshape(6, *part.input_shape), y)
    assert loss == pytest.approx(ref_loss, rel=1e-10)
    ours = layer_lib.state_dict(part, grad)
    for name, value in ref_grads.items():
        np.testing.assert_allclose(ours[name], value, rtol=1e-9, atol=1e-12, err_msg=name)
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch): the NumPy reference "
                                                "above checks the same")
    namespace = {"nn": torch.nn, "torch": torch}
    module = eval(layer_lib.torch_text(part), namespace).double()  # the width's nn.Sequential, as export prints it
    module.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in sliced.items()})
    out = module(torch.from_numpy(X.reshape(6, *part.input_shape)))
    torch_loss = torch.nn.functional.cross_entropy(out, torch.from_numpy(y))
    torch_loss.backward()
    assert loss == pytest.approx(float(torch_loss.detach()), rel=1e-10)
    for name, p in module.named_parameters():
        np.testing.assert_allclose(ours[name], p.grad.numpy(), rtol=1e-9, atol=1e-12, err_msg=name)


def aggregated(positions: dict, widths, deltas, weights, steps, budgets, scheme: str) -> np.ndarray:
    """The round's update x_1 - x_0 from x_0 = 0 (FedAvg's server, eta_g = 1), through the engine's pieces:
    each width's coefficients, and the server update level by level."""
    levels = Submodels("heterofl", tuple(sorted(positions)), positions, np.asarray(widths, np.float64)).levels
    coeffs = level_coefficients(scheme, weights, steps, budgets, widths, tuple(sorted(positions)))
    d = max(p.max() for p in positions.values()) + 1
    rows = np.zeros((len(deltas), d))
    for k, delta in enumerate(deltas):
        rows[k, positions[float(widths[k])]] = delta
    reports = RoundReports(np.arange(len(deltas)), {DELTA_X: rows}, coeffs[0], np.ones(len(deltas), bool), 1.0,
                           len(deltas))
    return server_update(FedAvg(), ServerState(np.zeros(d)), reports, coeffs, levels).x


def test_each_coordinate_takes_the_rule_over_the_devices_whose_slice_holds_it():
    """Two devices, widths 0.5 and 1 of a 4-coordinate vector whose first 2 the narrow one holds: by hand."""
    positions = {0.5: np.array([0, 1]), 1.0: np.arange(4)}
    narrow, wide = np.array([2.0, 4.0]), np.array([6.0, 8.0, 10.0, 12.0])
    widths = np.array([0.5, 1.0])
    uniform = aggregated(positions, widths, [narrow, wide], np.array([0.5, 0.5]), np.array([5, 5]), np.array([5, 5]),
                         "B")
    assert uniform.tolist() == [4.0, 6.0, 10.0, 12.0]  # both hold: the mean; only the wide one: its own
    # Scheme C with the narrow device at 2 of 5 steps, weights 1:3: K/s scales it by 2.5 where both hold
    scaled = aggregated(positions, widths, [narrow, wide], np.array([0.25, 0.75]), np.array([2, 5]),
                        np.array([5, 5]), "C")
    np.testing.assert_allclose(scaled, [0.25 * 2.5 * 2 + 0.75 * 6, 0.25 * 2.5 * 4 + 0.75 * 8, 10.0, 12.0], rtol=1e-15)
    # FedNova over the holders of the first two coordinates: tau_eff p_k / s_k with p renormalized over them
    nova = aggregated(positions, widths, [narrow, wide], np.array([0.5, 0.5]), np.array([2, 4]), np.array([5, 5]),
                      "fednova")
    tau = 0.5 * 2 + 0.5 * 4
    np.testing.assert_allclose(nova[:2], [tau * (0.5 / 2 * 2 + 0.5 / 4 * 6), tau * (0.5 / 2 * 4 + 0.5 / 4 * 8)])
    np.testing.assert_allclose(nova[2:], [4 * (1 / 4) * 10, 4 * (1 / 4) * 12])  # the wide one alone: tau_eff = 4
    # drop: the narrow device incomplete, so where both hold only the wide one counts, renormalized
    dropped = aggregated(positions, widths, [narrow, wide], np.array([0.5, 0.5]), np.array([2, 5]), np.array([5, 5]),
                         "drop")
    assert dropped.tolist() == [6.0, 8.0, 10.0, 12.0]


def test_one_width_for_every_device_is_the_plain_rule():
    """Every device at one width: the update on its slice is the scheme's plain sum, bit for bit, zero elsewhere."""
    whole, part = networks(MLP, 0.5)
    positions = slice_positions(whole, part)
    g = np.random.default_rng(3)
    deltas = [g.normal(size=part.n_params) for _ in range(3)]
    weights, steps, budgets = np.array([0.2, 0.3, 0.5]), np.array([3, 5, 1]), np.array([5, 5, 5])
    got = aggregated({0.5: positions, 1.0: np.arange(whole.n_params)}, np.full(3, 0.5), deltas, weights, steps,
                     budgets, "C")
    coeffs = SCHEMES["C"](weights, steps, budgets)
    want = np.zeros(whole.n_params)
    for c, d in zip(coeffs, deltas):
        want[positions] += c * d
    assert got.tobytes() == want.tobytes()


# -- a run: one round of two widths against NumPy, MPI, resume, replay, bad input ------------------------------

LAYERS = [{"type": "dense", "out": 8}, {"type": "relu"}, {"type": "dense", "out": 3}]


@pytest.fixture
def tiny_arrays(tmp_path):
    g = np.random.default_rng(0)
    path = tmp_path / "tiny.npz"
    np.savez(path, x_train=g.normal(size=(40, 5)).astype(np.float32), y_train=g.integers(0, 3, 40),
             x_test=g.normal(size=(10, 5)).astype(np.float32), y_test=g.integers(0, 3, 10))
    return path


def two_widths(path, method="heterofl", **more):
    return config_with({"rounds": 1, "data.kind": "arrays", "data.path": str(path), "data.clients": 2,
                        "model.kind": "sequential", "model.dtype": "float64", "model.layers": LAYERS,
                        "train.clients_per_round": 2, "train.local_steps": 1, "train.batch_size": "full",
                        "train.lr_local": 0.5, "train.weighting": "uniform", "submodel.method": method,
                        "submodel.widths": [0.5, 1.0], "submodel.assign": [0.5, 1.0], **more})


def full_gradient(layers, width, x, data) -> np.ndarray:
    """The NumPy reference network's mean-loss gradient of a width's slice of x (its own positions' order)."""
    whole, part = [layer_lib.build(layer_lib.check_layers(list(narrowed(layer_lib.check_layers(layers), w))), (5,),
                                   3, np.float64) for w in (1.0, width)]
    at = slice_positions(whole, part)
    state = layer_lib.state_dict(part, x[at])
    _, grads = network_loss_grad(part.layers, state, data.X_train, data.y_train)
    return at, layer_lib.whole_from_state(part, grads, "gradient", np.float64)


@pytest.mark.parametrize("method,steps,mu", [("heterofl", 1, 0.0), ("fjord", 3, 0.5)])
def test_a_round_of_two_widths_is_the_numpy_reference_of_the_rule(tiny_arrays, tmp_path, method, steps, mu):
    """Device 0 trains width 0.5, device 1 the whole model (FjORD: each step the width its stream draws, 0.5 or 1,
    under FedProx's pull to x_0 on that width's slice), full-batch steps from x_0; uniform weights, Scheme B: a
    coordinate both hold takes the mean of the two updates, one only device 1 holds takes its update."""
    more = {"train.algorithm": "fedprox", "fedprox.mu": mu} if mu else {}
    cfg = two_widths(tiny_arrays, method, **{"train.local_steps": steps, **more})
    runs.run(cfg, tmp_path / "r.h5")
    log = read_run(tmp_path / "r.h5")
    x0 = log["trajectory/x"][0]
    problem = problem_of(cfg)
    deltas = []
    for k, width in enumerate((0.5, 1.0)):
        draws = generator(cfg.seed, Purpose.WIDTH, 1, k).integers(0, 1 + (width == 1.0), size=steps)
        y = x0.copy()
        for j in range(steps):  # (HeteroFL: the device's own width every step)
            at, grad = full_gradient(LAYERS, width if method == "heterofl" else (0.5, 1.0)[draws[j]], y,
                                     problem.device(k))
            y[at] -= 0.5 * (grad + mu * (y[at] - x0[at]))
        deltas.append(y - x0)
    half = slice_positions(*[layer_lib.build(layer_lib.check_layers(list(narrowed(layer_lib.check_layers(LAYERS), w))),
                                             (5,), 3, np.float64) for w in (1.0, 0.5)])
    want = x0 + deltas[1]
    want[half] = x0[half] + 0.5 * (deltas[0][half] + deltas[1][half])
    np.testing.assert_allclose(log["trajectory/x"][1], want, rtol=1e-10, atol=1e-12)
    assert not deltas[0][np.setdiff1d(np.arange(x0.size), half)].any()  # the narrow device sent its slice alone
    assert log["participation/width"].tolist() == [[0.5, 1.0]]
    itemsize = 8
    assert log["participation/bytes_up"].tolist() == [[half.size * itemsize, x0.size * itemsize]]
    assert log["participation/bytes_down"].tolist() == log["participation/bytes_up"].tolist()


def by_speed(path, submodel=True, **more):
    """Four devices at speeds 1, 0.5, 0.3 and 0.2 on a simulated Pi 4, FjORD widths by speed under a deadline of
    0.8x the whole model's profiled time (submodel False: the same run without [submodel])."""
    sub = {"submodel.method": "fjord", "submodel.widths": [0.25, 0.5, 1.0]} if submodel else {}
    return config_with({"rounds": 3, "data.kind": "arrays", "data.path": str(path), "data.clients": 4,
                        "model.kind": "mlp", "model.hidden": [16, 8], "train.clients_per_round": 3,
                        "train.local_steps": 4, "train.batch_size": 8, "train.lr_local": 0.1,
                        "participation.mode": "deadline", "participation.deadline_s": "0.8x",
                        "participation.clock": "simulated", "device.profile": "pi4b",
                        "device.speed": [1.0, 0.5, 0.3, 0.2], "device.link_mbps": [1.0], **sub, **more})


def test_widths_by_speed_ranks_resume_and_replay_write_the_simulators_bytes(tiny_arrays, tmp_path, capsys):
    from test_protocol import loopback_run

    cfg = by_speed(tiny_arrays)
    lines = []
    runs.run(cfg, tmp_path / "sim.h5", on_info=lines.append)
    log = read_run(tmp_path / "sim.h5")
    # K steps of the whole model take 1/0.8 of the deadline at speed 1: each device gets the widest width whose
    # steps fit, and the slowest, whose narrowest does not fit either, that width and the steps that fit
    assert "submodel fjord: devices per width 0.25: 2, 0.5: 2, 1: 0" in lines
    selected, widths, steps = (log[f"participation/{name}"] for name in ("selected", "width", "steps"))
    assert np.isnan(widths[~selected]).all()
    rows, cols = np.nonzero(selected)
    assert widths[rows, cols].tolist() == [(0.5, 0.5, 0.25, 0.25)[k] for k in cols]
    assert steps[rows, cols].tolist() == [(4, 4, 4, 3)[k] for k in cols]
    moved = log["participation/bytes_down"] + log["participation/bytes_up"]  # each its slice, on a 1 Mbit/s link
    np.testing.assert_allclose(log["participation/comm_s"][rows, cols], 8 * moved[rows, cols] / 1e6, rtol=1e-6)
    assert moved[rows, cols].max() < 2 * 4 * log["trajectory/x"].shape[1] / 2
    assert main(["summary", str(tmp_path / "sim.h5")]) == 0
    titles = [ax.get_title() for ax in participation(Run.read(tmp_path / "sim.h5"), "t").axes]
    assert "submodel width trained (grey: not selected)" in titles
    narrow = widths[rows, cols] == 0.25
    done = steps[rows, cols][narrow].sum() / (4 * narrow.sum())
    assert (f"submodel fjord: device-rounds per width 0.25: {narrow.sum()} ({done:.0%} of their steps), "
            f"0.5: {(~narrow).sum()} (100% of their steps)") in capsys.readouterr().out
    assert_same_logs(log, loopback_run(cfg, tmp_path / "mpi.h5", 3))
    assert_same_logs(*interrupted_then_resumed(cfg, tmp_path, 1))
    # a measured run under the ranks replays bit for bit, its widths as recorded
    measured = by_speed(tiny_arrays, **{"participation.clock": "measured", "participation.deadline_s": 0.05,
                                        "submodel.assign": [0.25, 0.5, 1.0, 0.5]})
    ran = loopback_run(measured, tmp_path / "measured.h5", 3)
    replay = {"participation.mode": "trace", "participation.deadline_s": None,
              "participation.trace": str(tmp_path / "measured.h5")}
    runs.run(by_speed(tiny_arrays, **replay), tmp_path / "replay.h5")
    again = read_run(tmp_path / "replay.h5")
    for name in ("trajectory/x", "participation/width", "participation/coeff", "participation/steps",
                 "participation/bytes_up", "metrics/train_loss"):
        assert again[name].tobytes() == ran[name].tobytes(), name
    with pytest.raises(ConfigError, match=r"ran submodels of widths \[0.25, 0.5, 1.0\]; replay it with the same"):
        runs.run(by_speed(tiny_arrays, False, **replay), tmp_path / "x.h5")


@pytest.mark.parametrize("sets,line", [
    (['submodel.widths=[0.5, 1.5]'], "submodel.widths holds 1.5; a width is a fraction of a hidden layer's units in (0, 1]"),
    (['submodel.widths=[1.0, 0.5]'], "submodel.widths = [1.0, 0.5] must ascend, each width once (e.g. [0.5, 1.0])"),
    (['submodel.widths=[]'], "submodel.widths is empty"),
    (['submodel.widths=[0.25, 0.5]'], "submodel.widths = [0.25, 0.5] must end with 1.0: the metrics evaluate the whole"),
    (['submodel.assign=[0.5, 1.0]'], "submodel.assign lists 2 widths for 4 devices; give one a device"),
    (['submodel.assign=[0.5, 0.5, 0.3, 1.0]'], "submodel.assign holds 0.3, which is not one of submodel.widths"),
    (['model.kind="logreg"'], "submodel is set, but model.layers has no hidden dense or convolution layer to narrow"),
    (['train.algorithm="scaffold"'], '[submodel] cannot run with train.algorithm = "scaffold"'),
], ids=["outside", "unsorted", "empty", "not-whole", "assign-length", "assign-unknown", "nothing-to-slice", "scaffold"])
def test_bad_submodel_input_is_one_line_and_exit_2(tmp_path, capsys, sets, line):
    base = ["rounds=1", "data.clients=4", "train.clients_per_round=2", 'model.kind="mlp"', 'submodel.method="heterofl"',
            "submodel.widths=[0.5, 1.0]"]
    args = ["run", *[a for s in base + sets for a in ("--set", s)], "--out", str(tmp_path / "r.h5")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and line in err and "Traceback" not in err, err
    assert not (tmp_path / "r.h5").exists()


def test_a_profile_that_times_a_width_gives_its_steps_their_own_time(tiny_arrays, tmp_path):
    """By the profile's per-parameter rule the two fastest devices fit width 0.5 (the test above); a profile
    whose own entry for that width's layer list (what `edgefed profile --config` writes) says it is slow gives
    every device 0.25."""
    cfg = by_speed(tiny_arrays, **{"submodel.method": "heterofl"})
    half = width_models(cfg, *runs.problem_and_model(cfg)).models[0.5]
    profile = tmp_path / "board.toml"
    profile.write_text((hwprofile.SHIPPED / "pi4b.toml").read_text() + (
        f'\n[[speed]]\nmodel = "sequential"\nparams = {half.n_trainable}\nbatch = 8\nsteps_per_s = 1.0\n'
        f'layers = "{half.profile_key().split(": ", 1)[1]}"\n'))
    lines = []
    runs.run(by_speed(tiny_arrays, **{"submodel.method": "heterofl", "device.profile": str(profile)}),
             tmp_path / "r.h5", on_info=lines.append)
    assert "submodel heterofl: devices per width 0.25: 4, 0.5: 0, 1: 0" in lines


def test_secure_aggregation_sums_each_slice_among_the_devices_that_hold_it(tiny_arrays, tmp_path, monkeypatch):
    """Four devices of widths 0.25, 1, 0.5 and 1: each masks its slice alone (its masked input is zero elsewhere:
    nothing of the rest travels), a pair's masks cover the slice both hold, so every coordinate's masks cancel
    among its holders, also when the width-0.5 device drops out in round 2 and the survivors' shares unmask
    its pair masks. The round equals the plain one to the fixed point's resolution, each device sends its
    slice's words and the clip count."""
    from edgefed.engine.secure import SecureSum

    def cfg(assign, stalled, secure=True):
        more = {"data.clients": 4, "train.clients_per_round": 4, "train.local_steps": 2, "rounds": 2,
                "submodel.widths": [0.25, 0.5, 1.0], "submodel.assign": assign,
                "participation.mode": "deadline", "participation.deadline_s": 0.3, "participation.grace_s": 0.1,
                "fault": [{"device": stalled, "round": 2, "kind": "stall", "seconds": 0.6}]}
        if secure:
            more.update({"secagg.enabled": True, "secagg.key_source": "seeded", "secagg.threshold": 2})
        return two_widths(tiny_arrays, **more)

    masked = []
    reports = SecureSum.reports
    monkeypatch.setattr(SecureSum, "reports", lambda self, plan, res, *rest: (
        masked.append((plan.widths, res.masked.copy())), reports(self, plan, res, *rest))[1])
    runs.run(cfg([0.25, 1.0, 0.5, 1.0], 2, secure=False), tmp_path / "plain.h5")
    runs.run(secure := cfg([0.25, 1.0, 0.5, 1.0], 2), tmp_path / "secure.h5")
    a, b = read_run(tmp_path / "plain.h5"), read_run(tmp_path / "secure.h5")
    assert b["participation/late"].tolist() == [[False] * 4, [False, False, True, False]]
    np.testing.assert_allclose(b["trajectory/x"], a["trajectory/x"], atol=1e-6)
    assert np.abs(b["trajectory/x"][2] - b["trajectory/x"][1]).max() > 1e-3  # (round 2 moved x)
    positions = width_models(secure, *runs.problem_and_model(secure)).positions
    widths, values = masked[0]
    for w, row in zip(widths, values):
        outside = np.ones(row.size, bool)
        outside[positions[w]] = outside[-1] = False
        assert not row[outside].any() and row[~outside].any(), w
    words = (a["participation/bytes_up"] // 8 + 1) * 4  # float64 coordinates -> 32-bit words, and the count
    assert b["participation/bytes_up"][0].tolist() == words[0].tolist()  # (under mpiexec: tests/test_mpi.py)
    # a width only one selected device reaches is not summed over one: that device trains the next widest; a
    # width whose holders drop to one survivor aborts the round, as a sum of one device would
    runs.run(cfg([0.25, 1.0, 0.5, 0.5], 3), tmp_path / "capped.h5")
    assert read_run(tmp_path / "capped.h5")["participation/width"][0].tolist() == [0.25, 0.5, 0.5, 0.5]
    runs.run(cfg([0.25, 1.0, 1.0, 0.25], 2), tmp_path / "alone.h5")
    alone = read_run(tmp_path / "alone.h5")
    assert alone["metrics/secagg_aborted"].tolist() == [False, True]
    assert alone["trajectory/x"][2].tobytes() == alone["trajectory/x"][1].tobytes()

def test_edgefed_profile_times_each_width_as_its_own_layer_list(tiny_arrays, tmp_path):
    """`edgefed profile --config` measures the config's model and each narrower width's, keyed by the width's
    layer list (the whole width is the model itself, timed once)."""
    from edgefed.orchestration import profiling

    path = tmp_path / "c@1.toml"  # (a path may hold an "@")
    path.write_text(f'[data]\nkind = "arrays"\npath = "{tiny_arrays}"\nclients = 4\n[model]\nkind = "mlp"\n'
                    'hidden = [16, 8]\n[train]\nclients_per_round = 2\nbatch_size = 8\n[submodel]\nmethod = "fjord"\n')
    spec = profiling.CONFIG + str(path)
    parts = [profiling.build(s)[0] for s in profiling.width_specs(spec)]
    widths = width_models(load_config(path), *runs.problem_and_model(load_config(path)))
    assert [m.profile_key() for m in parts] == [widths.models[w].profile_key() for w in (0.25, 0.5)]
    entry = profiling.speed_entry(parts[0], 8, 100.0)
    assert (entry["model"], entry["params"]) == ("sequential", widths.n_params(0.25))
    assert profiling.build(spec)[0].profile_key() == "mlp"

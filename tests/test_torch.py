"""A PyTorch module as it is ([model] kind = "torch"): one step equals x - lr (grad F + the algorithm's terms) by
torch's own autograd, a skip connection with dropout repeats and replays, deadline runs under mpiexec replay in
the simulator bit for bit, resume, export of the module's own state_dict, and the refusals."""

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: pip install 'edgefed[torch]' runs these")

from conftest import config_with  # noqa: E402
from edgefed import hwprofile  # noqa: E402
from edgefed.cli import main  # noqa: E402
from edgefed.config import load_config  # noqa: E402
from edgefed.errors import ConfigError  # noqa: E402
from edgefed.kernels.sgd import step_terms  # noqa: E402
from edgefed.orchestration import run as runs  # noqa: E402
from edgefed.orchestration.profiling import speed_entry  # noqa: E402
from edgefed.problems import ClassificationData  # noqa: E402
from edgefed.rng import Purpose, generator, kernel_state  # noqa: E402
from edgefed.runlog import read_run  # noqa: E402
from edgefed.torchmodel import TorchModel, _load  # noqa: E402
from helpers import assert_same_logs, interrupted_then_resumed  # noqa: E402
from test_mpi import MPIEXEC, edgefed, write  # noqa: E402

MODULES = str(Path(__file__).parent / "torch_modules.py")
FLOWER = str(Path(__file__).parent.parent / "examples" / "flower_quickstart.py")


def model_of(factory, shape=(6,), classes=3, dtype=np.float64):
    return TorchModel(MODULES, factory, shape, classes, dtype, generator(0, Purpose.INIT))


def samples(shape=(6,), classes=3, n=20, seed=0, dtype=np.float64):
    g = np.random.default_rng(seed)
    X = g.normal(size=(n, int(np.prod(shape)))).astype(dtype)
    y = g.integers(0, classes, n)
    return ClassificationData(X, y, X[:4].copy(), y[:4].copy())


def autograd_gradient(model, params, data):
    """grad F at params by torch's autograd on a fresh module of the factory, the loss over the whole batch."""
    import torch_modules

    module = getattr(torch_modules, model.factory)(model.sample_shape, model.n_outputs).double()
    with torch.no_grad():
        for p, off, shape in zip(module.parameters(), model.offsets, model.shapes):
            p.copy_(torch.from_numpy(params[off:off + int(np.prod(shape))]).view(shape))
    module.eval()
    x = torch.from_numpy(data.X_train).view((-1, *model.sample_shape))
    torch.nn.functional.cross_entropy(module(x), torch.from_numpy(data.y_train)).backward()
    return torch.cat([p.grad.reshape(-1) for p in module.parameters()]).numpy()


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "scaffold"])
def test_one_full_batch_step_is_x_minus_lr_grad_by_torch_autograd(algorithm):
    model = model_of("linear")
    data = samples()
    x0 = model.initial_params()
    g = np.random.default_rng(1)
    anchor, correction = x0 + 0.1 * g.normal(size=model.n_trainable), 0.01 * g.normal(size=model.n_trainable)
    terms, extra = {"fedavg": (None, 0.0), "fedprox": (step_terms(np.float64, anchor=anchor, mu=0.3),
                                                           0.3 * (x0 - anchor)),
                    "scaffold": (step_terms(np.float64, correction=correction), correction)}[algorithm]
    x = x0.copy()
    model.local_steps(x, data, model.begin(data, kernel_state(0, Purpose.LOCAL, 1, 0)), 1, None, 0.2, terms)
    np.testing.assert_allclose(x, x0 - 0.2 * (autograd_gradient(model, x0, data) + extra), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_reporting_the_losses_for_oort_moves_no_bit_of_the_step(loss):
    model = TorchModel(MODULES, "linear", (6,), 3, np.float64, generator(0, Purpose.INIT), loss=loss)
    data = samples()
    if loss == "mse":
        data = dataclasses.replace(data, y_train=np.eye(3)[data.y_train], y_test=np.eye(3)[data.y_test])
    x0 = model.initial_params()
    plain, reported = x0.copy(), x0.copy()
    model.local_steps(plain, data, model.begin(data, kernel_state(0, Purpose.LOCAL, 1, 0)), 3, 5, 0.2)
    model.report_losses = True
    run = model.begin(data, kernel_state(0, Purpose.LOCAL, 1, 0))
    model.local_steps(reported, data, run, 3, 5, 0.2)
    assert np.array_equal(plain, reported) and run.samples == 15 and run.loss_sq > 0
    run = model.begin(data, kernel_state(0, Purpose.LOCAL, 1, 0))
    model.local_steps(x0.copy(), data, run, 1, None, 0.0)  # one full batch at lr 0: each sample's loss at x0
    import torch_modules

    module = torch_modules.linear((6,), 3).double()
    with torch.no_grad():
        for p, off, shape in zip(module.parameters(), model.offsets, model.shapes):
            p.copy_(torch.from_numpy(x0[off:off + int(np.prod(shape))]).view(shape))
        out = module(torch.from_numpy(data.X_train))
        target = torch.from_numpy(data.y_train)
        each = (torch.nn.functional.cross_entropy(out, target, reduction="none") if loss == "cross_entropy"
                else ((out - target) ** 2).mean(dim=1))
    assert run.samples == 20 and run.loss_sq == pytest.approx(float((each ** 2).sum()), rel=1e-12)


def test_a_skip_connection_with_dropout_steps_alike_in_chunks_and_repeats(tmp_path):
    model = model_of("residual")
    data = samples()
    x0 = model.initial_params()
    whole, parts = x0.copy(), x0.copy()
    model.local_steps(whole, data, model.begin(data, kernel_state(4, Purpose.LOCAL, 2, 1)), 6, 5, 0.1)
    run = model.begin(data, kernel_state(4, Purpose.LOCAL, 2, 1))
    for _ in range(3):  # a deadline cuts the work into chunks: the same minibatches and dropout masks
        model.local_steps(parts, data, run, 2, 5, 0.1)
    assert np.array_equal(whole, parts) and not np.array_equal(whole, x0)
    # the full gradient is the deterministic objective's (dropout off): torch's autograd in eval mode
    grad = np.zeros(model.n_trainable)
    model.loss_grad(x0, data, grad)
    np.testing.assert_allclose(grad, autograd_gradient(model, x0, data), rtol=1e-10, atol=1e-13)
    cfg = config_with({"rounds": 2, "data.clients": 4, "train.clients_per_round": 2, "train.local_steps": 4,
                       "model.kind": "torch", "model.module": MODULES, "model.factory": "residual"})
    runs.run(cfg, tmp_path / "a.h5")
    runs.run(cfg, tmp_path / "b.h5")
    a, b = read_run(tmp_path / "a.h5"), read_run(tmp_path / "b.h5")
    assert_same_logs(a, b)
    assert a["attrs"]["torch_version"] == torch.__version__ and "not promised across CPUs" in a["attrs"]["bits"]


def test_lanes_each_their_own_module_give_one_lanes_bits_and_dropout_asks_for_one(tmp_path):
    base = {"rounds": 2, "data.clients": 4, "train.clients_per_round": "all", "train.local_steps": 3,
            "model.kind": "torch", "model.module": MODULES, "model.factory": "linear"}
    runs.run(config_with(base), tmp_path / "one.h5")
    runs.run(config_with({**base, "mpi.threads_per_rank": 2}), tmp_path / "two.h5")
    assert_same_logs(read_run(tmp_path / "one.h5"), read_run(tmp_path / "two.h5"))
    with pytest.raises(ConfigError, match=r"mpi.threads_per_rank = 2, but model.module draws random numbers in "
                                          r"training \(dropout\)"):
        runs.run(config_with({**base, "model.factory": "residual", "mpi.threads_per_rank": 2}), tmp_path / "r.h5")
    assert not (tmp_path / "r.h5").exists()
    cfg = config_with({**base, "model.factory": "residual"})  # a rank's cores by default: one lane for it
    problem, model = runs.problem_and_model(cfg)
    transport = runs.local_transport(cfg, runs.build_algorithm(cfg), problem, model, cores=[0, 0])
    assert transport.threads == 1
    transport.close()


def test_resume_of_a_torch_run_is_the_whole_run(tmp_path):
    cfg = config_with({"rounds": 4, "data.clients": 4, "train.clients_per_round": 2, "train.local_steps": 3,
                       "model.kind": "torch", "model.module": MODULES, "model.factory": "residual"})
    whole, resumed = interrupted_then_resumed(cfg, tmp_path, 2)
    assert_same_logs(whole, resumed)


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install 'edgefed[mpi]'")
def test_flowers_quickstart_module_under_deadlines_on_ranks_replays_and_exports(tmp_path):
    """examples/flower_quickstart.py, Flower's quickstart CNN as it is: deadlines under mpiexec -n 2 (each
    rank imports torch: a third would add seconds, not a path), the log replayed as a trace in the simulator
    (bit for bit), the exported weights loaded back into the module."""
    g = np.random.default_rng(5)
    np.savez(tmp_path / "img.npz", x_train=g.random((120, 3, 32, 32), dtype=np.float32),
             y_train=g.integers(0, 10, 120))
    base = (f'rounds = 3\n[data]\nkind = "arrays"\npath = "{tmp_path / "img.npz"}"\nclients = 4\n'
            f'[model]\nkind = "torch"\nmodule = "{FLOWER}"\nfactory = "factory"\n'
            '[train]\nclients_per_round = "all"\nlocal_steps = 100000\nbatch_size = 8\n')
    cfg = write(tmp_path, "d.toml", base + '[participation]\nmode = "deadline"\ndeadline_s = 0.05\ngrace_s = 0.5\n')
    out = tmp_path / "d.h5"
    done = edgefed(["run", cfg, "--out", str(out), "--quiet"], 2)
    assert done.returncode == 0, done.stderr
    log = read_run(out)
    steps = log["participation/steps"]
    assert (steps > 0).all() and (steps < 100000).all()  # the deadline stopped every device's work
    replay = write(tmp_path, "r.toml", base + f'[participation]\nmode = "trace"\ntrace = "{out}"\n')
    runs.run(load_config(replay), tmp_path / "sim.h5")
    again = read_run(tmp_path / "sim.h5")
    assert again["trajectory/x"].tobytes() == log["trajectory/x"].tobytes()
    assert main(["export", str(out), "--weights", str(tmp_path / "w.npz")]) == 0
    net = _load(FLOWER).Net()
    weights = dict(np.load(tmp_path / "w.npz"))
    assert weights.keys() == net.state_dict().keys()
    net.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).numpy()
    assert np.array_equal(flat, log["trajectory/x"][-1])


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install 'edgefed[mpi]'")
def test_mpiexec_with_two_ranks_writes_the_simulators_log_with_dropout(tmp_path):
    cfg = write(tmp_path, "f.toml", f'rounds = 2\n[data]\nclients = 3\n[model]\nkind = "torch"\nmodule = "{MODULES}"\n'
                                    'factory = "residual"\n[train]\nclients_per_round = "all"\nlocal_steps = 5\n')
    done = edgefed(["run", cfg, "--out", str(tmp_path / "mpi.h5"), "--quiet"], 2)
    assert done.returncode == 0, done.stderr
    runs.run(load_config(cfg), tmp_path / "sim.h5")
    assert_same_logs(read_run(tmp_path / "sim.h5"), read_run(tmp_path / "mpi.h5"))


def test_mse_step_and_loss_are_torchs(tmp_path):
    model = TorchModel(MODULES, "linear", (6,), 2, np.float64, generator(0, Purpose.INIT), loss="mse")
    g = np.random.default_rng(3)
    X, Y = g.normal(size=(12, 6)), g.normal(size=(12, 2))
    data = ClassificationData(X, Y, X[:3].copy(), Y[:3].copy())
    x0 = model.initial_params()
    x = x0.copy()
    model.local_steps(x, data, model.begin(data, kernel_state(0, Purpose.LOCAL, 1, 0)), 1, None, 0.5)
    W, b = x0[:12].reshape(2, 6), x0[12:]
    residual = X @ W.T + b - Y  # nn.MSELoss: the mean over samples and outputs
    grad = np.concatenate([(2 / residual.size * residual.T @ X).ravel(), 2 / residual.size * residual.sum(0)])
    np.testing.assert_allclose(x, x0 - 0.5 * grad, rtol=1e-12, atol=1e-14)
    total, correct = model.loss_correct(x0, X, Y)
    assert correct == 0 and total == pytest.approx((residual ** 2).mean(1).sum(), rel=1e-12)
    full = np.zeros(model.n_trainable)
    assert model.loss_grad(x0, data, full) == pytest.approx(total / 12, rel=1e-12)
    np.testing.assert_allclose(full, grad, rtol=1e-12, atol=1e-14)


def test_a_board_profile_times_a_module_by_file_factory_and_shape(tmp_path):
    cfg = config_with({"rounds": 2, "data.clients": 3, "train.clients_per_round": "all", "train.local_steps": 40,
                       "model.kind": "torch", "model.module": MODULES, "model.factory": "linear"})
    model = runs.problem_and_model(cfg)[1]
    entry = speed_entry(model, 20, 500.0)
    assert entry["model"] == "torch" and entry["layers"] == "torch_modules.py:linear 60 -> 10"
    (tmp_path / "board.toml").write_text(hwprofile.profile_toml({
        "format": 1, "name": "board", "measured": True, "machine": {"arch": "aarch64", "cores": 4, "memory_mb": 1024},
        "speed": [entry]}))
    runs.run(dataclasses.replace(cfg, device=dataclasses.replace(cfg.device, profile=str(tmp_path / "board.toml")),
                                 participation=dataclasses.replace(cfg.participation, mode="deadline",
                                                                   deadline_s="auto")), tmp_path / "r.h5")
    log = read_run(tmp_path / "r.h5")
    np.testing.assert_allclose(log["attrs"]["deadline_s"], 1.1 * 40 / 500.0)
    assert log["attrs"]["clock"] == "simulated" and (log["participation/steps"] == 40).all()


@pytest.mark.parametrize("factory,message", [
    ("nowhere", "model.factory = 'nowhere' is not a function in"),
    ("broken", "raised ValueError: no such layer size"),
    ("wrong_width", "model.module's output has shape (2, 4) for a batch of 2; it must be (batch, 3)"),
    ("batchnorm", "model.module's buffers change in training (2.running_mean, 2.running_var, 2.num_batches_tracked)"
                  ": edgefed federates parameters only; use GroupNorm"),
    ("integer_parameter", "model.module's parameter steps is torch.int64"),
    ("tuple_output", "model.module's forward returned tuple; it must return one tensor of shape (batch, 3)"),
    ("detached", "model.module's backward on a batch of 2 raised RuntimeError: element 0 of tensors does not "
                 "require grad"),
    ("noisy_always", "model.module draws random numbers in evaluation mode"),
    ("numpy_noise_in_evaluation", "model.module draws from NumPy's global random generator (np.random) in "
                                  "evaluation: nothing seeds it per device"),
    ("python_noise_in_training", "model.module draws from Python's random module in training"),
])
def test_refusals_are_one_line(factory, message):
    with pytest.raises(ConfigError) as err:
        model_of(factory, dtype=np.float32)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("factory,message", [
    ("clamping", "model.module replaced parameter lin.weight (or its gradient) while it ran"),
    ("noisy_on_large_batches", "model.module drew random numbers in training although its first forward drew none"),
    ("numpy_noise_on_large_batches", "model.module draws from NumPy's global random generator (np.random) in training"),
])
def test_what_a_forward_does_wrong_while_training_is_one_line(factory, message):
    model, data = model_of(factory), samples()
    x = model.initial_params()
    with pytest.raises(ConfigError) as err:
        model.local_steps(x, data, model.begin(data, kernel_state(0, Purpose.LOCAL, 1, 0)), 2, 5, 0.1)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_global_randomness_first_seen_in_evaluation_is_one_line():
    """A module whose draws from NumPy's global generator show only on larger batches: evaluation (chunks of up
    to 64 samples) finds them as training does."""
    model, data = model_of("numpy_noise_on_large_batches"), samples()
    with pytest.raises(ConfigError, match=r"np.random\) in evaluation"):
        model.loss_correct(model.initial_params(), data.X_test, data.y_test)


def test_frozen_parameters_stay_the_factorys_and_out_of_x():
    model, data = model_of("frozen_first_layer"), samples()
    assert model.names == ["3.weight", "3.bias"] and model.n_trainable == 8 * 3 + 3
    x0 = model.initial_params()
    x = x0.copy()
    terms = step_terms(np.float64, anchor=x0 + 1.0, mu=0.5)  # FedProx's pull moves only what x holds
    model.local_steps(x, data, model.begin(data, kernel_state(0, Purpose.LOCAL, 1, 0)), 3, 5, 0.1, terms)
    weights = model.state_dict(x)
    assert set(weights) == {"1.weight", "1.bias", "3.weight", "3.bias"}
    assert np.array_equal(weights["1.weight"], model.clone().state_dict(x0)["1.weight"])
    assert np.array_equal(np.concatenate([weights["3.weight"].ravel(), weights["3.bias"]]), x)


def test_a_missing_file_a_relative_path_and_a_missing_torch(tmp_path, monkeypatch, capsys):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.toml").write_text('[model]\nkind = "torch"\nmodule = "m.py"\nfactory = "f"\n')
    code = main(["run", str(tmp_path / "sub" / "c.toml"), "--out", str(tmp_path / "r.h5")])
    assert code == 2 and capsys.readouterr().err.strip() == (
        f"edgefed: error: config: model.module = '{tmp_path / 'sub' / 'm.py'}' is not a file; give the Python file of "
        "your module (relative to the config file, or absolute)")
    assert not (tmp_path / "r.h5").exists()
    from edgefed import torchmodel

    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ConfigError, match=r'pip install "edgefed\[torch\]"'):
        torchmodel.import_torch()


def test_a_module_starts_from_a_state_dict_and_keeps_its_frozen_layer_through_a_run_and_export(tmp_path):
    """[model] weights = a .pt of the module's own state_dict: x_0 is its trainable part, the frozen layer
    (requires_grad False) is the file's on every device, is stored once in the log and comes back in the
    export; a state_dict of another module is one line naming the tensor."""
    g = np.random.default_rng(3)
    weights = {"1.weight": g.normal(size=(8, 6)), "1.bias": g.normal(size=8), "3.weight": g.normal(size=(3, 8)),
               "3.bias": g.normal(size=3)}
    torch.save({k: torch.from_numpy(v.astype(np.float32)) for k, v in weights.items()}, tmp_path / "w.pt")
    np.savez(tmp_path / "d.npz", x_train=g.normal(size=(40, 6)).astype(np.float32), y_train=g.integers(0, 3, 40))
    cfg = load_config(None, ['data.kind="arrays"', f'data.path="{tmp_path / "d.npz"}"', "data.clients=4", "rounds=2",
                             "train.clients_per_round=2", "train.local_steps=2", 'model.kind="torch"',
                             f'model.module="{MODULES}"', 'model.factory="frozen_first_layer"',
                             f'model.weights="{tmp_path / "w.pt"}"'])
    runs.run(cfg, tmp_path / "r.h5")
    log = read_run(tmp_path / "r.h5")
    start = np.concatenate([weights["3.weight"].ravel(), weights["3.bias"]]).astype(np.float32)
    assert log["trajectory/x"][0].tobytes() == start.tobytes()
    assert log["model/frozen"].size == 8 * 6 + 8
    assert main(["export", str(tmp_path / "r.h5"), "--weights", str(tmp_path / "r.npz")]) == 0
    out = np.load(tmp_path / "r.npz")
    assert np.array_equal(out["1.weight"], weights["1.weight"].astype(np.float32))
    assert not np.array_equal(out["3.weight"], weights["3.weight"].astype(np.float32))
    model = model_of("frozen_first_layer")
    with pytest.raises(ConfigError, match=r"has no tensor '3.bias', which model.module's state_dict needs with shape "
                                          r"\(3,\)"):
        model.load_weights({k: v for k, v in weights.items() if k != "3.bias"}, "w.pt")

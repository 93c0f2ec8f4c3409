"""Text and sequences on the kernels: the embedding, LSTM and GRU layers against tests/naive.py's NumPy
reference (PyTorch's semantics) and finite differences, odd shapes included; the compositions refused; token
ids checked where the data is read; LEAF's Shakespeare and Sent140 as token ids; the character LSTM's
exported weights in NumPy and PyTorch; and under mpiexec with deadlines, the simulator's bytes."""

import json
import subprocess
import sys
import tomllib
from collections import Counter

import numpy as np
import pytest

from conftest import config_with
from edgefed import layers as layer_lib
from edgefed.config import load_config
from edgefed.cli import main
from edgefed.errors import ConfigError, EdgefedError
from edgefed.models import Sequential
from edgefed.orchestration import run as runs
from edgefed.problems import ClassificationData, build_problem
from edgefed.problems.text import UNKNOWN_LETTER, Vocabulary
from edgefed.runlog import read_run
from edgefed.runtime.mpi.comm import local_mpiexec, outside_world_env
from golden import write_shakespeare
from naive import network_forward
from test_layer_library import assert_float64_matches_naive, model_for, naive  # (the layer library's own harness)

EMBED = {"type": "embedding", "num": 7, "dim": 3}


def lstm(hidden, **kw):
    return {"type": "lstm", "hidden": hidden, **kw}


def gru(hidden, **kw):
    return {"type": "gru", "hidden": hidden, **kw}


CASES = {  # name: (sample shape, layers before the dense head, samples)
    "embedding with padding_idx, 2 LSTM layers, every step flattened": (
        (5,), [{**EMBED, "padding_idx": 2}, lstm(4, layers=2, output="all"), {"type": "flatten"}], 6),
    "embedding, 3 GRU layers, the last step": ((5,), [EMBED, gru(4, layers=3)], 6),
    "float sequences, an LSTM of one unit": ((4, 3), [lstm(1)], 5),
    "a GRU's sequence into an LSTM, then tanh": ((3, 2), [gru(3, output="all"), lstm(2), {"type": "tanh"}], 4),
    "one step, one sample": ((1,), [EMBED, lstm(2, output="all"), {"type": "dropout", "rate": 0.5},
                                    {"type": "flatten"}], 1),
}


def samples(model, n, seed=0):
    g = np.random.default_rng(seed)
    if model.network.layers[0]["type"] == "embedding":
        X = g.integers(0, model.network.layers[0]["num"], (n, model.n_features)).astype(model.dtype)
    else:
        X = g.normal(size=(n, model.n_features)).astype(model.dtype)
    y = g.integers(0, model.n_outputs, n)
    return ClassificationData(X, y, X.copy(), y.copy())


@pytest.mark.parametrize("case", list(CASES))
def test_sequence_layers_forward_and_backward_against_numpy(case):
    shape, layers, n = CASES[case]
    model = model_for(shape, layers, np.float64)
    assert_float64_matches_naive(model, samples(model, n), loss_rel=1e-12)


def test_float32_char_model_against_numpy_and_the_padding_row():
    """float32 (the run's dtype) within its rounding; the padding_idx row starts at zero and never moves."""
    model = model_for((6,), [{"type": "embedding", "num": 9, "dim": 4, "padding_idx": 0}, lstm(5, layers=2)],
                      np.float32)
    data = samples(model, 8, seed=4)
    x = model.initial_params()
    pad = model.state_dict(x)["0.weight"][0]
    assert not pad.any() and model.state_dict(x)["0.weight"][1:].std() > 0.5  # N(0, 1), as nn.Embedding's
    grad = np.zeros(model.n_trainable, np.float32)
    model.loss_grad(x, data, grad)
    _, ref_grads, ref_out = naive(model, x, data.X_train, data.y_train)
    np.testing.assert_allclose(model.outputs(x, data.X_train), ref_out, rtol=2e-4, atol=2e-5)
    for name, value in ref_grads.items():
        np.testing.assert_allclose(model.state_dict(grad)[name], value, rtol=2e-3, atol=2e-5, err_msg=name)
    assert (data.X_train == 0).any() and not model.state_dict(grad)["0.weight"][0].any()
    model.local_steps(x, data, model.begin(data, np.arange(4, dtype=np.uint64)), 3, 4, 0.5)
    assert not model.state_dict(x)["0.weight"][0].any()


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_gradients_match_finite_differences(kind):
    model = model_for((4,), [EMBED, {"type": kind, "hidden": 3, "layers": 2, "output": "all"}, {"type": "flatten"}],
                      np.float64)
    data = samples(model, 3, seed=1)
    x = model.initial_params()
    grad = np.zeros(model.n_trainable)
    model.loss_grad(x, data, grad)
    for j in np.random.default_rng(2).choice(model.n_trainable, 12, replace=False):
        e = np.zeros(model.n_trainable)
        e[j] = 1e-6
        fd = (model.train_loss(x + e, data) - model.train_loss(x - e, data)) / 2e-6
        assert fd == pytest.approx(grad[j], abs=1e-8), j


def test_the_character_lstm_is_mcmahans():
    layers = layer_lib.builtin_layers("charlstm", (80,), 80)
    assert [layer["type"] for layer in layers] == ["embedding", "lstm", "dense"]
    assert Sequential.builtin("charlstm", (80,), 80, np.float32).n_trainable == 819_920


@pytest.mark.parametrize("shape,layers,message", [
    ((1, 6, 6), [{"type": "conv2d", "out": 2, "kernel": 3}, lstm(4)],
     "model.layers[1] (lstm) takes (L, F) sequences, got maps (2, 6, 6)"),
    ((8,), [gru(4)], "model.layers[0] (gru) takes (L, F) sequences, got a flat input (8,); put an embedding before it"),
    ((8,), [{"type": "dropout"}, EMBED], "model.layers[1] (embedding) takes token ids, a sample of shape (L,), so it "
                                          "must be the first layer"),
    ((8,), [EMBED, {"type": "conv1d", "out": 2, "kernel": 3}], "model.layers[1] (conv1d) takes (C, L) maps, but its "
                                                               "input (8, 3) is a sequence"),
    ((8,), [EMBED, lstm(4, output="all"), {"type": "dense", "out": 3}], "model.layers[2] (dense) takes a flat input, "
                                                                       "got (8, 4)"),
    ((8,), [{**EMBED, "padding_idx": 7}, lstm(2)], "padding_idx = 7 must be below num = 7"),
    ((8,), [EMBED, lstm(2, output="first")], "model.layers[1].output = 'first' must be one of 'last', 'all'"),
    ((8,), [EMBED, lstm(4), gru(4)], "model.layers[2] (gru) takes (L, F) sequences, got a flat input (4,); set output = "
                                     '"all" on model.layers[1] (lstm), so that it hands this layer its whole sequence'),
])
def test_compositions_that_cannot_work_are_refused_naming_the_layer(shape, layers, message):
    with pytest.raises(ConfigError) as err:
        layer_lib.build(layer_lib.check_layers(layers + [{"type": "flatten"}, {"type": "dense", "out": 3}]), shape, 3,
                        np.float32)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_every_layer_types_example_in_a_missing_setting_message_is_a_layer_that_checks():
    """A message for a missing setting shows a layer to copy: it must be one (no invented keys)."""
    for kind, spec in layer_lib.TYPES.items():
        if any(default is layer_lib.REQUIRED for default, _ in spec.settings.values()):
            with pytest.raises(ConfigError, match=r"needs '\w+', e.g. ") as err:
                layer_lib.check_layers([{"type": kind}])
            example = tomllib.loads(f"layer = {str(err.value).partition('e.g. ')[2]}")["layer"]
            assert layer_lib.check_layers([example])[0]["type"] == kind


# -- token ids where the data is read ------------------------------------------------------------------------
TOKENS = {"model.kind": "sequential", "model.layers": [{"type": "embedding", "num": 10, "dim": 2}, lstm(3),
                                                       {"type": "dense", "out": 2}]}


def arrays_config(tmp_path, x, **extra):
    np.savez(tmp_path / "ids.npz", x_train=x, y_train=np.arange(x.shape[0]) % 2)
    return config_with({"data.kind": "arrays", "data.path": str(tmp_path / "ids.npz"), "data.clients": 2, "rounds": 1,
                        "train.clients_per_round": 2, **TOKENS,
                        **extra})


@pytest.mark.parametrize("x,extra,message", [
    (np.arange(60).reshape(20, 3) % 10, {"data.normalize": "standard"},
     "data.normalize = 'standard' would change the token ids an embedding takes"),
    ((np.arange(60).reshape(20, 3) % 10).astype(np.float32), {}, "the samples are not integers, but the model's first "
                                                                 "layer is an embedding"),
    (np.where(np.arange(60).reshape(20, 3) == 40, 10, 1), {}, "sample 8 (row 13 of x_train) holds the token id 10, "
                                                             "outside [0, 10)"),
])
def test_token_ids_are_checked_when_the_data_is_read(tmp_path, x, extra, message):
    cfg = arrays_config(tmp_path, x, **extra)
    with pytest.raises(ConfigError, match=r"^[^\n]*$") as err:
        runs.run(cfg, tmp_path / "r.h5")
    assert message in str(err.value) and not (tmp_path / "r.h5").exists()
    if "holds the token id" in message:
        assert "device 0's training sample 8" in str(err.value)  # (the iid split put row 13 there)


def leaf_folder(tmp_path, task_samples):
    """A LEAF folder with train/ and test/ from {part: {user: (x, y)}}."""
    for part, users in task_samples.items():
        data = {"users": list(users), "num_samples": [len(x) for x, _ in users.values()],
                "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()}}
        (tmp_path / part).mkdir(parents=True, exist_ok=True)
        (tmp_path / part / "data.json").write_text(json.dumps(data))
    return tmp_path


def test_leaf_shakespeare_reads_characters_as_letter_ids(tmp_path):
    a, b = "To be, or not to be" + "—" * 2 + " " * 59, "x" * 79 + "$"
    folder = leaf_folder(tmp_path, {"train": {"HAMLET": ([a, b], ["T", "é"]), "OSRIC": ([b], ["y"])},
                                    "test": {"HAMLET": ([b], ["z"])}})  # OSRIC: no test samples
    cfg = load_config(None, ['data.kind="leaf"', f'data.path="{folder}"'])
    assert cfg.model.kind == "charlstm"  # LEAF Shakespeare's natural model
    problem = build_problem(cfg.data, 0, "float32", tokens=80)
    assert "Shakespeare, the next of 80 characters (6 outside them read as a space), 2 users" in problem.describe()
    hamlet, osric = problem.device(0), problem.device(1)
    assert hamlet.X_train.dtype == np.float32 and hamlet.X_train.shape == (2, 80)
    assert hamlet.X_train[0, :3].tolist() == [44, 67, 1] and hamlet.X_train[0, 19] == UNKNOWN_LETTER == 1  # "To "
    assert hamlet.X_train[1, 79] == UNKNOWN_LETTER and hamlet.y_train.tolist() == [44, UNKNOWN_LETTER]
    assert osric.X_test.shape == (0, 80) and hamlet.y_test.tolist() == [78]
    with pytest.raises(ConfigError, match=r"LEAF Shakespeare samples are token ids; a layer list must start with an "
                                          r"embedding .* or give a torch module that takes them"):
        runs.run(load_config(None, ['data.kind="leaf"', f'data.path="{folder}"', 'model.kind="mlp"']), tmp_path / "m.h5")
    assert not (tmp_path / "m.h5").exists()


def test_leaf_sent140_reads_tweets_as_word_ids(tmp_path):
    tweet = lambda text: ["1", "Mon Apr 06", "NO_QUERY", "someone", text]  # noqa: E731
    long = " ".join(f"w{i}" for i in range(30))
    folder = leaf_folder(tmp_path, {"train": {"u1": ([tweet("good good day!"), tweet(""), tweet(long)], [1, 0, 0]),
                                              "u2": ([tweet("bad day, bad")], [0])},
                                    "test": {"u1": ([tweet("good night")], [1])}})
    data = {"data.kind": "leaf", "data.path": str(folder)}
    problem = build_problem(config_with({**data, **TOKENS, "data.vocab_size": 3}).data, 0, "float32", tokens=10)
    assert "Sent140, 25 words a tweet, a vocabulary of 5 ids (0 padding, 1 unknown), 2 users" in problem.describe()
    u1 = problem.device(0)
    # by count: bad 2, day 2, good 2 (ties in code-point order), then the rest
    assert u1.X_train[0, :5].tolist() == [4, 4, 3, 1, 0] and not u1.X_train[1].any()
    assert u1.X_train[2].tolist() == [1] * 25 and u1.X_test[0, :3].tolist() == [4, 1, 0]
    assert Vocabulary.from_counts(Counter("b a b c".split()), 2).words == ["b", "a"]
    with pytest.raises(ConfigError, match=r"LEAF Sent140's ids run to 4, beyond the model's 4; give the embedding "
                                          r"num = 5$"):
        build_problem(config_with({**data, **TOKENS, "data.vocab_size": 3}).data, 0, "float32", tokens=4)
    with pytest.raises(ConfigError, match=r'ids run to 4, beyond the model\'s 4; model.kind = "charlstm" takes 4 ids; '
                                          r'use a layer list \(model.kind = "sequential"\) whose embedding has num = 5'):
        build_problem(config_with({**data, **TOKENS, "data.vocab_size": 3}).data, 0, "float32", tokens=4,
                      builtin="charlstm")
    (tmp_path / "words.txt").write_text("night\ngood\n")
    problem = build_problem(config_with({**data, **TOKENS, "data.vocab": str(tmp_path / "words.txt")}).data, 0,
                            "float32", tokens=10)
    assert problem.device(0).X_test[0, :3].tolist() == [3, 2, 0] and "4 ids" in problem.describe()
    for text, message in (("the\ncat\nthe\ndog\n", "line 3, 'the', repeats line 1"), ("the\n\ncat\n", "line 2 is blank"),
                          ("the\nbad day\n", "line 2, 'bad day', is not one word as tweets are split")):
        (tmp_path / "words.txt").write_text(text)  # never renumbered behind the user's back
        with pytest.raises(ConfigError, match=f"config: data.vocab = '{tmp_path / 'words.txt'}': {message}"):
            build_problem(config_with({**data, **TOKENS, "data.vocab": str(tmp_path / "words.txt")}).data, 0,
                          "float32", tokens=10)
    with pytest.raises(ConfigError, match="Sent140, which has no built-in model"):
        load_config(None, ['data.kind="leaf"', f'data.path="{folder}"'])


TWEET = ["1", "Mon Apr 06", "NO_QUERY", "someone", "a b"]


@pytest.mark.parametrize("x,y,message", [
    (["a" * 79, "b" * 80, "c" * 80], ["x", "y", "z"], "user 'u': sample 0 has 79 characters but the user's other "
                                                        "samples have 80; give every sample one length"),
    ([TWEET[:4], TWEET, TWEET], [0, 1, 1], "user 'u': sample 0 is not one of Sent140's tweets (five fields) like the "
                                           "others (\"['1', 'Mon Apr 06', 'NO_QUERY', 'someone\")"),
    ([[1, 2, 3], TWEET, TWEET], [0, 1, 1], "user 'u': sample 0 is not one of Sent140's tweets (five fields) like the "
                                           "others ('[1, 2, 3]')"),
    (["a" * 80, "b" * 80], [3, 4], "user 'u': label 0 is 3; a Shakespeare label is the one character that follows "
                                   'its sample, as a string ("e", not a number)'),
    ([[1.0, 2.0], [1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], [0, 1, 1], "user 'u': sample 0 has shape (2,) but the user's "
                                                                "other samples have (3,)"),
])
def test_a_bad_sample_is_named_itself_with_the_fix_of_its_task(tmp_path, x, y, message):
    """The odd sample is the one named (the user's samples decide its task and length), not the next one."""
    from edgefed.problems.leaf import convert_leaf

    with pytest.raises(EdgefedError) as err:
        convert_leaf(leaf_folder(tmp_path / "leaf", {"train": {"u": (x, y)}}), tmp_path / "out.h5")
    assert list(tmp_path.iterdir()) == [tmp_path / "leaf"]  # nothing written
    assert message in str(err.value) and "\n" not in str(err.value)


def test_shakespeare_samples_of_no_characters_are_one_line_in_run_and_warmup(tmp_path, capsys):
    folder = leaf_folder(tmp_path / "leaf", {"train": {"a": (["", ""], ["x", "y"]), "b": ([""], ["z"])}})
    (tmp_path / "c.toml").write_text(f'[data]\nkind = "leaf"\npath = "{folder}"\n')
    for args in (["run", str(tmp_path / "c.toml"), "--out", str(tmp_path / "r.h5")],
                 ["warmup", "--config", str(tmp_path / "c.toml")]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "user 'a': sample 0 is an empty string; a Shakespeare sample is a window" in err
    assert not (tmp_path / "r.h5").exists()


def test_the_character_lstms_exported_weights_give_the_logs_predictions(tmp_path):
    """Exported weights in tests/naive.py's NumPy forward pass give the log's test accuracy; where torch is
    installed, the printed module takes the file as it is, gives the same outputs, and one full-batch SGD
    step of autograd equals the kernels' gradient step."""
    from edgefed.analysis.export import export_weights
    from edgefed.analysis.logs import Run

    write_shakespeare(tmp_path / "leaf", users=3, samples=5)
    cfg = config_with({"rounds": 2, "data.kind": "leaf", "data.path": str(tmp_path / "leaf"), "model.kind": "charlstm",
                       "train.clients_per_round": 2, "train.local_steps": 2, "train.batch_size": 5,
                       "train.lr_local": 1.0})
    runs.run(cfg, tmp_path / "r.h5")
    log = read_run(tmp_path / "r.h5")
    _, text = export_weights(Run.read(tmp_path / "r.h5"), tmp_path / "w.npz")
    weights = dict(np.load(tmp_path / "w.npz"))
    problem = build_problem(cfg.data, cfg.seed, "float32", tokens=80)
    X = np.concatenate([problem.device(k).X_test for k in range(3)])
    y = np.concatenate([problem.device(k).y_test for k in range(3)])
    layers = layer_lib.builtin_layers("charlstm", (80,), 80)
    out = network_forward(layers, {k: v.astype(np.float64) for k, v in weights.items()}, X.astype(np.int64))[0]
    assert (out.argmax(axis=1) == y).mean() == pytest.approx(float(log["metrics/test_accuracy"][-1]))
    torch = pytest.importorskip("torch", reason="the torch extra is not installed: pip install 'edgefed[torch]'")
    nn = torch.nn
    scope = {"nn": nn}
    *classes, sequential = text.split("nn.Sequential(")
    exec("".join(classes), scope)
    module = eval("nn.Sequential(" + sequential.split("\nits inputs")[0], scope).double()
    module.load_state_dict({k: torch.from_numpy(v).double() for k, v in weights.items()})
    ids = torch.from_numpy(X.astype(np.int64))
    np.testing.assert_allclose(module(ids).detach().numpy(), out, rtol=1e-9, atol=1e-10)
    model = Sequential.builtin("charlstm", (80,), 80, np.float64)
    params = log["trajectory/x"][-1].astype(np.float64)
    data = ClassificationData(X.astype(np.float64), y, X[:1].astype(np.float64), y[:1])
    stepped = params.copy()
    model.local_steps(stepped, data, model.begin(data, np.arange(4, dtype=np.uint64)), 1, None, 0.3)
    loss = nn.functional.cross_entropy(module(ids), torch.from_numpy(y))
    loss.backward()
    with torch.no_grad():
        for p in module.parameters():
            p -= 0.3 * p.grad
    ours = model.state_dict(stepped)
    for name, value in module.state_dict().items():
        np.testing.assert_allclose(ours[name], value.numpy(), rtol=1e-9, atol=1e-12, err_msg=name)


MPIEXEC = local_mpiexec()


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install 'edgefed[mpi]'")
def test_a_character_lstm_under_deadlines_in_mpiexec_writes_the_simulators_bytes(tmp_path):
    """Deadlines on a simulated clock (a board profile timing the character LSTM): the steps each device
    completes, and every byte of the trajectory, are the simulator's under `mpiexec -n 3`."""
    from edgefed import hwprofile

    write_shakespeare(tmp_path / "leaf", users=4, samples=6)
    board = tmp_path / "board.toml"
    board.write_text(hwprofile.profile_toml({
        "format": 1, "name": "test board", "measured": True, "machine": {"arch": "aarch64", "cores": 4, "memory_mb": 512},
        "speed": [{"model": "charlstm", "params": 819920, "batch": 5, "steps_per_s": 20.0}]}))
    text = (f'rounds = 2\nseed = 3\n[data]\nkind = "leaf"\npath = "{tmp_path / "leaf"}"\n[train]\nclients_per_round = 3\n'
            'local_steps = 4\nbatch_size = 5\nlr_local = 1.0\n[participation]\nmode = "deadline"\ndeadline_s = 0.22\n'
            f'clock = "simulated"\n[device]\nprofile = "{board}"\nspeed = [1.0, 0.5]\n')
    (tmp_path / "c.toml").write_text(text)
    runs.run(load_config(tmp_path / "c.toml"), tmp_path / "sim.h5")
    done = subprocess.run([MPIEXEC, "-n", "3", sys.executable, "-m", "edgefed", "run", str(tmp_path / "c.toml"), "--out",
                           str(tmp_path / "mpi.h5"), "--quiet"], capture_output=True, text=True, timeout=300,
                          env=outside_world_env())
    assert done.returncode == 0, done.stderr
    sim, mpi = read_run(tmp_path / "sim.h5"), read_run(tmp_path / "mpi.h5")
    steps = sim["participation/steps"]
    assert set(steps[steps > 0].tolist()) == {2, 4}  # the slow board's devices finish half their budget
    for key in ("trajectory/x", "participation/steps", "metrics/test_accuracy", "metrics/train_loss"):
        assert sim[key].tobytes() == mpi[key].tobytes(), key


def test_a_device_without_test_samples_is_built_again_alone(tmp_path):
    """A device built once more on its own (its data dropped from the cache, or asked for twice) reads no test
    rows: zero samples of the right width, not a reshape error."""
    folder = leaf_folder(tmp_path, {"train": {"A": (["a" * 80, "b" * 80], ["a", "b"]), "B": (["c" * 80], ["c"])},
                                    "test": {"A": (["d" * 80], ["d"])}})
    problem = build_problem(load_config(None, ['data.kind="leaf"', f'data.path="{folder}"']).data, 0, "float32",
                            tokens=80)
    problem.device(1)
    again = problem.device(1)
    assert again.X_test.shape == (0, 80) and again.X_train.shape == (1, 80)

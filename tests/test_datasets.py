"""Datasets from files: arrays (.npz, .h5), LEAF's JSON and CIFAR's python batches, written here by the tests;
partitions (natural, Dirichlet), normalization, reading only a process's own devices, the label counts a
log keeps, and every refusal in one line."""

import json
import pickle
import re
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import config_with
from edgefed.config import load_config
from edgefed.errors import ConfigError, EdgefedError
from edgefed.problems.partition import DIRICHLET_DRAWS, partition
from edgefed.rng import Purpose, generator
from helpers import problem_of


def arrays_file(tmp_path, name="data.npz", n=60, shape=(2, 4, 4), classes=3, test=12, device=None, **extra):
    g = np.random.default_rng(0)
    arrays = {"x_train": g.integers(0, 256, (n, *shape)).astype(np.float32), "y_train": g.integers(0, classes, n)}
    if test:
        arrays["x_test"] = g.integers(0, 256, (test, *shape)).astype(np.float32)
        arrays["y_test"] = g.integers(0, classes, test)
    if device is not None:
        arrays["device_train"] = device
    arrays.update(extra)
    path = tmp_path / name
    if name.endswith(".h5"):
        with h5py.File(path, "w") as f:
            for key, value in arrays.items():
                f[key] = value
    else:
        np.savez(path, **arrays)
    return path, arrays


def cfg_for(path, **data):
    return config_with({"data.kind": "arrays", "data.path": str(path), **{f"data.{k}": v for k, v in data.items()},
                        "model.kind": "logreg", "train.clients_per_round": 2})


@pytest.mark.parametrize("name", ["data.npz", "data.h5"])
def test_arrays_devices_hold_their_partition_and_every_test_sample_once(tmp_path, name):
    path, arrays = arrays_file(tmp_path, name)
    problem = problem_of(cfg_for(path, clients=4))
    assert problem.sample_shape == (2, 4, 4) and problem.n_classes == 3 and problem.n_devices == 4
    parts = partition("iid", arrays["y_train"], 4, 0, 3).parts
    tests = []
    for k in range(4):
        d = problem.device(k)
        np.testing.assert_array_equal(d.X_train, arrays["x_train"][parts[k]].reshape(len(parts[k]), -1))
        np.testing.assert_array_equal(d.y_train, arrays["y_train"][parts[k]])
        tests.append(d.X_test)
    together = np.concatenate(tests)
    assert together.shape[0] == 12  # all of x_test, each row once: the log's test metrics are x_test's
    assert sorted(map(bytes, together)) == sorted(map(bytes, arrays["x_test"].reshape(12, -1)))


def test_a_process_reads_only_its_own_devices_rows(tmp_path, monkeypatch):
    path, _ = arrays_file(tmp_path, "data.h5")
    problem = problem_of(cfg_for(path, clients=4))
    asked = []
    read = problem.source.read
    monkeypatch.setattr(problem.source, "read", lambda part, rows: asked.append((part, rows.copy())) or read(part, rows))
    problem.host([1, 3])
    problem.device(3)
    problem.device(1)
    train = np.concatenate([rows for part, rows in asked if part == "train"])
    assert sorted(train) == sorted(np.concatenate([problem.train_rows[1], problem.train_rows[3]]))
    # an .h5 file's rows are read a device at a time, as it is built: only the hosted devices', nothing ahead
    assert [part for part, _ in asked] == ["train", "test"] * 2
    assert list(asked[0][1]) == list(problem.train_rows[3]) and list(asked[2][1]) == list(problem.train_rows[1])


def test_natural_partition_from_device_train_and_a_holdout_without_x_test(tmp_path):
    device = np.repeat([2, 0, 1], 20)
    path, arrays = arrays_file(tmp_path, device=device, test=0)
    problem = problem_of(cfg_for(path, partition="natural", test_fraction=0.25))
    assert problem.n_devices == 3
    for k in range(3):
        d = problem.device(k)
        own = np.flatnonzero(device == k)
        assert d.n_train == 15 and d.X_test.shape[0] == 5  # a quarter of each device's samples held out
        rows = {bytes(r) for r in arrays["x_train"][own].reshape(20, -1)}
        assert {bytes(r) for r in np.concatenate([d.X_train, d.X_test])} == rows
    first_two = problem_of(cfg_for(path, partition="natural", clients=2))
    assert first_two.n_devices == 2


def test_dirichlet_partition_skews_labels_as_alpha_says():
    labels = np.repeat(np.arange(10), 300)
    skew = []
    for alpha in (100.0, 0.2):
        parts = partition("dirichlet", labels, 10, 3, 10, alpha).parts
        assert sorted(np.concatenate(parts)) == list(range(3000))  # every sample once
        counts = np.stack([np.bincount(labels[p], minlength=10) for p in parts])
        shares = counts / counts.sum(axis=1, keepdims=True)
        skew.append(0.5 * np.abs(shares - 0.1).sum(axis=1).mean())
    assert skew[0] < 0.15 < 0.5 < skew[1]
    again = partition("dirichlet", labels, 10, 3, 10, 0.2).parts
    assert all(np.array_equal(a, b) for a, b in zip(again, partition("dirichlet", labels, 10, 3, 10, 0.2).parts))


def dirichlet_first_draw(labels, n_devices, seed, n_classes, alpha):
    """The dirichlet partition as it was before data.min_partition_size (one draw, no redraw), frozen here."""
    g = generator(seed, Purpose.DATA_DEVICE, round_idx=1)
    parts = [[] for _ in range(n_devices)]
    for c in range(n_classes):
        pool = g.permutation(np.flatnonzero(labels == c))
        share = generator(seed, Purpose.DATA_DEVICE, 3, c).dirichlet(np.full(n_devices, alpha))
        cuts = np.round(np.cumsum(share)[:-1] * pool.size).astype(np.int64)
        for k, part in enumerate(np.split(pool, cuts)):
            parts[k].append(part)
    return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]


@pytest.mark.parametrize("alpha,seed,min_size", [(0.5, 0, 10), (0.2, 3, 10), (100.0, 1, 10), (0.05, 7, 2)])
def test_a_dirichlet_first_draw_that_fits_is_the_partition_it_always_was(alpha, seed, min_size):
    """(0.05, 7): a device of 6 samples, kept with min_partition_size = 2 as it always was."""
    labels = np.random.default_rng(5).integers(0, 10, 3000)
    got = partition("dirichlet", labels, 12, seed, 10, alpha, min_size=min_size)
    assert got.draws == 1
    before = dirichlet_first_draw(labels, 12, seed, 10, alpha)
    assert len(got.parts) == 12 and all(np.array_equal(a, b) for a, b in zip(got.parts, before))


def test_dirichlet_draws_again_until_every_device_holds_min_partition_size():
    labels = np.repeat(np.arange(10), 200)
    first = dirichlet_first_draw(labels, 20, 0, 10, 0.1)
    assert min(p.size for p in first) < 10  # the draw earlier versions took (or refused) is too small
    got = partition("dirichlet", labels, 20, 0, 10, 0.1, min_size=10)
    assert got.draws > 1 and min(p.size for p in got.parts) >= 10
    assert sorted(np.concatenate(got.parts)) == list(range(2000))  # every sample once
    again = partition("dirichlet", labels, 20, 0, 10, 0.1, min_size=10)  # a function of the seed
    assert again.draws == got.draws and all(np.array_equal(a, b) for a, b in zip(got.parts, again.parts))
    other = partition("dirichlet", labels, 20, 1, 10, 0.1, min_size=10)
    assert min(p.size for p in other.parts) >= 10
    assert not all(np.array_equal(a, b) for a, b in zip(got.parts, other.parts))


def test_a_dirichlet_partition_no_draw_fits_is_refused_in_one_line():
    labels = np.repeat(np.arange(4), 20)  # 80 samples: 8 devices of 10 each would take an exactly even draw
    with pytest.raises(ConfigError) as err:
        partition("dirichlet", labels, 8, 0, 4, 0.5, min_size=10)
    best = int(re.search(r"left a device with (\d+) samples at best", str(err.value))[1])
    assert str(err.value) == (
        f'config: data.partition = "dirichlet" with dirichlet_alpha = 0.5 over 8 devices left a device with {best} '
        f"samples at best in {DIRICHLET_DRAWS} draws, below data.min_partition_size = 10; raise dirichlet_alpha, use "
        "fewer devices (data.clients), or lower min_partition_size")
    first = min(p.size for p in dirichlet_first_draw(labels, 8, 0, 4, 0.5))
    assert first < best < 10  # the best draw's smallest device, better than the first draw's
    assert min(p.size for p in partition("dirichlet", labels, 8, 0, 4, 0.5, min_size=best).parts) == best
    with pytest.raises(ConfigError, match=r'"dirichlet" cannot give 8 devices 10 samples each \(data.min_partition_size'
                                          r"\) from 40; use at most 4 devices"):  # (at once: no draw is tried)
        partition("dirichlet", labels[:40], 8, 0, 4, 0.5, min_size=10)


def test_the_log_records_the_dirichlet_partitions_draws(tmp_path, run_experiment):
    path, _ = arrays_file(tmp_path)  # 60 samples of 3 labels: seed 0's first draws leave a device under 10
    overrides = {"data.kind": "arrays", "data.path": str(path), "data.clients": 4, "data.partition": "dirichlet",
                 "model.kind": "logreg", "train.clients_per_round": 2, "rounds": 2, "train.local_steps": 2}
    problem = problem_of(config_with(overrides))
    assert problem.partition_draws > 1 and problem.n_train.min() >= 10
    log = run_experiment(overrides, name="r.h5")
    assert log["attrs"]["partition_draws"] == problem.partition_draws
    assert f"(dirichlet(0.5), {problem.partition_draws} draws for min_partition_size 10)" in log["attrs"]["problem"]
    assert log["devices/n_train"].tolist() == problem.n_train.tolist()
    assert problem_of(cfg_for(path, clients=4)).partition_draws is None  # the other partitions draw once


@pytest.mark.parametrize("value", [0, -1, 1.5, "x"])
def test_a_bad_min_partition_size_is_one_line(value):
    with pytest.raises(ConfigError) as err:
        config_with({"data.min_partition_size": value})
    assert "data.min_partition_size" in str(err.value) and "\n" not in str(err.value)


def test_normalize_standard_per_channel_and_unit(tmp_path):
    path, arrays = arrays_file(tmp_path)
    x = arrays["x_train"].astype(np.float64)
    standard = problem_of(cfg_for(path, clients=2, normalize="standard"))
    pooled = np.concatenate([standard.device(k).X_train for k in range(2)]).reshape(-1, 2, 16)
    np.testing.assert_allclose(pooled.mean(axis=(0, 2)), 0, atol=1e-5)
    np.testing.assert_allclose(pooled.std(axis=(0, 2)), 1, atol=1e-5)
    assert pooled.shape[0] == 60 and np.abs(x.mean(axis=(0, 2, 3))).min() > 1  # per channel: C = 2 statistics
    unit = problem_of(cfg_for(path, clients=2, normalize="unit")).device(0)
    assert 0 <= unit.X_train.min() and unit.X_train.max() <= 1


def test_float_targets_for_mse(tmp_path):
    path, _ = arrays_file(tmp_path, y_train=np.linspace(0, 1, 60), y_test=np.linspace(1, 2, 12), classes=1)
    cfg = config_with({"data.kind": "arrays", "data.path": str(path), "data.clients": 3, "model.kind": "sequential",
                       "model.loss": "mse", "model.layers": [{"type": "flatten"}, {"type": "dense", "out": 1}],
                       "train.clients_per_round": 2})
    problem = problem_of(cfg)
    d = problem.device(0)
    assert problem.n_outputs == 1 and d.y_train.dtype == np.float32 and d.y_train.shape == (d.n_train, 1)
    assert problem.label_counts() is None


def leaf_folder(tmp_path, users=(("ann", 5), ("bob", 3), ("cyd", 4)), x=None):
    g = np.random.default_rng(1)
    for part, per in (("train", 1.0), ("test", 0.5)):
        (tmp_path / part).mkdir(parents=True, exist_ok=True)
        files = [users[:2], users[2:]]
        for i, chunk in enumerate(files):
            data = {"users": [u for u, _ in chunk], "num_samples": [], "user_data": {}}
            for u, n in chunk:
                m = max(1, int(n * per))
                data["num_samples"].append(m)
                data["user_data"][u] = {"x": x if x is not None else g.random((m, 16)).round(3).tolist(),
                                        "y": g.integers(0, 4, m).tolist()}
            (tmp_path / part / f"part_{i}.json").write_text(json.dumps(data))
    return tmp_path


def test_leaf_one_device_per_user_in_file_order_with_its_own_test_samples(tmp_path):
    folder = leaf_folder(tmp_path / "leaf")
    cfg = config_with({"data.kind": "leaf", "data.path": str(folder), "model.kind": "logreg",
                       "train.clients_per_round": 2})
    problem = problem_of(cfg)
    assert problem.n_devices == 3 and problem.n_train.tolist() == [5, 3, 4] and problem.sample_shape == (16,)
    raw = json.loads((folder / "train" / "part_1.json").read_text())["user_data"]["cyd"]
    test = json.loads((folder / "test" / "part_0.json").read_text())["user_data"]["bob"]
    cyd, bob = problem.device(2), problem.device(1)
    np.testing.assert_allclose(cyd.X_train, np.asarray(raw["x"], np.float32))
    assert cyd.y_train.tolist() == raw["y"]
    np.testing.assert_allclose(bob.X_test, np.asarray(test["x"], np.float32))


def write_cifar(folder, kind="cifar10", n=6):
    folder.mkdir(parents=True, exist_ok=True)
    g = np.random.default_rng(2)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"] if kind == "cifar10" else ["train", "test"]
    for name in names:
        batch = {b"data": g.integers(0, 256, (n, 3072)).astype(np.uint8)}
        if kind == "cifar10":
            batch[b"labels"] = g.integers(0, 10, n).tolist()
        else:
            batch[b"fine_labels"], batch[b"coarse_labels"] = g.integers(0, 100, n).tolist(), g.integers(0, 20, n).tolist()
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)
    return folder


@pytest.mark.parametrize("kind,split,classes", [("cifar10", None, 10), ("cifar100", "coarse", 20)])
def test_cifar_python_batches(tmp_path, kind, split, classes):
    folder = write_cifar(tmp_path / kind, kind)
    cfg = config_with({"data.kind": kind, "data.path": str(folder), "data.clients": 3, "data.split": split,
                       "train.clients_per_round": 2})
    problem = problem_of(cfg)
    assert problem.n_classes == classes and problem.sample_shape == (3, 32, 32)
    name = "data_batch_2" if kind == "cifar10" else "train"
    with open(folder / name, "rb") as f:
        batch = pickle.load(f)
    d = problem.device(0)
    rows = problem.train_rows[0]
    first = rows[(rows >= 6) & (rows < 12)][0] if kind == "cifar10" else rows[0]
    at = int(np.searchsorted(rows, first))
    np.testing.assert_array_equal(d.X_train[at], batch[b"data"][first - (6 if kind == "cifar10" else 0)] / np.float32(255))


def test_a_cifar_file_that_would_run_code_is_refused(tmp_path):
    folder = write_cifar(tmp_path / "c10")

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with open(folder / "test_batch", "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": [0]}, f)
    cfg = config_with({"data.kind": "cifar10", "data.path": str(folder), "data.clients": 3,
                       "train.clients_per_round": 2})
    with pytest.raises(EdgefedError, match="builtins.print is not part of a CIFAR batch"):
        problem_of(cfg)


def test_label_counts_in_the_log_and_the_summary(tmp_path, run_experiment):
    path, arrays = arrays_file(tmp_path, device=np.repeat([0, 1, 2], 20), test=0)
    log = run_experiment({"data.kind": "arrays", "data.path": str(path), "data.partition": "natural",
                          "model.kind": "logreg", "train.clients_per_round": 2, "rounds": 1,
                          "train.local_steps": 2}, name="r.h5")
    counts = log["devices/label_counts"]
    assert counts.shape == (3, 3) and counts.dtype == np.int64
    assert counts.sum(axis=1).tolist() == log["devices/n_train"].tolist()
    from edgefed.analysis.logs import Run
    from edgefed.analysis.summary import summary_lines

    text = "\n".join(summary_lines(Run.read(tmp_path / "r.h5")))
    assert "partition: 3 devices x 3 labels" in text and "label skew" in text


@pytest.mark.parametrize("change,message", [
    (dict(drop="y_train"), "has no 'y_train'"),
    (dict(y_train=np.zeros(59, np.int64)), "y_train has 59 entries but x_train has 60 samples"),
    (dict(device_train=np.zeros(3, np.int64)), "device_train has 3 entries but x_train has 60 samples"),
    (dict(y_train=np.full(60, 7)), "has the label 7, outside [0, 3) (data.classes = 3)"),
    (dict(y_train=np.full(60, 0.5)), "labels that are not integers"),
    (dict(x_train=np.full((60, 2, 4, 4), np.nan, np.float32)), "x_train row 0 holds NaN or infinity"),
    (dict(x_test=np.zeros((12, 3, 3), np.float32)), "x_test samples are (3, 3) but x_train's are (2, 4, 4)"),
])
def test_bad_arrays_files_are_one_line(tmp_path, change, message):
    drop = change.pop("drop", None)
    path, arrays = arrays_file(tmp_path)
    arrays.update(change)
    if drop:
        arrays.pop(drop)
    np.savez(path, **arrays)
    with pytest.raises(ConfigError) as err:
        problem_of(cfg_for(path, clients=2, classes=3, normalize="standard"))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_folders_are_one_line(tmp_path):
    (tmp_path / "empty" / "train").mkdir(parents=True)
    (tmp_path / "empty" / "train" / "a.json").write_text(json.dumps({"users": [], "user_data": {}}))
    cfg = config_with({"data.kind": "leaf", "data.path": str(tmp_path / "empty"), "model.kind": "logreg",
                       "train.clients_per_round": 1})
    with pytest.raises(ConfigError, match="train/ has no users"):
        problem_of(cfg)
    text = leaf_folder(tmp_path / "text", x=["img_1.jpg"] * 5)
    cfg = config_with({"data.kind": "leaf", "data.path": str(text), "model.kind": "logreg",
                       "train.clients_per_round": 1})
    with pytest.raises(EdgefedError, match="user 'ann': sample 0 is a file name \\('img_1.jpg'\\), label 1; edgefed "
                                           "reads samples as numbers: convert the images to their pixels"):
        problem_of(cfg)
    with pytest.raises(ConfigError, match="has no data_batch_1"):
        problem_of(config_with({"data.kind": "cifar10", "data.path": str(tmp_path), "train.clients_per_round": 1}))


def test_images_stored_as_h_w_are_one_channel_for_the_statistics(tmp_path):
    """The same pixels as (n, H, W) and (n, 1, H, W) reach a 2-D model alike; read by a 1-D layer, (C, L)."""
    g = np.random.default_rng(3)
    x = (g.random((40, 4, 4)) * np.arange(1, 5)[None, :, None]).astype(np.float32)  # rows of unequal spread
    y = g.integers(0, 2, 40)
    np.savez(tmp_path / "hw.npz", x_train=x, y_train=y)
    np.savez(tmp_path / "chw.npz", x_train=x[:, None], y_train=y)
    conv = [{"type": "conv2d", "out": 2, "kernel": 3}, {"type": "flatten"}, {"type": "dense", "out": 2}]
    rows = []
    for name, layers in (("hw", conv), ("chw", conv), ("hw", [{"type": "conv1d", "out": 2, "kernel": 3}] + conv[1:])):
        cfg = config_with({"data.kind": "arrays", "data.path": str(tmp_path / f"{name}.npz"), "data.clients": 2,
                           "data.normalize": "standard", "model.kind": "sequential", "model.layers": layers,
                           "train.clients_per_round": 1})
        problem = problem_of(cfg)
        rows.append(np.concatenate([problem.device(k).X_train for k in range(2)]))
    np.testing.assert_array_equal(rows[0], rows[1])
    per_row = rows[2].reshape(-1, 4, 4).std(axis=(0, 2))
    np.testing.assert_allclose(per_row, 1, atol=0.05)  # (C, L): each of the 4 channels its own statistics (the
    # devices hold 90 % of the training set, the statistics are over all of it)
    assert np.abs(rows[0].reshape(-1, 4, 4).std(axis=(0, 2)) - 1).max() > 0.1


def test_a_regression_logs_its_test_loss_per_sample(tmp_path, run_experiment):
    g = np.random.default_rng(4)
    x = g.normal(size=(40, 3)).astype(np.float32)
    targets = g.normal(size=(40, 4))
    np.savez(tmp_path / "r.npz", x_train=x, y_train=targets, x_test=x, y_test=targets)
    log = run_experiment({"data.kind": "arrays", "data.path": str(tmp_path / "r.npz"), "data.clients": 2,
                          "model.kind": "sequential", "model.loss": "mse", "train.clients_per_round": 2,
                          "model.layers": [{"type": "dense", "out": 4}], "rounds": 1, "train.local_steps": 1})
    # x_test is x_train: the mean test loss per sample equals the train objective (n_test counts samples)
    assert log["metrics/test_loss"][0] == pytest.approx(log["metrics/train_loss"][0], rel=1e-6)
    assert np.isnan(log["metrics/test_accuracy"]).all()


def test_natural_device_ids_need_not_be_consecutive(tmp_path):
    path, _ = arrays_file(tmp_path, device=np.repeat([7, 2, 40], 20), test=0)
    problem = problem_of(cfg_for(path, partition="natural"))
    assert problem.n_devices == 3 and problem.n_train.tolist() == [18, 18, 18]  # ids 2, 7, 40 in order


def test_refusals_before_anything_is_written(tmp_path):
    path, arrays = arrays_file(tmp_path)
    arrays["x_test"][3, 0, 1, 1] = np.inf
    np.savez(path, **arrays)
    done = subprocess.run([sys.executable, "-m", "edgefed", "run", "--out", str(tmp_path / "r.h5"), "--set",
                           'data.kind="arrays"', "--set", f'data.path="{path}"', "--set", "data.clients=2", "--set",
                           "train.clients_per_round=2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().endswith("x_test row 3 holds NaN or infinity; clean the data "
                                                                  "(edgefed trains on finite values only)")
    assert not (tmp_path / "r.h5").exists()
    for sets, message in ((['model.loss="mse"', 'model.kind="sequential"', 'model.layers=[{type="dense", out=10}]'],
                           'model.loss = "mse" trains on float targets, which only data.kind = "arrays"'),
                          (['data.kind="cifar100"', f'data.path="{tmp_path}"', 'data.partition="natural"'],
                           'data.partition = "natural" needs each sample\'s device, which CIFAR does not have'),
                          (['model.kind="sequential"', 'model.layers=[{type=["dense"]}]'],
                           "model.layers[0].type = ['dense'] is not a layer type")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, sets)


def test_labels_must_be_one_per_sample(tmp_path):
    path, arrays = arrays_file(tmp_path)
    arrays["y_train"] = arrays["y_train"][:, None]
    np.savez(path, **arrays)
    with pytest.raises(ConfigError, match=r"y_train has shape \(60, 1\); give one integer label per sample"):
        problem_of(cfg_for(path, clients=2))

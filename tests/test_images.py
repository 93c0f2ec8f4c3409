"""MNIST/EMNIST IDX loading, partitions, and the MLP (2NN) kernel against NumPy and finite differences."""

import gzip
import hashlib
import struct
from pathlib import Path

import numpy as np
import pytest

from edgefed.config import load_config
from edgefed.errors import ConfigError, ProblemFileError
from edgefed.kernels.sgd import step_terms
from edgefed.problems import ClassificationData
from edgefed.problems import idx
from edgefed.problems.partition import partition
from edgefed.rng import Purpose, kernel_state
from helpers import cnn_model, logreg_model, mlp_model, problem_of
from naive import Xoshiro

# The real t10k files: the example's data/mnist/ in the checkout, else a shared data folder beside it.
_ROOT = Path(__file__).resolve().parents[1]
T10K = next((p for p in (_ROOT / "data" / "mnist", _ROOT.parent / "shared" / "data" / "mnist-t10k")
             if (p / "t10k-images-idx3-ubyte.gz").is_file()), _ROOT / "data" / "mnist")
needs_t10k = pytest.mark.skipif(not (T10K / "t10k-images-idx3-ubyte.gz").is_file(),
                                reason="the real MNIST t10k files are not in data/mnist/ of this checkout")


def write_idx(folder: Path, stem: str, images: np.ndarray, labels: np.ndarray, gz: bool = True):
    opener = gzip.open if gz else open
    suffix = ".gz" if gz else ""
    n, h, w = images.shape
    with opener(folder / f"{stem}-images-idx3-ubyte{suffix}", "wb") as f:
        f.write(struct.pack(">4i", 2051, n, h, w) + images.astype(np.uint8).tobytes())
    with opener(folder / f"{stem}-labels-idx1-ubyte{suffix}", "wb") as f:
        f.write(struct.pack(">2i", 2049, n) + labels.astype(np.uint8).tobytes())


@pytest.mark.parametrize("gz", [True, False])
def test_idx_rows_stream_and_emnist_orientation(tmp_path, gz, monkeypatch):
    g = np.random.default_rng(0)
    images = g.integers(0, 256, (9000, 3, 4))
    labels = g.integers(0, 10, 9000)
    write_idx(tmp_path, "t10k", images, labels, gz)
    suffix = ".gz" if gz else ""
    path = tmp_path / f"t10k-images-idx3-ubyte{suffix}"
    monkeypatch.setattr(idx, "BLOCK", 1000)  # rows are picked across many blocks
    rows = np.array([0, 5, 999, 1000, 4321, 8999])
    np.testing.assert_array_equal(idx.read_image_rows(path, rows), images[rows].reshape(6, 12))
    upright = idx.read_image_rows(path, rows, transpose=True)
    np.testing.assert_array_equal(upright, images[rows].transpose(0, 2, 1).reshape(6, 12))
    np.testing.assert_array_equal(idx.read_labels(tmp_path / f"t10k-labels-idx1-ubyte{suffix}"), labels)


def test_idx_errors_name_the_file(tmp_path):
    write_idx(tmp_path, "t10k", np.zeros((5, 2, 2)), np.zeros(5))
    labels = tmp_path / "t10k-labels-idx1-ubyte.gz"
    with pytest.raises(ProblemFileError, match="magic 2049, expected 2051"):
        idx.read_image_rows(labels, np.array([0]))
    cut = tmp_path / "cut-labels"
    cut.write_bytes(struct.pack(">2i", 2049, 10) + bytes(3))
    with pytest.raises(ProblemFileError, match="holds 3 labels but its header says 10"):
        idx.read_labels(cut)
    with pytest.raises(ProblemFileError, match="holds no mnist files; expected train-images-idx3-ubyte"):
        idx.dataset_files("mnist", tmp_path / "..", "")
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(ProblemFileError, match="not t10k-labels-idx1-ubyte"):
        idx.dataset_files("mnist", tmp_path, "")


@pytest.mark.parametrize("kind", ["iid", "label", "shards", "dirichlet"])
def test_partitions_cover_disjointly_and_are_seeded(kind):
    labels = np.random.default_rng(1).integers(0, 10, 5000)
    parts = partition(kind, labels, 20, seed=3, n_classes=10, alpha=0.3).parts
    flat = np.concatenate(parts)
    assert np.unique(flat).size == flat.size  # disjoint
    assert all(np.all(np.diff(p) > 0) for p in parts)
    again = partition(kind, labels, 20, seed=3, n_classes=10, alpha=0.3).parts
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, partition(kind, labels, 20, 4, 10, 0.3).parts))
    distinct = [np.unique(labels[p]).size for p in parts]
    if kind == "iid":
        assert flat.size == 5000 and {p.size for p in parts} == {250} and min(distinct) == 10
    if kind == "label":
        assert max(distinct) == 1  # one label per device
    if kind == "shards":
        assert flat.size == 5000 and max(distinct) <= 4 and np.mean(distinct) <= 3
    if kind == "dirichlet":
        assert flat.size == 5000 and np.mean(distinct) < 10


def test_a_partition_that_starves_a_device_is_refused():
    with pytest.raises(ConfigError, match="leaves device"):
        partition("iid", np.zeros(10, np.int64), 8, 0, 10)


@needs_t10k
def test_real_t10k_loads_with_its_documented_counts_and_checksum():
    labels = idx.read_labels(T10K / "t10k-labels-idx1-ubyte.gz")
    assert np.bincount(labels).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    pixels = idx.read_image_rows(T10K / "t10k-images-idx3-ubyte.gz", np.arange(10000))
    assert pixels.shape == (10000, 784) and pixels.max() == 255
    header = struct.pack(">4i", 2051, 10000, 28, 28)  # the documented md5 covers the whole decompressed file
    assert hashlib.md5(header + pixels.tobytes()).hexdigest() == "2646ac647ad5339dbf082846283269ea"


@needs_t10k
def test_mnist_problem_holds_out_the_end_and_builds_one_device(tmp_path):
    cfg = load_config(None, ['data.kind="mnist"', f'data.path="{T10K}"', "data.clients=10", 'data.partition="label"',
                             'train.clients_per_round="all"'])
    assert cfg.model.kind == "mlp"
    p = problem_of(cfg)
    assert p.n_train.sum() <= 8000 and sum(r.size for r in p.test_rows) == 2000
    assert max(r.max() for r in p.train_rows) < 8000 and min(r.min() for r in p.test_rows) >= 8000
    d = p.device(3)
    assert d.X_train.dtype == np.float32 and d.X_train.shape == (p.n_train[3], 784) and 0 <= d.X_train.min()
    assert d.X_train.max() <= 1.0 and np.unique(d.y_train).size == 1


def naive_mlp_steps(params, sizes, X, y, n_steps, batch, lr, rng_state, correction=None, mu=0.0, anchor=None):
    params = params.astype(np.float64).copy()
    rng = Xoshiro(rng_state)
    perm = list(range(X.shape[0]))
    for _ in range(n_steps):
        idx_ = rng.batch(perm, batch) if batch < X.shape[0] else perm
        g = naive_mlp_grad(params, sizes, X[idx_], y[idx_])[1]
        params -= lr * (g + (0 if correction is None else correction) + (0 if anchor is None else mu * (params - anchor)))
    return params


def naive_mlp_grad(params, sizes, X, y):
    layers, off = [], 0
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers.append((params[off:off + a * b].reshape(a, b), params[off + a * b:off + a * b + b]))
        off += a * b + b
    hs = [X]
    for i, (W, b) in enumerate(layers):
        z = hs[-1] @ W + b
        hs.append(np.maximum(z, 0) if i < len(layers) - 1 else z)
    z = hs[-1] - hs[-1].max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    loss = -np.mean(np.log(p[np.arange(len(y)), y]))
    delta = p
    delta[np.arange(len(y)), y] -= 1
    delta /= len(y)
    grads = []
    for i in range(len(layers) - 1, -1, -1):
        W, _ = layers[i]
        grads.append(np.concatenate([(hs[i].T @ delta).ravel(), delta.sum(axis=0)]))
        delta = (delta @ W.T) * (hs[i] > 0)
    return loss, np.concatenate(grads[::-1])


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 3e-5)])
@pytest.mark.parametrize("batch", [1, 6, 40])
def test_mlp_steps_match_numpy(dtype, tol, batch):
    g = np.random.default_rng(2)
    sizes = (7, 5, 6, 3)
    X, y = g.normal(size=(31, 7)).astype(dtype), g.integers(0, 3, 31)
    data = ClassificationData(X, y, X[:4].copy(), y[:4].copy())
    model = mlp_model(sizes, dtype, seed=1)
    x0 = model.initial_params()
    corr = (0.01 * g.normal(size=model.n_trainable)).astype(dtype)
    state = kernel_state(5, Purpose.LOCAL, 2, 1)
    for correction in (None, corr):
        expect = naive_mlp_steps(x0, sizes, X.astype(np.float64), y, 9, batch, 0.2, state.copy(),
                                 None if correction is None else correction.astype(np.float64))
        x = x0.copy()
        model.local_steps(x, data, model.begin(data, state.copy()), 9, batch, 0.2, step_terms(dtype, correction))
        np.testing.assert_allclose(x, expect, rtol=tol, atol=tol)


def test_mlp_full_gradient_loss_and_finite_differences():
    g = np.random.default_rng(3)
    sizes = (6, 8, 4)
    X, y = g.normal(size=(600, 6)), g.integers(0, 4, 600)  # more rows than one evaluation chunk
    data = ClassificationData(X, y, X[:5].copy(), y[:5].copy())
    model = mlp_model(sizes, np.float64, seed=0)
    x = model.initial_params() + 0.05 * g.normal(size=model.n_trainable)
    grad = np.zeros(model.n_trainable)
    loss = model.loss_grad(x, data, grad)
    ref_loss, ref_grad = naive_mlp_grad(x, sizes, X, y)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-13)
    assert model.train_loss(x, data) == pytest.approx(ref_loss, rel=1e-12)
    for j in g.choice(model.n_trainable, 12, replace=False):
        e = np.zeros(model.n_trainable)
        e[j] = 1e-6
        fd = (naive_mlp_grad(x + e, sizes, X, y)[0] - naive_mlp_grad(x - e, sizes, X, y)[0]) / 2e-6
        assert fd == pytest.approx(grad[j], abs=1e-8)


def test_2nn_has_mcmahans_parameter_count_and_glorot_init():
    model = mlp_model((784, 200, 200, 10), np.float32, seed=0)
    assert model.n_trainable == 199_210
    x = model.initial_params()
    w1 = x[: 784 * 200]
    assert np.abs(w1).max() <= np.sqrt(6 / 984) and np.abs(w1.std() - np.sqrt(2 / 984)) < 2e-3
    assert not x[784 * 200:784 * 200 + 200].any()  # zero biases
    assert np.array_equal(x, mlp_model((784, 200, 200, 10), np.float32, seed=0).initial_params())


def naive_cnn_loss(params, side, n_classes, X, y):
    """Straight from the definition: padded 5x5 convolutions, ReLU, 2x2 max pools, two dense layers."""
    s4 = side // 4
    shapes = [((5, 5, 1, 32), 32), ((5, 5, 32, 64), 64), ((s4 * s4 * 64, 512), 512), ((512, n_classes), n_classes)]
    layers, off = [], 0
    for wshape, b in shapes:
        n = int(np.prod(wshape))
        layers.append((params[off:off + n].reshape(wshape), params[off + n:off + n + b]))
        off += n + b

    def conv(h, W, b):
        pad = np.pad(h, ((0, 0), (2, 2), (2, 2), (0, 0)))
        s = h.shape[1]
        out = np.zeros((h.shape[0], s, s, W.shape[3])) + b
        for ky in range(5):
            for kx in range(5):
                out += np.einsum("nyxc,cd->nyxd", pad[:, ky:ky + s, kx:kx + s, :], W[ky, kx])
        return np.maximum(out, 0)

    def pool(h):
        n, s, _, c = h.shape
        return h.reshape(n, s // 2, 2, s // 2, 2, c).max(axis=(2, 4))

    h = pool(conv(X.reshape(-1, side, side, 1), *layers[0]))
    h = pool(conv(h, *layers[1])).reshape(X.shape[0], -1)
    h = np.maximum(h @ layers[2][0] + layers[2][1], 0)
    z = h @ layers[3][0] + layers[3][1]
    z = z - z.max(axis=1, keepdims=True)
    return -np.mean(z[np.arange(len(y)), y] - np.log(np.exp(z).sum(axis=1)))


def test_cnn_matches_its_definition_and_finite_differences():
    assert cnn_model(784, 10, np.float32, 0).n_trainable == 1_663_370  # McMahan et al.'s count, with "same" padding
    assert cnn_model(784, 62, np.float32, 0).n_trainable == 1_663_370 + 52 * 513  # EMNIST ByClass
    g = np.random.default_rng(4)
    X, y = g.random((70, 64)), g.integers(0, 3, 70)  # 70 rows: more than one evaluation chunk
    data = ClassificationData(X, y, X[:3].copy(), y[:3].copy())
    model = cnn_model(64, 3, np.float64, seed=0)
    x = model.initial_params() + 0.01 * g.normal(size=model.n_trainable)
    grad = np.zeros(model.n_trainable)
    loss = model.loss_grad(x, data, grad)
    assert loss == pytest.approx(naive_cnn_loss(x, 8, 3, X, y), rel=1e-12)
    assert model.train_loss(x, data) == pytest.approx(loss, rel=1e-12)
    # every layer's W and b: conv1 W 0..799, b 800..831; conv2 W ..52031, b ..52095; fc1 W ..183167,
    # b ..183679; fc2 W, b (the last 3)
    picks = [3, 700, 805, 840, 30000, 52050, 52100, 100000, 183300, model.n_trainable - 520, model.n_trainable - 2]
    for j in picks:
        e = np.zeros(model.n_trainable)
        e[j] = 1e-6
        fd = (naive_cnn_loss(x + e, 8, 3, X, y) - naive_cnn_loss(x - e, 8, 3, X, y)) / 2e-6
        assert fd == pytest.approx(grad[j], abs=2e-8, rel=1e-5), j
    # one SGD step is x - lr * (minibatch gradient + correction), with the minibatch the kernel's stream draws
    state = kernel_state(1, Purpose.LOCAL, 1, 0)
    rows = Xoshiro(state.copy()).batch(list(range(70)), 10)
    sub = ClassificationData(X[rows], y[rows], X[:1], y[:1])
    sub_grad = np.zeros(model.n_trainable)
    model.loss_grad(x, sub, sub_grad)
    corr = 0.001 * g.normal(size=model.n_trainable)
    stepped = x.copy()
    model.local_steps(stepped, data, model.begin(data, state), 1, 10, 0.1, step_terms(np.float64, corr))
    np.testing.assert_allclose(stepped, x - 0.1 * (sub_grad + corr), rtol=1e-10, atol=1e-13)
    # the step updates fc1 block by block inside its backward pass: bit for bit the gradient, then the update
    from edgefed.kernels.sgd import apply_step

    terms = step_terms(np.float64, corr, x + 0.01, 0.5)
    fused = x.copy()
    model.local_steps(fused, data, model.begin(data, state.copy()), 1, 10, 0.1, terms)
    oracle = np.zeros(model.n_trainable)
    model.oracle_grad(x, data, model.begin(data, state.copy()), 10, oracle)
    unfused = x.copy()
    apply_step(unfused, oracle, np.float64(0.1), terms)
    assert fused.tobytes() == unfused.tobytes()
    assert not np.array_equal(fused[52100:183168], x[52100:183168])  # fc1's W did move


def test_emnist_letters_are_upright_and_zero_based(tmp_path):
    g = np.random.default_rng(5)
    images = g.integers(0, 256, (300, 28, 28))
    labels = g.integers(1, 27, 300)  # letters: 1..26
    write_idx(tmp_path, "emnist-letters-train", images[:240], labels[:240])
    write_idx(tmp_path, "emnist-letters-test", images[240:], labels[240:])
    cfg = load_config(None, ['data.kind="emnist"', f'data.path="{tmp_path}"', 'data.split="letters"',
                             "data.clients=4", 'train.clients_per_round="all"', 'model.dtype="float64"'])
    assert cfg.model.kind == "cnn"
    p = problem_of(cfg)
    assert p.n_classes == 26 and p.n_train.sum() == 240 and sum(r.size for r in p.test_rows) == 60
    d = p.device(2)
    rows = p.train_rows[2]
    np.testing.assert_array_equal(d.y_train, labels[rows] - 1)
    np.testing.assert_allclose(d.X_train, images[rows].transpose(0, 2, 1).reshape(-1, 784) / 255)
    with pytest.raises(ProblemFileError, match="holds no emnist files"):
        problem_of(load_config(None, ['data.kind="emnist"', f'data.path="{tmp_path}"', 'data.split="digits"',
                                         "data.clients=4", 'train.clients_per_round="all"']))


def test_a_damaged_gzip_stream_is_a_clear_error(tmp_path):
    write_idx(tmp_path, "t10k", np.random.default_rng(0).integers(0, 256, (2000, 28, 28)), np.zeros(2000))
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2: len(raw) // 2 + 64] = b"\xff" * 64  # invalid deflate blocks mid-stream
    path.write_bytes(bytes(raw))
    with pytest.raises(ProblemFileError, match="cannot be read"):
        idx.read_image_rows(path, np.arange(2000))

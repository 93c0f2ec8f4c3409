"""Kernels against slow NumPy references (tests/naive.py) and finite differences."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefed.kernels import random as krandom
from edgefed.kernels.sgd import step_terms
from edgefed.models import Quadratic
from edgefed.problems import ClassificationData, QuadraticData
from edgefed.rng import Purpose, kernel_state
from helpers import cnn_model, fma_exact, logreg_model, mlp_model
from naive import Xoshiro, logreg_sgd, softmax_ce


def test_xoshiro_matches_reference_and_published_values():
    state = np.array([1, 2, 3, 4], dtype=np.uint64)
    ref = Xoshiro([1, 2, 3, 4])
    got = [int(krandom.next_u64(state)) for _ in range(100)]
    assert got[:4] == [11520, 0, 1509978240, 1215971899390074240]  # xoshiro256** reference output
    assert got == [ref.next() for _ in range(100)]


def test_bounded_in_range_and_uniform():
    state = kernel_state(3, Purpose.LOCAL, 1, 0)
    draws = np.array([krandom.bounded(state, 7) for _ in range(70000)])
    assert draws.min() == 0 and draws.max() == 6
    counts = np.bincount(draws, minlength=7)
    chi2 = ((counts - 10000) ** 2 / 10000).sum()
    assert chi2 < 22.5  # chi-square, 6 dof, p = 0.001


def test_draw_batch_is_a_distinct_subset_matching_reference():
    state = kernel_state(1, Purpose.LOCAL, 2, 3)
    ref = Xoshiro(state.copy())
    perm = np.arange(50, dtype=np.int64)
    ref_perm = list(range(50))
    for _ in range(20):
        krandom.draw_batch(state, perm, 50, 10)
        expect = ref.batch(ref_perm, 10)
        assert list(perm[:10]) == list(expect)
        assert len(set(perm[:10])) == 10
    assert sorted(perm) == list(range(50))


def _problem(n=37, f=6, c=4, seed=0, dtype=np.float64):
    g = np.random.default_rng(seed)
    X = g.normal(size=(n, f)).astype(dtype)
    y = g.integers(0, c, n).astype(np.int64)
    return ClassificationData(X, y, X[:5].copy(), y[:5].copy())


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("batch", [1, 8, 37, 100])
def test_logreg_sgd_matches_numpy_reference(dtype, tol, batch):
    data = _problem(dtype=dtype)
    model = logreg_model(6, 4, dtype)
    g = np.random.default_rng(1)
    x0 = (0.1 * g.normal(size=model.n_trainable)).astype(dtype)
    state = kernel_state(7, Purpose.LOCAL, 1, 2)
    expect = logreg_sgd(x0, data.X_train.astype(np.float64), data.y_train, 4, 13, batch, 0.3, state.copy())
    x = x0.copy()
    steps = model.local_steps(x, data, model.begin(data, state), 13, batch, 0.3)
    assert steps == 13
    np.testing.assert_allclose(x, expect, rtol=tol, atol=tol)


def test_logreg_loss_grad_matches_numpy_and_finite_differences():
    data = _problem()
    model = logreg_model(6, 4, np.float64)
    x = np.random.default_rng(2).normal(size=model.n_trainable)
    grad = np.zeros(model.n_trainable)
    loss = model.loss_grad(x, data, grad)
    ref_loss, gW, gb = softmax_ce(x[:24].reshape(6, 4), x[24:], data.X_train, data.y_train)
    assert loss == pytest.approx(ref_loss, rel=1e-13)
    np.testing.assert_allclose(grad, np.concatenate([gW.ravel(), gb]), rtol=1e-12, atol=1e-14)
    eps = 1e-6
    for j in range(model.n_trainable):
        e = np.zeros(model.n_trainable)
        e[j] = eps
        fd = (model.train_loss(x + e, data) - model.train_loss(x - e, data)) / (2 * eps)
        assert fd == pytest.approx(grad[j], abs=1e-8)


def test_logreg_loss_correct_counts_and_survives_huge_logits():
    data = _problem()
    model = logreg_model(6, 4, np.float64)
    x = np.random.default_rng(3).normal(size=model.n_trainable)
    loss, correct = model.loss_correct(x, data.X_train, data.y_train)
    z = data.X_train @ x[:24].reshape(6, 4) + x[24:]
    assert correct == int((z.argmax(axis=1) == data.y_train).sum())
    assert loss / 37 == pytest.approx(softmax_ce(x[:24].reshape(6, 4), x[24:], data.X_train, data.y_train)[0])
    big = 1e4 * x  # probabilities underflow to 0; the loss must stay finite and large
    loss_big, _ = model.loss_correct(big, data.X_train, data.y_train)
    assert np.isfinite(loss_big) and loss_big > 1e3
    many = _problem(n=150)  # evaluation runs 64 rows at a time: two full chunks and a partial one
    loss, correct = model.loss_correct(x, many.X_train, many.y_train)
    z = many.X_train @ x[:24].reshape(6, 4) + x[24:]
    assert correct == int((z.argmax(axis=1) == many.y_train).sum())
    assert loss / 150 == pytest.approx(softmax_ce(x[:24].reshape(6, 4), x[24:], many.X_train, many.y_train)[0])


def test_logreg_edge_cases():
    data = _problem(n=1)
    model = logreg_model(6, 4, np.float64)
    x = np.zeros(model.n_trainable)
    run = model.begin(data, kernel_state(0, Purpose.LOCAL, 1, 0))
    model.local_steps(x, data, run, 5, 0 + 20, 0.0)  # zero learning rate: nothing moves
    assert not x.any()
    grad = np.zeros(model.n_trainable)
    model.loss_grad(x, data, grad)
    model.local_steps(x, data, run, 1, 20, 0.5)  # batch larger than the data: one full-gradient step
    np.testing.assert_allclose(x, -0.5 * grad, rtol=1e-15)


def test_full_batch_step_is_gradient_descent():
    data = _problem()
    model = logreg_model(6, 4, np.float64)
    x = np.random.default_rng(4).normal(size=model.n_trainable)
    grad = np.zeros(model.n_trainable)
    model.loss_grad(x, data, grad)
    y = x.copy()
    model.local_steps(y, data, model.begin(data, kernel_state(0, Purpose.LOCAL, 1, 0)), 1, None, 0.1)
    np.testing.assert_allclose(y, x - 0.1 * grad, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("model_kind", ["logreg", "quadratic"])
def test_local_work_split_in_chunks_draws_the_same(model_kind):
    if model_kind == "logreg":
        data, model = _problem(dtype=np.float32), logreg_model(6, 4, np.float32)
    else:
        g = np.random.default_rng(5)
        data, model = QuadraticData(g.uniform(1, 2, 9), g.normal(size=9), 0.3), Quadratic(9, np.zeros(9), np.float64)
    state = kernel_state(11, Purpose.LOCAL, 4, 1)
    whole = model.initial_params() + 0.1
    model.local_steps(whole, data, model.begin(data, state.copy()), 10, 5, 0.05)
    chunked = model.initial_params() + 0.1
    run = model.begin(data, state.copy())
    for n in (3, 1, 6):
        model.local_steps(chunked, data, run, n, 5, 0.05)
    assert whole.tobytes() == chunked.tobytes()


def test_quadratic_steps_and_loss_are_exact():
    a, b = np.array([1.0, 2.0, 0.5]), np.array([1.0, -1.0, 3.0])
    data = QuadraticData(a, b, 0.0)
    model = Quadratic(3, np.zeros(3), np.float64)
    x = np.array([0.5, 0.5, 0.5])
    ref = x.copy()
    for _ in range(4):
        ref = fma_exact(-0.1, a * (ref - b), ref)  # x <- x - lr g, one rounding
    model.local_steps(x, data, model.begin(data, kernel_state(0, Purpose.LOCAL, 1, 0)), 4, None, 0.1)
    assert x.tobytes() == ref.tobytes()
    grad = np.zeros(3)
    assert model.loss_grad(np.zeros(3), data, grad) == pytest.approx(0.5 * (1 + 2 + 0.5 * 9))
    np.testing.assert_array_equal(grad, -a * b)


def test_quadratic_noise_has_the_configured_spread():
    data = QuadraticData(np.zeros(2000), np.zeros(2000), 0.5)  # a = 0: each step adds -lr * noise
    model = Quadratic(2000, np.zeros(2000), np.float64)
    x = np.zeros(2000)
    model.local_steps(x, data, model.begin(data, kernel_state(0, Purpose.LOCAL, 1, 0)), 1, None, 1.0)
    assert abs(x.mean()) < 0.05 and x.std() == pytest.approx(0.5, rel=0.05)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_logreg_scaffold_correction_matches_reference(dtype, tol):
    data = _problem(dtype=dtype)
    model = logreg_model(6, 4, dtype)
    g = np.random.default_rng(6)
    x0 = (0.1 * g.normal(size=model.n_trainable)).astype(dtype)
    corr = (0.05 * g.normal(size=model.n_trainable)).astype(dtype)
    state = kernel_state(2, Purpose.LOCAL, 3, 1)
    expect = logreg_sgd(x0, data.X_train.astype(np.float64), data.y_train, 4, 9, 8, 0.2, state.copy(),
                        correction=corr.astype(np.float64))
    x = x0.copy()
    model.local_steps(x, data, model.begin(data, state), 9, 8, 0.2, step_terms(dtype, correction=corr))
    np.testing.assert_allclose(x, expect, rtol=tol, atol=tol)


def test_logreg_oracle_gradient_is_one_minibatch():
    data = _problem()
    model = logreg_model(6, 4, np.float64)
    x = np.random.default_rng(7).normal(size=model.n_trainable)
    state = kernel_state(4, Purpose.CONTROL, 1, 0)
    idx = Xoshiro(state.copy()).batch(list(range(37)), 8)
    _, gW, gb = softmax_ce(x[:24].reshape(6, 4), x[24:], data.X_train[idx], data.y_train[idx])
    out = np.zeros(model.n_trainable)
    model.oracle_grad(x, data, model.begin(data, state), 8, out)
    np.testing.assert_allclose(out, np.concatenate([gW.ravel(), gb]), rtol=1e-12, atol=1e-15)
    full = np.zeros(model.n_trainable)
    model.oracle_grad(x, data, model.begin(data, state), None, out)
    model.loss_grad(x, data, full)
    np.testing.assert_allclose(out, full, rtol=1e-12, atol=1e-15)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**80), st.sampled_from(list(Purpose)), st.integers(0, 2**40), st.integers(0, 2**33))
def test_kernel_state_is_numpys_seed_sequence(seed, purpose, round_idx, device):
    """The in-kernel SeedSequence gives NumPy's words for every key (multi-word ones included)."""
    expected = np.random.SeedSequence(entropy=seed, spawn_key=(int(purpose), round_idx, device + 1))
    np.testing.assert_array_equal(kernel_state(seed, purpose, round_idx, device),
                                  expected.generate_state(4, np.uint64))


def _sequential_product(A, W, Z):
    """Z + A W with each output's terms added in reduction order, one exact fma each (linalg.py's order)."""
    Z = Z.copy()
    for k in range(A.shape[1]):
        Z = fma_exact(A[:, k:k + 1], W[k:k + 1, :], Z)
    return Z


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 8), st.integers(0, 9), st.integers(1, 70), st.sampled_from([np.float32, np.float64]),
       st.integers(0, 2**32 - 1))
def test_products_add_their_terms_in_order_by_fma(b, din, dout, dtype, seed):
    """Every tile shape and edge (rows past a tile, masked columns, strided rows) gives the bits of the
    sequential fma reference, so the tile choice per CPU cannot change a trajectory."""
    from edgefed.kernels.linalg import accumulate_outer, accumulate_product

    g = np.random.default_rng(seed)
    A = g.standard_normal((b, din + 3)).astype(dtype)[:, 1:din + 1]  # rows strided, as a column block
    W = g.standard_normal((din, dout)).astype(dtype)
    Z = g.standard_normal((b, dout)).astype(dtype)
    got = Z.copy()
    accumulate_product(A, W, got, b, din, dout)
    assert got.tobytes() == _sequential_product(A, W, Z).tobytes()
    D = g.standard_normal((b, dout)).astype(dtype)
    G = g.standard_normal((din, dout)).astype(dtype)
    got = G.copy()
    accumulate_outer(A, D, got, b, din, dout)
    assert got.tobytes() == _sequential_product(np.ascontiguousarray(A.T), D, G).tobytes()
    got = np.full_like(G, np.nan)  # fresh: the old values are never read, the sums start from +0
    accumulate_outer(A, D, got, b, din, dout, True)
    assert got.tobytes() == _sequential_product(np.ascontiguousarray(A.T), D, np.zeros_like(G)).tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_packed_operands_give_the_products_bits(dtype):
    """A weight matrix (or the gates' gradients) packed into tile-wide panels, as the recurrent layers read
    them: the bits of the sequential fma reference, at widths that leave a partial last panel and depths past
    one panel piece."""
    from edgefed.kernels.linalg import _packed, pack_columns, packed_values

    g = np.random.default_rng(1)
    for b, din, dout in ((9, 140, 40), (2, 3, 1030), (1, 1, 1)):  # (a panel piece 128 or 256 deep; a tall tile)
        A, W = g.standard_normal((b, din)).astype(dtype), g.standard_normal((din, dout)).astype(dtype)
        Z, D = g.standard_normal((b, dout)).astype(dtype), g.standard_normal((b, dout)).astype(dtype)
        P = np.full(packed_values(max(b, din), dout, np.dtype(dtype).itemsize), np.nan, dtype)
        pack_columns(W, din, dout, P)
        product = Z.copy()
        _packed(A, din, 1, P, product, b, dout, din, False)  # (packed_product's call; packed_outer's below)
        assert product.tobytes() == _sequential_product(A, W, Z).tobytes()
        pack_columns(D, b, dout, P)
        outer = np.full((din, dout), np.nan, dtype)
        _packed(A, 1, din, P, outer, din, dout, b, True)
        assert outer.tobytes() == _sequential_product(np.ascontiguousarray(A.T), D, np.zeros_like(outer)).tobytes()


def test_exp_sigmoid_and_tanh_from_fmas_are_within_ulps_of_libm():
    """kernels/exponential.py: within 1, 2 and 3 float64 ulps of NumPy's on a million values, every float32
    rounding the same; NaN stays NaN, tanh keeps the sign of zero, and the extremes saturate."""
    from numba import njit

    from edgefed.kernels.exponential import exp64, sigmoid64, tanh64

    @njit
    def apply(x, out):
        for i in range(x.size):
            out[0, i], out[1, i], out[2, i] = exp64(x[i]), sigmoid64(x[i]), tanh64(x[i])

    g = np.random.default_rng(0)
    x = np.concatenate([g.normal(0, 4, 1_000_000), g.uniform(-700, 700, 10_000), [0.0, -0.0, 0.1699, -0.17, 1e-300]])
    out = np.empty((3, x.size))
    apply(x, out)
    with np.errstate(over="ignore"):
        refs = np.exp(x), 1 / (1 + np.exp(-x)), np.tanh(x)
    for ours, ref, ulps in zip(out, refs, (1, 2, 3)):
        fine = (np.abs(ref) > 1e-300) & (np.abs(ref) < 1e300)
        assert np.max(np.abs(ours[fine] - ref[fine]) / np.spacing(np.abs(ref[fine]))) <= ulps
        with np.errstate(over="ignore"):  # (beyond float32: inf, alike)
            assert np.array_equal(ours[fine].astype(np.float32), ref[fine].astype(np.float32))
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0])
    out = np.empty((3, special.size))
    apply(special, out)
    assert np.isnan(out[:, 0]).all() and out[1, 1] == 1.0 and out[2, 1:3].tolist() == [1.0, -1.0]
    assert out[0, 2] < 1e-300 and out[1, 2] < 1e-300  # (x clamped to -708: 0 once rounded to float32)
    assert np.signbit(out[2, 3:]).tolist() == [False, True]


def test_tile_shape_does_not_change_the_bits():
    """The micro-kernel at other shapes than this CPU's (as an AVX2 laptop or a Pi would pick) gives the
    same bits as the product the models use."""
    from numba import njit

    from edgefed.kernels.fma import tile
    from edgefed.kernels.linalg import accumulate_product

    def product_with(mr, nr_bytes):
        full, edge = tile(mr, nr_bytes, False), tile(mr, nr_bytes, True)

        @njit
        def product(A, W, Z):
            nr = nr_bytes // Z.itemsize
            for j0 in range(0, Z.shape[1], nr):
                cols = min(nr, Z.shape[1] - j0)
                for i0 in range(0, Z.shape[0], mr):
                    rows = min(mr, Z.shape[0] - i0)
                    if cols == nr:
                        full(A, i0 * A.shape[1], A.shape[1], 1, rows, W, j0, W.shape[1], Z, i0 * Z.shape[1] + j0,
                             Z.shape[1], A.shape[1], cols, False)
                    else:
                        edge(A, i0 * A.shape[1], A.shape[1], 1, rows, W, j0, W.shape[1], Z, i0 * Z.shape[1] + j0,
                             Z.shape[1], A.shape[1], cols, False)
        return product

    g = np.random.default_rng(3)
    A = g.standard_normal((11, 300)).astype(np.float32)
    W = g.standard_normal((300, 75)).astype(np.float32)
    Z = g.standard_normal((11, 75)).astype(np.float32)
    ours = Z.copy()
    accumulate_product(A, W, ours, 11, 300, 75)
    for mr, nr_bytes in ((1, 16), (4, 32), (8, 64), (5, 128)):
        other = Z.copy()
        product_with(mr, nr_bytes)(A, W, other)
        assert other.tobytes() == ours.tobytes(), (mr, nr_bytes)


def test_first_draws_are_numpys_lognormal_and_pareto_bit_for_bit():
    from edgefed.kernels.first_draws import LOGNORMAL, PARETO, first_draws
    from edgefed.rng import generator, stream_words

    ids = np.r_[np.arange(3000), 4_000_000_000, 2 ** 32 - 1, 2 ** 33 + 5]  # (the last two keys take two words)
    for seed in (0, 2 ** 40 + 3):
        for kind, draw in ((LOGNORMAL, lambda g: g.lognormal(4.0, 2.0)), (PARETO, lambda g: g.pareto(0.5))):
            out, done = np.empty(ids.size), np.empty(ids.size, np.bool_)
            first_draws(stream_words(seed, Purpose.DATA_COUNT), ids, kind, 4.0, 2.0 if kind == LOGNORMAL else 0.5,
                        out, done, np.zeros(4, np.uint64), np.zeros(4, np.uint64))
            assert 0.97 < done.mean() < 1.0  # the ziggurat's rejections are left to NumPy, and there are some
            assert not done[-2:].any()  # as are keys of two words
            ref = np.array([draw(generator(seed, Purpose.DATA_COUNT, device_id=int(k))) for k in ids[done]])
            assert out[done].tobytes() == ref.tobytes()


def test_device_generators_draw_as_each_devices_own_generator():
    from edgefed.rng import device_generators, generator

    ids = [0, 1, 2, 999_999, 2 ** 33 + 5]
    for seed in (0, 2 ** 40 + 3):
        for k, g in device_generators(seed, Purpose.DATA_COUNT, ids):
            own = generator(seed, Purpose.DATA_COUNT, device_id=k)
            assert g.bit_generator.state == own.bit_generator.state
            assert g.lognormal(4.0, 2.0) == own.lognormal(4.0, 2.0) and g.pareto(0.5) == own.pareto(0.5)

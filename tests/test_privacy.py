"""Differential privacy for partial work (docs/design.md 2.19): the clipped, noised rule against an
independent NumPy replay on the quadratic, the noise's variance, epsilon against dp-accounting called
directly, determinism over ranks, and the refusals."""

import math

import numpy as np
import pytest

from edgefed.errors import ConfigError
from edgefed.orchestration import run as runs
from edgefed.rng import Purpose, generator
from edgefed.runlog import read_run
from edgefed.tracefiles import write_trace_file
from conftest import config_with
from helpers import assert_same_logs, interrupted_then_resumed
from test_clock import board, simulated  # noqa: F401
from test_async_runs import K as ASYNC_K, LR as ASYNC_LR, M, _config as async_config, problem  # noqa: F401
from test_protocol import loopback_run

dp = pytest.importorskip("dp_accounting", reason="dp-accounting is not installed: pip install 'edgefed[privacy]'")

N, D, K, LR = 6, 3, 8, 0.1
SHARES = [1.0, 0.75, 0.5, 0.375, 0.25, 1.0]


@pytest.fixture
def quadratic(tmp_path, quad_file):
    """A quadratic with N = 6 devices, each completing its own constant share of K = 8 steps."""
    g = np.random.default_rng(5)
    A, b = g.uniform(0.5, 2.0, (N, D)), g.normal(0, 3, (N, D))
    path = quad_file(A, b, x0=np.zeros(D))
    write_trace_file(tmp_path / "shares.csv", [f"t{i}" for i in range(N)], np.array([SHARES]), {})
    traces = [f"{tmp_path / 'shares.csv'}#t{i}" for i in range(N)]
    return A, b, {"data.kind": "quadratic", "data.path": str(path), "model.dtype": "float64",
                  "train.clients_per_round": 4, "train.local_steps": K, "train.lr_local": LR, "train.lr_global": 0.9,
                  "train.weighting": "uniform", "rounds": 6, "participation.mode": "trace",
                  "participation.trace": traces, "privacy.mechanism": "central"}


REBOOT = {"dynamics.fast_reboot": True, "dynamics.arrive": [{"device": 5, "round": 3}]}


@pytest.mark.parametrize("scheme,z,extra", [("C", 0.0, {}), ("fednova", 0.0, {}), ("A", 0.0, {}), ("drop", 0.0, {}),
                                            ("B", 0.7, {}), ("B", 0.0, REBOOT)])
def test_the_rule_is_clip_of_the_multiplied_update_plus_noise_by_hand(tmp_path, quadratic, scheme, z, extra):
    A, b, base = quadratic
    cfg = config_with({**base, "participation.scheme": scheme, "privacy.clip": 1.5, "privacy.noise_multiplier": z,
                       "privacy.delta": 1e-3, **extra})
    runs.run(cfg, tmp_path / "r.h5")
    log = read_run(tmp_path / "r.h5")
    x, boosted = np.zeros(D), False
    for r in range(6):
        ids = np.flatnonzero(log["participation/selected"][r])
        s = log["participation/steps"][r, ids]
        # s exact steps on f_k = 1/2 sum a (x - b)^2 from x: y = b + (1 - lr a)^s (x - b)
        deltas = b[ids] + (1 - LR * A[ids]) ** s[:, None] * (x - b[ids]) - x
        S = ids.size
        a = log["participation/coeff"][r, ids] * S  # the rule's multiplier (w_k = 1/S)
        contrib = a[:, None] * deltas
        norms = np.linalg.norm(contrib, axis=1)
        clipped = norms > 1.5
        contrib[clipped] *= (1.5 / norms[clipped])[:, None]
        noise = z * 1.5 * generator(0, Purpose.PRIVACY, r + 1).standard_normal(D)
        x = x + 0.9 / S * (contrib.sum(axis=0) + noise)
        np.testing.assert_allclose(log["trajectory/x"][r + 1], x, rtol=1e-9, atol=1e-12)
        assert log["participation/clipped"][r, ids].tolist() == (clipped & (s > 0)).tolist()
        if extra and 5 in ids:  # Scheme B's a_k is 1 but for the arrival's fast-reboot boost, clipped with it
            assert a[ids.tolist().index(5)] == pytest.approx(1 + 2 / (r + 1 - 3 + 1) ** 2)
            boosted = True
    assert log["participation/clipped"].any() and not log["participation/clipped"].all()
    assert not extra or boosted


def test_adaptive_clipping_follows_the_noised_quantile_by_hand_and_resumes(tmp_path, quadratic):
    A, b, base = quadratic
    cfg = config_with({**base, "participation.scheme": "C", "privacy.clip": 0.5, "privacy.noise_multiplier": 0.4,
                       "privacy.adaptive_clip": True, "privacy.target_quantile": 0.5, "privacy.clip_lr": 0.3,
                       "privacy.delta": 1e-3, "privacy.quantile_noise": 0.5})
    with pytest.raises(ConfigError, match=r"needs the count's noise 2 sigma_b above z = 0.4, but sigma_b = 0.2"):
        runs.run(config_with({**base, "privacy.noise_multiplier": 0.4, "privacy.adaptive_clip": True}),
                 tmp_path / "default.h5")  # sigma_b = S / 20 = 0.2: too little for z = 0.4
    runs.run(cfg, tmp_path / "r.h5")
    log = read_run(tmp_path / "r.h5")
    sigma_b = 0.5
    assert log["attrs"]["privacy_quantile_noise"] == sigma_b
    z_update = (0.4 ** -2 - (2 * sigma_b) ** -2) ** -0.5  # Andrew et al.: the two releases compose to z = 0.4
    x, clip = np.zeros(D), 0.5
    for r in range(6):
        ids = np.flatnonzero(log["participation/selected"][r])
        s = log["participation/steps"][r, ids]
        deltas = b[ids] + (1 - LR * A[ids]) ** s[:, None] * (x - b[ids]) - x
        S = ids.size
        contrib = (log["participation/coeff"][r, ids] * S)[:, None] * deltas
        norms = np.linalg.norm(contrib, axis=1)
        cut = norms > clip
        contrib[cut] *= (clip / norms[cut])[:, None]
        noise = z_update * clip * generator(0, Purpose.PRIVACY, r + 1).standard_normal(D)
        x = x + 0.9 / S * (contrib.sum(axis=0) + noise)
        np.testing.assert_allclose(log["trajectory/x"][r + 1], x, rtol=1e-9, atol=1e-12)
        assert log["metrics/privacy_clip"][r] == pytest.approx(clip, rel=1e-12)
        count = np.sum(~cut & (s > 0)) + sigma_b * generator(0, Purpose.PRIVACY_QUANTILE, r + 1).standard_normal(1)[0]
        clip = clip * math.exp(-0.3 * (count / S - 0.5))
    assert len(set(np.round(log["metrics/privacy_clip"], 12))) > 1  # it moved
    whole, resumed = interrupted_then_resumed(cfg, tmp_path, 3)
    assert_same_logs(whole, resumed)


def test_fedbuff_clips_each_staleness_weighted_report_and_noises_every_update(tmp_path, problem):
    # x_t = x_{t-1} + eta_g / M (sum_k clip_C(w(tau_k) Delta_k) + N(0, z^2 C^2)), a_k = M p_k = w(tau_k)
    A, b, path, profile = problem
    private = {"async.staleness": "polynomial", "privacy.mechanism": "central", "privacy.clip": 0.4,
               "privacy.noise_multiplier": 0.6, "privacy.delta": 1e-3}
    runs.run(async_config(path, profile, **private), tmp_path / "a.h5")
    log = read_run(tmp_path / "a.h5")
    tau, late = log["participation/staleness"], log["participation/late"]
    versions = [log["trajectory/x"][0]]
    for t in range(1, 16):
        step = 0.6 * 0.4 * generator(0, Purpose.PRIVACY, t).standard_normal(versions[0].size)
        taken = np.flatnonzero((tau[t - 1] >= 0) & ~late[t - 1])
        for k in taken:
            start = versions[t - 1 - tau[t - 1, k]]
            y = start.copy()
            for _ in range(ASYNC_K):
                y = y - ASYNC_LR * (A[k] * (y - b[k]))
            contribution = (1.0 + tau[t - 1, k]) ** -0.5 * (y - start)
            norm = np.linalg.norm(contribution)
            assert log["participation/clipped"][t - 1, k] == (norm > 0.4)
            step += contribution * min(1.0, 0.4 / norm)
        versions.append(versions[-1] + step / M)
    np.testing.assert_allclose(log["trajectory/x"], np.array(versions), rtol=0, atol=1e-12)
    assert log["participation/clipped"].any() and log["attrs"]["privacy_sampling_rate"] == M / 8  # q = M/N
    adaptive = async_config(path, profile, **{**private, "privacy.adaptive_clip": True, "privacy.quantile_noise": 1.0})
    whole, resumed = interrupted_then_resumed(adaptive, tmp_path, 7)
    assert_same_logs(whole, resumed)
    assert len(set(whole["metrics/privacy_clip"].tolist())) > 1


def test_over_selection_counts_in_q_and_a_compressed_private_run_replays_and_runs_on_ranks(tmp_path, board):
    # S = 2 of 6 with o = 0.5: three selected, the first two to finish taken, so q = 3/6 (the draw, not the
    # quorum); the replay of its log clips and noises with the recorded run's S (whatever its own config says)
    # and the same stream, to the byte
    private = {"data.clients": 6, "rounds": 4, "train.clients_per_round": 2, "compress.uplink": "int8",
               "compress.downlink": "fp16", "privacy.mechanism": "central", "privacy.clip": 0.05,
               "privacy.noise_multiplier": 0.5}
    cfg = simulated(board, **{**private, "participation.overselect": 0.5, "participation.clock": "simulated"})
    runs.run(cfg, tmp_path / "o.h5")
    log = read_run(tmp_path / "o.h5")
    assert log["attrs"]["privacy_sampling_rate"] == 0.5 and (log["metrics/n_applied"] == 2).all()
    assert (log["participation/selected"].sum(axis=1) == 3).all() and log["participation/clipped"].any()
    replay = config_with({**private, "data.samples": 200, "train.local_steps": 10, "participation.mode": "trace",
                          "participation.trace": str(tmp_path / "o.h5"), "train.clients_per_round": 5})
    runs.run(replay, tmp_path / "r.h5")
    again = read_run(tmp_path / "r.h5")
    for name in ("trajectory/x", "participation/coeff", "participation/clipped", "metrics/epsilon"):
        assert again[name].tobytes() == log[name].tobytes(), name
    assert_same_logs(log, loopback_run(cfg, tmp_path / "mpi.h5", 3))


def test_the_noise_has_the_variance_it_promises(tmp_path, quad_file):
    # a flat quadratic (a = 0): every update is 0, so x moves by eta_g / S N(0, z^2 C^2) alone
    d, rounds = 400, 10
    path = quad_file(np.zeros((5, d)), np.zeros((5, d)), x0=np.zeros(d))
    cfg = config_with({"data.kind": "quadratic", "data.path": str(path), "model.dtype": "float64",
                       "train.clients_per_round": 5, "rounds": rounds, "train.lr_global": 0.5,
                       "privacy.mechanism": "central", "privacy.clip": 2.0, "privacy.noise_multiplier": 1.5})
    runs.run(cfg, tmp_path / "r.h5")
    steps = np.diff(read_run(tmp_path / "r.h5")["trajectory/x"], axis=0).ravel()
    expected = (0.5 / 5 * 1.5 * 2.0) ** 2
    assert abs(steps.mean()) < 4 * math.sqrt(expected / steps.size)
    assert steps.var() == pytest.approx(expected, rel=0.1)  # 4,000 draws: the estimate is within 5 % (2 sigma)


def test_distributed_noise_under_secure_aggregation_survives_dropouts(tmp_path, quad_file):
    # a flat quadratic (no update): x moves by eta_g G sum of the survivors' noise, G = 1/S (uniform, Scheme B);
    # each device adds N(0, z^2 C^2 / t), so n survivors >= t carry n/t times the central variance
    d, rounds, S = 300, 8, 5
    path = quad_file(np.zeros((S, d)), np.zeros((S, d)), x0=np.zeros(d))
    write_trace_file(tmp_path / "t.csv", ["full", "none"], np.array([[1.0, 0.0]]), {})
    traces = [f"{tmp_path / 't.csv'}#full"] * 4 + [f"{tmp_path / 't.csv'}#none"]  # device 4 never reports
    base = {"data.kind": "quadratic", "data.path": str(path), "model.dtype": "float64", "rounds": rounds,
            "train.clients_per_round": S, "train.local_steps": 4, "train.lr_global": 0.5,
            "participation.mode": "trace", "participation.trace": traces, "secagg.enabled": True,
            "secagg.key_source": "seeded", "privacy.mechanism": "distributed", "privacy.clip": 2.0,
            "privacy.noise_multiplier": 1.5}
    runs.run(config_with(base), tmp_path / "r.h5")
    log = read_run(tmp_path / "r.h5")
    t = 4  # the default threshold for 5 devices: ceil(2 * 4 / 3) + 1
    assert (log["participation/coeff"][:, 4] == 0).all() and np.isfinite(log["metrics/epsilon"]).all()
    steps = np.diff(log["trajectory/x"], axis=0).ravel()
    expected = (0.5 / S) ** 2 * 4 * (1.5 * 2.0) ** 2 / t
    assert steps.var() == pytest.approx(expected, rel=0.1)
    assert_same_logs(log, loopback_run(config_with(base), tmp_path / "mpi.h5", 3))


def test_epsilon_every_round_is_the_accountants_and_a_target_sets_z(tmp_path, quadratic):
    _, _, base = quadratic
    cfg = config_with({**base, "privacy.epsilon": 5.0, "privacy.delta": 1e-3, "rounds": 6})
    lines = []
    runs.run(cfg, tmp_path / "r.h5", on_info=lines.append)
    log = read_run(tmp_path / "r.h5")
    z, q = log["attrs"]["privacy_noise_multiplier"], log["attrs"]["privacy_sampling_rate"]
    assert q == 4 / 6 and any(f"z = {z:.4g} (for epsilon 5 over 6 rounds)" in line for line in lines)
    for r in (1, 3, 6):
        accountant = dp.rdp.RdpAccountant()
        accountant.compose(dp.SelfComposedDpEvent(dp.PoissonSampledDpEvent(q, dp.GaussianDpEvent(z)), r))
        assert log["metrics/epsilon"][r] == pytest.approx(accountant.get_epsilon(1e-3), rel=1e-12)
    assert log["metrics/epsilon"][0] == 0.0 and 4.9 < log["metrics/epsilon"][6] <= 5.0 + 1e-6
    assert np.all(np.diff(log["metrics/epsilon"]) > 0)
    from edgefed.analysis.logs import Run
    from edgefed.analysis.summary import summary_lines

    line = next(x for x in summary_lines(Run.read(tmp_path / "r.h5")) if x.startswith("privacy:"))
    clipped = log["participation/clipped"][log["participation/coeff"] != 0].mean()
    assert line == (f"privacy: central noise; epsilon {log['metrics/epsilon'][6]:.3f} at delta 0.001 (z = {z:.4g}, "
                    f"clip C = 1); {clipped:.1%} of applied contributions clipped")


def test_a_private_run_repeats_resumes_and_runs_on_ranks_to_the_byte(tmp_path, quadratic):
    _, _, base = quadratic
    cfg = config_with({**base, "participation.scheme": "C", "privacy.noise_multiplier": 0.8})
    whole, resumed = interrupted_then_resumed(cfg, tmp_path, 3)
    assert_same_logs(whole, resumed)
    assert_same_logs(whole, loopback_run(cfg, tmp_path / "mpi.h5", 3))


def test_the_os_noise_source_is_not_the_seeded_stream(tmp_path, quadratic):
    _, _, base = quadratic
    logs = []
    for i, source in enumerate(("os", "os", "seeded")):
        runs.run(config_with({**base, "privacy.noise_multiplier": 1.0, "privacy.noise_source": source}),
                 tmp_path / f"{i}.h5")
        logs.append(read_run(tmp_path / f"{i}.h5"))
    xs = [log["trajectory/x"][-1].tobytes() for log in logs]
    assert len(set(xs)) == 3 and logs[0]["attrs"]["privacy_noise_source"] == "os"


@pytest.mark.parametrize("overrides,message", [
    ({"privacy.mechanism": "gaussian"}, "privacy.mechanism = 'gaussian' is not known"),
    ({"privacy.mechanism": "central", "privacy.clip": 0.0, "privacy.noise_multiplier": 1.0}, "privacy.clip = 0.0 must be positive"),
    ({"privacy.mechanism": "central", "privacy.noise_multiplier": -1.0}, "privacy.noise_multiplier = -1.0 must be a finite"),
    ({"privacy.mechanism": "central", "privacy.epsilon": 0.0}, "privacy.epsilon = 0.0 must be positive"),
    ({"privacy.mechanism": "central", "privacy.epsilon": 2.0, "privacy.delta": 1.5}, "privacy.delta = 1.5 must lie in (0, 1)"),
    ({"privacy.mechanism": "central"}, "needs exactly one of noise_multiplier (z) and epsilon"),
    ({"privacy.mechanism": "central", "privacy.noise_multiplier": 1.0, "privacy.epsilon": 2.0}, "needs exactly one of"),
    ({"privacy.mechanism": "central", "privacy.noise_multiplier": 1.0, "train.algorithm": "scaffold"},
     "does not take train.algorithm = \"scaffold\": its control variates"),
    ({"privacy.mechanism": "central", "privacy.noise_multiplier": 1.0, "secagg.enabled": True},
     "does not take [secagg] enabled = true: the coordinator sees only the masked sum"),
    ({"privacy.mechanism": "distributed", "privacy.noise_multiplier": 1.0}, "set [secagg] enabled = true"),
    ({"privacy.mechanism": "distributed", "privacy.noise_multiplier": 1.0, "secagg.enabled": True,
      "privacy.adaptive_clip": True}, "would need the count of unclipped updates summed securely"),
    ({"privacy.mechanism": "central", "privacy.noise_multiplier": 1.0, "privacy.target_quantile": 1.0},
     "privacy.target_quantile = 1.0 must lie in (0, 1)"),
])
def test_bad_privacy_keys_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        config_with(overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_without_dp_accounting_the_error_names_the_extra(tmp_path, quadratic, monkeypatch):
    import builtins

    real = builtins.__import__

    def missing(name, *args, **kwargs):
        if name == "dp_accounting":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", missing)
    _, _, base = quadratic
    with pytest.raises(ConfigError, match=r"pip install 'edgefed\[privacy\]'"):
        runs.run(config_with({**base, "privacy.noise_multiplier": 1.0}), tmp_path / "r.h5")
    assert not (tmp_path / "r.h5").exists()


def test_a_trace_run_with_distributed_noise_on_ranks_is_the_simulators(tmp_path):
    """(Over the loopback world: secure aggregation under a real mpiexec is tests/test_mpi.py's.)"""
    cfg = config_with({"rounds": 4, "data.clients": 6, "data.samples": 60, "train.clients_per_round": 4,
                       "train.local_steps": 5, "participation.mode": "trace", "participation.trace": "builtin",
                       "participation.scheme": "C", "secagg.enabled": True, "secagg.key_source": "seeded",
                       "secagg.threshold": 2, "privacy.mechanism": "distributed", "privacy.epsilon": 20.0,
                       "privacy.clip": 0.5})
    runs.run(cfg, tmp_path / "sim.h5")
    sim, mpi = read_run(tmp_path / "sim.h5"), loopback_run(cfg, tmp_path / "mpi.h5", 3)
    for name in ("trajectory/x", "metrics/epsilon", "participation/coeff", "participation/steps"):
        assert sim[name].tobytes() == mpi[name].tobytes(), name
    assert 0 < mpi["metrics/epsilon"][1] < mpi["metrics/epsilon"][-1] <= 20.0 + 1e-6


def test_a_sweep_over_z_tables_epsilon_and_the_report_draws_accuracy_against_it(tmp_path):
    import csv

    from edgefed.analysis.logs import Run
    from edgefed.analysis.figures import privacy_tradeoff
    from edgefed.analysis.report import _headline
    from edgefed.analysis.sweeps import Sweep
    from edgefed.orchestration.sweep import run_sweep

    (tmp_path / "s.toml").write_text(
        '[set]\nrounds = 2\n"data.clients" = 20\n"train.clients_per_round" = 10\n"train.local_steps" = 3\n'
        '"privacy.clip" = 0.5\n[axes]\n"privacy.mechanism,privacy.noise_multiplier" = '
        '[["none", 0.0], ["central", 0.5], ["central", 2.0]]\n')
    assert run_sweep(tmp_path / "s.toml", tmp_path / "out", on_line=lambda line: None) == 0
    with open(tmp_path / "out" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["epsilon"] == ""  # no privacy, no epsilon
    for row in rows[1:]:
        assert float(row["epsilon"]) == read_run(tmp_path / "out" / row["log"])["metrics/epsilon"][-1]
    assert float(rows[1]["epsilon"]) > float(rows[2]["epsilon"]) > 0  # more noise, less spent
    figure = privacy_tradeoff(Sweep.read(tmp_path / "out"))
    (line,) = figure.axes[0].get_lines()[:1]  # the private cells, by epsilon; the plain one a dashed level
    assert line.get_xdata().tolist() == sorted(float(row["epsilon"]) for row in rows[1:])
    page = _headline([Run.read(tmp_path / "out" / rows[1]["log"])])
    assert f"<td>ε {float(rows[1]['epsilon']):.3g} at δ" in page

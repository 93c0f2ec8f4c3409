"""Secure aggregation in runs: the trajectory is the plain run's up to the stated fixed-point rounding for
every rule, dropouts (non-finite, late) are unmasked, too many abort the round, the coordinator sees only
masked inputs, and what cannot be computed this way is refused in one line."""

import re
import sys

import numpy as np
import pytest

pytest.importorskip("cryptography")

from conftest import config_with  # noqa: E402
from helpers import assert_same_logs, interrupted_then_resumed  # noqa: E402
from edgefed import cli  # noqa: E402
from edgefed.errors import ConfigError  # noqa: E402
from edgefed.participation import schemes  # noqa: E402
from edgefed.runtime.local import LocalTransport  # noqa: E402
from edgefed.secagg import crypto, fixedpoint  # noqa: E402

SECURE = {"secagg.enabled": True, "secagg.key_source": "seeded"}


def quadratic(quad_file, n_devices=6, dim=5, seed=3, diverging=None):
    g = np.random.default_rng(seed)
    A, b = g.uniform(0.5, 2.0, (n_devices, dim)), g.normal(size=(n_devices, dim))
    if diverging is not None:  # its step factor 1 - 1e10: inf within the round's steps
        A[diverging] = 1e10
    return quad_file(A, b, g.integers(5, 60, n_devices), g.normal(size=dim))


def base(path, **extra):
    cfg = {"data.kind": "quadratic", "data.path": str(path), "model.dtype": "float64", "rounds": 5,
           "train.clients_per_round": 5, "train.local_steps": 6, "train.lr_local": 0.2, "train.lr_global": 0.9}
    cfg.update(extra)
    return cfg


def round_bounds(log, scheme, weighting, clip, bits, lr_global):
    """Per round: lr_g |G| n / (2 s), the most the secure sum may move x away from the plain sum."""
    n_train = log["devices/n_train"]
    out = []
    for sel, steps, budget, coeff in zip(log["participation/selected"], log["participation/steps"],
                                         log["participation/budget"], log["participation/coeff"]):
        ids = np.flatnonzero(sel)
        applied = coeff[ids] != 0
        a = schemes.device_factors(scheme, schemes.prescales(weighting, ids, n_train), steps[ids], budget[ids])
        g = schemes.server_factor(coeff[ids][applied], a[applied])
        out.append(abs(lr_global * g) * fixedpoint.rounding_bound(ids.size, clip, bits))
    return np.array(out)


@pytest.mark.parametrize("scheme,weighting", [("A", "count_selected"), ("B", "uniform"), ("C", "count_global"),
                                              ("fednova", "count_selected"), ("drop", "uniform"),
                                              ("C", "uniform")])
def test_every_rule_matches_the_plain_run_within_the_rounding_bound(quad_file, run_experiment, scheme, weighting):
    path = quadratic(quad_file)
    cfg = base(path, **{"participation.mode": "trace", "participation.trace": "builtin",  # partial work
                        "participation.scheme": scheme, "train.weighting": weighting, "secagg.bits": 32,
                        "secagg.clip": 8.0})
    plain = run_experiment(cfg)
    secure = run_experiment({**cfg, **SECURE})
    for key in ("participation/steps", "participation/selected", "participation/coeff"):
        np.testing.assert_array_equal(plain[key], secure[key])
    assert (plain["participation/steps"] < plain["participation/budget"])[plain["participation/selected"]].any()
    bounds = round_bounds(secure, scheme, weighting, 8.0, 32, 0.9)
    gap = np.abs(secure["trajectory/x"] - plain["trajectory/x"]).max(axis=1)
    assert gap[0] == 0.0 and gap[1] <= bounds[0] * (1 + 1e-9)  # from one x: the rounding, nothing else
    assert np.all(gap[1:] <= np.cumsum(bounds) * 2)  # and the contraction keeps it from growing
    assert not secure["metrics/secagg_clipped"].any()
    assert not secure["metrics/secagg_aborted"].any()


def test_the_rounding_shrinks_with_the_bits(quad_file, run_experiment):
    path = quadratic(quad_file)
    plain = run_experiment(base(path, rounds=1))
    gaps = {}
    for bits in (16, 32, 64):
        secure = run_experiment(base(path, rounds=1, **SECURE, **{"secagg.bits": bits, "secagg.clip": 8.0}))
        gaps[bits] = np.abs(secure["trajectory/x"][1] - plain["trajectory/x"][1]).max()
        assert gaps[bits] <= round_bounds(secure, "B", "count_selected", 8.0, bits, 0.9)[0] * (1 + 1e-9)
    assert gaps[16] > 1e-6 > gaps[32] > gaps[64]


def test_over_selected_surplus_devices_are_dropouts_too(quad_file, run_experiment):
    cfg = base(quadratic(quad_file, n_devices=8), **{"train.clients_per_round": 4, "participation.overselect": 0.5,
                                                     "participation.mode": "trace", "participation.trace": "builtin"})
    plain, secure = run_experiment(cfg), run_experiment({**cfg, **SECURE})
    np.testing.assert_array_equal(plain["participation/coeff"], secure["participation/coeff"])
    assert (plain["participation/selected"].sum(axis=1) == 6).all()
    gap = np.abs(secure["trajectory/x"] - plain["trajectory/x"]).max(axis=1)
    assert np.all(gap[1:] <= 2 * np.cumsum(round_bounds(secure, "B", "count_selected", 10.0, 32, 0.9)))


def test_an_interrupted_secure_run_resumes_to_the_same_log(quad_file, tmp_path):
    cfg = config_with(base(quadratic(quad_file), **SECURE))
    assert_same_logs(*interrupted_then_resumed(cfg, tmp_path, 2))


def test_a_nonfinite_device_is_a_dropout_the_survivors_unmask(quad_file, run_experiment):
    path = quadratic(quad_file, diverging=2)
    cfg = base(path, **{"train.clients_per_round": "all", "train.local_steps": 40, "train.lr_local": 0.2})
    plain = run_experiment(cfg)
    secure = run_experiment({**cfg, **SECURE, "secagg.threshold": 3})
    assert secure["participation/nonfinite"][:, 2].all() and plain["participation/nonfinite"][:, 2].all()
    np.testing.assert_array_equal(secure["participation/coeff"], plain["participation/coeff"])
    assert np.abs(secure["trajectory/x"] - plain["trajectory/x"]).max() < 1e-6
    assert secure["participation/bytes_up"][:, 2].tolist() == [0] * 5  # it sent no masked input


def test_as_many_dropouts_as_the_threshold_allows_then_one_more(quad_file, run_experiment, capsys):
    """6 devices, t = 4 of 6 shares: two dropouts (non-finite) are recovered; a third aborts the round."""
    for diverging, aborted in (((1, 4), False), ((0, 1, 4), True)):
        g = np.random.default_rng(5)
        A, b = g.uniform(0.5, 2.0, (6, 3)), g.normal(size=(6, 3))
        A[list(diverging)] = 1e10
        path = quad_file(A, b, None, np.zeros(3), name=f"q{len(diverging)}.npz")
        cfg = base(path, **SECURE, **{"train.clients_per_round": "all", "train.local_steps": 40, "rounds": 2,
                                      "secagg.threshold": 4})
        log = run_experiment(cfg)
        assert log["metrics/secagg_aborted"].tolist() == [aborted] * 2
        if aborted:
            np.testing.assert_array_equal(log["trajectory/x"], 0.0)  # nothing applied
            assert not log["participation/coeff"].any()
        else:
            assert np.abs(log["trajectory/x"][1]).max() > 0.1


def test_an_aborted_or_clipped_round_says_so_on_its_progress_line(quad_file, tmp_path, capsys):
    A = np.ones((3, 2))
    A[[0, 1]] = 1e10
    path = quad_file(A, np.ones((3, 2)), None, np.zeros(2))
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'rounds = 1\n[data]\nkind = "quadratic"\npath = "{path}"\n[model]\ndtype = "float64"\n'
                   '[train]\nclients_per_round = "all"\nlocal_steps = 40\nlr_local = 0.2\n'
                   '[secagg]\nenabled = true\n')
    assert cli.main(["run", str(cfg), "--out", str(tmp_path / "r.h5")]) == 0
    assert "secagg aborted: 1 of 3 survived, threshold 3" in capsys.readouterr().out
    assert cli.main(["summary", str(tmp_path / "r.h5")]) == 0
    assert re.search(r"secure aggregation: [\d.]+ ms and \d+ B of protocol per device and round, 1 rounds aborted, "
                     r"0 coordinates clipped \(os keys\)", capsys.readouterr().out)
    cfg.write_text(cfg.read_text().replace("local_steps = 40", "local_steps = 1") + "clip = 0.01\n")
    assert cli.main(["run", str(cfg), "--out", str(tmp_path / "c.h5")]) == 0
    assert "secagg clipped 6 coordinates" in capsys.readouterr().out  # 3 devices x 2 coordinates


def test_the_coordinator_gets_masked_inputs_only(quad_file, run_experiment, monkeypatch):
    seen = []
    work = LocalTransport.local_work

    def spy(self, plan, state, downlink=None):
        res = work(self, plan, state, downlink)
        seen.append(res)
        return res

    monkeypatch.setattr(LocalTransport, "local_work", spy)
    path = quadratic(quad_file)
    logs = [run_experiment(base(path, rounds=2, **{"secagg.enabled": True})) for _ in range(2)]  # OS keys
    assert all(res.vectors == {} and res.masked.dtype == np.dtype("<u4") for res in seen)
    np.testing.assert_array_equal(logs[0]["trajectory/x"], logs[1]["trajectory/x"])  # masks cancel exactly
    assert not np.array_equal(seen[0].masked, seen[2].masked)  # fresh keys: other words, same sum
    assert logs[0]["attrs"]["secagg_key_source"] == "os"
    sent = logs[0]["participation/secagg_bytes"][logs[0]["participation/selected"]]
    assert np.all(sent == sent[0]) and sent[0] > 0  # all linked: keys, 4 sealed shares, 5 reveals each
    assert np.all(np.isfinite(logs[0]["participation/secagg_s"][logs[0]["participation/selected"]]))


@pytest.mark.parametrize("extra,message", [
    ({"train.algorithm": "scaffold"}, "SCAFFOLD's controls need a second sum"),
    ({"participation.mode": "async"}, 'does not take participation.mode = "async"'),
    ({"compress.uplink": "int8"}, "does not take compress.uplink; set compress.uplink = \"none\""),
    ({"secagg.bits": 8}, "secagg.bits = 8 is not known"),
    ({"secagg.neighbours": 2, "secagg.threshold": 4}, "secagg.threshold = 4 exceeds the 3 shares"),
    ({"secagg.neighbours": 3, "secagg.threshold": 6}, "secagg.threshold = 6 exceeds the 5 shares a device makes (its 4"),
    ({"secagg.threshold": 1}, "secagg.threshold = 1 would let one device's shares unmask its own update"),
    ({"train.clients_per_round": 1}, "train.clients_per_round = 1 would show the one device's update"),
    ({"secagg.key_source": "urandom"}, "secagg.key_source = 'urandom' is not known"),
    ({"secagg.clip": 0.0}, "secagg.clip = 0.0 must be positive"),
])
def test_what_cannot_be_computed_securely_is_refused(extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_with({"secagg.enabled": True, **extra})


def test_a_missing_extra_is_named(monkeypatch):
    for name in [m for m in sys.modules if m.split(".")[0] == "cryptography"] + ["cryptography"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    monkeypatch.setattr(crypto, "_library", crypto._library.__wrapped__)  # and never imported here
    with pytest.raises(ConfigError, match=r"needs the cryptography package; install it with pip install 'edgefed\[secure\]'"):
        config_with({"secagg.enabled": True})

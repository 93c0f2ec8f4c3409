"""Compressed updates in whole runs: the math against a NumPy reference, the bytes logged, the MPI messages
that really shrink, simulator = MPI, residuals through --resume, and a shaped link's time."""

import numpy as np
import pytest

from edgefed import compression as comp
from edgefed.config.validation import validate
from edgefed.errors import ConfigError
from edgefed.orchestration import ranks
from edgefed.orchestration import run as runs
from edgefed.runlog import read_run
from edgefed.runtime.mpi import protocol
from conftest import config_with
from helpers import assert_same_logs, interrupted_then_resumed, run_until
from loopback_mpi import World

N, D, K, LR, ROUNDS = 4, 6, 3, 0.1, 4


def _run(cfg, path):
    runs.run(cfg, path)
    return read_run(path)


def _topk(x, k):
    """k largest magnitudes, ties to the lower index (independent of compression.encode)."""
    keep = np.lexsort((np.arange(x.size), -np.abs(x)))[:k]
    out = np.zeros_like(x)
    out[keep] = x[keep]
    return out


def _reference(A, b, n, x0, uplink, downlink, feedback):
    """FedAvg with every device, count weights, K exact gradient steps, in float64, as docs/design.md 2.13
    says: devices train from their copy of the model, send (Delta + residual) encoded, keep what was lost."""
    codecs = {"none": lambda v: v, "fp16": lambda v: v.astype(np.float16).astype(np.float64),
              "topk": lambda v: _topk(v, comp.topk_count(D, 0.34))}
    x, copy, residual = x0.copy(), x0.copy(), np.zeros((N, D))
    p = n / n.sum()
    trajectory = [x.copy()]
    for _ in range(ROUNDS):
        if downlink != "none":
            copy = copy + codecs[downlink](x - copy)
        held = copy if downlink != "none" else x
        total = np.zeros(D)
        for k in range(N):
            y = held.copy()
            for _ in range(K):
                y = y - LR * (A[k] * (y - b[k]))
            u = (y - held) + (residual[k] if feedback else 0.0)
            sent = codecs[uplink](u)
            if feedback:
                residual[k] = u - sent
            total += p[k] * sent
        x = x + total
        trajectory.append(x.copy())
    return np.array(trajectory)


@pytest.mark.parametrize("uplink,downlink,feedback", [("topk", "none", True), ("topk", "none", False),
                                                      ("fp16", "topk", False), ("topk", "fp16", True)])
def test_compressed_fedavg_follows_the_numpy_reference(tmp_path, quad_file, uplink, downlink, feedback):
    g = np.random.default_rng(3)
    A, b = g.uniform(0.5, 2.0, (N, D)), g.normal(size=(N, D))
    n, x0 = np.array([3, 1, 2, 4]), g.normal(size=D)
    path = quad_file(A, b, n=n, x0=x0)
    cfg = config_with({"data.kind": "quadratic", "data.path": str(path), "model.dtype": "float64",
                       "train.clients_per_round": "all", "train.local_steps": K, "train.lr_local": LR,
                       "rounds": ROUNDS, "compress.uplink": uplink, "compress.downlink": downlink,
                       "compress.topk_fraction": 0.34, "compress.error_feedback": feedback})
    log = _run(cfg, tmp_path / "q.h5")
    want = _reference(A, b, n, x0, uplink, downlink, feedback)
    np.testing.assert_allclose(log["trajectory/x"], want, rtol=0, atol=1e-12)
    lossless = _reference(A, b, n, x0, "none", "none", False)
    assert np.abs(want[-1] - lossless[-1]).max() > 1e-6  # the compression did change the run
    k = comp.topk_count(D, 0.34)
    up = {"topk": 12 * k, "fp16": 2 * D}[uplink]  # int32 index + float64 value per kept coordinate
    down = {"none": 8 * D, "topk": 12 * k, "fp16": 2 * D}[downlink]
    assert (log["participation/bytes_up"] == up).all() and (log["participation/bytes_down"] == down).all()
    if feedback:  # the residuals the log keeps for --resume are the reference's
        assert log["state/residual_delta_x"].any()


SCAFFOLD = {"rounds": 5, "data.clients": 7, "data.samples": "pareto", "train.clients_per_round": 4,
            "train.local_steps": 6, "train.algorithm": "scaffold", "participation.mode": "trace",
            "participation.trace": "builtin", "participation.scheme": "C",
            "dynamics.arrive": [{"device": 1, "round": 3}], "dynamics.depart": [{"device": 3, "round": 4}],
            "compress.uplink": "int8", "compress.downlink": "topk", "compress.topk_fraction": 0.1}


def test_every_run_logs_its_bytes_and_scaffold_sends_both_vectors_compressed(tmp_path):
    plain = _run(config_with({"rounds": 2}), tmp_path / "plain.h5")
    selected = plain["participation/selected"]
    assert (plain["participation/bytes_up"][selected] == 610 * 4).all()  # SYNTHETIC's logreg, float32
    assert (plain["participation/bytes_down"][selected] == 610 * 4).all()
    assert not plain["participation/bytes_up"][~selected].any() and not plain["participation/bytes_down"][~selected].any()

    log = _run(config_with(SCAFFOLD), tmp_path / "s.h5")
    worked = log["participation/steps"] > 0
    int8 = 610 + 4  # a code per coordinate and one float32 scale
    assert (log["participation/bytes_up"][worked] == 2 * int8).all()  # Delta x and Delta c
    assert not log["participation/bytes_up"][~worked].any()
    k = comp.topk_count(610, 0.1)
    # the compressed broadcast reaches every member (each keeps its copy of x and c); device 1 arriving in
    # round 3 first receives the whole copy; device 3, gone from round 4, nothing
    down, active = log["participation/bytes_down"], log["participation/active"]
    expected = np.where(active, 2 * 8 * k, 0)
    expected[2, 1] = 2 * 610 * 4
    np.testing.assert_array_equal(down, expected)
    assert not active[3:, 3].any() and not active[:2, 1].any()
    assert log["state/residual_delta_c"].any() and log["state/downlink_c"].any()


def test_simulator_equals_ranks_and_the_messages_really_shrink(tmp_path):
    cfg = config_with(SCAFFOLD)
    sim = _run(cfg, tmp_path / "sim.h5")
    sizes = {}
    for name, overrides in (("plain", {k: v for k, v in SCAFFOLD.items() if not k.startswith("compress")}),
                            ("compressed", SCAFFOLD)):
        world, errors = World(3), []
        mains = {0: lambda comm, c=config_with(overrides), p=tmp_path / f"{name}.h5":
                 ranks.run_coordinator(comm, lambda: (c, None, p), False, None, lambda line: None, errors.append)}
        mains.update({r: ranks.run_device_rank for r in (1, 2)})
        world.run(mains)
        assert not errors, errors
        work = [size for _, dest, tag, size in world.sent if dest == 0 and tag == protocol.TAG_WORK]
        down = [size for src, dest, tag, size in world.sent if src == 0 and dest == -1]
        residual = [size for _, dest, tag, size in world.sent if dest == 0 and tag == protocol.TAG_RESIDUAL]
        sizes[name] = (max(work), sorted(set(down)), residual)
    assert_same_logs(sim, read_run(tmp_path / "compressed.h5"))
    # a rank's report of two devices: int8 codes instead of float32 (a quarter, plus the header)
    assert sizes["compressed"][0] < 0.3 * sizes["plain"][0]
    # after round 1's full copy the broadcast is x's and c's top-k pairs: 2 x 61 x 8 bytes
    assert 2 * 8 * comp.topk_count(610, 0.1) in sizes["compressed"][1]
    # the residuals the log keeps for --resume follow the reports, dense: the bench's bookkeeping
    assert not sizes["plain"][2] and sizes["compressed"][2] and max(sizes["compressed"][2]) >= 2 * 2 * 610 * 4


def test_a_resume_restores_the_residuals_and_the_devices_copy(tmp_path):
    cfg = config_with({**SCAFFOLD, "rounds": 5})
    whole, resumed = interrupted_then_resumed(cfg, tmp_path, 3)
    assert_same_logs(whole, resumed)
    # and across ranks: the residuals travel back to the devices that own them
    point = run_until(cfg, tmp_path / "again.h5", 2)
    world, errors = World(3), []
    mains = {0: lambda comm: ranks.run_coordinator(comm, lambda: (cfg, point, tmp_path / "again.h5"), False, None,
                                                   lambda line: None, errors.append)}
    mains.update({r: ranks.run_device_rank for r in (1, 2)})
    world.run(mains)
    assert not errors, errors
    assert_same_logs(whole, read_run(tmp_path / "again.h5"))


def test_a_smaller_update_leaves_more_of_a_round_deadline_for_steps(tmp_path):
    """Simulated Pi 4 boards on a 100 Mbit/s link, 0.5 ms deadlines covering the round: a full float32
    logreg model each way takes 0.39 ms of it, a top-k report almost nothing."""
    base = {"rounds": 3, "device.profile": "pi4b", "device.link_mbps": [100.0], "participation.mode": "deadline",
            "participation.deadline_s": 0.0005, "participation.deadline_covers": "round"}
    logs = {}
    for kind in ("none", "topk"):
        logs[kind] = _run(config_with({**base, "compress.uplink": kind}), tmp_path / f"{kind}.h5")
    sel = logs["none"]["participation/selected"]
    for log in logs.values():
        moved = log["participation/bytes_up"] + log["participation/bytes_down"]
        np.testing.assert_allclose(log["participation/comm_s"][sel], 8 * moved[sel] / 100e6, rtol=1e-6)
    steps = {kind: log["participation/steps"][sel] for kind, log in logs.items()}
    assert (steps["none"] < 20).all() and (steps["topk"] > 2 * steps["none"]).all()


@pytest.mark.parametrize("key,value,message", [
    ("uplink", "int4", r"compress.uplink = 'int4' is not known; choose one of 'none', "),
    ("downlink", "gzip", r"compress.downlink = 'gzip' is not known; choose one of 'none', 'fp16', 'int8', 'topk'"),
    ("topk_fraction", 0.0, r"compress.topk_fraction = 0.0 must lie in \(0, 1\]"),
    ("error_feedback", True, r"compress.error_feedback = true needs a lossy compress.uplink"),
])
def test_bad_compress_keys_say_how_to_fix_them(key, value, message):
    with pytest.raises(ConfigError, match=message):
        validate(config_with({f"compress.{key}": value}))


def test_error_feedback_defaults_to_on_for_a_lossy_uplink():
    assert validate(config_with({"compress.uplink": "int8"})).compress.error_feedback is True
    assert validate(config_with({})).compress.error_feedback is False

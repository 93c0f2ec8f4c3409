"""Energy per device-round (docs/design.md 2.21): the model by hand, and a profile's [power] checked."""

import csv
import math
from pathlib import Path

import numpy as np
import pytest

from edgefed import hwprofile
from edgefed.errors import ConfigError
from edgefed.analysis.export import export_csv
from edgefed.analysis.logs import Run
from edgefed.analysis.summary import summary_lines
from edgefed.orchestration import run as runs
from edgefed.participation.energy import round_energy_j
from edgefed.runlog import RESTART, measured, read_run
from conftest import config_with
from helpers import run_until


def test_a_device_round_costs_its_busy_seconds_and_its_share_of_its_boards_idle_power():
    # board 0: 3 W idle, 0.75 W a busy core, two devices worked; board 1: 0.6 W and 0.3 W, one device; board 2:
    # no [power] (NaN); a 2 s round
    idle, busy = np.array([3.0, 0.6, np.nan]), np.array([0.75, 0.3, np.nan])
    energy = round_energy_j(np.array([0, 1, 0, 2]), np.array([1.0, 2.0, 0.5, 1.0]), 2.0, idle, busy)
    assert energy[:3].tolist() == [1.0 * 0.75 + 3.0 * 2.0 / 2, 2.0 * 0.3 + 0.6 * 2.0, 0.5 * 0.75 + 3.0 * 2.0 / 2]
    assert math.isnan(energy[3])
    # the board's idle energy is paid once, however its devices share it
    assert energy[[0, 2]].sum() - (1.5 * 0.75) == pytest.approx(3.0 * 2.0)


def test_power_tables_are_read_and_bad_watts_refused_naming_the_key():
    pi4 = hwprofile.load_profile("pi4b").power
    assert (pi4.idle_w, pi4.busy_w_per_core) == (3.06, 0.765)  # 0.6 A and 1.2 A at 5.1 V
    assert hwprofile.load_profile("pi5").power is None  # (no [power]: no energy for the board)
    base = {"format": 1, "name": "b", "machine": {"arch": "aarch64", "cores": 4, "memory_mb": 512}}
    for power, message in [({"idle_w": -1.0, "busy_w_per_core": 0.3}, "power.idle_w must be a finite number of "
                                                                        "watts >= 0, found -1.0"),
                           ({"idle_w": 0.6, "busy_w_per_core": math.inf}, "power.busy_w_per_core must be a finite"),
                           ({"idle_w": 0.6}, "power.busy_w_per_core is missing"),
                           (2.0, r"\[power\] must be a table")]:
        with pytest.raises(ConfigError, match=rf"^hardware profile b.toml: {message}"):
            hwprofile.profile_from_dict({**base, "power": power}, "b.toml")


# -- in runs --------------------------------------------------------------------------------------------------
N, D, K = 8, 4, 3
IDLE_W, BUSY_W = 2.0, 0.5
BOARD = """format = 1
name = "a hand-timed board with a meter"
measured = true
[machine]
arch = "any"
cores = 1
memory_mb = 8192
[recommend]
[[speed]]
model = "quadratic"
params = 4
batch = 1
steps_per_s = 1000.0
"""
POWER = f"[power]\nidle_w = {IDLE_W}\nbusy_w_per_core = {BUSY_W}\n"


@pytest.fixture
def board(tmp_path, quad_file):
    g = np.random.default_rng(5)
    path = quad_file(g.uniform(0.5, 2.0, (N, D)), g.normal(size=(N, D)), n=np.arange(1, N + 1))
    (tmp_path / "metered.toml").write_text(BOARD + POWER)
    (tmp_path / "unmetered.toml").write_text(BOARD)
    return lambda profile, **extra: config_with({
        "data.kind": "quadratic", "data.path": str(path), "model.dtype": "float64", "rounds": 4,
        "train.clients_per_round": 5, "train.local_steps": K, "train.lr_local": 0.05, "train.batch_size": 1,
        "device.profile": str(tmp_path / profile), "device.speed": [1.0, 0.5, 0.25], **extra})


def _step_s() -> np.ndarray:
    return 1e-3 / np.array([1.0, 0.5, 0.25])[np.arange(N) % 3]  # the profile's 1000 steps/s at each speed


@pytest.mark.parametrize("extra", [{"participation.mode": "deadline", "participation.deadline_s": 0.0025},
                                   {"participation.mode": "deadline", "participation.deadline_s": 1.0,
                                    "participation.overselect": 0.6}],
                         ids=["deadline", "overselected"])
def test_a_simulated_run_logs_each_device_rounds_energy_by_the_model(tmp_path, board, extra):
    """On the simulated clock each device is a board of its own: E = steps it computed x its step time x a
    busy core's watts + idle watts x the round's length; a device that computed nothing costs 0 J, one not
    selected has no energy (NaN). Over-selection's beaten devices pay for the steps they did."""
    lines = []
    runs.run(board("metered.toml", **extra), tmp_path / "e.h5", on_info=lines.append)
    assert "energy: modelled from the [power] of " in "\n".join(lines)
    log = read_run(tmp_path / "e.h5")
    steps, selected, energy = log["participation/steps"], log["participation/selected"], log["participation/energy_j"]
    length = np.diff(log["metrics/clock_s"])
    expected = np.where(steps > 0, steps * _step_s() * BUSY_W + IDLE_W * length[:, None], 0.0)
    np.testing.assert_allclose(energy[selected], expected[selected], rtol=1e-12)
    assert np.isnan(energy[~selected]).all()
    assert (steps[selected] == 0).any() or log["participation/late"].any()  # (the case the test is for happened)


def test_energy_is_measured_where_the_clock_is_and_absent_without_power(tmp_path, board):
    """A measured clock charges each device its measured busy time (elapsed x CPU share) and splits the
    machine's idle power over the round among the devices that worked; a profile without [power] logs no
    energy and says so once."""
    runs.run(board("metered.toml", **{"participation.clock": "measured", "participation.mode": "deadline",
                                      "participation.deadline_s": 0.0025}), tmp_path / "m.h5")
    log = read_run(tmp_path / "m.h5")
    selected = log["participation/selected"]
    busy = log["participation/elapsed_s"].astype(np.float64) * log["participation/cpu_percent"] / 100.0
    worked = selected & (busy > 0)
    share = IDLE_W * np.diff(log["metrics/clock_s"])[:, None] / worked.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(log["participation/energy_j"][worked], (busy * BUSY_W + share)[worked], rtol=1e-6)
    assert "participation/energy_j" in measured(log["attrs"]) and log["attrs"]["device_board"].tolist() == [0] * N
    # the board's steps within its deadlines: what its profile predicts (min(K, floor(2.5 ms / step time)))
    # beside what it did
    predicted = int((selected * np.minimum(K, np.floor(0.0025 / _step_s() + 1e-9))).sum())
    done = int(log["participation/steps"][selected].sum())
    lines = summary_lines(Run.read(tmp_path / "m.h5"))
    at = lines.index("steps within the deadlines, predicted by the boards' profiles and measured:")
    assert lines[at + 1] == f"  this machine ({tmp_path / 'metered.toml'}): predicted {predicted}, measured {done} " \
                            f"({done / predicted - 1:+.1%})"
    lines = []
    runs.run(board("unmetered.toml"), tmp_path / "u.h5", on_info=lines.append)
    assert "participation/energy_j" not in read_run(tmp_path / "u.h5")
    assert [line for line in lines if line.startswith("energy:")] == [
        f"energy: not computed (hardware profile {tmp_path / 'unmetered.toml'} has no [power]; add idle_w and "
        "busy_w_per_core with their sources to compute it)"]


def test_fedbuff_charges_each_report_its_tasks_time_and_the_tools_show_it(tmp_path, board):
    """FedBuff holds a board for its task's time (no links here: its steps at its step time), so a report
    costs steps x step time x (busy + idle watts); summary sums it per device, export --csv writes it, a
    sweep table's figure and the report's energy figure read the same sums."""
    cfg = board("metered.toml", **{"participation.mode": "async", "async.concurrency": 3, "async.buffer": 2,
                                   "async.max_staleness": 3, "rounds": 6})
    runs.run(cfg, tmp_path / "a.h5")
    log = read_run(tmp_path / "a.h5")
    steps, energy = log["participation/steps"], log["participation/energy_j"]
    reported = log["participation/selected"]
    np.testing.assert_allclose(energy[reported], (steps * _step_s() * (BUSY_W + IDLE_W))[reported], rtol=1e-12)
    run = Run.read(tmp_path / "a.h5")
    per_device = np.nansum(energy, axis=0)
    lines = summary_lines(run, target=0.0)
    assert f"energy (modelled from the boards' [power]): {per_device.sum():.4g} J in all, " \
           f"{per_device.sum() / 6:.4g} J a round; each simulated device is a board of its own" in lines
    assert lines[-N - 1].endswith("energy J  J a round")
    assert lines[-N].split()[-2:] == [f"{per_device[0]:.4g}", f"{per_device[0] / reported[:, 0].sum():.4g}"]
    assert math.isnan(run.energy_to_target(0.0)) and run.spent_j()[-1] == pytest.approx(per_device.sum())
    export_csv(run, tmp_path / "csv")
    rows = list(csv.DictReader(open(tmp_path / "csv" / "participation.csv")))
    assert [float(r["energy_j"]) if r["energy_j"] else math.nan for r in rows[:N]] == pytest.approx(
        energy[0].tolist(), nan_ok=True)


def test_a_boards_predicted_steps_leave_its_competitor_its_load():
    """The summary's prediction for a board: each device-round's deadline at its profile's step time, less
    the share of its core the board's CPU competitor takes ([device] contention, entry b: rank b + 1)."""
    data = {"attrs": {"device_board": np.array([0, 1, 1]), "profile_step_s": np.array([1e-3, 1e-3, 2e-3])},
            "participation/deadline_s": np.array([[0.1, 0.1, np.nan], [0.1, 0.1, 0.1]]),
            "participation/selected": np.array([[True, True, False], [True, True, True]]),
            "participation/budget": np.full((2, 3), 1000), "participation/steps": np.array([[95, 40, 0], [97, 52, 24]])}
    run = Run(Path("r.h5"), data, '[device]\nboards = ["a", "b"]\ncontention = [0.0, 0.5]\n')
    # board 0: 2 rounds of 0.1 s / 1 ms; board 1: device 1 2 rounds of 0.1 s x (1 - 0.5) / 1 ms, device 2 one of
    # 0.05 s / 2 ms
    assert run.board_steps() == [{"board": 0, "predicted": 200, "measured": 192, "gap": 192 / 200 - 1},
                                 {"board": 1, "predicted": 125, "measured": 116, "gap": 116 / 125 - 1}]
    # a restart after round 1 may have placed the devices elsewhere: the last world's rounds only
    data["launch/restarts"] = np.array([(b"L", 1, b"t", b"pi-b answered again", 2, 3)], RESTART)
    assert run.since_restart() == 1 and run.board_steps() == [
        {"board": 0, "predicted": 100, "measured": 97, "gap": 97 / 100 - 1},
        {"board": 1, "predicted": 75, "measured": 76, "gap": 76 / 75 - 1}]


def test_a_log_with_energy_resumes_when_no_board_has_power_any_more(tmp_path, board):
    """Resumed with boards none of which has [power] now (the metered one lost, say), the log's energy rows
    go on as NaN: it must not lose its column, nor fail every resume."""
    cfg = board("metered.toml")
    point = run_until(cfg, tmp_path / "r.h5", 2)
    (tmp_path / "metered.toml").write_text(BOARD)
    runs.run(cfg, tmp_path / "r.h5", resume_point=point)
    energy = read_run(tmp_path / "r.h5")["participation/energy_j"]
    assert energy.shape == (4, N) and np.isfinite(energy[:2]).any() and np.isnan(energy[2:]).all()


def test_a_replay_logs_the_energy_its_recording_spent(tmp_path, board):
    """Slow links make devices late on the simulated clock: their computed steps cost energy though the log
    keeps 0 steps for them. A replay of the log logs the recorded energy, byte for byte."""
    extra = {"participation.mode": "deadline", "participation.deadline_s": 0.0025, "participation.grace_s": 0.0,
             "device.link_mbps": [0.5]}
    runs.run(board("metered.toml", **extra), tmp_path / "a.h5")
    runs.run(board("metered.toml", **{"participation.mode": "trace", "participation.trace": str(tmp_path / "a.h5")}),
             tmp_path / "b.h5")
    a, b = read_run(tmp_path / "a.h5"), read_run(tmp_path / "b.h5")
    late = a["participation/late"] & (a["participation/steps"] == 0)
    assert late.any() and (a["participation/energy_j"][late] > 0).all()
    assert b["attrs"]["clock"] == "replayed"
    assert a["participation/energy_j"].tobytes() == b["participation/energy_j"].tobytes()


def test_devices_on_boards_without_power_are_not_counted_as_zero():
    data = {"attrs": {}, "participation/energy_j": np.array([[1.0, np.nan], [2.0, np.nan]]),
            "participation/selected": np.array([[True, True], [True, False]])}
    energy = Run(Path("r.h5"), data, "").energy()
    assert energy["total"] == 3.0 and energy["partial"] and math.isnan(energy["device"][1])
    data["participation/selected"][:, 1] = False  # (only a device never selected has no energy: nothing missing)
    assert not Run(Path("r.h5"), data, "").energy()["partial"]


class _Counter:
    """A board meter whose every reading adds one joule: a round's reading is then the number of reports
    its rank sent in it."""

    source = "test"

    def __init__(self):
        self.total = 0.0

    def joules(self) -> float:
        self.total += 1.0
        return self.total


def test_boards_that_read_their_own_energy_log_it_beside_the_model(tmp_path, board, monkeypatch):
    """Under mpiexec on a measured clock each device rank reads its board's meter at the start of its work and
    at each report it sends; a rank's reading of a round is split evenly among its devices that worked, so
    each board's devices sum to what its meter read (here one joule a message: one message a round)."""
    from edgefed.runtime import power
    from test_protocol import loopback_run

    monkeypatch.setattr(power, "meter", _Counter)
    cfg = board("metered.toml", **{"device.profile": None, "device.speed": [],
                                   "device.boards": [str(tmp_path / "metered.toml")] * 2})
    log = loopback_run(cfg, tmp_path / "read.h5", 3)
    read, selected = log["participation/energy_read_j"], log["participation/selected"]
    board_of = log["attrs"]["device_board"]
    assert (~selected).any()  # (5 of 8 a round: some not selected, whose reading must stay NaN)
    for b in (0, 1):
        mine = selected & (board_of == b)[None, :]
        assert mine.any(axis=1).all()  # (5 of 8 over two boards of 4: each board works every round)
        np.testing.assert_allclose(np.where(mine, read, 0.0).sum(axis=1)[mine.any(axis=1)], 1.0, rtol=1e-12)
    assert np.isfinite(read[selected]).all() and np.isnan(read[~selected]).all()
    assert np.isfinite(log["participation/energy_j"][selected]).all()  # the model's, beside it
    rounds = int(selected.any(axis=1).sum())
    modelled = log["participation/energy_j"][selected].sum()
    lines = summary_lines(Run.read(tmp_path / "read.h5"))
    assert (f"energy read by the boards' own meters (RAPL, a Pi 5's PMIC; measured): {2 * rounds:.4g} J over "
            f"{selected.sum()} device-rounds, where the model says {modelled:.4g} J") in lines
    assert sum(line.endswith(f"; its meter read {rounds:.4g} J") for line in lines) == 2, lines
    monkeypatch.setattr(power, "meter", lambda: None)  # boards without a meter: NaN beside the model
    assert np.isnan(loopback_run(cfg, tmp_path / "none.h5", 3)["participation/energy_read_j"]).all()


def test_rapl_counters_wrap_and_a_pmic_is_sampled(tmp_path, monkeypatch):
    from edgefed.runtime import power

    zone = tmp_path / "intel-rapl:0"
    zone.mkdir()
    (tmp_path / "intel-rapl:0:0").mkdir()  # a subzone (a core's): part of the package, not counted again
    (zone / "max_energy_range_uj").write_text("1000000\n")
    (zone / "energy_uj").write_text("900000\n")
    monkeypatch.setattr(power, "POWERCAP", tmp_path)
    meter = power.meter()
    assert meter.source == "RAPL" and meter.zones == [zone]
    (zone / "energy_uj").write_text("950000\n")
    assert meter.joules() == pytest.approx(0.05)
    (zone / "energy_uj").write_text("100000\n")  # wrapped: 50,000 to the range, then 100,000
    assert meter.joules() == pytest.approx(0.2)
    text = ("  VDD_CORE_A current(7)=2.00000000A\n  VDD_CORE_V volt(15)=0.80000000V\n"
            "  EXT5V_V volt(24)=5.10000000V\n  3V3_SYS_A current(2)=0.50000000A\n  3V3_SYS_V volt(10)=3.30000000V\n")
    assert power.rails_watts(text) == pytest.approx(2 * 0.8 + 0.5 * 3.3)  # EXT5V has no current: not a rail here
    clock = iter([10.0, 12.0])
    monkeypatch.setattr(power.time, "monotonic", lambda: next(clock))
    pmic = power.Pmic(lambda: text)
    assert pmic.joules() == pytest.approx(2.0 * (1.6 + 1.65))  # 2 s at a steady 3.25 W

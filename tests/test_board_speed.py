"""Boards held to their profiles: the calibration's rescaling on a machine whose arithmetic is known, what it
says of a board it cannot bring to its profile, and the meter that runs on each board."""

import io
import math
import time

import pytest

from edgefed.orchestration.board_speed import Calibrated, calibrate, drift, meter, out_of_reach, profile_speed

CORE = 200_000.0  # this machine's steps a CPU second, in the fake


def machine(cores, drift=1.0):
    """A fake cluster: boards on cores; a board gets its set share while its core has room (a core's boards
    over one core share it in proportion), at this machine's speed times drift."""
    set_shares = []

    def apply(shares):
        set_shares[:] = shares

    def measure():
        got = []
        for i, s in enumerate(set_shares):
            load = sum(set_shares[j] for j, c in enumerate(cores) if c == cores[i])
            got.append(s / max(load, 1.0))
        return [(g * CORE * drift, CORE * drift, g) for g in got]

    return apply, measure


def test_shares_are_rescaled_until_every_board_runs_at_its_profiles_speed():
    apply, measure = machine([0, 1])
    # the first shares from a profile of this machine that is 20 % off: one rescaling brings both within 3 %
    result = calibrate([0.3, 0.084], [50_000.0, 14_000.0], measure, apply)
    assert result.tries == 2 and result.shares == pytest.approx([0.25, 0.07])
    assert result.speeds == pytest.approx([50_000.0, 14_000.0])
    assert out_of_reach(["a", "b"], [0, 1], result, [50_000.0, 14_000.0]) is None


def test_a_board_out_of_reach_is_named_with_why():
    # two boards that need 0.6 of a core each, on one core
    apply, measure = machine([0, 0])
    result = calibrate([0.6, 0.6], [120_000.0, 120_000.0], measure, apply, tries=3)
    assert out_of_reach(["pi-a", "pi-b"], [0, 0], result, [120_000.0, 120_000.0]) == (
        "board pi-a cannot be brought to its profile's 120,000 steps/s: 100,000 steps/s, -16.7% off after 3 "
        "measurements (the shares of the boards on its core (core 0: pi-a, pi-b) add up to 1.73 cores); also off: "
        "pi-b")
    # (each share 0.6, then 0.72, then 0.864: rescaled twice)
    # a board faster than a whole core of this machine
    apply, measure = machine([0])
    result = calibrate([0.9], [300_000.0], measure, apply, tries=3)
    assert result.shares == [1.0] and "a whole core of this machine is slower than the board's profile" in \
        out_of_reach(["pi5"], [0], result, [300_000.0])
    # a meter that never answered
    silent = Calibrated([0.5], [float("nan")], CORE, 1)
    assert "no answer from its meter" in out_of_reach(["pi-a"], [0], silent, [100_000.0])
    # several off: the furthest named, the others after it
    both = Calibrated([0.5, 0.5, 0.5], [0.475, 0.25, 0.5], CORE, 6)  # 95,000, 50,000 and 100,000 steps/s
    said = out_of_reach(["pi-a", "pi-b", "pi-c"], [0, 1, 2], both, [100_000.0] * 3)
    assert said.startswith("board pi-b cannot be brought to its profile's 100,000 steps/s: 50,000 steps/s, -50.0% off")
    assert said.endswith("; also off: pi-a")


def test_the_meter_answers_each_line_with_its_speeds_and_share():
    """A window of steps for each line, as long as the line says; a meter no quota holds keeps its core busy
    (most of a core)."""
    out = io.StringIO()
    start = time.perf_counter()
    meter(io.StringIO("0.05\n0.05\n"), out)
    assert time.perf_counter() - start >= 0.1
    lines = [list(map(float, line.split())) for line in out.getvalue().splitlines()]
    assert len(lines) == 2
    for wall, cpu, share in lines:
        assert wall > 0 and cpu > 0 and 0.5 < share <= 1.05


def test_a_run_is_warned_of_each_board_off_its_profile(tmp_path):
    """The drift check before a run: a board more than 5 % off its profile's speed (wall clock) is named with
    its speed and gap, one within is not; a board whose meter never answered is said to."""
    listed = tmp_path / "boards.txt"
    listed.write_text("head coordinator\npi-a pi4b\npi-b pi-zero-2w 0.5\npi-c pi4b\n")
    pi4, zero = profile_speed("pi4b"), profile_speed("pi-zero-2w")

    class Fake:
        def __init__(self, hosts):
            assert hosts == ["pi-a", "pi-b", "pi-c"]

        def measure(self, seconds=1.0):
            return [(pi4 * 1.04, 1.0, 0.2), (zero * 0.8, 1.0, 0.06), (math.nan,) * 3]

        def close(self):
            pass

    lines = []
    drift(listed, say=lines.append, meters_for=Fake)
    assert lines == [
        f"pi-cluster.sh: warning: board pi-b runs {zero * 0.8:,.0f} steps/s, -20.0% off its profile pi-zero-2w "
        f"({zero:,.0f}): its deadlines and predictions will be off; profile it again (launch/pi-cluster.sh "
        "profile BOARDS)",
        "pi-cluster.sh: warning: board pi-c did not measure its speed (launch/pi-cluster.sh check BOARDS)"]
    lines.clear()
    Fake.measure = lambda self, seconds=1.0: [(pi4, 1.0, 0.2), (zero * 1.02, 1.0, 0.06), (pi4 * 0.97, 1.0, 0.2)]
    drift(listed, say=lines.append, meters_for=Fake)
    assert lines == ["pi-cluster.sh: 3 boards within 5% of their profiles' speed"]

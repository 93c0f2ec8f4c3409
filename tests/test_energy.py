"""Energy per device-round (docs/design.md 2.21): the model by hand, and a profile's [power] checked."""

import math

import numpy as np
import pytest

from edgefed import hwprofile
from edgefed.errors import ConfigError
from edgefed.participation.energy import round_energy_j


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

"""What a board says it draws, where it can: its own energy counter, read by its device rank in every round.

- RAPL (Intel and AMD x86 packages, through Linux's powercap: /sys/class/powercap/intel-rapl:N/energy_uj):
  a counter of microjoules per package, which wraps at its max_energy_range_uj; every package's is summed.
  Reading it needs root on current kernels (a file that cannot be read is no meter).
- A Raspberry Pi 5's PMIC (`vcgencmd pmic_read_adc`): each rail's current and voltage, read when asked;
  the energy between two readings is the mean of their powers (the sum of V x I over the rails that give
  both) times the time between them, a sample, not a counter: short rounds are read more finely than long
  ones. The 5 V input's own losses are not among the rails.

A meter's joules(): the energy since the meter was made, cumulative. meter() gives this machine's, or None.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

POWERCAP = Path("/sys/class/powercap")  # (tests point it elsewhere)
VCGENCMD = "vcgencmd"
_RAIL = re.compile(r"^\s*(\S+)_([AV])\s+\w+\(\d+\)=([-+\d.eE]+)[AV]\s*$")


class Rapl:
    """Every package's RAPL energy counter, summed across their wraps."""

    source = "RAPL"

    def __init__(self, zones: list[Path]):
        self.zones = zones
        self.ranges = [int((z / "max_energy_range_uj").read_text()) for z in zones]
        self.last = self._read()
        self.total_uj = 0

    def _read(self) -> list[int]:
        return [int((z / "energy_uj").read_text()) for z in self.zones]

    def joules(self) -> float:
        now = self._read()
        for i, (before, after) in enumerate(zip(self.last, now)):
            self.total_uj += after - before if after >= before else after + self.ranges[i] - before
        self.last = now
        return self.total_uj / 1e6


class Pmic:
    """A Pi 5's PMIC rails, sampled: the energy between readings at the mean of their powers."""

    source = "PMIC (sampled)"

    def __init__(self, read=None):
        self.read = read or (lambda: subprocess.run([VCGENCMD, "pmic_read_adc"], capture_output=True, text=True,
                                                    timeout=5).stdout)
        self.at, self.watts = time.monotonic(), rails_watts(self.read())
        self.total_j = 0.0

    def joules(self) -> float:
        at, watts = time.monotonic(), rails_watts(self.read())
        self.total_j += 0.5 * (self.watts + watts) * (at - self.at)
        self.at, self.watts = at, watts
        return self.total_j


def rails_watts(text: str) -> float:
    """The power of the rails `vcgencmd pmic_read_adc` gives both a current and a voltage of, W."""
    amps, volts = {}, {}
    for line in text.splitlines():
        m = _RAIL.match(line)
        if m:
            (amps if m.group(2) == "A" else volts)[m.group(1)] = float(m.group(3))
    return sum(amps[rail] * volts[rail] for rail in amps.keys() & volts.keys())


def meter():
    """This machine's energy meter: RAPL where its counters can be read, else a Pi 5's PMIC, else None."""
    zones = sorted(z for z in POWERCAP.glob("intel-rapl:*") if z.name.count(":") == 1)  # packages, not subzones
    if zones:
        try:
            return Rapl(zones)
        except (OSError, ValueError):
            pass  # not readable (root only on current kernels): no counter
    if shutil.which(VCGENCMD):
        try:
            pmic = Pmic()
            if pmic.watts > 0:  # (older firmware and other Pis do not know pmic_read_adc)
                return pmic
        except (OSError, subprocess.SubprocessError):
            pass
    return None

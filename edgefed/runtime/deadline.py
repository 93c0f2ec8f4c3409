"""Local work under a wall-clock deadline, and what the board says about itself while it works.

A device runs its kernel in chunks and stops when the deadline has passed or its budget is done. The first
chunk is one step; later chunks are sized from the measured step time to last about `chunk_s` (never past
the time left), so the clock is read about once per millisecond: its cost (~1 us per chunk, measured in
benchmarks/) stays well under 1 % of the work, and the overshoot past the deadline stays within one chunk.
Because the kernels continue the caller's generator state, the steps a chunked run completes are bit for
bit the steps an unchunked run of the same count makes: a deadline run replays exactly as a trace.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import psutil

CHUNK_S = 0.001


def run_all(step_fn, n_steps: int) -> int:
    """Full and trace modes: exactly n_steps, in one call."""
    return step_fn(n_steps) if n_steps > 0 else 0


class DeadlineRunner:
    """run(step_fn, budget): steps done before `deadline_s` passed (counted from the call), at most budget,
    and before `stop` (a threading.Event) was set: an over-selected device told to stop ends within a chunk."""

    def __init__(self, deadline_s: float, chunk_s: float = CHUNK_S, clock=time.perf_counter, stop=None):
        self.deadline_s, self.chunk_s, self.clock, self.stop = deadline_s, chunk_s, clock, stop
        self.chunks = 0  # chunks run by the last call, for benchmarks and tests

    def __call__(self, step_fn, n_steps: int) -> int:
        clock, stop = self.clock, self.stop
        end = clock() + self.deadline_s
        done, chunk, self.chunks = 0, 1, 0
        while done < n_steps:
            t0 = clock()
            if t0 >= end or (stop is not None and stop.is_set()):
                break
            n = min(chunk, n_steps - done)
            step_fn(n)
            done += n
            self.chunks += 1
            t1 = clock()
            per_step = max((t1 - t0) / n, 1e-9)
            chunk = max(1, int(min(self.chunk_s, end - t1) / per_step))
        return done


class BoardReadings:
    """CPU frequency (MHz) and temperature (deg C) where the board reports them; NaN where it does not."""

    def __init__(self, core: int | None = None, sys_root: str = "/sys"):
        self.core = core
        freq = Path(sys_root, f"devices/system/cpu/cpu{core or 0}/cpufreq/scaling_cur_freq")
        zone = Path(sys_root, "class/thermal/thermal_zone0/temp")  # a Pi's SoC sensor (cpu-thermal)
        self._files = {"freq": freq if freq.is_file() else None, "temp": zone if zone.is_file() else None}
        self._temp_key = None if self._files["temp"] else self._find_sensor()
        self._fallback = {"freq": (-math.inf, math.nan), "temp": (-math.inf, math.nan)}  # (when read, value)

    @staticmethod
    def _find_sensor():
        try:
            sensors = psutil.sensors_temperatures()
        except (AttributeError, OSError):
            return None
        for name in ("cpu_thermal", "coretemp", "k10temp", "soc_thermal", "cpu-thermal"):  # Pi first
            if sensors.get(name):
                return name
        return next((name for name, entries in sensors.items() if entries), None)

    def frequency_mhz(self) -> float:
        """The core's current frequency: one sysfs read (~10 us) on boards with cpufreq, as every Pi has.

        Without it psutil parses /proc/cpuinfo (~0.15 ms, a tenth of a simulated round), so that value is
        read at most once a second; so is psutil's temperature, which walks every hwmon sensor.
        """
        return self._read("freq", self._psutil_frequency)

    def temperature_c(self) -> float:
        return self._read("temp", self._psutil_temperature)

    def _read(self, what: str, fallback) -> float:
        """The sysfs file's value (kHz or millidegrees, so / 1000), else psutil's at most once a second."""
        path = self._files[what]
        if path is not None:
            try:
                return int(path.read_bytes()) / 1000.0
            except (OSError, ValueError):
                self._files[what] = None
        when, value = self._fallback[what]
        now = time.monotonic()
        if now - when >= 1.0:
            value = fallback()
            self._fallback[what] = (now, value)
        return value

    def _psutil_frequency(self) -> float:
        try:
            freqs = psutil.cpu_freq(percpu=True)
        except (AttributeError, OSError, NotImplementedError):
            return math.nan
        if not freqs:
            return math.nan
        entry = freqs[self.core] if self.core is not None and self.core < len(freqs) else freqs[0]
        return float(entry.current) if entry.current else math.nan

    def _psutil_temperature(self) -> float:
        if self._temp_key is None:
            return math.nan
        try:
            entries = psutil.sensors_temperatures().get(self._temp_key)
        except OSError:
            return math.nan
        return float(entries[0].current) if entries else math.nan

"""CPU competitors: a duty-cycle load beside the training process, like the paper's 0/30/50/70/90 % competitors.

A competitor is a separate process pinned to one core that is busy `load` of every 10 ms period and sleeps
the rest. Its load lives in a small memory-mapped file (load, stop flag, period counter), so the process
hosting several devices changes the level to the current device's before that device works, and waits until
the competitor has started a period at the new level (at most one period): otherwise a device with a short
deadline would run beside the previous device's load. Started as a fresh interpreter (not a fork), which is
safe inside an MPI rank.
"""

from __future__ import annotations

import mmap
import os
import struct
import subprocess
import sys
import tempfile
import time

PERIOD_S = 0.01
CELL = 24  # load (float64), stop flag (float64), periods started (int64)


def pin(core: int | None, pid: int = 0) -> None:
    """Pin a process to one core (Linux); elsewhere do nothing."""
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(pid, {core % os.cpu_count()})


def duty_cycle(get_load, should_stop, period_s: float = PERIOD_S, on_period=None) -> None:
    """Busy for load * period, asleep for the rest, until should_stop()."""
    while not should_stop():
        load = get_load()
        if on_period is not None:
            on_period()
        start = time.perf_counter()
        busy_until = start + load * period_s
        x = 0
        while time.perf_counter() < busy_until:
            x += 1
        rest = start + period_s - time.perf_counter()
        if rest > 0:
            time.sleep(rest)


class Competitor:
    """One competitor process on `core`, whose load can change while it runs; stop() ends it."""

    def __init__(self, core: int | None, load: float = 0.0):
        fd, self._path = tempfile.mkstemp(prefix="edgefed-contend-")
        os.write(fd, bytes(CELL))
        self._cell = mmap.mmap(fd, CELL)
        os.close(fd)
        self._load = None
        self._cell[0:8] = struct.pack("d", float(load))
        self.core = core
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edgefed.runtime.contention", self._path, str(-1 if core is None else core)],
            stdin=subprocess.DEVNULL,
        )

    def set_load(self, load: float) -> None:
        """Change the competitor's load and wait (up to a few periods) until it runs at it."""
        if load == self._load:
            return
        self._load = load
        self._cell[0:8] = struct.pack("d", float(load))
        start = struct.unpack("q", self._cell[16:24])[0]
        deadline = time.monotonic() + 5 * PERIOD_S
        while struct.unpack("q", self._cell[16:24])[0] == start and time.monotonic() < deadline:
            time.sleep(PERIOD_S / 20)

    def stop(self) -> None:
        if self._cell is None:
            return
        self._cell[8:16] = struct.pack("d", 1.0)
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._cell.close()
        self._cell = None
        try:
            os.unlink(self._path)  # (the competitor removes it once it has mapped it)
        except FileNotFoundError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _serve(path: str, core: int) -> None:
    with open(path, "r+b") as f:
        cell = mmap.mmap(f.fileno(), CELL)
    # both processes hold the mapping now: the file's name is not needed, and a world killed with its
    # processes (no stop()) leaves nothing in the temporary folder
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    pin(None if core < 0 else core)
    parent = os.getppid()

    def next_period():
        cell[16:24] = struct.pack("q", struct.unpack("q", cell[16:24])[0] + 1)

    # The parent may die without stop() (an MPI abort kills it): then the competitor ends itself.
    duty_cycle(lambda: struct.unpack("d", cell[0:8])[0],
               lambda: struct.unpack("d", cell[8:16])[0] != 0.0 or os.getppid() != parent, on_period=next_period)


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))

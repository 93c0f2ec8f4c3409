"""CPU competitors: a duty-cycle load beside the training process, like the paper's 0/30/50/70/90 % competitors.

A competitor is a separate process pinned to one core that is busy `load` of every 10 ms period and sleeps
the rest: busy in CPU time, of the CPU its cgroup allows (on a board held to a share of a core by a quota, a
virtual one, it takes `load` of that share, as on a real board). Its load lives in a small memory-mapped file
(load, stop flag, period counter), so the process hosting several devices changes the level to the current
device's before that device works, and waits until the competitor has started a period at the new level (at
most one period): otherwise a device with a short deadline would run beside the previous device's load.
Started as a fresh interpreter (not a fork), which is safe inside an MPI rank.
"""

from __future__ import annotations

import mmap
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PERIOD_S = 0.01
OWED_S = 0.1  # a competitor catches up on at most this long a stretch of its load (a quota's period is shorter)
CELL = 24  # load (float64), stop flag (float64), periods started (int64)


def pin(core: int | None, pid: int = 0) -> None:
    """Pin a process to one core (Linux); elsewhere do nothing."""
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(pid, {core % os.cpu_count()})


def cpu_share() -> float:
    """The share of one core this process may use: the least CPU quota of its cgroup and the cgroup's parents
    (a container's `--cpus`, a virtual board's share), 1.0 where none limits it (or off Linux)."""
    try:
        lines = Path("/proc/self/cgroup").read_text(encoding="utf-8").splitlines()
    except OSError:
        return 1.0
    shares = [1.0]
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: cpu.max holds "QUOTA PERIOD" or "max PERIOD"
            root, files = Path("/sys/fs/cgroup"), ("cpu.max",)
        elif "cpu" in controllers.split(","):  # v1: the cpu hierarchy, mounted as its controllers or as cpu
            root, files = Path("/sys/fs/cgroup") / controllers, ("cpu.cfs_quota_us", "cpu.cfs_period_us")
            if not root.is_dir():
                root = Path("/sys/fs/cgroup/cpu")
        else:
            continue
        leaf = root / path.lstrip("/")
        shares += [_quota_share(level, files) for level in (leaf, *leaf.parents) if level.is_relative_to(root)]
    return min(shares)


def _quota_share(folder: Path, files: tuple[str, ...]) -> float:
    try:
        values = " ".join((folder / f).read_text(encoding="utf-8") for f in files).split()
        quota, period = (float(v) for v in values[:2])
    except (OSError, ValueError):  # no such file at this level, or "max"
        return 1.0
    return quota / period if quota > 0 and period > 0 else 1.0


def duty_cycle(get_load, should_stop, period_s: float = PERIOD_S, on_period=None, share: float = 1.0) -> None:
    """Use `load` of the CPU this process may use (`share` of a core: its cgroup's quota), period by period:
    busy in each until it has used its part, asleep for the rest, until should_stop(). Counted in CPU time,
    and what a period could not get (the cgroup's quota was spent) owed to the next ones, up to OWED_S: on
    a board held to a share of a core by a quota, busy for `load` of the wall clock would take all of it,
    and a debt forgotten at each period's end would take almost none."""
    owed, load, then, used = 0.0, None, time.perf_counter(), time.thread_time()
    while not should_stop():
        now = get_load()
        if now != load:
            owed, load = 0.0, now
        if on_period is not None:
            on_period()
        start, cpu = time.perf_counter(), time.thread_time()
        end = start + period_s
        # owed by the wall time since the last period began (a throttled competitor misses periods), less all
        # the CPU it used since, its waking and sleeping too: on a small share they are not negligible
        cap = OWED_S * load * share
        owed = max(-cap, min(owed + load * share * (start - then) - (cpu - used), cap))
        then, used = start, cpu
        x = 0
        while time.thread_time() - cpu < owed and time.perf_counter() < end:
            x += 1
        rest = end - time.perf_counter()
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
               lambda: struct.unpack("d", cell[8:16])[0] != 0.0 or os.getppid() != parent, on_period=next_period,
               share=cpu_share())


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))

"""What boards do beside what their profiles say: every board's local steps a second measured at once (as a run
loads them, each on its own share), over SSH. `launch/virtual-cluster.sh up` calibrates its boards' CPU quotas
with it until each board runs at its profile's speed; `launch/pi-cluster.sh run` checks a cluster's boards for
drift before a run.

    python -m edgefed.orchestration.board_speed shares STATE CGROUP      # a virtual cluster's quotas, as listed
    python -m edgefed.orchestration.board_speed calibrate STATE CGROUP   # ... calibrated
    python -m edgefed.orchestration.board_speed drift BOARDS             # warn of boards off their profiles

The speed is the logistic-regression step at batch 20 (the one a virtual board's quota is set from): the steps
done over a wall-clock window of calls of about 2 ms of CPU each, every pause of the board's share inside it.
"""

from __future__ import annotations

import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from edgefed import hwprofile
from edgefed.errors import EdgefedError

MODEL, BATCH, PARAMS = "logreg", 20, 610
TOLERANCE = 0.03  # calibrated: every board within 3 % of its profile
DRIFT = 0.05  # a run's boards: a warning beyond 5 %
TRIES = 6  # rescalings before a board is said to be out of reach
MEASURE_S = 1.0  # each measurement's length on every board at once
PERIOD_US = (1_000, 1_000_000)  # what the kernel takes for a CFS period
QUOTA_US = 2000  # a virtual board's quota in each period (launch/virtual-cluster.sh: why 2 ms)

METER = "from edgefed.orchestration.board_speed import meter; meter()"  # what runs on each board


def meter(lines=sys.stdin, out=sys.stdout) -> None:
    """On a board: for each line read (seconds), what a window of that many seconds of steps gave: steps a
    second of wall time, steps a second of this process's CPU time, and the share of a core it got. A call's
    steps are fixed (about 2 ms of CPU), so a pause of the board's share falls inside the window wherever it
    comes, not into a call's own timing."""
    from edgefed.orchestration.profiling import metered

    step, k = metered(MODEL, BATCH)
    for line in lines:
        steps, t0, c0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < float(line):
            step(k)
            steps += k
        wall, cpu = time.perf_counter() - t0, max(time.process_time() - c0, 1e-9)
        print(steps / wall, steps / cpu, cpu / wall, file=out, flush=True)


def profile_speed(profile: str) -> float:
    """The steps a second a board's profile gives the meter's model."""
    return 1.0 / hwprofile.load_profile(profile).step_seconds(MODEL, BATCH, PARAMS)


class Meters:
    """One meter per board, started over SSH at once and kept: each measurement runs on every board together."""

    def __init__(self, hosts: list[str], python: str = sys.executable):
        from edgefed.orchestration.launcher import SSH  # (not at the top: a board's meter need not load the log)

        command = f"{shlex.quote(python)} -u -c {shlex.quote(METER)}"
        self.procs = [subprocess.Popen([*SSH, host, command],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True) for host in hosts]

    def measure(self, seconds: float = MEASURE_S) -> list[tuple[float, float, float]]:
        """Every board's (steps a second, steps a CPU second, share of a core), measured at once (NaN: the
        board's meter did not answer)."""
        for proc in self.procs:
            try:
                proc.stdin.write(f"{seconds}\n")
                proc.stdin.flush()
            except (OSError, ValueError):
                pass
        with ThreadPoolExecutor(max_workers=len(self.procs)) as pool:
            return list(pool.map(_answer, self.procs))

    def close(self) -> None:
        for proc in self.procs:
            try:
                proc.stdin.close()
                proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()


def _answer(proc) -> tuple[float, float, float]:
    try:
        wall, cpu, share = map(float, proc.stdout.readline().split())
        return wall, cpu, share
    except ValueError:
        return math.nan, math.nan, math.nan


@dataclass(frozen=True)
class Calibrated:
    shares: list[float]  # each board's share of a core, as set
    got: list[float]  # the share each got, measured
    core_speed: float  # this machine's steps a CPU second as the boards measured it at that moment
    tries: int  # measurements taken

    @property
    def speeds(self) -> list[float]:
        """Each board's steps a second: the share it got at this machine's speed of the moment."""
        return [g * self.core_speed for g in self.got]


def calibrate(shares: list[float], target: list[float], measure, apply, tolerance: float = TOLERANCE,
              tries: int = TRIES) -> Calibrated:
    """Each share rescaled by target / speed until every board is within tolerance of its target, at most a
    whole core; apply(shares) sets them, measure() gives every board's reading at once. A board's speed is the
    share it got (which a cgroup holds to the percent) times this machine's speed at that moment, the median
    of the boards' steps a CPU second: this machine drifts (a VM's neighbours, its clock), and a board's
    share is what calibrating can hold, not the machine under it."""
    shares = list(shares)
    for attempt in range(1, tries + 1):
        apply(shares)
        readings = measure()
        cpu = [r[1] for r in readings if math.isfinite(r[1])]
        result = Calibrated(list(shares), [r[2] for r in readings], statistics.median(cpu) if cpu else math.nan,
                            attempt)
        off = [v / t - 1 for v, t in zip(result.speeds, target)]
        if all(abs(o) <= tolerance for o in off) or attempt == tries or not cpu:
            return result
        shares = [min(s * t / v, 1.0) if math.isfinite(v) and v > 0 and abs(o) > tolerance / 2 else s
                  for s, t, v, o in zip(shares, target, result.speeds, off)]
    raise AssertionError("unreachable")


def out_of_reach(names: list[str], cores: list[int], result: Calibrated, target: list[float],
                 tolerance: float = TOLERANCE) -> str | None:
    """One line naming the board furthest off its target after calibrating (a silent meter first), why, and
    the others off; None when all are within."""
    def gap(i: int) -> float:
        v, t = result.speeds[i], target[i]
        return math.inf if not math.isfinite(v) else abs(v / t - 1)

    off = sorted((i for i in range(len(target)) if gap(i) > tolerance), key=lambda i: (-gap(i), i))
    if not off:
        return None
    i, v, t = off[0], result.speeds[off[0]], target[off[0]]
    said = "no answer from its meter" if not math.isfinite(v) else f"{v:,.0f} steps/s, {v / t - 1:+.1%} off"
    mates = [j for j, c in enumerate(cores) if c == cores[i]]
    load = sum(result.shares[j] for j in mates)
    if result.shares[i] >= 1.0 and math.isfinite(v) and v < t:
        why = "a whole core of this machine is slower than the board's profile"
    elif load > 1.0 + tolerance:
        why = (f"the shares of the boards on its core (core {cores[i]}: "
               f"{', '.join(names[j] for j in mates)}) add up to {load:.2f} cores")
    else:
        why = "the share it got moved under it: this machine is loaded; try again on a quieter one"
    others = "" if len(off) == 1 else f"; also off: {', '.join(names[j] for j in off[1:])}"
    return (f"board {names[i]} cannot be brought to its profile's {t:,.0f} steps/s: {said} after "
            f"{result.tries} measurements ({why}){others}")


# -- a virtual cluster's quotas --------------------------------------------------------------------------------
def write_share(group: Path, share: float) -> None:
    """A board's cgroup given a share of a core: its 2 ms quota in a period of 2 ms / share."""
    period = int(min(max(QUOTA_US / share + 0.5, PERIOD_US[0]), PERIOD_US[1]))
    if (group / "cpu.cfs_quota_us").exists():  # cgroup v1
        (group / "cpu.cfs_period_us").write_text(f"{period}\n")
        (group / "cpu.cfs_quota_us").write_text(f"{QUOTA_US}\n")
    else:
        (group / "cpu.max").write_text(f"{QUOTA_US} {period}\n")


def board_rows(state: Path) -> list[list[str]]:
    """A virtual cluster's boards file: a row N HOST ADDRESS PROFILE SHARE LINK MEMORY per board."""
    return [line.split() for line in (state / "boards").read_text().splitlines() if line.strip()]


def apply_shares(state: Path, cgroup: Path) -> None:
    """Every board's cgroup (cgroup/bN) given the share its row in the boards file holds."""
    for row in board_rows(state):
        write_share(cgroup / f"b{row[0]}", float(row[4]))


def calibrate_virtual(state: Path, cgroup: Path, say=print) -> int:
    """Calibrate the boards of the virtual cluster in STATE (its boards file: N HOST ADDRESS PROFILE SHARE LINK
    MEMORY), whose cgroups are under cgroup; the boards file gets the shares set. 0 when every board is within
    3 %, else 1 with one line naming the board furthest off (out_of_reach)."""
    rows = board_rows(state)
    names, target = [r[1] for r in rows], [profile_speed(r[3]) for r in rows]
    cores = [(int(r[0]) - 1) % (os.cpu_count() or 1) for r in rows]  # (as `up` pins them)
    meters = Meters([r[2] for r in rows])
    try:
        meters.measure(0.1)  # (the first call compiles nothing but loads every kernel: not a speed)
        result = calibrate([float(r[4]) for r in rows], target, meters.measure,
                           lambda shares: [write_share(cgroup / f"b{r[0]}", s) for r, s in zip(rows, shares)])
    finally:
        meters.close()
    for r, share in zip(rows, result.shares):
        r[4] = f"{share:.4f}"
    (state / "boards").write_text("".join(" ".join(r) + "\n" for r in rows))
    cells = ", ".join(f"{n} {g:.1%} of a core, {v:,.0f} steps/s ({v / t - 1:+.1%})" for n, g, v, t in
                      zip(names, result.got, result.speeds, target))
    say(f"virtual-cluster.sh: calibrated in {result.tries} measurements of the boards at once, this machine at "
        f"{result.core_speed:,.0f} steps a CPU second: {cells}")
    problem = out_of_reach(names, cores, result, target)
    if problem:
        say(f"virtual-cluster.sh: {problem}")
    return 0 if problem is None else 1


# -- a run's boards ------------------------------------------------------------------------------------------------
def drift(boards_file: Path, say=print, meters_for=Meters) -> None:
    """Every board of a board list measured at once; a warning for each one more than 5 % off its profile
    (a hotter board, another machine's profile, a board under load), never an error: the run goes on."""
    from edgefed.orchestration.launcher import read_boards

    boards = read_boards(boards_file)[1:]
    meters = meters_for([b.host for b in boards])
    try:
        meters.measure(0.1)
        measured = meters.measure()
    finally:
        meters.close()
    off = []
    for b, (m, _, _) in zip(boards, measured):
        t = profile_speed(b.profile)
        if not math.isfinite(m):
            off.append(b.host)
            say(f"pi-cluster.sh: warning: board {b.host} did not measure its speed (launch/pi-cluster.sh check BOARDS)")
        elif abs(m / t - 1) > DRIFT:
            off.append(b.host)
            say(f"pi-cluster.sh: warning: board {b.host} runs {m:,.0f} steps/s, {m / t - 1:+.1%} off its profile "
                f"{b.profile} ({t:,.0f}): its deadlines and predictions will be off; profile it again "
                "(launch/pi-cluster.sh profile BOARDS)")
    if not off:
        say(f"pi-cluster.sh: {len(boards)} boards within {DRIFT:.0%} of their profiles' speed")


def main(argv: list[str]) -> int:
    try:
        if len(argv) == 3 and argv[0] == "calibrate":
            return calibrate_virtual(Path(argv[1]), Path(argv[2]))
        if len(argv) == 3 and argv[0] == "shares":
            apply_shares(Path(argv[1]), Path(argv[2]))
            return 0
        if len(argv) == 2 and argv[0] == "drift":
            drift(Path(argv[1]))
            return 0
    except (EdgefedError, OSError) as exc:  # (a profile, the boards file, a cgroup's files)
        print(f"board_speed: {exc}", file=sys.stderr)
        return 2
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

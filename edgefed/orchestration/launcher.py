"""`edgefed launch`: `edgefed run` on every rank of an mpiexec world, watched, and started again on the same
log when the world dies, like `torchrun --max-restarts`.

Under MPI one dead rank ends the whole world. Every device's data is a pure function of (seed, device), so
any rank can host any device, and a log resumed under another number of ranks continues byte for byte. So
when the world dies the launcher checks which boards still answer (over SSH, for a board list), leaves out
those that do not and a rank the coordinator found silent ([mpi] rank_timeout_s), and starts the world
again with `--resume` on the same log. A board left out for not answering is asked again every [mpi]
rejoin_check_s; when it answers, the world ends at the next round boundary and starts again with it (the
seed's arrivals, on real boards). Each restart is one line here and one row of the log's /launch/restarts.
Ctrl-C (SIGINT, SIGTERM) ends everything at once; bad input (exit 2) is never retried.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgefed import hwprofile
from edgefed.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_RANK_LOST, EXIT_REJOIN, EdgefedError
from edgefed.orchestration.resume import Launch
from edgefed.runlog import device_count, last_completed_round, run_status
from edgefed.runtime.mpi.comm import local_mpiexec
from edgefed.runtime.mpi.placement import device_owners

STOP_GRACE_S = 5.0  # after Ctrl-C, how long the ranks get to leave on their own before they are killed
FINISH_GRACE_S = 30.0  # after the log is complete, how long the world gets to end on its own


@dataclass(frozen=True)
class Board:
    host: str
    profile: str | None  # None for the head node (line 1: the coordinator)
    load: float = 0.0


def read_boards(path: Path) -> list[Board]:
    """A board list (launch/hostfile.example): `HOST ROLE-OR-PROFILE [LOAD]` per line, the head node first."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise EdgefedError(f"board list {path} cannot be read ({exc}); see launch/hostfile.example") from None
    boards = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        head = not boards
        if not head and len(words) < 2:
            raise EdgefedError(f"board list {path} line {number}: board {words[0]} needs a hardware profile "
                               "(e.g. pi4b)")
        try:
            load = float(words[2]) if len(words) > 2 else 0.0
        except ValueError:
            load = -1.0
        if not 0 <= load < 1:
            raise EdgefedError(f"board list {path} line {number}: the load {words[2]!r} must be a number in [0, 1)")
        boards.append(Board(words[0], None if head else words[1], load))
    if len(boards) < 2:
        raise EdgefedError(f"board list {path} lists no board after the head node; see launch/hostfile.example")
    return boards


def find_mpiexec(given: str | None) -> str:
    found = given or local_mpiexec()
    if not found or not (shutil.which(found) or Path(found).is_file()):
        raise EdgefedError(f"no mpiexec{' at ' + given if given else ''}; pip install 'edgefed[mpi]' or give "
                           "--mpiexec PATH")
    return found


def mpi_flavour(mpiexec: str) -> str:
    """'openmpi' or 'mpich' (MPICH's Hydra, and what else takes its flags), from `mpiexec --version`."""
    try:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EdgefedError(f"{mpiexec} --version failed ({exc}); give a working --mpiexec PATH") from None
    return "openmpi" if any(s in text.lower() for s in ("open mpi", "open-mpi", "openrte")) else "mpich"


def world_command(mpiexec: str, flavour: str, ranks: int, hosts: list[str] | None, hostfile: Path,
                  run_args: list[str], extra=()) -> list[str]:
    """mpiexec with `edgefed run` on every rank; with hosts, one rank per host in order (rank r: hosts[r])."""
    if hosts is None:
        launch = [mpiexec, "--oversubscribe", "-n", str(ranks)] if flavour == "openmpi" else [mpiexec, "-n", str(ranks)]
    else:
        slots = [f"{h} slots=1" if flavour == "openmpi" else f"{h}:1" for h in hosts]
        hostfile.write_text("\n".join(slots) + "\n")
        launch = ([mpiexec, "--hostfile", str(hostfile), "--map-by", "slot", "-np", str(ranks)] if flavour == "openmpi"
                  else [mpiexec, "-f", str(hostfile), "-n", str(ranks)])
    return launch + list(extra) + [sys.executable, "-m", "edgefed", "run", *run_args]


SSH = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]  # to a board: never a prompt, never a long wait


def ssh_answers(host: str, command: str = "true") -> bool:
    try:
        return subprocess.run([*SSH, host, command],
                              capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def ssh_ready(host: str) -> bool:
    """A board that came back can run a rank: it answers, and the Python the ranks run imports edgefed and
    mpi4py there (what `pi-cluster.sh check` asks of a board)."""
    return ssh_answers(host, f"{shlex.quote(sys.executable)} -c 'import edgefed, mpi4py'")


# How many processes the kernel's OOM killer ended on a board: its memory cgroup's count where that cgroup has
# a limit (a virtual board's, launch/virtual-cluster.sh), else the machine's (/proc/vmstat: a real board).
OOM_PROBE = r"""
p=$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {m = $3} $2 == "" {u = $3} END {print (m != "" ? m : u)}' /proc/self/cgroup)
limit=max; kills=
if [ -f "/sys/fs/cgroup/memory$p/memory.limit_in_bytes" ]; then
    limit=$(cat "/sys/fs/cgroup/memory$p/memory.limit_in_bytes")
    [ "$limit" -lt 4611686018427387904 ] 2> /dev/null || limit=max
    kills=$(awk '$1 == "oom_kill" {print $2}' "/sys/fs/cgroup/memory$p/memory.oom_control")
elif [ -f "/sys/fs/cgroup$p/memory.max" ]; then
    limit=$(cat "/sys/fs/cgroup$p/memory.max")
    kills=$(awk '$1 == "oom_kill" {print $2}' "/sys/fs/cgroup$p/memory.events")
fi
[ "$limit" != max ] && [ -n "$kills" ] || kills=$(awk '$1 == "oom_kill" {print $2}' /proc/vmstat)
echo "${kills:-0}"
"""


def ssh_oom_kills(host: str) -> int | None:
    """The OOM kills a board's kernel has counted for it (OOM_PROBE), over SSH; None when it does not say."""
    try:
        done = subprocess.run([*SSH, host, "sh", "-c",
                               shlex.quote(OOM_PROBE)], capture_output=True, text=True, timeout=15)
        return int(done.stdout.split()[-1]) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def _toml_list(values, quote: bool) -> str:
    return "[" + ", ".join(json.dumps(v) if quote else repr(v) for v in values) + "]"


def board_overrides(boards: list[Board]) -> list[str]:
    """The boards' profiles as [device] boards and, when any board is under load, their loads as [device]
    contention (entry i: rank i + 1), as `--set` overrides."""
    devices = boards[1:]
    sets = [f"device.boards={_toml_list([b.profile for b in devices], True)}"]
    if any(b.load for b in devices):
        sets.append(f"device.contention={_toml_list([float(b.load) for b in devices], False)}")
    return sets


def _die_with_parent() -> None:
    """In the child, before mpiexec starts: SIGKILL when the launcher dies, however it dies (Linux)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Launcher:
    """One launch: a world, and worlds again until the run completes, fails for good, or restarts run out."""

    def __init__(self, log: Path, config: str | None = None, overrides=(), *, force: bool = False,
                 ranks: int | None = None, boards: list[Board] | None = None, placement: dict | None = None,
                 restarts: int = 3, mpiexec: str | None = None, mpiexec_args=(), quiet: bool = False,
                 resume: bool = False, on_line=print, answers=ssh_answers, oom_kills=ssh_oom_kills,
                 rejoin_check_s: float | None = None, ready=ssh_ready):
        """config, overrides, force: the first world's `edgefed run` (a restart resumes the log, with the same
        overrides). placement: the config's per-rank lists ({"device.boards": [...], ...}), kept in step
        when a rank is left out. rejoin_check_s: how often to ask the boards left out for not answering
        whether they are `ready` again (None: never)."""
        self.log, self.config, self.overrides, self.force = Path(log), config, list(overrides), force
        self.restarts_left = restarts
        self.ranks = len(boards) if boards else ranks
        self.every_board = list(boards or ())  # the board list as given: who may come back, and where
        self.present = list(range(len(self.every_board)))  # the boards of the next world (their lines)
        self.away: list[int] = []  # lines of the boards left out for not answering: asked again
        self.back: list[int] = []  # those found back during the world under way
        self.taken_back: set[int] = set()  # boards taken back once: lost again, they stay out (no flapping)
        self.rejoin_check_s, self.ready = (rejoin_check_s if boards else None), ready
        self.placement = {k: list(v) for k, v in (placement or {}).items() if v}
        self._moved: list[str] = []  # placement overrides after ranks were left out
        self.homes: np.ndarray | None = None  # with a board list: each device's board (its line), as first placed
        self.absences: list[dict] = []  # boards left out: line, its devices, the rounds they were away ([[mpi.away]])
        self.mpiexec, self.mpiexec_args = find_mpiexec(mpiexec), list(mpiexec_args)
        self.flavour = mpi_flavour(self.mpiexec)
        self.quiet, self.resume, self.say, self.answers, self.oom_kills = quiet, resume, on_line, answers, oom_kills
        self._oom = {}  # board host -> its OOM kills before the world started
        self.id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%f")
        self.records: list[dict] = []
        self.child: subprocess.Popen | None = None
        self.stopping = False
        self._timer: threading.Timer | None = None
        self._before = self._identity()  # the log as it was before this launch (--force may replace it)

    @property
    def boards(self) -> list[Board] | None:
        """The boards of the next world, in the list's order (None: no board list, ranks on this machine)."""
        return [self.every_board[i] for i in self.present] if self.every_board else None

    def _identity(self):
        try:
            st = self.log.stat()
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    # -- one world ----------------------------------------------------------------------------------------
    def _args(self, status: Path) -> list[str]:
        # resume the log once this launch has one (an old log that --force was to replace does not count)
        ours = self.log.exists() and (self.resume or self._identity() != self._before)
        if ours:
            args = ["--resume", str(self.log)]
        else:
            args = ([self.config] if self.config else []) + ["--out", str(self.log)] + (["--force"] if self.force else [])
        sets = self.overrides + (board_overrides(self.boards) if self.boards else []) + self._moved
        args += [a for o in sets for a in ("--set", o)]
        if self.absences:
            placed = status.with_name("placement")
            placed.write_text("\n".join(self._placement_sets()) + "\n", encoding="utf-8")
            args += ["--launch-placement", str(placed)]
        if self.quiet:
            args.append("--quiet")
        args += ["--launch-status", str(status)]
        if self.records:
            args += ["--launch-restarts", json.dumps(self.records)]
        return args

    def _world(self, folder: Path) -> tuple[int, dict | None]:
        """Run one world to its end: (exit code, the lost rank the coordinator named, if any)."""
        status = folder / "status.json"
        status.unlink(missing_ok=True)
        board_back = Launch(status).board_back
        board_back.unlink(missing_ok=True)
        self.back = []
        hosts = [b.host for b in self.boards] if self.boards else None
        command = world_command(self.mpiexec, self.flavour, self.ranks, hosts, folder / "hosts", self._args(status),
                                self.mpiexec_args)
        if self.stopping:  # Ctrl-C between two worlds: no new one
            return EXIT_INTERRUPTED, None
        # its own group, so Ctrl-C is ours to pass on; and killed with us if we are killed
        self.child = subprocess.Popen(command, start_new_session=True, preexec_fn=_die_with_parent)
        code = self._wait_world(board_back)
        self._kill_group(signal.SIGKILL)  # a stopped or orphaned rank must not outlive its world
        self._reaped()
        lost = None
        if status.exists():
            try:
                lost = json.loads(status.read_text())
            except (OSError, ValueError):
                lost = None
        return code, lost

    def _wait_world(self, board_back: Path) -> int:
        """The world's exit code; 0 when its run is complete but a rank hung on the way out (a stopped rank
        holds up MPI_Finalize forever), ended after FINISH_GRACE_S. Meanwhile the boards left out are asked
        every rejoin_check_s; those back are named in board_back, for the coordinator to end the world."""
        complete_at, asking, asked_at = None, None, time.monotonic()
        while True:
            try:
                return self.child.wait(timeout=min(1.0, self.rejoin_check_s or 1.0))
            except subprocess.TimeoutExpired:
                pass
            if asking is not None and not asking.is_alive():
                self.back = [i for i, ok in zip(self.away, asking.answers) if ok]
                asking = None
                if self.back:  # (whole, or not at all: the coordinator may read it at any moment)
                    tmp = board_back.with_name(board_back.name + ".tmp")
                    tmp.write_text(", ".join(self.every_board[i].host for i in self.back))
                    os.replace(tmp, board_back)
            elif (asking is None and not self.back and self.away and self.rejoin_check_s is not None
                  and time.monotonic() - asked_at >= self.rejoin_check_s):
                asking, asked_at = self._ask_away(), time.monotonic()
            if self._finished_hung(complete_at):
                return 0
            complete_at = complete_at or (time.monotonic() if run_status(self.log) == "complete" else None)

    def _ask_away(self) -> threading.Thread:
        """The boards left out, asked whether they are ready, in a daemon thread (an SSH question takes
        seconds, and Ctrl-C must not wait for one); its `answers` once it has ended."""
        hosts = [self.every_board[i].host for i in self.away]
        answers = [False] * len(hosts)

        def ask_one(j: int) -> None:
            answers[j] = self.ready(hosts[j])

        def ask() -> None:  # (daemon threads all: a pool's workers are joined at exit)
            each = [threading.Thread(target=ask_one, args=(j,), daemon=True) for j in range(len(hosts))]
            for thread in each:
                thread.start()
            for thread in each:
                thread.join()

        asking = threading.Thread(target=ask, daemon=True)
        asking.answers = answers
        asking.start()
        return asking

    def _finished_hung(self, complete_at: float | None) -> bool:
        """The run is complete but its world has not ended within FINISH_GRACE_S: ended here."""
        if complete_at is None or time.monotonic() - complete_at <= FINISH_GRACE_S:
            return False
        self.say(f"launch: {self.log} is complete but the world did not end within {FINISH_GRACE_S:.0f} s "
                 "(a rank hung on its way out); ended it")
        self._kill_group(signal.SIGKILL)
        self.child.wait()
        return True

    def _reaped(self, timeout_s: float = 10.0) -> None:
        """Until no process of the world is left (its rank 0 lets go of the log only as it ends: the next
        world's --resume must not find it still held)."""
        end = time.monotonic() + timeout_s
        while self.child is not None and time.monotonic() < end:
            try:
                os.killpg(self.child.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)

    def _kill_group(self, sig) -> None:
        if self.child is not None:
            try:
                os.killpg(self.child.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _stop(self, signum, frame) -> None:
        """Ctrl-C or SIGTERM: the ranks get the signal (the coordinator keeps the log resumable), then a kill."""
        if self.stopping:  # a second Ctrl-C: no more grace
            self._kill_group(signal.SIGKILL)
            return
        self.stopping = True
        self._kill_group(signal.SIGINT)
        # the main thread is inside child.wait(), which reaps the world; a timer kills what lingers
        self._timer = threading.Timer(STOP_GRACE_S, self._kill_group, (signal.SIGKILL,))
        self._timer.daemon = True
        self._timer.start()

    # -- the launch ---------------------------------------------------------------------------------------
    def run(self) -> int:
        # SIGHUP too: a closed SSH session must not leave the world running without its launcher
        previous = {s: signal.signal(s, self._stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            with tempfile.TemporaryDirectory(prefix="edgefed-launch-") as folder:
                return self._loop(Path(folder))
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _loop(self, folder: Path) -> int:
        while True:
            started = time.monotonic()
            self._oom = self._count_oom()
            code, lost = self._world(folder)
            if self.stopping:
                if self._timer is not None:
                    self._timer.cancel()
                self.say(f"launch: stopped; the log {self.log} holds every completed round (edgefed launch ... "
                         f"--resume {self.log} continues it)")
                return EXIT_INTERRUPTED
            if code == 0:
                return 0
            if code == EXIT_BAD_INPUT:
                return code  # bad input: the same world would fail the same way
            if code == EXIT_REJOIN and self.back:  # not a failure: no restart of the budget is spent
                before = self.ranks
                self._take_back()
                self._record(before, f"{', '.join(self.every_board[i].host for i in self.back)} answered again",
                             started, "the world ended")
                continue
            starved = self._ran_out()
            cause = self._cause(code, lost, starved)
            if self.restarts_left <= 0:
                self.say(f"launch: the world died ({cause}) and no restart is left; the log {self.log} holds "
                         f"every completed round (--resume continues it)")
                return code if code > 0 else 128 - code  # a signal: as a shell reports it
            before = self.ranks
            self._leave_out(lost, starved)
            if self.ranks < 1:
                self.say(f"launch: the world died ({cause}) and no rank is left to run it")
                return code if code > 0 else 128 - code
            self.restarts_left -= 1
            self._record(before, cause, started)

    def _record(self, before: int, cause: str, started: float, ended: str = "the world died") -> None:
        """A restart: a line here, and a row the next world writes into the log's /launch/restarts."""
        record = {"launch": self.id, "round": max(last_completed_round(self.log), 0), "cause": cause,
                  "ranks_before": before, "ranks_after": self.ranks,
                  "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        self.records.append(record)
        self.say(f"launch: restart {len(self.records)}: {ended} at round {record['round']} after "
                 f"{time.monotonic() - started:.1f} s ({cause}); ranks {before} -> {self.ranks}; "
                 f"resuming {self.log} ({self.restarts_left} restarts left)")

    def _take_back(self) -> None:
        """The boards found back join the next world, in their places in the board list, with their devices."""
        for i in self.back:
            self.say(f"launch: taking back {self.every_board[i].host}: it answers again")
        back = max(last_completed_round(self.log), 0) + 1
        for absence in self.absences:
            if absence["line"] in self.back and absence["back"] is None:
                absence["back"] = back
        self.taken_back |= set(self.back)
        self.away = [i for i in self.away if i not in self.back]
        self.present = sorted(self.present + self.back)
        self.ranks = len(self.present)

    def _move(self, rank: int) -> None:
        """The per-rank lists of the config without the rank left out; an explicit device placement gives way
        to round-robin (in full and trace mode neither changes a byte)."""
        for key, values in self.placement.items():
            if key == "mpi.device_ranks":
                values.clear()
            elif 0 < rank <= len(values):
                del values[rank - 1]
        self._moved = [f"{key}={_toml_list(values, key == 'device.boards') if values else '[]'}"
                       for key, values in self.placement.items()]

    def _count_oom(self) -> dict:
        """Each board's OOM kills so far (the boards after the head node: the head is this machine)."""
        if self.boards is None:
            return {}
        with ThreadPoolExecutor(max_workers=8) as pool:
            return dict(zip([b.host for b in self.boards[1:]], pool.map(self.oom_kills, [b.host for b in self.boards[1:]])))

    def _ran_out(self) -> dict[int, str]:
        """{rank: "HOST ran out of memory (N MB)"} of the boards whose kernel killed a process for memory
        during the world (a rank killed that way looks like one that stopped answering)."""
        if not self._oom:
            return {}
        after = self._count_oom()
        out = {}
        for rank, board in enumerate(self.boards[1:], 1):
            before, now = self._oom.get(board.host), after.get(board.host)
            if before is not None and now is not None and now > before:
                out[rank] = f"{board.host} ran out of memory ({_memory_mb(board.profile)})"
        return out

    def _cause(self, code: int, lost: dict | None, starved: dict | None = None) -> str:
        if starved:
            return "; ".join(f"board {text}" for text in starved.values())
        if lost is not None:
            host = f" on {lost['host']}" if lost.get("host") else ""
            return f"rank {lost['rank']}{host} stopped answering for {lost['silent_s']:.1f} s"
        if code < 0:
            return f"mpiexec ended by signal {-code}"
        return f"exit code {code}" + (" (a rank was lost)" if code == EXIT_RANK_LOST else "")


    def _leave_out(self, lost: dict | None, starved: dict | None = None) -> None:
        """The next world: without the rank found silent; with a board list, without every board that does
        not answer either, or whose kernel killed a rank for memory (the same world would run out again; the
        head node, line 1, is this machine)."""
        if self.boards is None:
            if lost is not None:
                self.ranks -= 1
                self._move(int(lost["rank"]))
            return
        starved = starved or {}
        drop = {int(lost["rank"])} if lost is not None and int(lost["rank"]) > 0 else set()
        drop |= set(starved)
        with ThreadPoolExecutor(max_workers=8) as pool:
            answers = list(pool.map(self.answers, [b.host for b in self.boards[1:]]))
        drop |= {i + 1 for i, ok in enumerate(answers) if not ok}
        for i in sorted(drop):
            why = (f"it ran out of memory ({_memory_mb(self.boards[i].profile)})" if i in starved else
                   "it stopped answering" if answers[i - 1] else "it does not answer over SSH")
            self.say(f"launch: leaving out {self.boards[i].host} (rank {i}): {why}")
        # a board that ran out of memory would again, and one lost again after it was taken back may keep
        # failing (a restart each time): only the other silent ones are asked whether they are back
        self.away += [self.present[i] for i in sorted(drop - set(starved)) if self.present[i] not in self.taken_back]
        self._devices_away([self.present[i] for i in sorted(drop)])
        self.present = [line for i, line in enumerate(self.present) if i not in drop]
        self.ranks = len(self.present) if len(self.present) > 1 else 0

    # -- a board's devices are its own -------------------------------------------------------------------
    def _devices_away(self, lines: list[int]) -> None:
        """The devices at home on the boards left out are away from the next round until their board is back:
        in the objective, silent ([[mpi.away]]; the others stay on their boards). Before the log knows its
        devices (a world lost while starting) nothing is away: the next world places them over the boards left."""
        if not lines:
            return
        if self.homes is None:
            n = device_count(self.log)
            if n is None:
                return
            # the first world's placement, every board present: rank = line
            self.homes = device_owners(n, len(self.every_board), self.placement.get("mpi.device_ranks", ()))
        start = max(last_completed_round(self.log), 0) + 1
        for line in lines:
            devices = np.flatnonzero(self.homes == line)
            if devices.size:
                self.absences.append({"line": line, "devices": devices, "round": start, "back": None})
                self.say(f"launch: the {devices.size} devices of {self.every_board[line].host} are away from round "
                         f"{start} until it is back")

    def _placement_sets(self) -> list[str]:
        """The next world's placement as --set lines: every device on its board, those of a board left out
        held (silent) by the others in turn; and every board's absences so far."""
        rank_of = np.zeros(len(self.every_board), np.int64)
        rank_of[self.present] = np.arange(len(self.present))
        present = np.zeros(len(self.every_board), bool)
        present[self.present] = True
        ranks = rank_of[self.homes]
        held = np.flatnonzero(~present[self.homes])
        ranks[held] = 1 + np.arange(held.size) % max(len(self.present) - 1, 1)
        away = ", ".join(f"{{devices = {_toml_list(a['devices'].tolist(), False)}, round = {a['round']}"
                         + ("" if a["back"] is None else f", back = {a['back']}") + "}" for a in self.absences)
        return [f"mpi.device_ranks={_toml_list(ranks.tolist(), False)}", f"mpi.away=[{away}]"]


def _memory_mb(profile: str | None) -> str:
    """A board's memory in words, from its profile ("512 MB, of which its system takes 220 MB")."""
    try:
        machine = hwprofile.load_profile(profile).machine
    except (EdgefedError, TypeError):
        return "its memory"
    system = machine.get("system_mb", 0)
    return f"{machine['memory_mb']} MB" + (f", of which its system takes {system} MB" if system else "")

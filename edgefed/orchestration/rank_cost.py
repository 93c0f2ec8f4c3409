"""What a device rank costs its board beside its devices' steps, measured by `edgefed profile` ([rank]).

A device under a deadline runs its steps in short chunks that read the clock (runtime/deadline.py), while
its rank's main thread keeps polling (the next command's broadcast, a stop, the heartbeat); in every round
the rank also unpacks the broadcast and packs its devices' reports. On a board of one core, or a virtual
board's share of one, those take CPU time from the steps inside the deadline; on a board whose other cores
are idle they take almost none. Measured on the board itself, the difference is whatever the board makes
of it:

- lost_share: the median over ten pairs of windows of 1 − (steps a second a device completes in a deadline
  as a rank runs it) / (steps a second the profile's way, in the window before), logistic-regression steps
  (batch 20) in a worker thread: calls of about 2 ms with the main thread asleep, as a rate over the calls
  to the end of the last one (a call past the window's end counted with its time, which on a throttled
  board is a whole quota period), or a DeadlineRunner given the window, its steps over the window, with the
  main thread waiting as a working device rank waits (comm.wait at the working poll interval, probing for a
  stop, sending the heartbeat). A window is 0.1 s, or 20 ms of CPU over the share of a core the board gets
  where that is longer (0.4 s on a virtual Zero at 5 %): ten of its quota's periods;
- round_s: per model, the median seconds of one round's own work, the state unpacked and one report packed
  (protocol.Wire, as the rank does it).
"""

from __future__ import annotations

import threading
import time

import numpy as np

WINDOW_S = 0.1  # one window at least; the windows alternate (alone, beside the polls), a pair at a time
WINDOWS = 10  # pairs
PERIODS, CALL_S = 10, 0.002  # a window holds at least 10 calls' CPU time (a throttled board's quota periods)


class _Until:
    """A request that completes at a time: the broadcast a working rank waits on while its devices train."""

    def __init__(self, end: float):
        self.end = end

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        return time.perf_counter() >= self.end


def core_share(step, k: int, seconds: float = 0.2) -> float:
    """The share of a core this process gets: its CPU time over the wall time of calls of steps (a virtual
    board's quota; about 1 on a real board's idle core)."""
    cpu, wall = time.process_time(), time.perf_counter()
    while time.perf_counter() - wall < seconds:
        step(k)
    return min(max((time.process_time() - cpu) / (time.perf_counter() - wall), 1e-3), 1.0)


def lost_share(step, k: int, window_s: float | None = None, windows: int = WINDOWS) -> float:
    """The share of a device's steps in a deadline window lost to running as a device rank on this machine,
    in [0, 0.9] (see the module); step(k) runs k steps, a call of about 2 ms (profiling.metered). window_s:
    each window (None: WINDOW_S, longer on a board that gets a small share of a core, so that a window holds
    PERIODS of its quota's periods of about a call's CPU each: a window of 2.5 periods counts 40 % more or
    less as one falls in or out)."""
    if window_s is None:
        window_s = max(WINDOW_S, PERIODS * CALL_S / core_share(step, k))
    from mpi4py import MPI

    from edgefed.runtime.deadline import DeadlineRunner
    from edgefed.runtime.mpi.comm import wait
    from edgefed.runtime.mpi.device_server import WORKING_POLL_S
    from edgefed.runtime.mpi.protocol import TAG_ALIVE, TAG_CANCEL

    comm, beat, heard = MPI.COMM_SELF, np.zeros(1, np.int64), np.zeros(1, np.int64)

    def poll() -> None:  # what a working rank does at each wake: take stops, send a heartbeat when due
        comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_CANCEL)
        if time.perf_counter() - last[0] > 1.0:
            sent = comm.Isend(beat, dest=0, tag=TAG_ALIVE)
            comm.Recv(heard, source=0, tag=TAG_ALIVE)  # (to itself: taken at once, nothing left pending)
            sent.Wait()
            last[0] = time.perf_counter()

    last = [time.perf_counter()]
    rates = {False: [], True: []}
    for i in range(2 * windows):
        polling, done = bool(i % 2), []

        def work(start: float, end: float) -> None:
            if polling:  # as a device runs in a deadline: the steps a window of window_s yields
                done.append(DeadlineRunner(end - time.perf_counter())(lambda n: step(n), 1 << 60) / window_s)
                return
            count = 0  # the profile's way: a rate over whole calls, to the end of the last one
            while time.perf_counter() < end:
                step(k)
                count += k
            done.append(count / (time.perf_counter() - start))

        start = time.perf_counter()
        end = start + window_s
        worker = threading.Thread(target=work, args=(start, end))
        worker.start()
        if polling:
            wait(_Until(end), WORKING_POLL_S, also=poll)
        worker.join()
        rates[polling].append(done[0])
    # each polled window against the window alone before it: a drift of the machine's speed between pairs
    # (this VM's moves 20 % within a minute) cancels, and the median keeps a pair a pause fell into out
    lost = [1.0 - ranked / alone for alone, ranked in zip(rates[False], rates[True])]
    return float(min(max(float(np.median(lost)), 0.0), 0.9))


def round_seconds(model, repeats: int = 21) -> float:
    """The median seconds of one round's own work on a device rank for `model`: the broadcast state
    unpacked and one device's report packed into its record."""
    from edgefed.runtime.mpi.protocol import TAG_WORK, Wire
    from edgefed.transport import LocalResults

    dim = model.n_trainable
    wire = Wire(1, dim, model.dtype, ("delta",))
    state, records = wire.state_buffer(), np.zeros(1, wire.tags[TAG_WORK])
    one = lambda dtype, value: np.full(1, value, dtype)  # noqa: E731
    res = LocalResults({"delta": np.zeros((1, dim), model.dtype)}, one(np.int32, 1), one(np.float32, 0.1),
                       one(np.float32, 100.0), one(bool, False), one(np.float32, np.nan), one(np.float32, np.nan),
                       one(bool, False), one(np.float64, 0.1), one(np.float32, 0.0), one(np.int16, -1),
                       one(np.float32, 0.0))
    took = []
    for _ in range(repeats):
        t = time.perf_counter()
        wire.unpack_state(state)
        wire.pack_work(records, 1, np.zeros(1, np.int64), res)
        took.append(time.perf_counter() - t)
    return float(np.median(took))


def measure(models: dict, step, k: int, out=print) -> dict:
    """The profile's [rank] table on this machine: models {key: built model} to time a round's work of;
    step, k: the steps the share is measured in (lost_share)."""
    share = lost_share(step, k)
    round_s = {key: round(round_seconds(m), 6) for key, m in models.items()}
    out(f"device rank: a device loses {share:.1%} of its steps to its deadline's chunks and its rank's polls; "
        "a round's own work "
        + ", ".join(f"{key} {s * 1e3:.2f} ms" for key, s in round_s.items()))
    return {"lost_share": round(share, 4), "round_s": round_s,
            "round_params": {key: int(m.n_trainable) for key, m in models.items()}}

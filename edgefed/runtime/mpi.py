"""The MPI runtime: rank 0 coordinates (engine, log), ranks 1..P-1 host devices.

Per-round traffic, all on buffers allocated once:
- down: `Ibcast` of a control vector (int64: command, round, learning rate, each device's budget, trace
  steps and deadline, and which reports of the previous round the coordinator accepted), then `Ibcast` of the
  model (and SCAFFOLD's c) in the model dtype;
- up: each rank sends one message with a record per device it worked for (meta in float64, then Delta x
  and Delta c in the model dtype), point-to-point so that a rank that misses its deadline holds nobody up.
No pickling on the per-round path; setup and teardown exchange small metadata only.

Waiting never spins: every wait is a non-blocking request polled with short sleeps (MPICH's blocking calls
keep a core at 99 %). Device ranks compute on a worker thread, so their main thread keeps serving MPI while
a device works or hangs: a report that comes after deadline + grace is dropped by the coordinator and the
device keeps its SCAFFOLD control. If any rank raises, it prints its error and aborts the world.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from edgefed.errors import ConfigError, EdgefedError
from edgefed.runtime.messages import Evaluation, LocalResults, RoundPlan

CMD_STOP, CMD_ROUND, CMD_EVAL, CMD_INIT_CONTROLS, CMD_LOAD_CONTROLS = range(5)
TAG_WORK, TAG_EVAL, TAG_INIT, TAG_LOAD, TAG_BYE = 11, 12, 13, 14, 15
HEAD = 8  # fixed part of the control vector; then budgets (N), trace steps (N), accepted (N), deadlines (N)
WORK_META = ("round", "device", "steps", "elapsed_s", "cpu_percent", "cpu_freq_mhz", "temperature_c", "late",
             "compiled")
EVAL_META = ("round", "device", "train_loss", "test_loss_sum", "test_correct", "n_test")
INIT_META = ("round", "device")
POLL_MAX_S = 0.001
SPIN_S = 300e-6

_ENV_SIZES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def launched_size() -> int:
    """World size announced by the launcher's environment (1 when not under mpirun/mpiexec)."""
    for name in _ENV_SIZES:
        value = os.environ.get(name)
        if value and value.isdigit():
            return int(value)
    return 1


def world():
    """COMM_WORLD when launched with more than one rank, else None (the simulator runs, MPI stays untouched)."""
    if launched_size() <= 1:
        return None
    try:
        import mpi4py

        mpi4py.rc.thread_level = "funneled"  # only the main thread of a rank calls MPI
        from mpi4py import MPI
    except (ImportError, RuntimeError) as exc:
        raise EdgefedError(f"this run was started by mpirun but MPI cannot be loaded ({exc}); "
                           "install it with pip install 'edgefed[mpi]' (or your system's MPI and mpi4py)") from None
    comm = MPI.COMM_WORLD
    return comm if comm.Get_size() > 1 else None


class Backoff:
    """Pause between polls without burning a core: spin for SPIN_S, then sleeps doubling up to poll_max_s.

    The brief spin matters: a large non-blocking broadcast only advances when it is tested.
    """

    def __init__(self, poll_max_s: float = POLL_MAX_S, wake: threading.Event | None = None):
        self.poll_max_s = poll_max_s
        self.start = time.perf_counter()
        self.sleep = 20e-6
        self.wake = wake  # set by another thread to end a sleep early (a device's work finished)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def pause(self) -> None:
        if self.elapsed() > SPIN_S:
            if self.wake is None:
                time.sleep(self.sleep)
            elif self.wake.wait(self.sleep):
                self.wake.clear()
                self.sleep = 20e-6
                return
            self.sleep = min(self.sleep * 2, self.poll_max_s)

    def reset(self) -> None:
        self.sleep = 20e-6


def wait(req, poll_max_s: float = POLL_MAX_S, also=None, wake: threading.Event | None = None) -> None:
    """Wait for a request without burning a core; `also()` runs between polls (a device rank sends finished
    work while it waits for the next command), at once when `wake` is set."""
    backoff = Backoff(poll_max_s, wake)
    while not req.Test():
        if also is not None:
            also()
        backoff.pause()


def device_owners(n_devices: int, size: int, device_ranks=()) -> np.ndarray:
    """The rank hosting each device: round-robin over 1..P-1, or the config's `[mpi] device_ranks`."""
    if not device_ranks:
        return 1 + np.arange(n_devices) % (size - 1)
    owners = np.asarray(device_ranks, dtype=np.int64)
    if owners.size != n_devices:
        raise ConfigError(f"config: mpi.device_ranks has {owners.size} entries; give one rank per device ({n_devices})")
    bad = owners[(owners < 1) | (owners >= size)]
    if bad.size:
        raise ConfigError(f"config: mpi.device_ranks holds rank {bad[0]}; devices live on ranks 1..{size - 1} "
                          f"of this mpirun -n {size}")
    return owners


@dataclass(frozen=True)
class Layout:
    """Shapes of every buffer, identical on all ranks."""

    n_devices: int
    dim: int
    dtype: np.dtype
    scaffold: bool

    @property
    def model_len(self) -> int:
        return 2 * self.dim if self.scaffold else self.dim

    def record(self, tag: int) -> np.dtype:
        meta, payload = {TAG_WORK: (WORK_META, self.model_len), TAG_EVAL: (EVAL_META, 0), TAG_BYE: (EVAL_META, 0),
                         TAG_INIT: (INIT_META, self.dim)}[tag]
        return np.dtype([("meta", "<f8", (len(meta),)), ("data", self.dtype, (payload,))])

    def max_record_bytes(self) -> int:
        return max(self.record(tag).itemsize for tag in (TAG_WORK, TAG_EVAL, TAG_INIT))

    def new_control(self) -> np.ndarray:
        return np.zeros(HEAD + 4 * self.n_devices, dtype=np.int64)


def _deadlines(ctrl: np.ndarray, n: int) -> np.ndarray:
    """Each device's deadline (s) as float64 bits; NaN outside deadline mode."""
    return ctrl[HEAD + 3 * n:HEAD + 4 * n].view(np.float64)


def _floats(ctrl: np.ndarray) -> np.ndarray:
    """lr, (unused), grace_s live as float64 bits in slots 2..4 of the control vector."""
    return ctrl[2:5].view(np.float64)


class MpiTransport:
    """The coordinator's side: the engine's transport, moving buffers to and from the device ranks."""

    def __init__(self, comm, layout: Layout, owners: np.ndarray, poll_max_s: float = POLL_MAX_S):
        self.comm, self.layout, self.owners, self.poll = comm, layout, owners, poll_max_s
        from mpi4py import MPI

        self.MPI = MPI
        self.ctrl = layout.new_control()
        self.xbuf = np.zeros(layout.model_len, dtype=layout.dtype)
        n = layout.n_devices
        self.hosted = {r: np.flatnonzero(owners == r) for r in range(1, comm.Get_size())}
        self._recv = {r: np.zeros(max(ids.size, 1) * layout.max_record_bytes(), np.uint8)
                      for r, ids in self.hosted.items()}
        self._accept_round, self._accepted = -1, np.zeros(n, np.int64)
        self._status = MPI.Status()

    # -- down ---------------------------------------------------------------------------------------------
    def _command(self, cmd: int, round_idx: int = 0, plan: RoundPlan | None = None, x=None, c=None, arg=0) -> None:
        ctrl, n = self.ctrl, self.layout.n_devices
        ctrl[:] = 0
        ctrl[0], ctrl[1], ctrl[5], ctrl[6] = cmd, round_idx, self._accept_round, arg
        ctrl[HEAD + 2 * n:HEAD + 3 * n] = self._accepted
        if plan is not None:
            _floats(ctrl)[:] = (plan.lr, math.nan, plan.grace_s)
            _deadlines(ctrl, n)[:] = math.nan
            if plan.deadline_s is not None:
                _deadlines(ctrl, n)[plan.device_ids] = plan.deadline_s
            ctrl[HEAD + plan.device_ids] = plan.budgets
            ctrl[HEAD + n:HEAD + 2 * n] = -1
            if plan.steps is not None:
                ctrl[HEAD + n + plan.device_ids] = plan.steps
        self._accept_round = -1
        self._accepted[:] = 0
        wait(self.comm.Ibcast(ctrl, root=0), self.poll)
        if x is not None:
            self.xbuf[: self.layout.dim] = x
            if self.layout.scaffold:
                self.xbuf[self.layout.dim:] = c
            wait(self.comm.Ibcast(self.xbuf, root=0), self.poll)

    # -- up -----------------------------------------------------------------------------------------------
    def _collect(self, tag: int, round_idx: int, ranks, timeout_s: float | None = None) -> dict:
        """One message per rank in `ranks` for (tag, round); anything else that arrives is an old late report."""
        MPI, status = self.MPI, self._status
        got, expected = {}, set(int(r) for r in ranks)
        backoff = Backoff(self.poll)
        while expected - set(got):
            if self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                src, msg_tag, nbytes = status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE)
                buf = self._recv[src]
                self.comm.Recv([buf[:nbytes], MPI.BYTE], source=src, tag=msg_tag)
                records = buf[:nbytes].view(self.layout.record(msg_tag))
                if msg_tag == tag and src in expected and records.size and records["meta"][0, 0] == round_idx:
                    got[src] = records.copy()
                backoff.reset()  # anything else is a late report of an older round: dropped
                continue
            if timeout_s is not None and backoff.elapsed() > timeout_s:
                break
            backoff.pause()
        return got

    # -- the transport interface --------------------------------------------------------------------------
    def local_work(self, plan: RoundPlan, x: np.ndarray, c: np.ndarray | None = None) -> LocalResults:
        self._command(CMD_ROUND, plan.round_idx, plan, x, c)
        owners = self.owners[plan.device_ids]
        ranks = np.unique(owners)
        timeout = None
        if plan.deadline_s is not None:  # a rank runs its devices one after another
            timeout = max((float(plan.deadline_s[owners == r].sum()) for r in ranks), default=0.0) + plan.grace_s
        got = self._collect(TAG_WORK, plan.round_idx, ranks, timeout)
        d, n_sel = self.layout.dim, plan.device_ids.size
        row = {int(k): i for i, k in enumerate(plan.device_ids)}
        deltas = np.zeros((n_sel, d), self.layout.dtype)
        delta_c = np.zeros((n_sel, d), self.layout.dtype) if self.layout.scaffold else None
        meta = np.full((n_sel, len(WORK_META)), np.nan)
        meta[:, WORK_META.index("steps")] = 0
        meta[:, WORK_META.index("late")] = 1  # until its report arrives
        for records in got.values():
            for rec in records:
                i = row[int(rec["meta"][1])]
                meta[i] = rec["meta"]
                deltas[i] = rec["data"][:d]
                if delta_c is not None:
                    delta_c[i] = rec["data"][d:]
        late = meta[:, WORK_META.index("late")] != 0
        steps = np.where(late, 0, meta[:, WORK_META.index("steps")]).astype(np.int32)
        deltas[late] = 0
        if delta_c is not None:
            delta_c[late] = 0

        def col(name):
            return meta[:, WORK_META.index(name)].astype(np.float32)

        return LocalResults(deltas, steps, col("elapsed_s"), col("cpu_percent"), delta_c, late,
                            col("cpu_freq_mhz"), col("temperature_c"), col("compiled") == 1)

    def accept(self, round_idx: int, device_ids: np.ndarray) -> None:
        """Sent with the next command: the devices whose reports of round_idx were applied."""
        self._accept_round = round_idx
        self._accepted[:] = 0
        self._accepted[device_ids] = 1

    def evaluate(self, x: np.ndarray) -> Evaluation:
        self._command(CMD_EVAL, 0, None, x, np.zeros_like(x) if self.layout.scaffold else None)
        got = self._collect(TAG_EVAL, 0, [r for r, ids in self.hosted.items() if ids.size])
        n = self.layout.n_devices
        ev = Evaluation(np.full(n, np.nan), np.zeros(n), np.zeros(n, np.int64), np.zeros(n, np.int64))
        for records in got.values():
            for m in records["meta"]:
                k = int(m[1])
                ev.train_loss[k], ev.test_loss_sum[k] = m[2], m[3]
                ev.test_correct[k], ev.n_test[k] = int(m[4]), int(m[5])
        return ev

    def init_controls(self, x0: np.ndarray, init: str) -> np.ndarray:
        return self.reset_controls(x0, init, np.arange(self.layout.n_devices))

    def reset_controls(self, x: np.ndarray, init: str, device_ids: np.ndarray) -> np.ndarray:
        """Fresh controls (zero, or the full local gradient at x) for these devices; returns their rows."""
        mask = RoundPlan(0, np.asarray(device_ids), np.ones(len(device_ids), np.int32), 0.0)
        self._command(CMD_INIT_CONTROLS, 0, mask, x, np.zeros_like(x), arg=int(init == "gradient"))
        got = self._collect(TAG_INIT, 0, np.unique(self.owners[device_ids]))
        controls = np.zeros((self.layout.n_devices, self.layout.dim), self.layout.dtype)
        for records in got.values():
            for rec in records:
                controls[int(rec["meta"][1])] = rec["data"]
        return controls[device_ids]

    def load_controls(self, controls: np.ndarray) -> None:
        self._command(CMD_LOAD_CONTROLS)
        for rank, ids in self.hosted.items():
            if ids.size:
                rows = np.ascontiguousarray(controls[ids], dtype=self.layout.dtype)
                wait(self.comm.Isend(rows, dest=rank, tag=TAG_LOAD), self.poll)

    def close(self, failed: bool = False) -> None:
        """Tell the device ranks to stop and drain what they still send until each says goodbye.

        Draining lets a late report that is still on its way complete, so no rank hangs on it at exit.
        After a failure the caller aborts the world instead.
        """
        if not failed:
            self._command(CMD_STOP)
            self._collect(TAG_BYE, -2, list(self.hosted))


class DeviceServer:
    """A device rank: waits for commands, runs its devices' work on a worker thread, reports back."""

    def __init__(self, comm, layout: Layout, transport, poll_max_s: float = POLL_MAX_S):
        self.comm, self.layout, self.transport, self.poll = comm, layout, transport, poll_max_s
        self.ctrl = layout.new_control()
        self.xbuf = np.zeros(layout.model_len, dtype=layout.dtype)
        self.own = transport.device_ids
        nbytes = max(self.own.size, 1) * layout.max_record_bytes()
        self._send = [np.zeros(nbytes, np.uint8), np.zeros(nbytes, np.uint8)]  # double-buffered
        self._send_req = [None, None]
        self._next = 0
        self._future = None  # (round, Future) of the work in progress
        self._done = threading.Event()  # the worker finished: report now rather than after the next sleep

    def _records(self, tag: int, n: int) -> np.ndarray:
        """n zeroed records to fill, living in the next free send buffer (no allocation per round)."""
        i = self._next
        if self._send_req[i] is not None:
            wait(self._send_req[i], self.poll)
            self._send_req[i] = None
        rec = self.layout.record(tag)
        records = self._send[i][: n * rec.itemsize].view(rec)
        records.view(np.uint8)[:] = 0
        return records

    def _send_records(self, tag: int, records: np.ndarray) -> None:
        i = self._next
        self._next = 1 - i
        self._send_req[i] = self.comm.Isend([self._send[i][: records.nbytes], self._mpi_byte], dest=0, tag=tag)

    def _report_finished_work(self) -> None:
        if self._future is None or not self._future[1].done():
            return
        round_idx, future, ids = self._future
        self._future = None
        res = future.result()  # re-raises a device's error here, on the main thread
        records = self._records(TAG_WORK, ids.size)
        meta = records["meta"]
        meta[:, 0], meta[:, 1], meta[:, 2] = round_idx, ids, res.steps
        meta[:, 3], meta[:, 4], meta[:, 5], meta[:, 6] = res.elapsed_s, res.cpu_percent, res.cpu_freq_mhz, res.temperature_c
        meta[:, 7], meta[:, 8] = res.late, res.compiled
        records["data"][:, : self.layout.dim] = res.deltas
        if res.delta_c is not None:
            records["data"][:, self.layout.dim:] = res.delta_c
        self._send_records(TAG_WORK, records)

    def serve(self) -> None:
        from mpi4py import MPI

        self._mpi_byte = MPI.BYTE
        n, d = self.layout.n_devices, self.layout.dim
        while True:
            wait(self.comm.Ibcast(self.ctrl, root=0), self.poll, also=self._report_finished_work, wake=self._done)
            ctrl = self.ctrl
            cmd, round_idx = int(ctrl[0]), int(ctrl[1])
            if ctrl[5] >= 0:
                self.transport.accept(int(ctrl[5]), np.flatnonzero(ctrl[HEAD + 2 * n:HEAD + 3 * n]))
            if cmd == CMD_STOP:
                self._goodbye()
                break
            if cmd == CMD_LOAD_CONTROLS:
                rows = np.zeros((self.own.size, d), self.layout.dtype)
                if self.own.size:
                    wait(self.comm.Irecv(rows, source=0, tag=TAG_LOAD), self.poll)
                self.transport.load_controls(rows)
                continue
            wait(self.comm.Ibcast(self.xbuf, root=0), self.poll, also=self._report_finished_work, wake=self._done)
            x = self.xbuf[:d].copy()
            c = self.xbuf[d:].copy() if self.layout.scaffold else None
            if cmd == CMD_ROUND:
                self._start_work(round_idx, x, c)
            elif cmd == CMD_EVAL:
                self._evaluate(x)
            elif cmd == CMD_INIT_CONTROLS:
                self._init_controls(x, "gradient" if ctrl[6] else "zero")
    def _goodbye(self) -> None:
        """Finish (and drop) work still running, then say goodbye; the coordinator drains until it hears it."""
        if self._future is not None:
            self._future[1].exception()  # waits for the worker; a late result is of no use any more
            self._future = None
        records = self._records(TAG_BYE, 1)
        records["meta"][0, 0] = -2
        self._send_records(TAG_BYE, records)
        for req in self._send_req:
            if req is not None:
                wait(req, self.poll)

    def _start_work(self, round_idx: int, x, c) -> None:
        n = self.layout.n_devices
        budgets = self.ctrl[HEAD:HEAD + n]
        ids = self.own[budgets[self.own] > 0]
        if ids.size == 0:
            return
        lr, _, grace = _floats(self.ctrl)
        deadlines = _deadlines(self.ctrl, n)[ids]
        trace_steps = self.ctrl[HEAD + n:HEAD + 2 * n][ids]
        plan = RoundPlan(round_idx, ids, budgets[ids].astype(np.int32), float(lr),
                         steps=None if trace_steps[0] < 0 else trace_steps.astype(np.int32),
                         deadline_s=None if np.isnan(deadlines).all() else deadlines.copy(), grace_s=float(grace))
        if self._future is not None:  # still on an older round: these devices cannot start in time
            records = self._records(TAG_WORK, ids.size)
            records["meta"][:, 0], records["meta"][:, 1], records["meta"][:, 7] = round_idx, ids, 1
            self._send_records(TAG_WORK, records)
            return
        future = self.transport.submit(plan, x, c)
        future.add_done_callback(lambda _: self._done.set())
        self._future = (round_idx, future, ids)

    def _evaluate(self, x) -> None:
        ev = self.transport.evaluate(x)
        ids = self.own
        records = self._records(TAG_EVAL, ids.size)
        m = records["meta"]
        m[:, 0], m[:, 1] = 0, ids
        m[:, 2], m[:, 3], m[:, 4], m[:, 5] = ev.train_loss[ids], ev.test_loss_sum[ids], ev.test_correct[ids], ev.n_test[ids]
        self._send_records(TAG_EVAL, records)

    def _init_controls(self, x, init: str) -> None:
        ids = self.own[self.ctrl[HEAD:HEAD + self.layout.n_devices][self.own] > 0]
        if ids.size == 0:
            return
        if self.transport.controls is None:
            rows = self.transport.init_controls(x, init)
        else:
            rows = self.transport.reset_controls(x, init, ids)
        records = self._records(TAG_INIT, ids.size)
        records["meta"][:, 0], records["meta"][:, 1] = 0, ids
        records["data"] = rows
        self._send_records(TAG_INIT, records)


def abort_with(comm, message: str, code: int = 1) -> None:
    """Print this rank's error and take the whole world down (as `python -m mpi4py` does)."""
    print(f"edgefed: error on rank {comm.Get_rank()}: {message}", file=sys.stderr, flush=True)
    comm.Abort(code)

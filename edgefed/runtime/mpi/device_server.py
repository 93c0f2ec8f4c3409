"""A device rank: waits for commands, runs its devices' work on a worker thread, reports back.

The worker thread keeps the main thread free to serve MPI while a device works or hangs: a finished round
is reported at once (the worker wakes the polling main thread), and a round that arrives while an older
one still runs is answered at once with late records, so the coordinator never waits on a hung device.
When the round is over-selected each device is reported as it finishes, and a stop from the coordinator
ends the rest within a chunk. A `[[fault]] kind = "slow_link"` holds a device's report for its seconds.

Whenever it is not sending anything else the rank sends a heartbeat every `heartbeat_s` (also while it
evaluates, which then runs beside the main thread), so the coordinator can tell a rank that is slow from one
that is gone ([mpi] rank_timeout_s).
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from collections import deque

import numpy as np

from edgefed.algorithms.base import DeviceRows, ServerState
from edgefed.memory import peak_rss
from edgefed.runtime import power
from edgefed.runtime.mpi import protocol
from edgefed.runtime.mpi.comm import POLL_MAX_S, Backoff, mpi_of, wait
from edgefed.runtime.mpi.protocol import Wire
from edgefed.secagg import protocol as secagg

WORKING_POLL_S = 0.01  # the longest pause between polls while this rank's devices train (see _poll_max)


class Heart:
    """A device rank's heartbeat to the coordinator: one tiny message every `heartbeat_s`, sent from the main
    thread (the only one that calls MPI) whenever it is not busy, and around work handed to a helper thread."""

    def __init__(self, comm, heartbeat_s: float | None, poll_max_s: float = POLL_MAX_S):
        self.comm, self.heartbeat_s, self.poll = comm, heartbeat_s, poll_max_s  # None: no heartbeats
        self._alive = np.array([comm.Get_rank()], np.int64)
        self.request, self._at = None, -float("inf")

    def beat(self) -> None:
        now = time.perf_counter()
        if self.heartbeat_s is None or now - self._at < self.heartbeat_s:
            return
        if self.request is None or self.request.Test():  # skip a beat while the last one is in flight
            self.request = self.comm.Isend(self._alive, dest=0, tag=protocol.TAG_ALIVE)
            self._at = now

    def beating(self, fn, *args):
        """fn(*args) on a helper thread while this thread keeps the heartbeat going; its result or error."""
        if self.heartbeat_s is None:
            return fn(*args)
        out = {}

        def call():
            try:
                out["value"] = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
                out["error"] = exc

        worker = threading.Thread(target=call, daemon=True)
        worker.start()
        while worker.is_alive():
            self.beat()
            worker.join(self.poll * 20)
        if "error" in out:
            raise out["error"]
        return out["value"]


class DeviceServer:
    def __init__(self, comm, wire: Wire, transport, poll_max_s: float = POLL_MAX_S, heart: Heart | None = None):
        """heart: the rank's heartbeat (None: none, and the coordinator then never times the rank out)."""
        self.comm, self.wire, self.transport, self.poll = comm, wire, transport, poll_max_s
        self.heart = heart or Heart(comm, None, poll_max_s)
        self.command = wire.command_buffer()
        self.state = wire.state_buffer()
        self.downlink = wire.downlink_buffer()
        self.copy = None  # with a compressed downlink: {"x": ..., server vectors} as the devices hold them
        self.own = transport.device_ids
        nbytes = max(self.own.size, 1) * wire.record_bytes()
        self._send = [np.zeros(nbytes, np.uint8), np.zeros(nbytes, np.uint8)]  # double-buffered
        self._send_req = [None, None]
        self._next = 0
        self._future = None  # (plan, Future, RoundWork) of the work in progress
        self._finished = deque()  # (row, when) of the devices done, as the worker says
        self._sent = set()  # rows of the work in progress already reported
        self._due = []  # (when its report may leave, row) of the finished devices
        self._cancel = np.zeros(1, np.int64)  # a stop's round
        self._stopped_round = -1  # the last round the coordinator said it has enough of
        self._begun = 0.0  # when the work in progress was handed to the worker
        self._done = threading.Event()  # the worker finished: report now rather than after the next sleep
        self._task_buf = np.zeros(wire.task.itemsize, np.uint8)
        self._tasks = deque()  # async: (plan, x) of the tasks rank 0 sent, not started yet
        self._task = None  # async: (plan, Future, RoundWork) of the task running
        self._task_due = None  # async: when the finished task's report may leave (after its link's time)
        self._tasks_ended = False  # async: rank 0's end-of-tasks record came
        self._secagg_sent = []  # (request, buffer) of secure aggregation's replies on their way
        self.meter = power.meter()  # the board's own energy meter (None: it has none)
        self._read_j = math.nan  # the meter's reading at the rank's last report of the round (or its start)

    def _records(self, tag: int, n: int) -> np.ndarray:
        """n zeroed records to fill, living in the next free send buffer (no allocation per round)."""
        i = self._next
        if self._send_req[i] is not None:
            wait(self._send_req[i], self.poll)
            self._send_req[i] = None
        record = self.wire.tags[tag]
        buf = self._send[i][: n * record.itemsize]
        buf[:] = 0
        return buf.view(record)

    def _board_energy(self, records: np.ndarray, read: bool = True) -> None:
        """The rank and what its board's meter read since its last report of the round, on the first record
        (NaN: no meter, or read False)."""
        records["rank"] = self.comm.Get_rank()
        records["board_j"][1:] = 0.0
        if self.meter is None or not read:
            records["board_j"][0] = math.nan
            return
        now = self.meter.joules()
        records["board_j"][0], self._read_j = now - self._read_j, now

    def _send_records(self, tag: int, records: np.ndarray) -> None:
        if "peak_rss" in records.dtype.names:  # (work and evaluation: the rank's memory goes into the log)
            records["peak_rss"] = peak_rss()
        i = self._next
        self._next = 1 - i
        self._send_req[i] = self.comm.Isend([self._send[i][: records.nbytes], self._mpi_byte], dest=0, tag=tag)

    def _heartbeat(self) -> None:
        self.heart.beat()

    def _report_finished_work(self, block: bool = False) -> None:
        """Send what is due: each finished device's record once its link delay has passed (with
        over-selection, device by device; else all of them once the round's work is done). block: wait for
        the send buffers if rank 0 has not taken the last reports yet (safe once a broadcast has completed:
        rank 0 is then collecting); otherwise try again at the next poll."""
        self._heartbeat()
        self._take_stops()
        self._serve_tasks()
        if self._future is None:
            return
        plan, future, work = self._future
        now = time.perf_counter()
        while self._finished:
            row, when = self._finished.popleft()
            sent = plan.down_bytes + int(work.bytes_up[row])
            self._due.append((when + self.transport.link_delay(int(plan.device_ids[row]), plan.round_idx, sent), row))
        done = future.done()
        if done:
            future.result()  # re-raises a device's error here, on the main thread
        if not plan.by_arrival and (not done or any(due > now for due, _ in self._due)):
            return  # the rank's one message waits for its last device and its slowest link
        ready = sorted((row, due) for due, row in self._due if due <= now and row not in self._sent)
        if ready and not block and not self._send_free(both=bool(work.residuals)):
            return  # rank 0 has not taken the last ones yet: try again at the next poll, taking its stops meanwhile
        if ready:
            rows = np.array([row for row, _ in ready])
            # waiting, neither working nor on the link: for the lane before starting, for the others after
            held = np.array([now - due for _, due in ready])
            wait_s = np.nan_to_num(work.started[rows] - self._begun) + held
            records = self._records(protocol.TAG_WORK, rows.size)
            self.wire.pack_work(records, plan.round_idx, plan.device_ids[rows], work.results(rows), wait_s,
                                [work.payload[r] for r in rows])
            self._board_energy(records)
            self._send_records(protocol.TAG_WORK, records)
            if work.residuals:  # right behind the reports: the coordinator keeps them for --resume
                left = self._records(protocol.TAG_RESIDUAL, rows.size)
                self.wire.pack_residuals(left, plan.round_idx, plan.device_ids[rows],
                                         {name: values[rows] for name, values in work.residuals.items()})
                self._send_records(protocol.TAG_RESIDUAL, left)
            self._sent.update(rows.tolist())
        if done and len(self._sent) == plan.device_ids.size:
            self._future = None

    def _serve_tasks(self) -> None:
        """Async: take the tasks rank 0 sends, run them one after another on the worker, and send each one's
        work record as soon as it is done."""
        while self.comm.Iprobe(source=0, tag=protocol.TAG_TASK):
            self.comm.Recv(self._task_buf, source=0, tag=protocol.TAG_TASK)
            if self.wire.is_end_of_tasks(self._task_buf):
                self._tasks_ended = True
            else:
                self._tasks.append(self.wire.unpack_task(self._task_buf))
        if self._task is not None and self._task[1].done():
            plan, future, work = self._task
            future.result()  # a device's error surfaces here, on the main thread
            if self._task_due is None:  # a shaped link, or a slow_link fault, holds the report
                sent = plan.down_bytes + int(work.bytes_up[0])
                self._task_due = time.perf_counter() + self.transport.link_delay(int(plan.device_ids[0]),
                                                                                 plan.round_idx, sent)
            if time.perf_counter() < self._task_due or not self._send_free():
                return
            records = self._records(protocol.TAG_WORK, 1)
            self.wire.pack_work(records, plan.round_idx, plan.device_ids, work.results(), 0.0, work.payload)
            self._board_energy(records, read=False)  # (a task is not a round: its board's energy is not read)
            self._send_records(protocol.TAG_WORK, records)
            self._task = self._task_due = None
        if self._task is None and self._tasks:
            plan, x = self._tasks.popleft()
            future, work = self.transport.submit(plan, ServerState(x, {}))
            future.add_done_callback(lambda _: self._done.set())
            self._task = (plan, future, work)

    def _send_free(self, both: bool = False) -> bool:
        """Whether the next send buffer (both: both buffers, for a report and its residuals) is free now: a
        report never waits here for rank 0 to take an older one, since rank 0 may itself be waiting for this
        rank to take part in a broadcast or to take its stop."""
        reqs = self._send_req if both else [self._send_req[self._next]]
        return all(req is None or req.Test() for req in reqs)

    def _take_stops(self) -> None:
        """A stop from the coordinator (over-selection: the round has enough) ends this rank's work of it,
        also when it comes before the round's work has started here."""
        while self.comm.Iprobe(source=0, tag=protocol.TAG_CANCEL):
            self.comm.Recv(self._cancel, source=0, tag=protocol.TAG_CANCEL)
            self._stopped_round = max(self._stopped_round, int(self._cancel[0]))
            if self._future is not None and self._future[0].round_idx == self._stopped_round:
                self.transport.stop()

    def _wait_broadcast(self, buf) -> None:
        wait(self.comm.Ibcast(buf, root=0), self._poll_max, also=self._report_finished_work, wake=self._done)

    def _poll_max(self) -> float:
        """The longest pause between polls now: longer while this rank's devices train, since a finished one
        wakes the rank at once and a poll then only takes rank 0's stops and sends the heartbeat (at 1 ms the
        polls took 4 % of a core here, a quarter of a virtual Pi 5's share; at 10 ms, 1.5 %)."""
        working = any(job is not None and not job[1].done() for job in (self._future, self._task))
        return max(self.poll, WORKING_POLL_S) if working else self.poll

    def serve(self) -> None:
        self._mpi_byte = mpi_of(self.comm).BYTE
        while True:
            self._wait_broadcast(self.command.head.view(np.uint8))
            body = self.command.body()
            if body.size:
                self._wait_broadcast(body)
            command = int(self.command["command"])
            accepted = self.wire.accepted(self.command)
            if accepted is not None:
                self.transport.accept(*accepted)
            if command == protocol.STOP:
                self._goodbye()
                break
            if command == protocol.LOAD_DEVICES:
                self._load_devices()
                continue
            if command == protocol.SECAGG:
                self._secagg()
                continue
            x, vectors = self._receive_state(command)
            if command == protocol.ROUND:
                self._start_work(ServerState(x, vectors))
            elif command == protocol.EVAL:
                self._evaluate(x)
            elif command == protocol.START_DEVICES:
                self._start_devices(x)
            elif command == protocol.PROBE:
                self._probe(x)

    def _receive_state(self, command: int):
        """(x, server vectors) of the command: in full, or a compressed downlink's differences added to the
        copy this rank holds (which a round's full state replaces)."""
        if self.command["downlink"]:
            self._wait_broadcast(self.downlink)
            self.copy = self.wire.apply_downlink(self.downlink, self.copy)
        else:
            self._wait_broadcast(self.state)
            x, vectors = self.wire.unpack_state(self.state)
            if command != protocol.ROUND or not self.wire.downlink.lossy:
                return x, vectors
            self.copy = {"x": x, **vectors}
        held = dict(self.copy)
        return held.pop("x"), held

    def _goodbye(self) -> None:
        """Finish (and drop) work still running, then say goodbye; the coordinator drains until it hears it."""
        while self.wire.tasks and not self._tasks_ended:  # take every task rank 0 sent, up to its last record
            self._heartbeat()
            self._serve_tasks()
            time.sleep(self.poll)
        self._tasks.clear()  # async tasks not started are not needed any more, nor the one running
        running = [job[1] for job in (self._future, self._task) if job is not None]
        if running:
            self.transport.stop()
        for future in running:
            while not future.done():  # a stalled device may take a while to stop: keep the heartbeat going
                self._heartbeat()
                concurrent.futures.wait([future], timeout=self.poll * 20)
            future.exception()  # a late result is of no use any more
        self._future = self._task = None
        records = self._records(protocol.TAG_BYE, 1)
        records["rank"] = self.comm.Get_rank()
        self._send_records(protocol.TAG_BYE, records)
        for req in (*self._send_req, self.heart.request, *(req for req, _ in self._secagg_sent)):
            if req is not None:
                wait(req, self.poll)

    def _start_work(self, state: ServerState) -> None:
        plan = self.wire.decode_plan(self.command, self.own)
        if plan is None:
            return
        # a late round that finished while the command was on its way is free; its last reports may wait
        # for rank 0, which is collecting now that the command's broadcast is done
        self._report_finished_work(block=True)
        if self._future is not None or self._stopped_round >= plan.round_idx:
            # still on an older round, or this one is over already: these devices cannot start in time
            records = self._records(protocol.TAG_WORK, plan.device_ids.size)
            self.wire.pack_work(records, plan.round_idx, plan.device_ids, None)
            self._board_energy(records, read=False)  # (the meter's reading goes on with the older round)
            self._send_records(protocol.TAG_WORK, records)
            return
        self._finished.clear()
        self._due, self._sent, self._begun = [], set(), time.perf_counter()

        def finished(row):
            self._finished.append((row, time.perf_counter()))
            self._done.set()

        future, work = self.transport.submit(plan, state, finished)
        future.add_done_callback(lambda _: self._done.set())
        self._future = (plan, future, work)
        # the board's meter from here (a PMIC's reading spawns vcgencmd: not before the devices start)
        self._read_j = math.nan if self.meter is None else self.meter.joules()

    def _secagg(self) -> None:
        """A phase of secure aggregation: take the records rank 0 relays, answer for this rank's devices. It
        runs here, on the main thread, while a late device may still be working on the worker."""
        cmd = self.command
        round_idx, phase, nbytes = int(cmd["round"]), int(cmd["phase"]), int(cmd["payload_bytes"])
        relayed = np.zeros(nbytes, np.uint8)
        if nbytes:
            self._wait_broadcast(relayed)
        addressed = cmd.entries["device"].copy()
        secure = self.transport.secure
        if phase == protocol.KEYS:
            widths = cmd.entries["width"]
            out = secure.keys(round_idx, addressed, None if np.isnan(widths).all() else widths.copy())
        elif phase == protocol.SHARES:
            out = secure.shares(round_idx, relayed.view(secagg.KEYS))
        elif phase == protocol.DELIVER:  # the shares for this rank's devices follow, point to point
            if self.transport.hosts(addressed).any():
                secure.deliver(round_idx, self._receive_shares(round_idx))
            return
        else:
            out = secure.reveal(round_idx, addressed)
        if not self.transport.hosts(addressed).any():
            return
        self._secagg_sent = [(req, buf) for req, buf in self._secagg_sent if not req.Test()]
        raw = self.wire.pack_secagg(round_idx, phase, out)
        self._secagg_sent.append((self.comm.Isend([raw, self._mpi_byte], dest=0, tag=protocol.TAG_SECAGG), raw))

    def _receive_shares(self, round_idx: int) -> np.ndarray:
        MPI = mpi_of(self.comm)
        status = MPI.Status()
        backoff = Backoff(self.poll)
        while not self.comm.Iprobe(source=0, tag=protocol.TAG_SECAGG, status=status):
            self._report_finished_work()
            backoff.pause()
        raw = np.zeros(status.Get_count(MPI.BYTE), np.uint8)
        self.comm.Recv([raw, MPI.BYTE], source=0, tag=protocol.TAG_SECAGG)
        got_round, _, shares = self.wire.unpack_secagg(raw, secagg.SHARE)
        if got_round != round_idx:
            raise RuntimeError(f"rank {self.comm.Get_rank()}: shares of round {got_round} came in round {round_idx}")
        return shares

    def _evaluate(self, x) -> None:
        ev = self.heart.beating(self.transport.evaluate, x)
        records = self._records(protocol.TAG_EVAL, max(ev.ids.size, 1))
        self.wire.pack_evaluation(records, ev)
        self._send_records(protocol.TAG_EVAL, records)

    def _probe(self, x) -> None:
        ids = self.wire.addressed(self.command, self.own)
        if ids.size == 0:
            return
        losses = self.heart.beating(self.transport.probe, int(self.command["round"]), x, ids)
        records = self._records(protocol.TAG_PROBE, ids.size)
        records["device"], records["loss"] = ids, losses
        self._send_records(protocol.TAG_PROBE, records)

    def _start_devices(self, x) -> None:
        ids = self.wire.addressed(self.command, self.own)
        if ids.size == 0:
            return
        rows = self.heart.beating(self.transport.start_devices, x, ids)
        records = self._records(protocol.TAG_ROWS, ids.size)
        self.wire.pack_rows(records, ids, rows)
        self._send_records(protocol.TAG_ROWS, records)

    def _load_devices(self) -> None:
        ids = self.wire.addressed(self.command, self.own)  # the own devices that hold a stored row
        records = np.zeros(ids.size, self.wire.load)
        if ids.size:
            wait(self.comm.Irecv(records.view(np.uint8), source=0, tag=protocol.TAG_LOAD), self.poll)
        rows = self.wire.unpack_rows([records], ids, self.wire.restored)
        n = self.wire.n_devices
        self.transport.load_devices({name: DeviceRows(ids, values, n) for name, values in rows.items()})
